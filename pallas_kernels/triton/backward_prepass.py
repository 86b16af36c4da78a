"""The backward pre-pass: Delta = rowsum(dO * O) and psi(dO) per block_q rows,
stored transposed (D, T) for the INT8 dV = P^T.dO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton.common import LaunchConfig
from pallas_kernels.triton.quantize import quantize_block


def _kernel(o_ref, do_ref, delta_ref, do8_t_ref, do_scale_ref):
  do = do_ref[...]
  delta_ref[...] = jnp.sum(do.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=1)
  do8, scale, _ = quantize_block(do)
  do8_t_ref[...] = do8.T
  do_scale_ref[...] = jnp.full(do_scale_ref.shape, scale, jnp.float32)


def backward_prepass(o, do, *, block_q: int, launch: LaunchConfig):
  """(Delta (B, H, T), dO8 (B, H, D, T), dO scales per token (B, H, T))."""
  batch, seq_len, heads, head_dim = o.shape
  tokens = pl.BlockSpec((None, block_q, None, head_dim), lambda t, b, h: (b, t, h, 0))
  rows = pl.BlockSpec((None, None, block_q), lambda t, b, h: (b, h, t))
  return launch.call(
      _kernel, grid=(seq_len // block_q, batch, heads), in_specs=[tokens, tokens],
      out_specs=[rows, pl.BlockSpec((None, None, head_dim, block_q),
                                    lambda t, b, h: (b, h, 0, t)), rows],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads, head_dim, seq_len), jnp.int8),
                 jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32)],
      name="sagebwd_backward_prepass")(o, do)
