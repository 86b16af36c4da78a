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
after S: P = 448 * exp2(S - m), m the running row maximum, is one FMA per
score, f * c_h + b_h (b_h = log2 448 - m - 1.5 * 2**23 * c_h: rounding b_h
at that scale moves the exponent by under one int8 step of S, far below
E4M3's), converted to E4M3 in pairs (`registers.pack_e4m3`) and added by
FP8 wgmmas into the fp32 output accumulator, rescaled by exp2(m_prev - m)
first; V^T arrives in E4M3 per channel, whose scales multiply O once at the
end. The kernel also returns m, the backward's bound on dS needs it.

The two warpgroups take turns on the tensor cores (a schedule barrier): one
runs its softmax while the other's products run. Causal: the query blocks of a
CTA see the same key steps (128 query rows against 128-key steps), the last
one masked; later steps are skipped and the longest CTAs launch first.
"""

from __future__ import annotations

import dataclasses
import functools
import math

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
  ring (128 keys a slot), the schedule barrier."""


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


def _softmax(f, scales, m, e, l):
  """One step's online softmax (`numerics.folded_softmax_step` on the biased
  scores f of each half): P as rounding-add bits per half, the factor alpha
  for the old accumulator, and the new running (m, e, l). `scales`: per
  half, (c_h, log2 v_scale_h, 1 / v_scale_h)."""
  bcast = lambda x: lax.broadcast_in_dim(x, (BLOCK, BLOCK), [0])
  f_tops = [jnp.max(x, axis=1) for x in f]  # -inf where the row sees no key
  tops = [(f_top - nm.ROUND_MAGIC_F32) * c + log2_v
          for f_top, (c, log2_v, _) in zip(f_tops, scales)]
  m_new = jnp.maximum(m, functools.reduce(jnp.maximum, tops))
  e_new = jnp.maximum(functools.reduce(jnp.maximum, tops), m_new - nm.E_FLOOR_BELOW_MAX)
  alpha = jnp.exp2(e - e_new)
  bits, l_new = [], l * alpha
  for x, f_top, top, (c, _, inv_v_scale) in zip(f, f_tops, tops, scales):
    # A row that sees no key: its -inf scores stay -inf (not -inf + inf).
    from_top = x - bcast(jnp.maximum(f_top, _LOWEST_F))
    # At most log2 255, exactly so at the row's largest (no clip).
    p = jnp.exp2(from_top * c + bcast((top - e_new) + nm.LOG2_UINT8_MAX))
    l_new = l_new + jnp.sum(p, axis=1) * inv_v_scale
    bits.append(lax.bitcast_convert_type(p + nm.ROUND_MAGIC_F32, jnp.int32))
  return bits, alpha, m_new, e_new, l_new


def _fp8_softmax(f, cs, m, l):
  """One step's online softmax for FP8 P.V (`numerics.fp8_softmax_step` on
  the biased scores f of each half, with c_h = `cs`): P = 448 * exp2(S - m)
  per half, fp32, the factor alpha for the old accumulator, the new (m, l)."""
  bcast = lambda x: lax.broadcast_in_dim(x, (BLOCK, BLOCK), [0])
  tops = [(jnp.max(x, axis=1) - nm.ROUND_MAGIC_F32) * c for x, c in zip(f, cs)]
  m_new = jnp.maximum(m, functools.reduce(jnp.maximum, tops))
  alpha = jnp.exp2(m - m_new)
  ps, l_new = [], l * alpha
  for x, c in zip(f, cs):
    p = jnp.exp2(x * c + bcast((_LOG2_E4M3_MAX - m_new) - nm.ROUND_MAGIC_F32 * c))
    l_new = l_new + jnp.sum(p, axis=1)
    ps.append(p)
  return ps, alpha, m_new, l_new


def _finalize_fp8(acc, m, l, v_scale):
  """O and lse from the FP8 step's state (`numerics.finalize_fp8_rows`), V's
  per-channel scale (D,) applied here, with a reciprocal per row."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, m + jnp.log2(l_safe) - _LOG2_E4M3_MAX)
  o = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
  return o * lax.broadcast_in_dim(v_scale, acc.shape, [1]), lse


def _finalize(acc, e, l):
  """O and lse from the running state: `numerics.finalize_folded_rows`, with
  a reciprocal per row."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, e + jnp.log2(l_safe) - nm.LOG2_UINT8_MAX)
  return acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0]), lse


