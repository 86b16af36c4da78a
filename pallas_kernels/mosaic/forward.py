"""The forward kernel for Hopper (Mosaic GPU, `plgpu.kernel`).

Each CTA owns `compute_wgs` blocks of 64 query rows, one per compute
warpgroup, and a producer warpgroup that streams K and V^T by TMA through a
ring of `max_concurrent_steps` shared-memory slots. A step covers 128 keys:
two 64-token quantization blocks of K and V (the halves h = 0, 1). Per step
and half, a warpgroup computes

  S_h = wgmma_s8(Q8, K8_h^T) into an int32 accumulator that starts at
        0x4B400000, so its bits read as fp32 are f = 1.5 * 2**23 + S_h exactly
        (|S_h| < 2**22): no conversion instruction;
  P_h = exp2((f - f_top) * c_h + b_h): one add and one FMA.
        f - f_top, the distance to the row's largest f of the half, is exact
        (both are the same bias plus an integer); c_h = q_scale * k_scale_h
        turns it into base-2 logits; the row constant b_h = (top_h - E) +
        log2 255, with top_h = (f_top - 1.5 * 2**23) * c_h + log2 v_scale_h
        the half's largest folded score, folds in V's block scale and
        quantizes P per row of the 128-key tile to 0..255 against E, the
        row's largest folded score. So each score is rounded once and the
        row's largest gets exactly log2 255, at any logit scale (folding the
        bias into b_h instead saves the add but rounds b_h at the scale of
        1.5 * 2**23 * c_h); top_h - E is 0 where top_h is E and negative
        elsewhere, so no argument exceeds log2 255 and P needs no clip;

then rounds P by adding 1.5 * 2**23, packs the low bytes into wgmma's 8-bit
register operand (`registers.dots`; V^T arrives REGISTER_B, its
keys permuted to match, `types.TransposedLayout`), and forms PV = P_0.V8_0 +
P_1.V8_1 in one int32 accumulator by unsigned x signed wgmmas. The output
accumulates as acc = acc * exp2(E_prev - E) + float(PV). E is floored at the
running maximum minus 60, so the rescale factor never overflows; tiles that
far below the maximum contribute below fp32 resolution anyway.
docs/algorithm.md gives the algorithm and
`sagebwd_jax.reference.ReferenceBackend(backend.MOSAIC_NUMERICS)`
computes the same values in plain JAX.

With FP8 products (`Config.fp8`, quantization="int8_fp8") the step differs
after S: P = 448 * exp2(S + log2 v_scale_h - m), m the running maximum of
the folded scores, is one FMA per score, f * c_h + b_h (b_h = log2 448 +
log2 v_scale_h - m - 1.5 * 2**23 * c_h: rounding b_h at that scale moves
the exponent by under one int8 step of S, far below E4M3's), converted to
E4M3 in pairs (`registers.pack_e4m3`) and added by FP8 wgmmas into the fp32
output accumulator, rescaled by exp2(m_prev - m) first. V^T arrives in E4M3
with one scale per 64-key block, folded into P as the INT8 mode folds it,
so O takes no scale at the end. The kernel also returns the rows' largest
unfolded scores, tracked apart: the backward's bound on dS needs them.

The two warpgroups take turns on the tensor cores (a schedule barrier): one
runs its softmax while the other's products run. With FP8 products
`ForwardTuning(pipelined=True)` issues each step's P.V together with the
next step's S instead, one turn a step (a ping-pong). Causal: the query blocks of a
CTA see the same key steps (128 query rows against 128-key steps), the last
one masked; later steps are skipped and the longest CTAs launch first.

With `Config.causal_exact` (docs/algorithm.md, "Statistics over what each row
sees") K8 lacks m, the first key block's mean, and each 8-bit half's top takes
back the row's q_i . m, one add per row: one number per row, which each
warpgroup forms once before its loop from its 16-bit Q tile and m (a product
and a row sum in registers; a per-step product would cost tensor core time and
a ring slot's shared memory). The last causal step holds each query block's
diagonal block, the block the causal edge crosses
(`causal_blocks.right_edge`), and a half all before or all after the block's
rows: the diagonal half runs from the unquantized Q, K and V (S = Q16.K16^T
with fp32 accumulation and the multiplier as its scale; P, V's factor 1,
rounded to the inputs' dtype times V16), so no block statistic reaches a row
that does not see the whole block; the other half runs in 8 bits as every
step.

Longer than 400 lines because the loop's one body serves both numerics
modes, the FP8 mode's three schedules (the default, pipelined, overlap) and
`Config.causal_exact`'s 16-bit edge step: split by mode or schedule, the
kernels would repeat the pipeline's frame (the schedules' timings:
docs/performance-log.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import numerics as nm
from pallas_kernels.mosaic import pipeline, registers
from pallas_kernels.mosaic.common import BLOCK, positive_scale, smem_transforms, supports
from pallas_kernels.layouts import check_layout
from pallas_kernels.types import Config, Masks, QuantizedQKV, TransposedLayout

KV_STEP = 2 * BLOCK  # keys per step: two quantization blocks
# The least f an S accumulator can read as (1.5 * 2**23 - 2**22).
_LOWEST_F = float(2**23)
_LOG2_E4M3_MAX = math.log2(nm.E4M3_MAX)


@dataclasses.dataclass(frozen=True)
class ForwardTuning(pipeline.Tuning):
  """Launch settings of the Mosaic forward: query blocks per CTA, the K/V
  ring (128 keys a slot), the schedule barrier. `pipelined` (FP8, without
  `Config.exact_edges`): each step issues its P.V with the next step's S; K's
  tile is released when S has read it, V's a step later. `overlap`: the next
  step's S first, and its softmax under this step's P.V."""


def takes(masks: Masks, config: Config, q_len: int, kv_len: int, head_dim: int,
          dtype) -> bool:
  """Whether `forward_mosaic` computes this case (else the fallback does):
  either quantization."""
  return (supports(masks, config, head_dim)
          and q_len % BLOCK == 0 and kv_len % KV_STEP == 0
          and (not config.causal or q_len == kv_len) and config.window is None
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _causal_mask(f, q_base, kv_base):
  """f where the query (row; `q_base` + row) may see the key (column;
  `kv_base` + column), -inf elsewhere."""
  q_pos = plgpu.broadcasted_iota(jnp.int32, f.shape, 0, layout=plgpu.Layout.WGMMA)
  kv_pos = plgpu.broadcasted_iota(jnp.int32, f.shape, 1, layout=plgpu.Layout.WGMMA)
  return jnp.where(q_pos + q_base >= kv_pos + kv_base, f, -jnp.inf)


class _Half(NamedTuple):
  """A step's 64 keys of scores, as the softmaxes read them: S = (x -
  offset) * c, plus `mean` (per row) where K8 lacks K's mean m;
  `log2_v` and `inv_v` fold V's block scale into P (None: V's factor is 1,
  an edge tile's).
  x is an S accumulator read as fp32 (offset 1.5 * 2**23, c the block
  scales), so x - x_top is exact; or an edge tile's Q16.K16^T (offset 0, c
  the multiplier)."""

  x: jax.Array
  c: jax.Array | float
  offset: float
  mean: jax.Array | None = None
  log2_v: jax.Array | None = None
  inv_v: jax.Array | None = None

  def top(self, x_top):
    """The rows' largest scores, from x's row maxima: -inf where a row sees
    no key."""
    top = (x_top - self.offset) * self.c if self.offset else x_top * self.c
    return top if self.mean is None else top + self.mean

  def folded(self, top):
    return top if self.log2_v is None else top + self.log2_v

  def row_sum(self, p):
    """P's row sums, in the units of unfolded P."""
    total = jnp.sum(p, axis=1)
    return total if self.inv_v is None else total * self.inv_v


