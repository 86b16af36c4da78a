"""What the two Mosaic GPU backward kernels (dK/dV and dQ) share: their launch
settings and the per-score chain of a 64 x 64 tile (their pipeline is
`pipeline`'s).

Both kernels recompute S from int8 Q and K in an int32 accumulator and form
the exp2 argument of P = exp2(S * q_scale * k_scale - lse) by one FMA
(`exponent`; c = q_scale * k_scale is one scalar per tile: both are block
scales) from S in fp32 (`scores`): where `products` issues it the
accumulator starts at 0x4B400000, so its bits read as fp32 are 1.5 * 2**23 +
S exactly (one add); where the pipelined FP8 schedules issue it by
`registers.dots` it starts fresh (one conversion, and no move sets it).
dP = dO.V^T runs in 16 bits (the one product never quantized) in an
accumulator that starts at -Delta (FP8 dK/dV: at zero, Delta folded into
dS^T's multiply); dQ issues it with S under one wait, dK/dV after forming
P^T (registers). The int8
products (P^T.dO, dS^T.Q, dS.K) take their 8-bit operand straight from
registers (`registers.dots`; the B operands arrive REGISTER_B,
`types.TransposedLayout`), rounded by one add each, into int32
accumulators that no instruction initializes (the first wgmma ignores them):
merging one into fp32 is a conversion and an FMA (its per-row scale).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import numerics as nm
from pallas_kernels.mosaic import pipeline, registers
from pallas_kernels.mosaic.common import BLOCK, positive_scale, smem_transforms
from pallas_kernels.types import Config, Fp8Operands, QuantizedQKV

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
  FP8 products (dV and dK, or dQ); the ring's tiles for the first products
  are released once those are done (before the chain), those for the
  second a step later. In the ping-pong (with the schedule barrier) each
  warpgroup steps through all of its CTA's tiles (causal dK/dV: those
  before its diagonal are masked whole), so that both take as many turns.
  `overlap` (without causal_exact): the next step's S and dP go out before
  this step's FP8 products, and the next chain runs under them."""


def magic(shape=TILE):
  """An int32 WGMMA-layout tile of 0x4B400000, the accumulators' start."""
  return plgpu.layout_cast(jnp.full(shape, nm.ROUND_MAGIC_I32, jnp.int32), plgpu.Layout.WGMMA)


def zeros(shape, dtype=jnp.float32):
  return plgpu.layout_cast(jnp.full(shape, 0, dtype), plgpu.Layout.WGMMA)


def products(pairs, starts, schedule: pipeline.Schedule | None = None):
  """wgmmas A.B^T for each (A smem tile, B smem tile stored (N, K)) of `pairs`,
  into accumulators that start at `starts`, issued back to back; the
  warpgroup takes its turn at `schedule`'s barrier, then one wait covers them.

  S starts at `magic()` (`scores` reads 1.5 * 2**23 + S), dP at -Delta
  broadcast to the tile (FP8 dK/dV: at zero), so the subtraction costs
  nothing per score.
  """
  def issue(accs):
    for acc, (a, b) in zip(accs, pairs):
      plgpu.wgmma(acc, a, b.T)
    if schedule is not None:
      schedule.turn()

  return pl.run_state(issue)(tuple(plgpu.ACC.init(x) for x in starts))


def scores(acc, *, biased: bool):
  """S in fp32, exact, from its int32 accumulator: one that started at
  `magic()` (`biased`: its bits read as fp32 are 1.5 * 2**23 + S; an add)
  or from zero (a conversion, I2FP).
  Folding the bias into `exponent`'s FMA instead would round -lse - 1.5 *
  2**23 * c, an error of ~c in the exponent that nothing cancels here (the
  forward's row maximum does cancel it)."""
  if biased:
    return lax.bitcast_convert_type(acc, jnp.float32) - nm.ROUND_MAGIC_F32
  return acc.astype(jnp.float32)


def exponent(s, c, lse, *, along: int, cap=None):
  """The base-2 exponent of P = exp2(S * q_scale * k_scale - lse), capped at 0
  (`numerics.log2_p`), from S in fp32 (`scores`): an FMA and a minimum.
  `lse` has one value per row (`along`=0) or per column (`along`=1). The FP8
  products take P times a factor: `lse` less its log2, and `cap` (a scalar,
  or a vector as `lse`) that log2."""
  x = s * positive_scale(c) - lax.broadcast_in_dim(lse, s.shape, [along])
  return _capped(x, cap, along)


def edge_exponent(s, multiplier: float, lse, *, along: int, cap=None):
  """`exponent` of an edge tile (`Config.exact_edges`) from its fp32
  Q16.K16^T: s * multiplier (scale * log2 e, which Q8's scale carries) less
  the rows' lse in the exact frame."""
  return _capped(s * multiplier - lax.broadcast_in_dim(lse, s.shape, [along]), cap, along)


