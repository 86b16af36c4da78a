"""SageBwd as one `jax.custom_vjp`: docs/algorithm.md, stage by stage.

forward:  K-smoothing -> quantize Q, K, V -> INT8 attention -> residuals
backward: Delta and psi(dO) -> recomputed P -> INT8 dV, dQ, dK (dP in bf16;
          dQ, dK too with ds_precision="bf16")

Which code runs each stage is the `backend` (Pallas kernels or the pure-JAX
reference); this file only wires the stages together. Sequences arrive padded
to whole blocks, with the true lengths in `masks`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import numerics as nm
from pallas_kernels.types import Backend, Config, Masks


def key_mean(k: jax.Array, kv_ids: jax.Array | None) -> jax.Array:
  """Mean of K over each sequence's valid tokens: (B, Hkv, D) fp32.

  Subtracting it shifts every score row by a constant, so softmax is
  unchanged, while the int8 grid no longer spends its range on the channel
  bias that K typically carries. Padding never enters the mean.
  """
  k = k.astype(jnp.float32)
  if kv_ids is None:
    return jnp.mean(k, axis=1)
  valid = (kv_ids != nm.KV_INVALID_ID).astype(jnp.float32)
  total = jnp.einsum("bthd,bt->bhd", k, valid)
  return total / jnp.maximum(jnp.sum(valid, axis=1), 1.0)[:, None, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def sagebwd_attention(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks,
                      config: Config, backend: Backend, smooth_k: bool) -> jax.Array:
  """INT8 attention on block-padded (B, T, H, D) inputs; output like q."""
  return _forward(q, k, v, masks, config, backend, smooth_k)[0]


def _forward(q, k, v, masks, config, backend, smooth_k):
  k_mean = key_mean(k, masks.kv_ids) if smooth_k else None
  qkv = backend.quantize(q, k, v, k_mean, config)
  if config.ds_precision == "bf16":
    # dS.K and dS^T.Q in 16 bits: their second operands unquantized. K is the
    # smoothed one, as in the int8 product: rows of dS sum to zero only up to
    # the forward's error, and the mean would multiply that remainder.
    k16 = k if k_mean is None else (k.astype(jnp.float32) - k_mean[:, None]).astype(k.dtype)
    qkv = qkv._replace(q16=q, k16=k16)
  o, lse = backend.forward(qkv, masks, config, q.dtype)
  return o, (qkv, v, o, lse, masks)


def _backward(config, backend, smooth_k, residuals, do):
  del smooth_k  # rows of dS sum to zero: the smoothing mean has no gradient term
  qkv, v, o, lse, masks = residuals
  dq, dk, dv = backend.backward(qkv, v, o, lse, do, masks, config)
  # q, k and v share one dtype (the op checks it), which o carries too.
  return dq.astype(o.dtype), dk.astype(o.dtype), dv.astype(o.dtype), None


sagebwd_attention.defvjp(_forward, _backward)