def _softmax(halves, m, e, l):
  """One step's online softmax (`numerics.folded_softmax_step` on the step's
  `_Half`s): P per half (rounding-add bits of an 8-bit half, fp32 of an edge
  half), the factor alpha for the old accumulator, and the new running (m,
  e, l)."""
  bcast = lambda x: lax.broadcast_in_dim(x, (BLOCK, BLOCK), [0])
  x_tops = [jnp.max(h.x, axis=1) for h in halves]  # -inf where the row sees no key
  tops = [h.folded(h.top(x_top)) for h, x_top in zip(halves, x_tops)]
  m_new = jnp.maximum(m, functools.reduce(jnp.maximum, tops))
  e_new = jnp.maximum(functools.reduce(jnp.maximum, tops), m_new - nm.E_FLOOR_BELOW_MAX)
  alpha = jnp.exp2(e - e_new)
  out, l_new = [], l * alpha
  for h, x_top, top in zip(halves, x_tops, tops):
    # A row that sees no key: its -inf scores stay -inf (not -inf + inf).
    # Each row of an edge tile sees its own key.
    from_top = h.x - bcast(jnp.maximum(x_top, _LOWEST_F) if h.offset else x_top)
    # At most log2 255, exactly so at the row's largest (no clip).
    p = jnp.exp2(from_top * h.c + bcast((top - e_new) + nm.LOG2_UINT8_MAX))
    l_new = l_new + h.row_sum(p)
    out.append(lax.bitcast_convert_type(p + nm.ROUND_MAGIC_F32, jnp.int32) if h.offset
               else p)
  return out, alpha, m_new, e_new, l_new