def _forward_call(q8, q_scale, k8, k_scale, v8_t, v_scales: tuple, *, fp8: bool, causal: bool,
                  out_dtype, tuning: ForwardTuning):
  """q8 (B, H, Tq, D); k8 (B, Hkv, Tk / 64, 64, D); v8_t REGISTER_B (B, Hkv,
  Tk / 64, D, 64); Q's and K's scales per token; `v_scales`: V's folded
  ones per block (log2, reciprocal), or with `fp8` its per-channel scale
  (B, Hkv, D). Returns O, lse and, with `fp8`, the rows' maxima.
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

  def kernel(q_ref, qs_ref, k_ref, ks_ref, vt_ref, *refs):
    vs_refs, (o_ref, *row_refs), scoped = refs[:len(v_scales)], refs[len(v_scales):-1], refs[-1]
    b, h, t = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    if causal:  # the longest query tiles launch first (shorter tail)
      t = num_q_tiles - 1 - t
    wg = lax.axis_index("wg")
    (q_smem, k_smem, vt_smem, o_smem, row_smem), (k_bars, v_bars, q_bars), consumed, sched = (
        scoped)
    k_consumed, v_consumed = consumed
    kvh = lax.div(h, jnp.array(group, h.dtype))
    # Key steps the CTA's query blocks see (the same for each of its warpgroups).
    cta_steps = lax.div(t * wgs * BLOCK, jnp.array(KV_STEP, t.dtype)) + 1 if causal else num_steps
    schedule = pipeline.Schedule(sched, tuning)

    def compute():
      q_block = t * wgs + wg
      if num_q_blocks % wgs:  # (causal cases are whole tiles: Tq == Tk, whole steps)
        q_block = jnp.minimum(q_block, num_q_blocks - 1)
      q_base = q_block * BLOCK
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q_base, BLOCK)], q_smem.at[wg],
                              q_bars.at[wg])
      q_scale = qs_ref[b, h, q_base]
      plgpu.barrier_wait(q_bars.at[wg])

      def step_scales(j):
        """Per half: (c_h, log2 v_scale_h, 1 / v_scale_h), or c_h with FP8."""
        out = []
        for half in range(halves):
          blk = j * halves + half
          c = positive_scale(q_scale * ks_ref[b, kvh, blk * BLOCK])
          out.append(c if fp8 else (c, vs_refs[0][b, kvh, blk], vs_refs[1][b, kvh, blk]))
        return tuple(out)

      magic = plgpu.layout_cast(jnp.full((BLOCK, BLOCK), nm.ROUND_MAGIC_I32, jnp.int32),
                                plgpu.Layout.WGMMA)

      # `pl.run_state` bodies cannot close over constants: j is always traced
      # there (a loop index, or derived from the grid position).
      def issue_scores(j, accs):
        """Both halves' S of step j into accumulators that start at 0x4B400000."""
        plgpu.barrier_wait(k_bars.at[ring.slot(j)])
        for half, acc in enumerate(accs):
          plgpu.wgmma(acc, q_smem.at[wg], k_smem.at[ring.slot(j), half].T)
        schedule.turn()  # the other warpgroup's softmax runs meanwhile

      def scores(j):
        s = pl.run_state(functools.partial(issue_scores, j))(
            tuple(plgpu.ACC.init(magic) for _ in range(halves)))
        plgpu.barrier_arrive(k_consumed.at[ring.slot(j)])
        return s

      def finish_step(j, s, state, scales, *, masked: bool):
        """Softmax and P.V of step j from its S; returns the new state."""
        slot = ring.slot(j)
        f = [lax.bitcast_convert_type(x, jnp.float32) for x in s]
        if masked:
          f = [_causal_mask(x, q_base, j * KV_STEP + half * BLOCK) for half, x in enumerate(f)]
        if fp8:
          acc, m, l = state
          p, alpha, m, l = _fp8_softmax(f, scales, m, l)
          a_tiles = tuple(registers.pack_e4m3(x) for x in p)
        else:
          acc, m, e, l = state
          bits, alpha, m, e, l = _softmax(f, scales, m, e, l)
          a_tiles = tuple(registers.pack(x) for x in bits)
        schedule.arrive()  # softmax done: let the other warpgroup issue
        plgpu.barrier_wait(v_bars.at[slot])
        schedule.wait()
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        b_tiles = tuple(vt_smem.at[slot, i] for i in range(halves))
        if fp8:
          (acc,) = registers.dots((acc, a_tiles, b_tiles, vt_transforms))
        else:
          (pv,) = registers.dots((None, a_tiles, b_tiles, vt_transforms), unsigned_a=True)
          acc = acc + pv.astype(jnp.float32)
        plgpu.barrier_arrive(v_consumed.at[slot])
        return (acc, m, l) if fp8 else (acc, m, e, l)

      def kv_step(j, carry, *, masked: bool):
        """S, softmax and P.V of step j, one after the other."""
        state, scales = carry
        next_scales = step_scales(jnp.minimum(j + 1, num_steps - 1))
        return finish_step(j, scores(j), state, scales, masked=masked), next_scales

      full_row = lambda value: plgpu.layout_cast(jnp.full((BLOCK,), value, jnp.float32), row)
      state = (plgpu.layout_cast(jnp.full((BLOCK, head_dim), 0.0, jnp.float32),
                                 plgpu.Layout.WGMMA),
               full_row(nm.NOTHING_SEEN), *(() if fp8 else (full_row(-jnp.inf),)),
               full_row(0.0))
      carry = (state, step_scales(0))
      schedule.lead_in(wg)
      # With causality the last step holds the diagonal.
      steps = cta_steps if causal else num_steps
      if causal:
        carry = lax.fori_loop(0, steps - 1, functools.partial(kv_step, masked=False), carry)
        state, _ = kv_step(steps - 1, carry, masked=True)
      else:
        state, _ = lax.fori_loop(0, steps, functools.partial(kv_step, masked=False), carry)
      schedule.lead_out(wg)
      if fp8:
        acc, m, l = state
        v_scale = plgpu.load(vs_refs[0].at[b, kvh], layout=plgpu.Layout.WGMMA.reduce(0),
                             optimized=False)
        o, lse = _finalize_fp8(acc, m, l, v_scale)
        rows = (lse, m)
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
      def load(j, slot):
        blocks = pl.ds(j * halves, halves)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, blocks], k_smem.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(vt_ref.at[b, kvh, blocks], vt_smem.at[slot], v_bars.at[slot])

      pipeline.stream(ring, first=jnp.int32(0), end=cta_steps,
                      groups=((load, (k_consumed, v_consumed)),))

    pipeline.split(wg, tuning, pipeline.FORWARD_REGISTERS, compute=compute, producer=producer)

  i8 = jnp.int8
  scratch = (
      plgpu.SMEM((wgs, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),
      plgpu.SMEM((ring.slots, halves, BLOCK, head_dim), i8,
                 transforms=smem_transforms(head_dim, i8)),
      plgpu.SMEM((ring.slots, halves, head_dim, BLOCK), v_dtype, transforms=vt_transforms),
      plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),
      plgpu.SMEM((wgs, row_outputs, BLOCK), jnp.float32),
  )
  barriers = (
      (plgpu.Barrier(num_barriers=ring.slots), plgpu.Barrier(num_barriers=ring.slots),
       plgpu.Barrier(num_barriers=wgs)),
      (plgpu.Barrier(num_arrivals=wgs, num_barriers=ring.slots),) * 2,
      plgpu.Barrier(num_arrivals=wgs),
  )
  out_type = (jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
              *(jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),) * row_outputs)
  return pipeline.kernel(
      kernel, tuning=tuning, scratch=scratch, barriers=barriers, out_type=out_type,
      grid=(heads, num_q_tiles, batch), grid_names=("heads", "q_seq", "batch"),
      name="sagebwd_forward_fp8_mosaic" if fp8 else "sagebwd_forward_mosaic",
  )(q8, q_scale, k8, k_scale, v8_t, *v_scales)


def forward_mosaic(qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype,
                   tuning: ForwardTuning = ForwardTuning()):
  """O (B, Tq, H, D) in `out_dtype`, the base-2 log-sum-exp (B, H, Tq), and
  with `Config.fp8` the rows' largest base-2 scores (B, H, Tq), else None.

  For the cases `takes` accepts, V8^T REGISTER_B (`types.Layouts`); P is
  quantized as `backend.MOSAIC_NUMERICS` says, or with FP8 products to E4M3
  against the running maximum.
  """
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
  if config.fp8:
    v_scales = (qkv.v_scale,)
  else:
    v_scales = nm.folded_v_scales(qkv.v_scale[..., ::BLOCK], KV_STEP // BLOCK)
  out = _forward_call(qkv.q8, qkv.q_scale, k8, qkv.k_scale, qkv.v8_t, v_scales,
                      fp8=config.fp8, causal=config.causal, out_dtype=jnp.dtype(out_dtype),
                      tuning=tuning)
  return out if config.fp8 else (*out, None)
