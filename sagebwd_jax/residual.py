"""The log-sum-exp that `dot_product_attention(..., return_residual=True)`
returns: jax.nn's residual, computed by SageBwd's forward, with a gradient.

jax.nn stops the residual's gradient; here it has one, SageBwd's: d lse_i =
scale * sum_j P_ij (dq_i . k_j + q_i . dk_j), with P the forward's softmax.
Its two terms are the forward's P.V and the backward's P^T.dO with other
operands, so the backends compute them as they are, in INT8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import numerics as nm
from pallas_kernels.types import Backend, Config, Masks
from sagebwd_jax.sagebwd import attend, key_mean, opaque, prepass, quantize


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def log_sum_exp(query, key, value, masks: Masks, config: Config, backend: Backend,
                smooth_k: bool) -> jax.Array:
  """The forward's natural-log log-sum-exp (B, Tq, H) fp32, +inf where a row
  saw no key, of block-padded (B, T, H, D) inputs.

  `sagebwd_attention` returns only O, so this runs the forward once more
  (under jit XLA merges the two where it can prove them equal).
  """
  return _forward(query, key, value, masks, config, backend, smooth_k, for_backward=False)[0]


def _forward(query, key, value, masks, config, backend, smooth_k, for_backward=True):
  # As the op's forward quantizes (sagebwd_attention), so that XLA can merge them.
  qkv = quantize(query, key, value, masks, config, backend, smooth_k, for_backward)
  lse = jnp.swapaxes(attend(qkv, masks, config, backend, query.dtype)[1], 1, 2) * nm.LN_2
  if smooth_k and not config.causal_exact:  # causal_exact's scores restore q . m themselves
    # The kernels' scores are of K - mean(K): each row is shifted by q . mean.
    group = query.shape[2] // key.shape[2]
    shift = jnp.einsum("bthd,bhd->bth", query.astype(jnp.float32),
                       jnp.repeat(key_mean(key, masks.kv_ids), group, axis=1))
    lse = lse + config.scale * shift
  return lse, (query, key, value, masks, lse)


def _backward(config, backend, smooth_k, residuals, cotangent):
  query, key, value, masks, lse = residuals
  # Rows that saw no key have no softmax, and no gradient.
  g = jnp.where(jnp.isfinite(lse), cotangent, 0.0)[..., None] * config.scale
  # One quantization with K as the values too: the forward then gives P.K;
  # the backward, with dO = g q and zero V and O (so dS = 0), P^T.(g q) as dV.
  qkv = quantize(query, key, key, masks, config, backend, smooth_k)
  p_k, lse_2, row_max = attend(qkv, masks, config, backend, query.dtype)
  dq = g * p_k.astype(jnp.float32)
  (do,) = opaque((g * query.astype(jnp.float32)).astype(query.dtype))
  pre = prepass(qkv, jnp.zeros_like(query), do, config, backend)
  if config.fp8:  # dS = 0 here (V = 0): its operands only have to be given
    pre = pre._replace(fp8=backend.fp8_operands(qkv, jnp.zeros_like(key), pre, row_max, lse_2,
                                                masks, config))
  dk = backend.backward(qkv, jnp.zeros_like(key), lse_2, do, pre, masks, config)[2]
  return dq.astype(query.dtype), dk.astype(key.dtype), jnp.zeros_like(value), None


log_sum_exp.defvjp(_forward, _backward)


def residual(lse: jax.Array, dtype) -> jax.Array:
  """The lse (+inf where a row saw no key) as jax.nn's residual (-inf there)."""
  return jnp.where(lse == jnp.inf, -jnp.inf, lse).astype(dtype)