def _fp8_softmax(halves, m, l, row_max):
  """One step's online softmax for FP8 P.V (`numerics.fp8_softmax_step` on
  the step's `_Half`s): P = 448 * exp2(S + log2 v_scale - m) per half, fp32,
  the factor alpha for the old accumulator, the new (m, l) and the rows'
  largest unfolded scores `row_max` with the step's (m is the folded
  scores' maximum)."""
  bcast = lambda x: lax.broadcast_in_dim(x, (BLOCK, BLOCK), [0])
  tops = [h.top(jnp.max(h.x, axis=1)) for h in halves]
  m_new = jnp.maximum(m, functools.reduce(jnp.maximum, [h.folded(t)
                                                        for h, t in zip(halves, tops)]))
  alpha = jnp.exp2(m - m_new)
  ps, l_new = [], l * alpha
  for h in halves:
    p = jnp.exp2(h.x * h.c + bcast(_fp8_exponent_row(h, m_new)))
    l_new = l_new + h.row_sum(p)
    ps.append(p)
  row_max = jnp.maximum(row_max, functools.reduce(jnp.maximum, tops))
  return ps, alpha, m_new, l_new, row_max


def _fp8_exponent_row(h: _Half, m):
  """The row's terms of the FP8 P's exponent, so that it is one FMA per score:
  log2 448 - m, the half's mean and V factor, less offset * c."""
  row = _LOG2_E4M3_MAX - m
  row = h.folded(row if h.mean is None else row + h.mean)
  return row - h.offset * h.c if h.offset else row


def _finalize_fp8(acc, m, l):
  """O and lse from the FP8 step's state (`numerics.finalize_fp8_rows`), with
  a reciprocal per row."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, m + jnp.log2(l_safe) - _LOG2_E4M3_MAX)
  return acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0]), lse


def _finalize(acc, e, l):
  """O and lse from the running state: `numerics.finalize_folded_rows`, with
  a reciprocal per row."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, e + jnp.log2(l_safe) - nm.LOG2_UINT8_MAX)
  return acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0]), lse


class _Exact(NamedTuple):
  """What `Config.causal_exact` adds to the kernel's operands, each None
  where the case needs none: Q in the inputs' dtype and layout (B, Tq, H, D),
  the mean term's and the edge tiles'; m (B, Hkv, D) fp32, the mean K8
  lacks; K and V in the inputs' dtype and layout (B, Tk, Hkv, D), the edge
  tiles' (`Config.exact_edges`)."""

  q16: jax.Array | None = None
  k_mean: jax.Array | None = None
  k16: jax.Array | None = None
  v16: jax.Array | None = None


