"""The log-sum-exp that `dot_product_attention(..., return_residual=True)`
returns: jax.nn's residual, computed by SageBwd's forward, without a gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from pallas_kernels import numerics as nm
from pallas_kernels.types import Backend, Config, Masks
from sagebwd_jax.sagebwd import key_mean, quantize


def forward_lse(query, key, value, masks: Masks, config: Config, backend: Backend,
                 smooth_k: bool) -> jax.Array:
  """The forward's natural-log log-sum-exp (B, Tq, H), +inf where a row saw
  no key, without a gradient.

  `sagebwd_attention` returns only O, so this runs the forward once more
  (under jit XLA merges the two where it can prove them equal).
  """
  query, key, value = jax.lax.stop_gradient((query, key, value))
  qkv = quantize(query, key, value, masks, config, backend, smooth_k)
  lse = jnp.swapaxes(backend.forward(qkv, masks, config, query.dtype)[1], 1, 2) * nm.LN_2
  if smooth_k:
    k_mean = key_mean(key, masks.kv_ids)
    # The kernels' scores are of K - mean(K): each row is shifted by q . mean.
    group = query.shape[2] // key.shape[2]
    shift = jnp.einsum("bthd,bhd->bth", query.astype(jnp.float32),
                       jnp.repeat(k_mean, group, axis=1))
    lse = lse + config.scale * shift
  return lse


def residual(lse: jax.Array, dtype, inputs: tuple[jax.Array, ...]) -> jax.Array:
  """The lse (+inf where a row saw no key) as jax.nn's residual (-inf
  there); differentiating it with respect to `inputs` raises."""
  lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)
  return _no_gradient(lse.astype(dtype), inputs)


@jax.custom_vjp
def _no_gradient(x: jax.Array, inputs: tuple[jax.Array, ...]) -> jax.Array:
  """x, which depends on `inputs` without a gradient: the backward refuses
  any cotangent but a symbolic zero (the residual unused by the loss)."""
  del inputs
  return x


def _no_gradient_fwd(x, inputs):
  del inputs
  return x.value, None


def _no_gradient_bwd(_, cotangent):
  if not isinstance(cotangent, SymbolicZero):
    raise NotImplementedError(
        "SageBwd's residual (return_residual=True) has no gradient: its backward "
        "does not take a log-sum-exp cotangent. Stop the gradient through it "
        "(jax.lax.stop_gradient) or use implementation='xla' for this computation.")
  return None, None


_no_gradient.defvjp(_no_gradient_fwd, _no_gradient_bwd, symbolic_zeros=True)
