"""The forward kernel for Hopper in Pallas' Mosaic GPU dialect (`plgpu.kernel`).

Same semantics as `pallas_kernels.triton.forward.forward` (base-2 scores from int8
Q.K^T times the block scales, online softmax, P quantized per row with the row
maximum exp2(rowmax(S) - m_new), int8 P.V, O = acc / l, lse = m + log2(l)),
restricted to the cases `supports` accepts: no masks besides causality, no
Q-smoothing, D in {64, 128}, 64 x 64 quantization blocks.

Structure (FlashAttention-3 style, like jax's `attention_mgpu.py`): one CTA
per (query head, 128 query rows, batch) with three warpgroups. Warpgroups 0
and 1 each own 64 query rows (one quantization block) and run
  S = wgmma_int8(Q8, K8^T)  (int32 accumulator, K tile (64, D) is K-major)
  online softmax, P8 = round(P / sP) staged through shared memory
  PV = wgmma_int8(P8, V8)   (V stored transposed (D, Tk): K-major again)
warpgroup 2 is the producer: it streams K and V^T tiles through a
`max_concurrent_steps`-deep ring of shared-memory slots with TMA. A schedule
barrier alternates the two consumers' tensor-core and softmax phases
(`use_schedule_barrier`); `overlap_qk` also issues the next block's Q.K^T
before this block's softmax. Causal: only the diagonal key block is masked,
later blocks are skipped, the longest query tiles launch first.

Scales are stored per token (`QuantizedQKV`), so a 64-token tile of k_scale
or v_scale is 64 copies of the block's scale: loaded (from global memory, one
key block ahead of use) as a per-row vector of the 64-row accumulator, it
multiplies each row by that same scalar, exactly the scalar product the
portable kernel forms. Every `MosaicLaunch` gives the same results up to fp32
rounding (bit tricks are exact; approx_math changes exp2/log2/division ulps).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import numerics as nm
from pallas_kernels.mosaic.common import (BLOCK, COMPUTE_WGS, check_supported, smem_transforms,
                                          warp_specialized_kernel)
from pallas_kernels.types import Config, Masks, QuantizedQKV

@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
  """Tuning knobs of the Mosaic forward (static)."""

  max_concurrent_steps: int = 2  # K/V ring depth
  use_schedule_barrier: bool = True  # alternate the two warpgroups' tensor-core phases
  bit_tricks: bool = False  # fp32 bit tricks for int32->fp32 and rounding
  overlap_qk: bool = False  # issue block j+1's Q.K^T before block j's softmax (FA3)
  approx_math: bool = True


def _forward_call(q8, q_scale, k8, k_scale, v8_t, v_scale, *, causal: bool, out_dtype,
                  launch: MosaicLaunch, padded: bool):
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  num_kv_blocks = kv_len // BLOCK
  num_q_tiles = q_len // (COMPUTE_WGS * BLOCK)
  steps = min(launch.max_concurrent_steps, num_kv_blocks)
  bit_tricks = launch.bit_tricks
  row = plgpu.Layout.WGMMA.reduce(1)

  def kernel(q_ref, qs_ref, k_ref, ks_ref, vt_ref, vs_ref, o_ref, lse_ref, scoped):
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    t = lax.axis_index("q_seq")
    if causal:  # the longest query tiles launch first (shorter tail)
      t = num_q_tiles - 1 - t
    wg = lax.axis_index("wg")
    (q_smem2, k_smem, vt_smem, p_smem2, o_smem2, lse_smem2), bars, consumed, sched = scoped
    k_bars, v_bars, q_bars = bars
    k_consumed, v_consumed = consumed
    kvh = lax.div(h, jnp.array(group, h.dtype))

    def schedule_barrier():
      if launch.use_schedule_barrier:
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    if causal:  # key blocks the CTA's last query row sees
      cta_kv_steps = (t + 1) * COMPUTE_WGS
      if padded:  # the last CTA's second query block is padding (Tq = Tk)
        cta_kv_steps = jnp.minimum(cta_kv_steps, num_kv_blocks)
    else:
      cta_kv_steps = num_kv_blocks

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      q_smem, p_smem = q_smem2.at[wg], p_smem2.at[wg]
      o_smem, lse_smem = o_smem2.at[wg], lse_smem2.at[wg]
      qi = t * COMPUTE_WGS + wg  # this warpgroup's query block
      q_base = qi * BLOCK
      if not causal:
        kv_steps = num_kv_blocks
      elif padded:  # the padding block (qi == num_kv_blocks) sees every key, unmasked
        kv_steps = jnp.minimum(qi + 1, num_kv_blocks)
      else:
        kv_steps = qi + 1

      plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q_base, BLOCK)], q_smem, q_bars.at[wg])
      q_scale_row = plgpu.load(qs_ref.at[b, h, pl.ds(q_base, BLOCK)], layout=row, optimized=False)
      plgpu.barrier_wait(q_bars.at[wg])

      m = plgpu.layout_cast(jnp.full((BLOCK,), -jnp.inf, jnp.float32), row)
      l = plgpu.layout_cast(jnp.full((BLOCK,), 0.0, jnp.float32), row)
      acc = plgpu.layout_cast(jnp.full((BLOCK, head_dim), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA)

      if launch.use_schedule_barrier:
        pl.when(wg == 1)(schedule_barrier)

      def load_scales(j):
        kv = pl.ds(j * BLOCK, BLOCK)
        return (plgpu.load(ks_ref.at[b, kvh, kv], layout=row, optimized=False),
                plgpu.load(vs_ref.at[b, kvh, kv], layout=row, optimized=False))

      def scores(s_int, k_scale_row, j, masked):
        """Base-2 logits: int32 -> fp32 times (q block scale * k block scale)."""
        s = nm.int32_to_float(s_int, bit_tricks=bit_tricks) * lax.broadcast_in_dim(
            q_scale_row * k_scale_row, (BLOCK, BLOCK), [0])
        if masked:  # causal, on the last key block this query block sees
          q_pos = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0,
                                         layout=plgpu.Layout.WGMMA)
          kv_pos = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1,
                                          layout=plgpu.Layout.WGMMA)
          s = jnp.where(q_pos + q_base >= kv_pos + j * BLOCK, s, -jnp.inf)
        return s

      def softmax_to_smem(s, m, l, v_scale_row):
        """numerics.online_softmax_step; P8 goes to p_smem (an 8-bit wgmma A
        operand must come from shared memory)."""
        m_tile = jnp.max(s, axis=1)
        m_new = jnp.maximum(m, m_tile)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, (BLOCK, BLOCK), [0]))
        l = alpha * l + jnp.sum(p, axis=1)
        # P per row, scaled by its row maximum exp2(rowmax(S) - m_new)
        p_amax = jnp.exp2(m_tile - m_safe)
        inv = nm.inverse_scale(p_amax)
        p_smem[...] = nm.round_to_int8(p * lax.broadcast_in_dim(inv, (BLOCK, BLOCK), [0]),
                                       nonnegative=True, bit_tricks=bit_tricks)
        plgpu.commit_smem()
        return alpha, m_new, l, (p_amax / nm.INT8_MAX) * v_scale_row

      def end_softmax(slot):
        if launch.use_schedule_barrier:  # done with softmax; wait for the tensor core
          plgpu.barrier_arrive(sched)
          plgpu.barrier_wait(v_bars.at[slot])
          plgpu.barrier_wait(sched)
        else:
          plgpu.barrier_wait(v_bars.at[slot])

      def accumulate(acc, alpha, pv, pv_scale):
        pv = nm.int32_to_float(pv, bit_tricks=bit_tricks)
        return (acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                + pv * lax.broadcast_in_dim(pv_scale, acc.shape, [0]))

      def issue_qk(j, s_ref):
        slot = lax.rem(j, jnp.array(steps, j.dtype))
        plgpu.barrier_wait(k_bars.at[slot])
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        schedule_barrier()  # the other warpgroup's softmax runs meanwhile

      def kv_step(j, carry, *, masked: bool):
        """Q.K^T, softmax, P.V of key block j, one after the other."""
        acc, m, l, (k_scale_row, v_scale_row) = carry
        slot = lax.rem(j, jnp.array(steps, j.dtype))
        # The next key block's scales, a whole step ahead of their use.
        next_scales = load_scales(jnp.minimum(j + 1, num_kv_blocks - 1))

        def qk(s_ref):
          issue_qk(j, s_ref)
          return s_ref[...]

        s_int = pl.run_scoped(qk, plgpu.ACC((BLOCK, BLOCK), jnp.int32))
        plgpu.barrier_arrive(k_consumed.at[slot])
        alpha, m, l, pv_scale = softmax_to_smem(scores(s_int, k_scale_row, j, masked), m, l,
                                                v_scale_row)
        end_softmax(slot)

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p_smem, vt_smem.at[slot].transpose((1, 0)))
          return acc_ref[...]

        pv = pl.run_scoped(pv, plgpu.ACC((BLOCK, head_dim), jnp.int32))
        plgpu.barrier_arrive(v_consumed.at[slot])
        return accumulate(acc, alpha, pv, pv_scale), m, l, next_scales

      def overlapped_step(j, carry, *, masked: bool, has_next: bool):
        """Softmax and P.V of key block j while Q.K^T of block j + 1 runs
        (its int32 scores arrive in the carry)."""
        acc, m, l, (k_scale_row, v_scale_row), s_int = carry
        slot = lax.rem(j, jnp.array(steps, j.dtype))
        next_scales = load_scales(jnp.minimum(j + 1, num_kv_blocks - 1))

        def body(pv_ref, s_ref=None):
          if has_next:
            issue_qk(j + 1, s_ref)
          alpha, m_new, l_new, pv_scale = softmax_to_smem(
              scores(s_int, k_scale_row, j, masked), m, l, v_scale_row)
          end_softmax(slot)
          plgpu.wgmma(pv_ref, p_smem, vt_smem.at[slot].transpose((1, 0)))
          s_next = s_int
          if has_next:  # wait for Q.K^T only; P.V may still run
            s_next = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
            plgpu.barrier_arrive(k_consumed.at[lax.rem(j + 1, jnp.array(steps, j.dtype))])
          pv = plgpu.wgmma_accumulator_load(pv_ref, wait_n=0)
          return alpha, m_new, l_new, pv_scale, s_next, pv

        scratch = [plgpu.ACC((BLOCK, head_dim), jnp.int32)]
        if has_next:
          scratch.append(plgpu.ACC((BLOCK, BLOCK), jnp.int32))
        alpha, m, l, pv_scale, s_next, pv = pl.run_scoped(body, *scratch)
        plgpu.barrier_arrive(v_consumed.at[slot])
        return accumulate(acc, alpha, pv, pv_scale), m, l, next_scales, s_next

      carry = (acc, m, l, load_scales(0))
      # Causal: blocks before the last one this query block sees are whole;
      # the last is the diagonal (or, for a padding block, one more whole block).
      masked_last = causal
      last = jnp.asarray(kv_steps - 1, jnp.int32)
      if launch.overlap_qk:
        def first_qk(s_ref):
          issue_qk(jnp.int32(0), s_ref)
          return s_ref[...]

        carry = (*carry, pl.run_scoped(first_qk, plgpu.ACC((BLOCK, BLOCK), jnp.int32)))
        plgpu.barrier_arrive(k_consumed.at[0])
        carry = lax.fori_loop(
            0, kv_steps - 1,
            functools.partial(overlapped_step, masked=False, has_next=True), carry)
        carry = overlapped_step(last, carry, masked=masked_last, has_next=False)[:4]
      else:
        carry = lax.fori_loop(0, kv_steps - 1, functools.partial(kv_step, masked=False),
                              carry)
        carry = kv_step(last, carry, masked=masked_last)

      if causal:
        # Release the slots of the blocks only the other warpgroup needs.
        @pl.loop(kv_steps, cta_kv_steps)
        def _flush(j):
          slot = lax.rem(j, jnp.array(steps, j.dtype))
          plgpu.barrier_wait(k_bars.at[slot])
          plgpu.barrier_wait(v_bars.at[slot])
          plgpu.barrier_arrive(k_consumed.at[slot])
          plgpu.barrier_arrive(v_consumed.at[slot])
          schedule_barrier()
          schedule_barrier()
      acc, m, l, _ = carry
      if launch.use_schedule_barrier:
        pl.when(wg == 0)(schedule_barrier)

      # finalize_rows: every row saw its own key, so l > 0
      empty = l == 0
      l_safe = jnp.where(empty, 1.0, l)
      lse = jnp.where(empty, jnp.inf, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log2(l_safe))
      o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
      o_smem[...] = o.astype(out_dtype)
      lse_smem[...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, pl.ds(q_base, BLOCK), h])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_base, BLOCK)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def load_k(j, slot):
        kv = pl.ds(j * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_smem.at[slot], k_bars.at[slot])

      def load_v(j, slot):
        kv = pl.ds(j * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(vt_ref.at[b, kvh, :, kv], vt_smem.at[slot], v_bars.at[slot])

      for i in range(steps):
        @pl.when(i < cta_kv_steps)
        def _():
          load_k(i, i)
          load_v(i, i)

      # K of block j may not wait for V of block j - steps to be consumed: with
      # overlap_qk a warpgroup issues Q.K^T of block j + 1 before P.V of block j.
      @pl.loop(steps, cta_kv_steps)
      def _ring(j):
        slot = lax.rem(j, jnp.array(steps, j.dtype))
        plgpu.barrier_wait(k_consumed.at[slot])
        load_k(j, slot)
        plgpu.barrier_wait(v_consumed.at[slot])
        load_v(j, slot)

      # Observe the last consumptions too (every barrier phase gets waited on:
      # GPU interpret mode checks it; harmless on the GPU).
      @pl.loop(jnp.maximum(cta_kv_steps - steps, 0), cta_kv_steps)
      def _drain(j):
        slot = lax.rem(j, jnp.array(steps, j.dtype))
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])

  i8 = jnp.int8
  scratch = (
      plgpu.SMEM((COMPUTE_WGS, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),
      plgpu.SMEM((steps, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),
      plgpu.SMEM((steps, head_dim, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),
      plgpu.SMEM((COMPUTE_WGS, BLOCK, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),
      plgpu.SMEM((COMPUTE_WGS, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),
      plgpu.SMEM((COMPUTE_WGS, BLOCK), jnp.float32),
  )
  barriers = (
      (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
       plgpu.Barrier(num_barriers=COMPUTE_WGS)),
      (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),) * 2,
      plgpu.Barrier(num_arrivals=COMPUTE_WGS),
  )
  out_type = (jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
              jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32))
  return warp_specialized_kernel(
      kernel, scratch=scratch, barriers=barriers, out_type=out_type,
      grid=(heads, num_q_tiles, batch), grid_names=("heads", "q_seq", "batch"),
      approx_math=launch.approx_math, name="sagebwd_forward_mosaic",
  )(q8, q_scale, k8, k_scale, v8_t, v_scale)


def forward_mosaic(qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype,
                   launch: MosaicLaunch = MosaicLaunch()):
  """O (B, Tq, H, D) in `out_dtype` and the base-2 log-sum-exp (B, H, Tq).

  Same contract as `pallas_kernels.triton.forward.forward` for the cases `supports`
  accepts. Tq is padded to a multiple of 128 (two query blocks per CTA) when
  needed; padded rows are dropped.
  """
  check_supported(qkv, masks, config, "forward_mosaic")
  out_dtype = jnp.dtype(out_dtype)
  q8, q_scale = qkv.q8, qkv.q_scale
  q_len, kv_len = q8.shape[2], qkv.k8.shape[2]
  if config.causal and q_len != kv_len:
    raise NotImplementedError("forward_mosaic: causal needs Tq == Tk")
  pad = -q_len % (COMPUTE_WGS * BLOCK)
  if pad:
    q8 = jnp.pad(q8, ((0, 0), (0, 0), (0, pad), (0, 0)))
    q_scale = jnp.pad(q_scale, ((0, 0), (0, 0), (0, pad)))
  o, lse = _forward_call(q8, q_scale, qkv.k8, qkv.k_scale, qkv.v8_t, qkv.v_scale,
                         causal=config.causal, out_dtype=out_dtype, launch=launch,
                         padded=bool(pad))
  if pad:
    o, lse = o[:, :q_len], lse[:, :, :q_len]
  return o, lse