def _forward_call(q8, q_scale, k8, k_scale, v8_t, log2_v, inv_v, exact: _Exact, *,
                  fp8: bool, causal: bool, multiplier: float, out_dtype,
                  tuning: ForwardTuning):
  """q8 (B, H, Tq, D); k8 (B, Hkv, Tk / 64, 64, D); v8_t REGISTER_B (B, Hkv,
  Tk / 64, D, 64); Q's and K's scales per token; `log2_v`, `inv_v`: V's
  block scales as folded into P (`numerics.folded_v_scales`), (B, Hkv,
  Tk / 64); `exact`: `Config.causal_exact`'s operands,
  with `multiplier` the edge tiles' score scale. Returns O, lse and, with
  `fp8`, the rows' largest unfolded scores.
  Where Tq is not whole CTA tiles, the last CTA's last warpgroup computes the
  last query block again (the same values, stored twice) rather than pad Q."""
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, num_kv_blocks = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  wgs = tuning.compute_wgs
  num_steps = num_kv_blocks * BLOCK // KV_STEP
  num_q_blocks = q_len // BLOCK
  num_q_tiles = -(-num_q_blocks // wgs)
  ring = pipeline.Ring(min(tuning.max_concurrent_steps, num_steps))
  halves = KV_STEP // BLOCK
  row = plgpu.Layout.WGMMA.reduce(1)
  v_dtype = v8_t.dtype
  vt_transforms = smem_transforms(BLOCK, v_dtype)
  row_outputs = 2 if fp8 else 1  # lse, and with FP8 the row maxima
  means, edges = exact.k_mean is not None, exact.k16 is not None
  pipelined = fp8 and tuning.pipelined
  i8_transforms = smem_transforms(head_dim, jnp.int8)
  exact_inputs = tuple(x for x in exact if x is not None)
  present = [name for name, x in zip(_Exact._fields, exact) if x is not None]
  staged = [name for name in present if name != "k_mean"]  # copied to shared memory

  def kernel(q_ref, qs_ref, k_ref, ks_ref, vt_ref, log2_v_ref, inv_v_ref, *refs):
    x_refs, refs = _Exact(**dict(zip(present, refs))), refs[len(present):]
    (o_ref, *row_refs), scoped = refs[:-1], refs[-1]
    b, h, t = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    if causal:  # the longest query tiles launch first (shorter tail)
      t = num_q_tiles - 1 - t
    wg = lax.axis_index("wg")
    (q_smem, k_smem, vt_smem, o_smem, row_smem, *x_smem), (k_bars, v_bars, q_bars), consumed, \
        sched, *x_bars = scoped
    k_consumed, v_consumed = consumed
    if exact_inputs:
      (q16_smem, _, k16_smem, v16_smem), (q16_bars, _, k16_bars, v16_bars) = (
          _Exact(**dict(zip(staged, x_smem[0]))), _Exact(**dict(zip(staged, x_bars[0]))))
    kvh = lax.div(h, jnp.array(group, h.dtype))
    # Key steps the CTA's query blocks see (the same for each of its warpgroups).
    cta_steps = lax.div(t * wgs * BLOCK, jnp.array(KV_STEP, t.dtype)) + 1 if causal else num_steps
    schedule = pipeline.Schedule(sched, tuning, wg)

    def compute():
      q_block = t * wgs + wg
      if num_q_blocks % wgs:  # (causal cases are whole tiles: Tq == Tk, whole steps)
        q_block = jnp.minimum(q_block, num_q_blocks - 1)
      q_base = q_block * BLOCK
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q_base, BLOCK)], q_smem.at[wg],
                              q_bars.at[wg])
      if exact_inputs:
        rows16 = pl.ds(q_base, BLOCK)
        plgpu.copy_gmem_to_smem(x_refs.q16.at[b, rows16, h], q16_smem.at[wg], q16_bars.at[wg])
      if edges:  # causal, 64-row query blocks: a query block's edge is its own keys
        plgpu.copy_gmem_to_smem(x_refs.k16.at[b, rows16, kvh], k16_smem.at[wg],
                                k16_bars.at[wg])
        plgpu.copy_gmem_to_smem(x_refs.v16.at[b, rows16, kvh], v16_smem.at[wg],
                                v16_bars.at[wg])
      q_scale = qs_ref[b, h, q_base]
      plgpu.barrier_wait(q_bars.at[wg])
      mean = None
      if exact_inputs:
        plgpu.barrier_wait(q16_bars.at[wg])
      if means:
        # Each row's q_i . m, the same in all its 8-bit halves: formed once.
        q16 = q16_smem.at[wg][...].astype(jnp.float32)
        k_mean = plgpu.load(x_refs.k_mean.at[b, kvh], layout=plgpu.Layout.WGMMA.reduce(0),
                            optimized=False)
        mean = jnp.sum(q16 * lax.broadcast_in_dim(k_mean, q16.shape, [1]), axis=1) * multiplier

      def step_scales(j):
        """Per half: (c_h, log2 v_scale_h, 1 / v_scale_h)."""
        out = []
        for half in range(halves):
          blk = j * halves + half
          c = positive_scale(q_scale * ks_ref[b, kvh, blk * BLOCK])
          out.append((c, log2_v_ref[b, kvh, blk], inv_v_ref[b, kvh, blk]))
        return tuple(out)

      magic = plgpu.layout_cast(jnp.full((BLOCK, BLOCK), nm.ROUND_MAGIC_I32, jnp.int32),
                                plgpu.Layout.WGMMA)
      zeros = lambda: plgpu.layout_cast(jnp.zeros((BLOCK, BLOCK), jnp.float32),
                                        plgpu.Layout.WGMMA)

      # `pl.run_state` bodies cannot close over constants: j is always traced
      # there (a loop index, or derived from the grid position).
      def issue_scores(j, keys, edge, accs):
        """The S of step j's halves `keys` into accumulators that start at
        0x4B400000; then, with `edge`, the edge tile's."""
        plgpu.barrier_wait(k_bars.at[ring.slot(j)])
        for half, acc in zip(keys, accs):
          plgpu.wgmma(acc, q_smem.at[wg], k_smem.at[ring.slot(j), half].T)
        if edge:
          plgpu.barrier_wait(k16_bars.at[wg])
          plgpu.wgmma(accs[-1], q16_smem.at[wg], k16_smem.at[wg].T)
        schedule.turn()  # the other warpgroup's softmax runs meanwhile

      def scores(j, keys=range(halves), edge=False):
        """S of the halves `keys`, then (with `edge`) the edge tile's
        Q16.K16^T."""
        starts = (magic,) * len(keys) + ((zeros(),) if edge else ())
        with jax.named_scope("s"):
          s = pl.run_state(functools.partial(issue_scores, j, keys, edge))(
              tuple(plgpu.ACC.init(x) for x in starts))
        plgpu.barrier_arrive(k_consumed.at[ring.slot(j)])
        return s

      def eight_bit(f, scales, mean):
        """`_Half` of an S accumulator read as fp32."""
        c, log2_v, inv_v = scales
        return _Half(f, c, nm.ROUND_MAGIC_F32, mean, log2_v, inv_v)

      def finish_step(slot, step_halves, state, v_halves):
        """Softmax and P.V of the step in ring `slot`: the 8-bit halves' P
        times V8's tiles `v_halves` in order, an edge half's (the last) times
        V16. Returns the new state."""
        edge = len(step_halves) > len(v_halves)
        with jax.named_scope("elementwise"):
          if fp8:
            acc, m, l, row_max = state
            p, alpha, m, l, row_max = _fp8_softmax(step_halves, m, l, row_max)
            a_tiles = tuple(registers.pack_e4m3(x) for x in p[:len(v_halves)])
          else:
            acc, m, e, l = state
            p, alpha, m, e, l = _softmax(step_halves, m, e, l)
            a_tiles = tuple(registers.pack(x) for x in p[:len(v_halves)])
          if edge:
            p16 = p[-1].astype(x_refs.v16.dtype)
        with jax.named_scope("wait_turn"):
          schedule.arrive()  # softmax done: let the other warpgroup issue
          plgpu.barrier_wait(v_bars.at[slot])
          schedule.wait()
        with jax.named_scope("pv"):
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          b_tiles = tuple(vt_smem.at[slot, i] for i in v_halves)
          if fp8:
            (acc,) = registers.dots((acc, a_tiles, b_tiles, vt_transforms))
          else:
            (pv,) = registers.dots((None, a_tiles, b_tiles, vt_transforms), unsigned_a=True)
            acc = acc + pv.astype(jnp.float32)
        plgpu.barrier_arrive(v_consumed.at[slot])
        if edge:
          plgpu.barrier_wait(v16_bars.at[wg])
          acc = pl.run_state(lambda acc: plgpu.wgmma(acc, p16, v16_smem.at[wg]))(
              plgpu.ACC.init(acc))
        return (acc, m, l, row_max) if fp8 else (acc, m, e, l)

      def kv_step(j, carry, *, masked: bool):
        """S, softmax and P.V of step j, one after the other."""
        state, scales = carry
        next_scales = step_scales(jnp.minimum(j + 1, num_steps - 1))
        s = scores(j)
        slot = ring.slot(j)
        f = [lax.bitcast_convert_type(x, jnp.float32) for x in s]
        if masked:
          f = [_causal_mask(x, q_base, j * KV_STEP + half * BLOCK) for half, x in enumerate(f)]
        step_halves = [eight_bit(x, scale, mean) for x, scale in zip(f, scales)]
        return finish_step(slot, step_halves, state, range(halves)), next_scales

      def edge_step(j, carry):
        """The last causal step with `Config.exact_edges`: the query block's
        own 64 keys (the diagonal, its edge) in 16 bits, the step's other half
        (all before the block's rows, or all after them) in 8 bits."""
        state, scales = carry
        other = 1 - lax.rem(q_block, 2)
        pick = lambda pair: jax.tree.map(
            lambda a, b: jnp.where(jnp.broadcast_to(other == 0, jnp.shape(a)), a, b), *pair)
        s, x = scores(j, keys=(other,), edge=True)
        f = _causal_mask(lax.bitcast_convert_type(s, jnp.float32), q_base,
                         j * KV_STEP + other * BLOCK)
        step_halves = [eight_bit(f, pick(scales), mean),
                       _Half(_causal_mask(x, q_base, q_base), multiplier, 0.0)]
        return finish_step(ring.slot(j), step_halves, state, (other,))

      def issue_s(j):
        """S of step j's halves into accumulators that start at 0x4B400000,
        left in flight."""
        slot = ring.slot(j)
        with jax.named_scope("tiles_s"):
          plgpu.barrier_wait(k_bars.at[slot])
        return registers.dots(*[(magic, ((q_smem.at[wg], i8_transforms),),
                                 (k_smem.at[slot, half],), i8_transforms)
                                for half in range(halves)], wait=False)

      def fp8_chain(j, s, scales, m, l, row_max, *, masked: bool):
        """Step j's softmax from its finished S: P's E4M3 tiles, alpha and
        the new (m, l, row_max)."""
        f = [lax.bitcast_convert_type(x, jnp.float32) for x in s]
        if masked:
          f = [_causal_mask(x, q_base, j * KV_STEP + half * BLOCK) for half, x in enumerate(f)]
        p, alpha, m, l, row_max = _fp8_softmax(
            [eight_bit(x, scale, mean) for x, scale in zip(f, scales)], m, l, row_max)
        return tuple(registers.pack_e4m3(x) for x in p), alpha, m, l, row_max

      def issue_pv(j, acc, a_tiles):
        """acc + P.V of step j, left in flight."""
        slot = ring.slot(j)
        with jax.named_scope("tiles_pv"):
          plgpu.barrier_wait(v_bars.at[slot])
        return registers.dots(
            (acc, a_tiles, tuple(vt_smem.at[slot, i] for i in range(halves)), vt_transforms),
            wait=False)

      def pipelined_step(j, carry, *, masked: bool, last: bool = False):
        """FP8 step j, its S issued and waited for by step j - 1: its P.V goes
        out with step j + 1's S, the warpgroup takes its turn (the other
        one's chain runs under these products), and one wait covers both, so
        that no product is in flight across the loop's back edge."""
        s, (acc, m, l, row_max), scales = carry
        next_scales = step_scales(jnp.minimum(j + 1, num_steps - 1))
        slot = ring.slot(j)
        with jax.named_scope("elementwise"):
          a_tiles, alpha, m, l, row_max = fp8_chain(j, s, scales, m, l, row_max, masked=masked)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        with schedule.issuing(), jax.named_scope("issue"):
          pv = issue_pv(j, acc, a_tiles)
          in_flight = (pv,) if last else (issue_s(j + 1), pv)
        with jax.named_scope("wait"):
          *s, acc = registers.wait_for(*in_flight)
        plgpu.barrier_arrive(v_consumed.at[slot])
        if not last:  # step j + 1's S has read K
          plgpu.barrier_arrive(k_consumed.at[ring.slot(j + 1)])
        return tuple(s), (acc, m, l, row_max), next_scales

      def pipelined_steps(state, steps):
        """Steps [0, steps) as `pipelined_step`s, the last masked when causal."""
        with schedule.issuing():
          s = issue_s(jnp.int32(0))
        s = registers.wait_for(s)
        plgpu.barrier_arrive(k_consumed.at[ring.slot(jnp.int32(0))])
        carry = lax.fori_loop(0, steps - 1, functools.partial(pipelined_step, masked=False),
                              (s, state, step_scales(0)))
        _, state, _ = pipelined_step(jnp.asarray(steps - 1, jnp.int32), carry, masked=causal,
                                     last=True)
        return state

      def overlap_step(j, carry, *, masked: bool):
        """Step j's P.V under step j + 1's chain: step j + 1's S goes out
        first, then step j's P.V, the warpgroup takes its turn, waits for S
        alone (groups complete in order) and runs step j + 1's chain while
        P.V runs; then it waits for P.V and rescales. Nothing is in flight
        across the loop's back edge."""
        a_tiles, (acc, m, l, row_max), scales = carry  # scales: step j + 1's
        with schedule.issuing(), jax.named_scope("issue"):
          s = issue_s(j + 1)
          pv = issue_pv(j, acc, a_tiles)
        with jax.named_scope("wait"):
          s = registers.wait_for(s, pending=1)
        plgpu.barrier_arrive(k_consumed.at[ring.slot(j + 1)])
        next_scales = step_scales(jnp.minimum(j + 2, num_steps - 1))
        with jax.named_scope("elementwise"):
          next_tiles, alpha, m, l, row_max = fp8_chain(j + 1, s, scales, m, l, row_max,
                                                       masked=masked)
        with jax.named_scope("wait_pv"):
          (acc,) = registers.wait_for(pv)
        plgpu.barrier_arrive(v_consumed.at[ring.slot(j)])
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return next_tiles, (acc, m, l, row_max), next_scales

      def overlap_steps(state, steps):
        """Steps [0, steps) with each chain but the first under the step
        before's P.V (`overlap_step`); the last chain masked when causal."""
        acc, m, l, row_max = state
        with schedule.issuing():
          s = issue_s(jnp.int32(0))
        s = registers.wait_for(s)
        plgpu.barrier_arrive(k_consumed.at[ring.slot(jnp.int32(0))])
        # Masking a step the rows see whole changes nothing: step 0's chain is
        # masked whenever causal, in case it is the last.
        a_tiles, _, m, l, row_max = fp8_chain(jnp.int32(0), s, step_scales(0), m, l, row_max,
                                              masked=causal)
        carry = (a_tiles, (acc, m, l, row_max), step_scales(jnp.int32(min(1, num_steps - 1))))
        whole = functools.partial(overlap_step, masked=False)
        if causal:  # the last chain, step steps - 1's, masked: none when steps == 1
          split = jnp.maximum(steps - 2, 0)
          segments = ((0, split, whole, False),
                      (split, steps - 1, functools.partial(overlap_step, masked=True), True))
        else:
          segments = ((0, steps - 1, whole, False),)

        def last_pv(carry):
          a_tiles, (acc, m, l, row_max), _ = carry
          last = jnp.asarray(steps - 1, jnp.int32)
          with schedule.issuing(), jax.named_scope("issue"):
            pv = issue_pv(last, acc, a_tiles)
          (acc,) = registers.wait_for(pv)
          plgpu.barrier_arrive(v_consumed.at[ring.slot(last)])
          return acc, m, l, row_max

        return registers.steps(carry, segments, last_pv)

      full_row = lambda value: plgpu.layout_cast(jnp.full((BLOCK,), value, jnp.float32), row)
      state = (plgpu.layout_cast(jnp.full((BLOCK, head_dim), 0.0, jnp.float32),
                                 plgpu.Layout.WGMMA),
               full_row(nm.NOTHING_SEEN), *(() if fp8 else (full_row(-jnp.inf),)),
               full_row(0.0), *((full_row(nm.NOTHING_SEEN),) if fp8 else ()))
      carry = (state, step_scales(0))
      schedule.lead_in()
      # With causality the last step holds the diagonal.
      steps = cta_steps if causal else num_steps
      if pipelined and tuning.overlap:
        state = overlap_steps(state, steps)
      elif pipelined:
        state = pipelined_steps(state, steps)
      elif causal:
        carry = lax.fori_loop(0, steps - 1, functools.partial(kv_step, masked=False), carry)
        if edges:
          state = edge_step(steps - 1, carry)
        else:
          state, _ = kv_step(steps - 1, carry, masked=True)
      else:
        state, _ = lax.fori_loop(0, steps, functools.partial(kv_step, masked=False), carry)
      schedule.lead_out()
      if fp8:
        acc, m, l, row_max = state
        o, lse = _finalize_fp8(acc, m, l)
        rows = (lse, row_max)
      else:
        acc, _, e, l = state
        o, lse = _finalize(acc, e, l)
        rows = (lse,)
      o_smem.at[wg][...] = o.astype(out_dtype)
      for i, x in enumerate(rows):
        row_smem.at[wg, i][...] = x
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[b, pl.ds(q_base, BLOCK), h])
      for i, ref in enumerate(row_refs):
        plgpu.copy_smem_to_gmem(row_smem.at[wg, i], ref.at[b, h, pl.ds(q_base, BLOCK)])
      plgpu.wait_smem_to_gmem(0)

    def producer():
      def load_k(j, slot):
        blocks = pl.ds(j * halves, halves)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, blocks], k_smem.at[slot], k_bars.at[slot])

      def load_v(j, slot):
        blocks = pl.ds(j * halves, halves)
        plgpu.copy_gmem_to_smem(vt_ref.at[b, kvh, blocks], vt_smem.at[slot], v_bars.at[slot])

      # Pipelined, K's tile is released a step before V's: the next S must not
      # wait for the other warpgroup's release of V, which follows its turn.
      groups = (((load_k, (k_consumed,)), (load_v, (v_consumed,))) if pipelined
                else ((lambda j, slot: (load_k(j, slot), load_v(j, slot)),
                       (k_consumed, v_consumed)),))
      pipeline.stream(ring, first=jnp.int32(0), end=cta_steps, groups=groups)

    pipeline.split(wg, tuning, pipeline.FORWARD_REGISTERS, compute=compute, producer=producer)

  i8 = jnp.int8
  scratch = (
      plgpu.SMEM((wgs, BLOCK, head_dim), i8, transforms=i8_transforms),
      plgpu.SMEM((ring.slots, halves, BLOCK, head_dim), i8, transforms=i8_transforms),
      plgpu.SMEM((ring.slots, halves, head_dim, BLOCK), v_dtype, transforms=vt_transforms),
      plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),
      plgpu.SMEM((wgs, row_outputs, BLOCK), jnp.float32),
  )
  barriers = (
      (plgpu.Barrier(num_barriers=ring.slots), plgpu.Barrier(num_barriers=ring.slots),
       plgpu.Barrier(num_barriers=wgs)),
      (plgpu.Barrier(num_arrivals=wgs, num_barriers=ring.slots),) * 2,
      pipeline.Schedule.barrier(tuning),
  )
  if exact_inputs:
    # A warpgroup's 64 rows of Q16, K16 and V16, as `_Exact` names them.
    dtype16 = exact.q16.dtype
    tile = plgpu.SMEM((wgs, BLOCK, head_dim), dtype16,
                      transforms=smem_transforms(head_dim, dtype16))
    scratch += ((tile,) * len(staged),)
    barriers += ((plgpu.Barrier(num_barriers=wgs),) * len(staged),)
  out_type = (jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
              *(jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),) * row_outputs)
  return pipeline.kernel(
      kernel, tuning=tuning, scratch=scratch, barriers=barriers, out_type=out_type,
      grid=(heads, num_q_tiles, batch), grid_names=("heads", "q_seq", "batch"),
      name="sagebwd_forward_fp8_mosaic" if fp8 else "sagebwd_forward_mosaic",
  )(q8, q_scale, k8, k_scale, v8_t, log2_v, inv_v, *exact_inputs)


