"""The backward pre-pass: Delta = rowsum(dO * O) and psi(dO) per block_q rows,
stored transposed (D, T) for the INT8 dV = P^T.dO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.jax_triton import tiles
from pallas_kernels.jax_triton.launch import LaunchConfig, batch_folded


@triton.jit
def _prepass_kernel(o_ptr, do_ptr, delta_ptr, do8_t_ptr, do_scale_ptr, T: tl.constexpr,
                    H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr):
  t = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  h = tl.program_id(2)
  head = b * H + h
  rows = t * BQ + tl.arange(0, BQ)
  dims = tl.arange(0, D)
  tokens = tiles.token_offsets(b, rows, h, T, H, D)
  do = tl.load(do_ptr + tokens).to(tl.float32)
  o = tl.load(o_ptr + tokens).to(tl.float32)
  tl.store(delta_ptr + head * T + rows, tl.sum(do * o, axis=1))
  do8, scale = tiles.quantize_tile(do)
  tl.store(do8_t_ptr + head * D * T + dims[:, None] * T + rows[None, :], tl.trans(do8))
  tl.store(do_scale_ptr + head * T + rows, tl.full((BQ,), scale, tl.float32))


def backward_prepass(o: jax.Array, do: jax.Array, *, block_q: int, launch: LaunchConfig
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(Delta (B, H, T), dO8 (B, H, D, T), dO scales per token (B, H, T))."""

  def run(o, do):
    batch, seq_len, heads, head_dim = o.shape
    out_shape = [jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads, head_dim, seq_len), jnp.int8),
                 jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32)]
    return tuple(launch.call(_prepass_kernel, [o, do], out_shape,
                             grid=(seq_len // block_q, batch, heads),
                             name="sagebwd_triton_backward_prepass", T=seq_len, H=heads,
                             D=head_dim, BQ=block_q))

  return batch_folded(run)(o, do)
