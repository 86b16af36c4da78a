"""The backward pre-pass, one kernel: Delta = rowsum(dO * O) and psi(dO) per
block_q rows, O and dO read once, dO8 written once, transposed (D, T) for the
INT8 dV = P^T.dO in the layout the dK/dV kernel that will run reads (TOKENS,
with the portable kernel's P^T.dO accumulator start, or REGISTER_B); with
FP8 products (`Config.fp8`) dO in E4M3 per block instead
(`numerics.quantize_e4m3`), for the Hopper FP8 dK/dV, and ||dO_i||, which
dS's row bound takes (`numerics.ds_row_bound`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.jax_triton import tiles
from pallas_kernels.batching import batch_folded
from pallas_kernels.jax_triton.launch import LaunchConfig
from pallas_kernels.jax_triton.quantize import check_register_blocks, transposed_shape
from pallas_kernels.types import Prepass, TransposedLayout


@triton.jit
def _prepass_kernel(o_ptr, do_ptr, delta_ptr, do8_t_ptr, do_scale_ptr, do_start_ptr,
                    do_norm_ptr, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, REGISTER_B: tl.constexpr, FP8: tl.constexpr):
  t, head, rows, tokens = tiles.program_block(T, H, D, BLOCK_Q, REGISTER_B)
  do = tl.load(do_ptr + tokens).to(tl.float32)
  o = tl.load(o_ptr + tokens).to(tl.float32)
  tl.store(delta_ptr + head * T + rows, tl.sum(do * o, axis=1))
  if FP8:
    tl.store(do_norm_ptr + head * T + rows, tiles.row_norms(do))
    do8, scale = tiles.quantize_e4m3(do)
  else:
    do8, scale = tiles.quantize_tile(do)
  tiles.store_transposed(do8_t_ptr, do8, rows, head, t, T, D, BLOCK_Q, REGISTER_B)
  tl.store(do_scale_ptr + head * T + rows, tl.full((BLOCK_Q,), scale, tl.float32))
  if not REGISTER_B and not FP8:
    tl.store(do_start_ptr + (head * (T // BLOCK_Q) + t) * D + tl.arange(0, D),
             tiles.block_start(do8))


def backward_prepass(o: jax.Array, do: jax.Array, *, block_q: int, launch: LaunchConfig,
                     layout: TransposedLayout = TransposedLayout.TOKENS,
                     fp8: bool = False) -> Prepass:
  """Delta (B, H, T), dO8^T in `layout` (E4M3 with `fp8`), dO's scales per
  token (B, H, T), TOKENS and INT8 the P^T.dO accumulator start (B, H,
  T // block_q, D), and with `fp8` ||dO_i|| (B, H, T)."""
  check_register_blocks(layout, block_q)
  register_b = layout is TransposedLayout.REGISTER_B
  no_start = register_b or fp8

  def run(o, do):
    batch, seq_len, heads, head_dim = o.shape
    start = (1,) if no_start else (batch, heads, seq_len // block_q, head_dim)
    out_shape = [jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32),
                 jax.ShapeDtypeStruct(transposed_shape(batch, heads, head_dim, seq_len, layout),
                                      jnp.float8_e4m3fn if fp8 else jnp.int8),
                 jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32),
                 jax.ShapeDtypeStruct(start, jnp.int32),
                 jax.ShapeDtypeStruct((batch, heads, seq_len) if fp8 else (1,), jnp.float32)]
    delta, do8_t, do_scale, do_start, do_norm = launch.call(
        _prepass_kernel, [o, do], out_shape, grid=(seq_len // block_q, batch, heads),
        name="sagebwd_triton_backward_prepass", T=seq_len, H=heads, D=head_dim,
        BLOCK_Q=block_q, REGISTER_B=register_b, FP8=fp8)
    return delta, do8_t, do_scale, None if no_start else do_start, do_norm if fp8 else None

  return Prepass(*batch_folded(run)(o, do))
