"""What the two Mosaic GPU backward kernels (dK/dV and dQ) share: their launch
settings and the tile operations both run (recomputed P and dS, per-row
quantization into shared memory, wgmma helpers, stores).

Same semantics as the portable kernels (`pallas_kernels.triton.backward_dkdv`,
`pallas_kernels.triton.backward_dq`): P and dS quantized per token (per key row
in dK/dV, per query row in dQ), dO.V^T in bf16/fp16 with fp32 accumulation,
for the cases `mosaic.common.supports` accepts. Scales are stored per token
(`QuantizedQKV`), so a 64-token tile of a block's scale is 64 copies of one
scalar: loaded as a per-row vector of the 64-row accumulator it multiplies
every element by that same scalar, exactly the scalar products the portable
kernels form.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import numerics as nm

SLOTS = 2  # shared-memory slots per streamed operand (prefetch one block ahead)


@dataclasses.dataclass(frozen=True)
class MosaicBackwardLaunch:
  """Tuning knobs of the Mosaic backward (static; results do not depend on
  them beyond fp32 rounding of exp2 under approx_math).

  `python -m benchmarks.mosaic_backward` times the combinations against the
  portable kernels on the same inputs; `MosaicBackend.tuned` takes the
  fastest (figures: docs/performance.md)."""

  bit_tricks: bool = False  # fp32 bit tricks for int32->fp32 and rounding
  approx_math: bool = True
  # Two compute warpgroups (128 keys per dK/dV CTA, 128 queries per dQ CTA)
  # fed by a TMA producer warpgroup through a ring of `max_concurrent_steps`
  # slots. Needs Tk (dK/dV), Tq (dQ) % 128 == 0, else the single-warpgroup
  # kernel runs.
  warp_specialized: bool = False
  max_concurrent_steps: int = 2


def write_tile(value, smem, dst):
  """Stores a register tile to global memory through shared memory (TMA)."""
  smem[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)
  plgpu.wait_smem_to_gmem(0)


def p_and_ds(s_int, dp, scale_row, lse, delta, *, q_start, kv_start, masked: bool,
              transposed: bool, bit_tricks: bool):
  """P and dS of one recomputed tile (as `common.score_tile` and the portable
  backward form them): scores are int32 * (q_scale * k_scale), given as one
  value per accumulator row; `lse` and `delta` run along the query axis
  (columns when `transposed`, i.e. rows are keys)."""
  tile = s_int.shape
  s = nm.int32_to_float(s_int, bit_tricks=bit_tricks) * lax.broadcast_in_dim(scale_row, tile, [0])
  if masked:
    s = causal_mask(s, q_start, kv_start, transposed=transposed)
  along_q = [1] if transposed else [0]
  p = jnp.exp2(s - lax.broadcast_in_dim(lse, tile, along_q))
  return p, p * (dp - lax.broadcast_in_dim(delta, tile, along_q))


def accumulate(acc, product, row_scale, bit_tricks: bool):
  """acc + an int32 product dequantized with one scale per row."""
  return acc + nm.int32_to_float(product, bit_tricks=bit_tricks) * lax.broadcast_in_dim(
      row_scale, acc.shape, [0])


def quantize_rows_to_smem(x, dst_smem, *, nonnegative: bool, bit_tricks: bool):
  """numerics.quantize_rows on a (64, 64) WGMMA-layout tile; the int8 values
  go to `dst_smem` (committed), the per-row scales (amax / 127) are returned."""
  amax = jnp.max(x if nonnegative else jnp.abs(x), axis=1)
  inv = nm.inverse_scale(amax)
  dst_smem[...] = nm.round_to_int8(x * lax.broadcast_in_dim(inv, x.shape, [0]),
                                   nonnegative=nonnegative, bit_tricks=bit_tricks)
  plgpu.commit_smem()
  return amax / nm.INT8_MAX


def acc(shape, dtype=jnp.float32):
  return plgpu.layout_cast(jnp.full(shape, 0, dtype), plgpu.Layout.WGMMA)


def dot(a_smem, b_smem_t, shape, dtype):
  """One wgmma a @ b into a fresh accumulator; b is passed as its (N, K) tile."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem_t.transpose((1, 0)))
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, dtype))


def two_dots(first, second):
  """Two independent wgmmas issued back to back, then one wait for both.
  Each of `first`, `second` is (a_smem, b_smem_t, shape, dtype) as for `dot`."""
  def body(ref1, ref2):
    for ref, (a_smem, b_smem_t, _, _) in ((ref1, first), (ref2, second)):
      plgpu.wgmma(ref, a_smem, b_smem_t.transpose((1, 0)))
    return (plgpu.wgmma_accumulator_load(ref1, wait_n=1),
            plgpu.wgmma_accumulator_load(ref2, wait_n=0))
  return pl.run_scoped(body, plgpu.ACC(first[2], first[3]), plgpu.ACC(second[2], second[3]))


def causal_mask(s, q_start, kv_start, *, transposed: bool):
  rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
  cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
  q_pos, kv_pos = (cols + q_start, rows + kv_start) if transposed else (
      rows + q_start, cols + kv_start)
  return jnp.where(q_pos >= kv_pos, s, -jnp.inf)