def _exact_operands(qkv: QuantizedQKV, config: Config) -> _Exact:
  """`Config.causal_exact`'s operands of the kernel (`_Exact`): the mean term
  where K8 lacks m, the edge tiles with `Config.exact_edges`."""
  edges = config.exact_edges
  means = config.causal_exact and qkv.k_mean is not None
  if not (means or edges):
    return _Exact()
  needed = ("q16", "k16", "v16") if edges else ("q16",)
  missing = [name for name in needed if getattr(qkv, name) is None]
  if missing:
    raise ValueError(f"causal_exact: forward_mosaic needs QuantizedQKV.{', '.join(missing)} "
                     "(sagebwd.quantize sets them)")
  return _Exact(qkv.q16, qkv.k_mean if means else None, qkv.k16 if edges else None,
                qkv.v16 if edges else None)


def forward_mosaic(qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype,
                   tuning: ForwardTuning = ForwardTuning()):
  """O (B, Tq, H, D) in `out_dtype`, the base-2 log-sum-exp (B, H, Tq), and
  with `Config.fp8` the rows' largest base-2 scores (B, H, Tq), else None.

  For the cases `takes` accepts, V8^T REGISTER_B (`types.Layouts`); P is
  quantized as `backend.MOSAIC_NUMERICS` says, or with FP8 products to E4M3
  against the running maximum. With `Config.causal_exact` the statistics
  over what each row sees, from the operands `sagebwd.quantize` adds
  (`QuantizedQKV.q16`, `k_mean`, `k16`, `v16`).
  """
  if tuning.pipelined and config.fp8 and config.exact_edges:
    raise ValueError("forward_mosaic: tuning=ForwardTuning(pipelined=True) does not take "
                     "causal_exact's 16-bit edge step; pass pipelined=False")
  batch, heads, q_len, head_dim = qkv.q8.shape
  kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
  if not takes(masks, config, q_len, kv_len, head_dim, out_dtype):
    raise NotImplementedError(
        "forward_mosaic takes no masks but causality, smooth_q=False, ds_precision='int8', "
        "64 x 64 blocks, "
        f"D in (64, 128), Tq % 64 == 0, Tk % {KV_STEP} == 0, Tq == Tk when causal, 16-bit "
        f"output; got D={head_dim}, Tq={q_len}, Tk={kv_len}, config={config}, "
        f"masks={masks.q_ids is not None}, dtype={jnp.dtype(out_dtype)}")
  check_layout("v8_t", qkv.v8_t, TransposedLayout.REGISTER_B)
  # Splitting the token axis in blocks moves no byte (a bitcast).
  k8 = qkv.k8.reshape(batch, kv_heads, kv_len // BLOCK, BLOCK, head_dim)
  log2_v, inv_v = nm.folded_v_scales(qkv.v_scale[..., ::BLOCK], KV_STEP // BLOCK)
  out = _forward_call(qkv.q8, qkv.q_scale, k8, qkv.k_scale, qkv.v8_t, log2_v, inv_v,
                      _exact_operands(qkv, config), fp8=config.fp8, causal=config.causal,
                      multiplier=config.scale * nm.LOG2_E, out_dtype=jnp.dtype(out_dtype),
                      tuning=tuning)
  return out if config.fp8 else (*out, None)