def _capped(x, cap, along: int):
  if cap is None:
    return nm.log2_p(x)
  return jnp.minimum(x, cap if jnp.ndim(cap) == 0 else lax.broadcast_in_dim(cap, x.shape,
                                                                            [along]))


def causal_mask(f, *, row_start, col_start, rows_are_keys: bool):
  """f where the query may see the key, -inf elsewhere."""
  rows = plgpu.broadcasted_iota(jnp.int32, f.shape, 0, layout=plgpu.Layout.WGMMA) + row_start
  cols = plgpu.broadcasted_iota(jnp.int32, f.shape, 1, layout=plgpu.Layout.WGMMA) + col_start
  q_pos, kv_pos = (cols, rows) if rows_are_keys else (rows, cols)
  return jnp.where(q_pos >= kv_pos, f, -jnp.inf)


def keys_before(f, end, *, col_start):
  """f where the key (column, `col_start` + column) comes before `end`,
  -inf elsewhere: the 8-bit keys of the step that holds a query block's
  diagonal (`Config.exact_edges`)."""
  cols = plgpu.broadcasted_iota(jnp.int32, f.shape, 1, layout=plgpu.Layout.WGMMA) + col_start
  return jnp.where(cols < end, f, -jnp.inf)


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


def dq_row_factor(fp8: Fp8Operands, scale: float) -> jax.Array:
  """dQ's factor per row after its FP8 product (B, H, Tq): b_i k_top_i / 448,
  times `scale` (Q was quantized times scale * log2(e); dS is in base-2
  units)."""
  return fp8.ds_bound * fp8.k_top / nm.E4M3_MAX * scale


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


class EdgeOperands(NamedTuple):
  """What the edge tiles (`Config.exact_edges`) add to a backward kernel's
  operands. Causal with 64 x 64 blocks, a block's one edge tile is its
  diagonal: the warpgroup's own 64 positions on both sides. Q and K in the
  inputs' dtype and layout (B, T, H or Hkv, D), K unsmoothed (the exact
  frame); the rows' lse (B, H, Tq) as the forward wrote it (the kernels'
  lse operand is the 8-bit tiles', `causal_exact_operands`); for dQ each
  query block's m' (`QuantizedQKV.k_mean_seen`, None without K-smoothing),
  which its edge product takes K less."""

  q16: jax.Array
  k16: jax.Array
  lse: jax.Array
  k_mean_seen: jax.Array | None = None


def causal_exact_operands(qkv: QuantizedQKV, lse, config: Config,
                          name: str) -> tuple[jax.Array, EdgeOperands | None]:
  """`Config.causal_exact` in a backward kernel's operands: the lse its
  8-bit tiles read, less each row's q_i . m where K8 lacks K's mean m
  (`numerics.mean_scores`: S + q_i . m - lse = S - (lse - q_i . m), so the
  steps add no term), and with `Config.exact_edges` the diagonal's operands
  (`EdgeOperands`, else None)."""
  if not config.causal_exact:
    return lse, None
  means, edges = qkv.k_mean is not None, config.exact_edges
  needed = ("q16",) * (means or edges) + ("k16",) * edges
  missing = [field for field in needed if getattr(qkv, field) is None]
  if missing:
    raise ValueError(f"causal_exact: {name} needs QuantizedQKV.{', '.join(missing)} "
                     "(sagebwd.quantize sets them)")
  forward_lse = lse
  if means:
    lse = lse - nm.mean_scores(qkv.q16, qkv.k_mean, config.scale * nm.LOG2_E)
  if not edges:
    return lse, None
  return lse, EdgeOperands(qkv.q16, qkv.k16, forward_lse, qkv.k_mean_seen)


def sharing(tile, dtype) -> plgpu.RefUnion:
  """`tile` ((warpgroups, 64, D)) and a tile of its shape in `dtype` in the
  same shared memory, for operands of one warpgroup whose lifetimes do not
  overlap (the edge step's before the output's staging, or after the last
  product of Q8). Each warpgroup's tile starts at the same byte in both, the
  narrower padded to the wider's size, so that no warpgroup's tile of one
  overlaps another warpgroup's of the other (the warpgroups' lifetimes do
  overlap): `shared_tiles` gives a warpgroup's two."""
  other = plgpu.SMEM(tile.shape, dtype, transforms=smem_transforms(tile.shape[-1], dtype))
  widest = max(jnp.dtype(x.dtype).itemsize for x in (tile, other))
  # The narrower's warpgroup w at tile w * (widest / its itemsize).
  padded = lambda x: plgpu.SMEM((x.shape[0] * widest // jnp.dtype(x.dtype).itemsize,
                                 *x.shape[1:]), x.dtype, transforms=x.transforms)
  return plgpu.RefUnion(padded(tile), padded(other))


def shared_tiles(union, wg) -> tuple:
  """Warpgroup `wg`'s (64, D) tile in each view of a `sharing` union."""
  warpgroups = min(ref.shape[0] for ref in union)
  return tuple(ref.at[wg * (ref.shape[0] // warpgroups)] for ref in union)
