"""What the two Mosaic GPU backward kernels (dK/dV and dQ) share: their launch
settings and the per-score chain of a 64 x 64 tile (their pipeline is
`pipeline`'s).

Both kernels recompute S from int8 Q and K in an int32 accumulator that starts
at 0x4B400000, so its bits read as fp32 are 1.5 * 2**23 + S exactly, and form
the exp2 argument of P = exp2(S * q_scale * k_scale - lse) by one add and one
FMA (`exponent`; c = q_scale * k_scale is one scalar per tile: both are block
scales). dP = dO.V^T runs in 16 bits (the one product never quantized) in an
accumulator that starts at -Delta; dQ issues it with S under one wait, dK/dV
after forming P^T (registers). The int8
products (P^T.dO, dS^T.Q, dS.K) take their 8-bit operand straight from
registers (`registers.dots`; the B operands arrive REGISTER_B,
`types.TransposedLayout`), rounded by one add each, into int32
accumulators that no instruction initializes (the first wgmma ignores them):
merging one into fp32 is a conversion and an FMA (its per-row scale).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import numerics as nm
from pallas_kernels.mosaic import pipeline, registers
from pallas_kernels.mosaic.common import BLOCK, positive_scale

TILE = (BLOCK, BLOCK)
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per accumulator column


@dataclasses.dataclass(frozen=True)
class BackwardTuning(pipeline.Tuning):
  """Launch settings of a Mosaic backward kernel: blocks of 64 keys (dK/dV) or
  queries (dQ) per CTA, the ring of the other side's tiles, the schedule
  barrier. `python -m benchmarks.mosaic_backward` times them
  (docs/performance-log.md).

  `pipelined` (FP8): each step issues the next step's S and dP with its own
  FP8 products (dV and dK, or dQ), one wait covering both; the ring's tiles
  for the first products are released after the chain, those for the
  second a step later. With the schedule barrier the warpgroups take one
  turn a step, after that issue (a ping-pong: one's products run while the
  other runs its chain), and each steps through all of its CTA's tiles
  (causal dK/dV: those before its diagonal are masked whole), so that both
  take as many turns."""

  pipelined: bool = False


def magic(shape=TILE):
  """An int32 WGMMA-layout tile of 0x4B400000, the accumulators' start."""
  return plgpu.layout_cast(jnp.full(shape, nm.ROUND_MAGIC_I32, jnp.int32), plgpu.Layout.WGMMA)


def zeros(shape, dtype=jnp.float32):
  return plgpu.layout_cast(jnp.full(shape, 0, dtype), plgpu.Layout.WGMMA)


def products(pairs, starts, schedule: pipeline.Schedule | None = None):
  """wgmmas A.B^T for each (A smem tile, B smem tile stored (N, K)) of `pairs`,
  into accumulators that start at `starts`, issued back to back; the
  warpgroup takes its turn at `schedule`'s barrier, then one wait covers them.

  S starts at `magic()` (read its result as fp32: 1.5 * 2**23 + S), dP at
  -Delta broadcast to the tile, so the subtraction costs nothing per score.
  """
  def issue(accs):
    for acc, (a, b) in zip(accs, pairs):
      plgpu.wgmma(acc, a, b.T)
    if schedule is not None:
      schedule.turn()

  return pl.run_state(issue)(tuple(plgpu.ACC.init(x) for x in starts))


def as_float(biased_scores):
  return lax.bitcast_convert_type(biased_scores, jnp.float32)


def exponent(f, c, lse, *, along: int, cap=None):
  """The base-2 exponent of P = exp2(S * q_scale * k_scale - lse), capped at 0
  (`numerics.log2_p`), from the biased scores f = 1.5 * 2**23 + S: an add
  (exact), an FMA and a minimum.
  Folding the bias into the FMA's addend would round -lse - 1.5 * 2**23 * c,
  an error of ~c in the exponent that nothing cancels here (the forward's
  row maximum does cancel it). `lse` has one value per row (`along`=0) or
  per column (`along`=1). The FP8 products take P times a factor: `lse`
  less its log2, and `cap` (a scalar, or a vector as `lse`) that log2."""
  x = (f - nm.ROUND_MAGIC_F32) * positive_scale(c) - lax.broadcast_in_dim(lse, f.shape, [along])
  if cap is None:
    return nm.log2_p(x)
  return jnp.minimum(x, cap if jnp.ndim(cap) == 0 else lax.broadcast_in_dim(cap, f.shape,
                                                                            [along]))


def causal_mask(f, *, row_start, col_start, rows_are_keys: bool):
  """f where the query may see the key, -inf elsewhere."""
  rows = plgpu.broadcasted_iota(jnp.int32, f.shape, 0, layout=plgpu.Layout.WGMMA) + row_start
  cols = plgpu.broadcasted_iota(jnp.int32, f.shape, 1, layout=plgpu.Layout.WGMMA) + col_start
  q_pos, kv_pos = (cols, rows) if rows_are_keys else (rows, cols)
  return jnp.where(q_pos >= kv_pos, f, -jnp.inf)


def pack_signed_rows(y):
  """`numerics.quantize_rows` of a tile, packed for `registers.dots`, and
  the row scales (amax / 127). |y| * 127 / amax never rounds past 127, so no
  clip."""
  amax = jnp.max(jnp.abs(y), axis=1)
  inv = nm.inverse_scale(amax)
  bits = lax.bitcast_convert_type(
      y * lax.broadcast_in_dim(inv, y.shape, [0]) + nm.ROUND_MAGIC_F32, jnp.int32)
  return registers.pack(bits), amax / nm.INT8_MAX


def pack_unsigned(pq):
  """P in 0..255 (`numerics.unsigned_rows`' pq), rounded by one add and
  packed for `registers.dots`."""
  return registers.pack(lax.bitcast_convert_type(pq + nm.ROUND_MAGIC_F32, jnp.int32))


def merge(acc, product, row_scale):
  """acc + (int32 product) * row_scale: a conversion and an FMA per element.

  The product started fresh (`registers.dots`), so no
  instruction set its accumulator: against a biased start (0x4B400000, read
  back by one add) this saves a move per element and step
  (docs/performance-log.md, 2026-12-02)."""
  return acc + product.astype(jnp.float32) * lax.broadcast_in_dim(row_scale, acc.shape, [0])


def write_tile(value, smem, dst):
  """Stores a register tile to global memory through shared memory (TMA)."""
  smem[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)
  plgpu.wait_smem_to_gmem(0)


def row_vector(ref):
  return plgpu.load(ref, layout=ROW, optimized=False)


def col_vector(ref):
  return plgpu.load(ref, layout=COL, optimized=False)
