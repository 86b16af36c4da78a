"""The backward kernels for Hopper in Pallas' Mosaic GPU dialect (`plgpu.kernel`).

Same semantics as the portable kernels `pallas_kernels.backward_dkdv.backward_dkdv`
and `pallas_kernels.backward_dq.backward_dq` (P and dS quantized per token: per
key row in dK/dV, per query row in dQ; dO.V^T in bf16/fp16 with fp32
accumulation), restricted to the cases `mosaic_forward.supports` accepts: no masks besides
causality, no Q-smoothing, D in {64, 128}, 64 x 64 quantization blocks.

First version, straightforward: one warpgroup per CTA, one 64-row block.

dK/dV: one CTA per (query head, key block, batch) loops over the query blocks
that see its keys, on transposed tiles so every int8 operand is K-major:
  S^T  = wgmma_int8(K8, Q8^T)       B = the Q8 tile (64, D), stored (N, K)
  dP^T = wgmma_bf16(V, dO^T)        fp32 accumulator
  P^T, dS^T quantized per key row, staged through shared memory (an 8-bit
  wgmma A operand must come from shared memory)
  dV  += wgmma_int8(P8^T, dO8)      B = the dO8^T tile (D, 64) of `do8_t`
  dK  += wgmma_int8(dS8^T, Q8)      B = the Q8^T tile (D, 64) of `qkv.q8_t`
dQ: one CTA per (query head, query block, batch) loops over key blocks:
  S = wgmma_int8(Q8, K8^T), dP = wgmma_bf16(dO, V^T), dS per query row,
  dQ += wgmma_int8(dS8, K8)         B = the K8^T tile (D, 64) of `qkv.k8_t`.
The two products that need no quantized operand (S and dP) are issued back to
back with one wait; the int8 products of P8 / dS8 follow one at a time (a
single 128-thread warpgroup holds the fp32 dK and dV, 128 registers a thread
at D=128, so no more accumulators are kept in flight). The next block's tiles
are fetched by TMA into the other of two shared-memory slots while this block
computes (no producer warpgroup yet).

`MosaicBackwardLaunch(warp_specialized=True)` runs both kernels
FlashAttention-3 style instead: two compute warpgroups own one 64-row block
each (128 keys per dK/dV CTA, 128 queries per dQ CTA) and share the other
side's tiles (Q8, Q8^T, dO, dO8^T for dK/dV; K8, K8^T, V for dQ), which a
producer warpgroup streams with TMA through a `max_concurrent_steps`-deep
ring. Under causality a warpgroup waits on and releases the ring slots of the
blocks only the other warpgroup needs (dK/dV: the second warpgroup's first,
fully masked query block; dQ: the first warpgroup's last key block); causal
dQ CTAs launch longest first. Shared memory for dK/dV at D = 128 with GQA
(fp32 partials) allows a ring of 2; MHA or D = 64 allows 3.

Scales are stored per token (`QuantizedQKV`), so a 64-token tile of a block's
scale is 64 copies of one scalar: loaded as a per-row vector of the 64-row
accumulator it multiplies every element by that same scalar, exactly the
scalar products the portable kernels form (as in `mosaic_forward`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels import numerics as nm
from pallas_kernels.mosaic_forward import (BLOCK, COMPUTE_WGS, check_supported,
                                           smem_transforms, warp_specialized_kernel)
from pallas_kernels.types import Config, Masks, QuantizedQKV

SLOTS = 2  # shared-memory slots per streamed operand (prefetch one block ahead)


@dataclasses.dataclass(frozen=True)
class MosaicBackwardLaunch:
  """Tuning knobs of the Mosaic backward (static; results do not depend on
  them beyond fp32 rounding of exp2 under approx_math)."""

  bit_tricks: bool = False  # fp32 bit tricks for int32->fp32 and rounding
  approx_math: bool = True
  # Two compute warpgroups (128 keys per dK/dV CTA, 128 queries per dQ CTA)
  # fed by a TMA producer warpgroup through a ring of `max_concurrent_steps`
  # slots. Needs Tk (dK/dV), Tq (dQ) % 128 == 0, else the single-warpgroup
  # kernel runs.
  warp_specialized: bool = False
  max_concurrent_steps: int = 2


def _write_tile(value, smem, dst):
  """Stores a register tile to global memory through shared memory (TMA)."""
  smem[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)
  plgpu.wait_smem_to_gmem(0)


def _p_and_ds(s_int, dp, scale_row, lse, delta, *, q_start, kv_start, masked: bool,
              transposed: bool, bit_tricks: bool):
  """P and dS of one recomputed tile (as `common.score_tile` and the portable
  backward form them): scores are int32 * (q_scale * k_scale), given as one
  value per accumulator row; `lse` and `delta` run along the query axis
  (columns when `transposed`, i.e. rows are keys)."""
  tile = s_int.shape
  s = nm.int32_to_float(s_int, bit_tricks=bit_tricks) * lax.broadcast_in_dim(scale_row, tile, [0])
  if masked:
    s = _causal_mask(s, q_start, kv_start, transposed=transposed)
  along_q = [1] if transposed else [0]
  p = jnp.exp2(s - lax.broadcast_in_dim(lse, tile, along_q))
  return p, p * (dp - lax.broadcast_in_dim(delta, tile, along_q))


def _accumulate(acc, product, row_scale, bit_tricks: bool):
  """acc + an int32 product dequantized with one scale per row."""
  return acc + nm.int32_to_float(product, bit_tricks=bit_tricks) * lax.broadcast_in_dim(
      row_scale, acc.shape, [0])


def _quantize_rows_to_smem(x, dst_smem, *, nonnegative: bool, bit_tricks: bool):
  """numerics.quantize_rows on a (64, 64) WGMMA-layout tile; the int8 values
  go to `dst_smem` (committed), the per-row scales (amax / 127) are returned."""
  amax = jnp.max(x if nonnegative else jnp.abs(x), axis=1)
  inv = nm.inverse_scale(amax)
  dst_smem[...] = nm.round_to_int8(x * lax.broadcast_in_dim(inv, x.shape, [0]),
                                   nonnegative=nonnegative, bit_tricks=bit_tricks)
  plgpu.commit_smem()
  return amax / nm.INT8_MAX


def _acc(shape, dtype=jnp.float32):
  return plgpu.layout_cast(jnp.full(shape, 0, dtype), plgpu.Layout.WGMMA)


def _dot(a_smem, b_smem_t, shape, dtype):
  """One wgmma a @ b into a fresh accumulator; b is passed as its (N, K) tile."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem_t.transpose((1, 0)))
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, dtype))


def _two_dots(first, second):
  """Two independent wgmmas issued back to back, then one wait for both.
  Each of `first`, `second` is (a_smem, b_smem_t, shape, dtype) as for `_dot`."""
  def body(ref1, ref2):
    for ref, (a_smem, b_smem_t, _, _) in ((ref1, first), (ref2, second)):
      plgpu.wgmma(ref, a_smem, b_smem_t.transpose((1, 0)))
    return (plgpu.wgmma_accumulator_load(ref1, wait_n=1),
            plgpu.wgmma_accumulator_load(ref2, wait_n=0))
  return pl.run_scoped(body, plgpu.ACC(first[2], first[3]), plgpu.ACC(second[2], second[3]))


def _causal_mask(s, q_start, kv_start, *, transposed: bool):
  rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
  cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
  q_pos, kv_pos = (cols + q_start, rows + kv_start) if transposed else (
      rows + q_start, cols + kv_start)
  return jnp.where(q_pos >= kv_pos, s, -jnp.inf)


def _dkdv_update(dk, dv, *, i, j, masked: bool, b, h, k_smem, v_smem, k_scale_row, tiles,
                 bars, p_smem, ds_smem, scale_refs, bit_tricks: bool):
  """One query block i of key block j's dK, dV (backward_dkdv's q_step).

  `tiles` are the smem tiles (Q8 (64, D), Q8^T (D, 64), dO (64, D), dO8^T
  (D, 64)) of query block i and `bars` the barriers that say they arrived.
  """
  q_tile, qt_tile, do_tile, dot_tile = tiles
  q_bar, qt_bar, do_bar, dot_bar = bars
  qs_ref, dos_ref, lse_ref, delta_ref = scale_refs
  row = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row (key)
  col = plgpu.Layout.WGMMA.reduce(0)  # one value per accumulator column (query)
  tile = (BLOCK, BLOCK)
  rows = pl.ds(i * BLOCK, BLOCK)
  q_scale_row = plgpu.load(qs_ref.at[b, h, rows], layout=row, optimized=False)
  do_scale_row = plgpu.load(dos_ref.at[b, h, rows], layout=row, optimized=False)
  lse_col = plgpu.load(lse_ref.at[b, h, rows], layout=col, optimized=False)
  delta_col = plgpu.load(delta_ref.at[b, h, rows], layout=col, optimized=False)

  plgpu.barrier_wait(q_bar)
  plgpu.barrier_wait(do_bar)
  s_t, dp_t = _two_dots((k_smem, q_tile, tile, jnp.int32), (v_smem, do_tile, tile, jnp.float32))
  p_t, ds_t = _p_and_ds(s_t, dp_t, q_scale_row * k_scale_row, lse_col, delta_col,
                        q_start=i * BLOCK, kv_start=j * BLOCK, masked=masked,
                        transposed=True, bit_tricks=bit_tricks)
  p_scale = _quantize_rows_to_smem(p_t, p_smem, nonnegative=True, bit_tricks=bit_tricks)
  ds_scale = _quantize_rows_to_smem(ds_t, ds_smem, nonnegative=False, bit_tricks=bit_tricks)

  plgpu.barrier_wait(dot_bar)
  pv = _dot(p_smem, dot_tile, (BLOCK, dk.shape[1]), jnp.int32)
  dv = _accumulate(dv, pv, p_scale * do_scale_row, bit_tricks)
  plgpu.barrier_wait(qt_bar)
  dsq = _dot(ds_smem, qt_tile, (BLOCK, dk.shape[1]), jnp.int32)
  dk = _accumulate(dk, dsq, ds_scale * q_scale_row, bit_tricks)
  return dk, dv


def _dkdv_call(q8, q8_t, q_scale, k8, k_scale, v, lse, delta, do, do8_t, do_scale, *,
               causal: bool, out_dtype, launch: MosaicBackwardLaunch):
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  num_q_blocks = q_len // BLOCK
  bit_tricks = launch.bit_tricks
  row = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row (key)

  def kernel(q_ref, qt_ref, qs_ref, k_ref, ks_ref, v_ref, lse_ref, delta_ref, do_ref,
             dot_ref, dos_ref, dk_ref, dv_ref, smem, bars):
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    j = lax.axis_index("kv_seq")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, p_smem, ds_smem, dk_smem,
     dv_smem) = smem
    kv_bar, q_bars, qt_bars, do_bars, dot_bars = bars
    kv = pl.ds(j * BLOCK, BLOCK)

    plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_smem, kv_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_smem, kv_bar.at[1])
    k_scale_row = plgpu.load(ks_ref.at[b, kvh, kv], layout=row, optimized=False)

    def fetch(i, slot):
      rows = pl.ds(i * BLOCK, BLOCK)
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem.at[slot], q_bars.at[slot])
      plgpu.copy_gmem_to_smem(qt_ref.at[b, h, :, rows], qt_smem.at[slot], qt_bars.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_bars.at[slot])
      plgpu.copy_gmem_to_smem(dot_ref.at[b, h, :, rows], dot_smem.at[slot],
                              dot_bars.at[slot])

    if causal:
      start, full, end = common.causal_q_blocks(j, BLOCK, BLOCK, num_q_blocks)
    else:
      start, full, end = 0, 0, num_q_blocks
    start = jnp.asarray(start, jnp.int32)
    end = jnp.asarray(end, jnp.int32)

    @pl.when(start < end)
    def _():
      fetch(start, lax.rem(start, SLOTS))

    plgpu.barrier_wait(kv_bar.at[0])
    plgpu.barrier_wait(kv_bar.at[1])

    def q_step(i, carry, *, masked: bool):
      dk, dv = carry
      slot = lax.rem(i, jnp.array(SLOTS, i.dtype))

      @pl.when(i + 1 < end)
      def _():
        fetch(i + 1, lax.rem(i + 1, jnp.array(SLOTS, i.dtype)))

      return _dkdv_update(
          dk, dv, i=i, j=j, masked=masked, b=b, h=h, k_smem=k_smem, v_smem=v_smem,
          k_scale_row=k_scale_row,
          tiles=(q_smem.at[slot], qt_smem.at[slot], do_smem.at[slot], dot_smem.at[slot]),
          bars=(q_bars.at[slot], qt_bars.at[slot], do_bars.at[slot], dot_bars.at[slot]),
          p_smem=p_smem, ds_smem=ds_smem, scale_refs=(qs_ref, dos_ref, lse_ref, delta_ref),
          bit_tricks=bit_tricks)

    carry = (_acc((BLOCK, head_dim)), _acc((BLOCK, head_dim)))
    if causal:
      carry = lax.fori_loop(start, full, functools.partial(q_step, masked=True), carry)
      carry = lax.fori_loop(full, end, functools.partial(q_step, masked=False), carry)
    else:
      carry = lax.fori_loop(0, num_q_blocks, functools.partial(q_step, masked=False), carry)
    dk, dv = carry
    # Q was quantized as Q * scale * log2(e); the products above carry log2(e).
    dk_smem[...] = (dk * nm.LN_2).astype(out_dtype)
    dv_smem[...] = dv.astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[b, kv, h])
    plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[b, kv, h])
    plgpu.wait_smem_to_gmem(0)

  i8, fdt = jnp.int8, v.dtype
  smem = (
      plgpu.SMEM((BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # K8
      plgpu.SMEM((BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # V
      plgpu.SMEM((SLOTS, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # Q8
      plgpu.SMEM((SLOTS, head_dim, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # Q8^T
      plgpu.SMEM((SLOTS, BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # dO
      plgpu.SMEM((SLOTS, head_dim, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # dO8^T
      plgpu.SMEM((BLOCK, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # P8^T
      plgpu.SMEM((BLOCK, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # dS8^T
      plgpu.SMEM((BLOCK, head_dim), out_dtype, transforms=smem_transforms(head_dim, out_dtype)),
      plgpu.SMEM((BLOCK, head_dim), out_dtype, transforms=smem_transforms(head_dim, out_dtype)),
  )
  bars = (plgpu.Barrier(num_barriers=2),) + (plgpu.Barrier(num_barriers=SLOTS),) * 4
  shape = jax.ShapeDtypeStruct((batch, kv_len, heads, head_dim), out_dtype)
  return plgpu.kernel(
      kernel,
      out_type=(shape, shape),
      scratch_types=(smem, bars),
      grid=(heads, kv_len // BLOCK, batch),
      grid_names=("heads", "kv_seq", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=launch.approx_math),
      kernel_name="sagebwd_backward_dkdv_mosaic",  # its name in profiles
  )(q8, q8_t, q_scale, k8, k_scale, v, lse, delta, do, do8_t, do_scale)


def _dkdv_ws_call(q8, q8_t, q_scale, k8, k_scale, v, lse, delta, do, do8_t, do_scale, *,
                  causal: bool, out_dtype, launch: MosaicBackwardLaunch):
  """dK/dV with warp specialization: two compute warpgroups own 64 keys each
  (128 per CTA) and share the query-side tiles that a producer warpgroup
  streams with TMA through a `max_concurrent_steps`-deep ring."""
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  num_q_blocks = q_len // BLOCK
  wgs = COMPUTE_WGS
  steps = launch.max_concurrent_steps
  row = plgpu.Layout.WGMMA.reduce(1)

  def kernel(q_ref, qt_ref, qs_ref, k_ref, ks_ref, v_ref, lse_ref, delta_ref, do_ref,
             dot_ref, dos_ref, dk_ref, dv_ref, scoped):
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    t = lax.axis_index("kv_seq")
    wg = lax.axis_index("wg")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    smem, (k_bars, v_bars), ring_bars, consumed = scoped
    (k_smem2, v_smem2, q_ring, qt_ring, do_ring, dot_ring, p_smem2, ds_smem2,
     out_smem2) = smem
    q_bars, qt_bars, do_bars, dot_bars = ring_bars
    # Query blocks the CTA's first key block sees; the second warpgroup's
    # may start one later (its first, fully masked, block is only released).
    if causal:
      cta_start = common.causal_q_blocks(t * wgs, BLOCK, BLOCK, num_q_blocks)[0]
    else:
      cta_start = jnp.int32(0)
    cta_start = jnp.asarray(cta_start, jnp.int32)
    end = jnp.int32(num_q_blocks)
    slot_of = lambda i: lax.rem(i, jnp.array(steps, i.dtype))

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      j = t * wgs + wg  # this warpgroup's key block
      kv = pl.ds(j * BLOCK, BLOCK)
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      p_smem, ds_smem = p_smem2.at[wg], ds_smem2.at[wg]
      plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_smem, k_bars.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_smem, v_bars.at[wg])
      k_scale_row = plgpu.load(ks_ref.at[b, kvh, kv], layout=row, optimized=False)
      plgpu.barrier_wait(k_bars.at[wg])
      plgpu.barrier_wait(v_bars.at[wg])

      def q_step(i, carry, *, masked: bool):
        slot = slot_of(i)
        dk, dv = _dkdv_update(
            *carry, i=i, j=j, masked=masked, b=b, h=h, k_smem=k_smem, v_smem=v_smem,
            k_scale_row=k_scale_row,
            tiles=(q_ring.at[slot], qt_ring.at[slot], do_ring.at[slot], dot_ring.at[slot]),
            bars=(q_bars.at[slot], qt_bars.at[slot], do_bars.at[slot], dot_bars.at[slot]),
            p_smem=p_smem, ds_smem=ds_smem, scale_refs=(qs_ref, dos_ref, lse_ref, delta_ref),
            bit_tricks=launch.bit_tricks)
        plgpu.barrier_arrive(consumed.at[slot])
        return dk, dv

      if causal:
        start, full, _ = common.causal_q_blocks(j, BLOCK, BLOCK, num_q_blocks)

        @pl.loop(cta_start, start)
        def _release(i):  # blocks only the other warpgroup needs
          slot = slot_of(i)
          for bar in (q_bars, qt_bars, do_bars, dot_bars):
            plgpu.barrier_wait(bar.at[slot])
          plgpu.barrier_arrive(consumed.at[slot])
      else:
        start = full = jnp.int32(0)
      carry = (_acc((BLOCK, head_dim)), _acc((BLOCK, head_dim)))
      carry = lax.fori_loop(start, full, functools.partial(q_step, masked=True), carry)
      dk, dv = lax.fori_loop(full, end, functools.partial(q_step, masked=False), carry)
      # One staging buffer for both (fp32 dK and dV at D = 128 would not fit).
      out_smem = out_smem2.at[wg]
      for x, dst in (((dk * nm.LN_2), dk_ref), (dv, dv_ref)):
        _write_tile(x.astype(out_dtype), out_smem, dst.at[b, kv, h])

    @pl.when(wg == wgs)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def load(i):
        slot, rows = slot_of(i), pl.ds(i * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_ring.at[slot], q_bars.at[slot])
        plgpu.copy_gmem_to_smem(qt_ref.at[b, h, :, rows], qt_ring.at[slot],
                                qt_bars.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_ring.at[slot], do_bars.at[slot])
        plgpu.copy_gmem_to_smem(dot_ref.at[b, h, :, rows], dot_ring.at[slot],
                                dot_bars.at[slot])

      @pl.loop(cta_start, jnp.minimum(cta_start + steps, end))
      def _prologue(i):
        load(i)

      @pl.loop(cta_start + steps, end)
      def _ring(i):
        plgpu.barrier_wait(consumed.at[slot_of(i)])  # block i - steps is done
        load(i)

      @pl.loop(jnp.maximum(end - steps, cta_start), end)
      def _drain(i):  # observe the last consumptions too
        plgpu.barrier_wait(consumed.at[slot_of(i)])

  i8, fdt = jnp.int8, v.dtype
  smem = (
      plgpu.SMEM((wgs, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # K8
      plgpu.SMEM((wgs, BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # V
      plgpu.SMEM((steps, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # Q8
      plgpu.SMEM((steps, head_dim, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # Q8^T
      plgpu.SMEM((steps, BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # dO
      plgpu.SMEM((steps, head_dim, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # dO8^T
      plgpu.SMEM((wgs, BLOCK, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # P8^T
      plgpu.SMEM((wgs, BLOCK, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # dS8^T
      plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),  # dK, then dV
  )

  barriers = ((plgpu.Barrier(num_barriers=wgs),) * 2,
              (plgpu.Barrier(num_barriers=steps),) * 4,
              plgpu.Barrier(num_arrivals=wgs, num_barriers=steps))
  shape = jax.ShapeDtypeStruct((batch, kv_len, heads, head_dim), out_dtype)
  return warp_specialized_kernel(
      kernel, scratch=smem, barriers=barriers, out_type=(shape, shape),
      grid=(heads, kv_len // (wgs * BLOCK), batch), grid_names=("heads", "kv_seq", "batch"),
      approx_math=launch.approx_math, name="sagebwd_backward_dkdv_mosaic",
  )(q8, q8_t, q_scale, k8, k_scale, v, lse, delta, do, do8_t, do_scale)


def backward_dkdv_mosaic(qkv: QuantizedQKV, v, lse, delta, do, do8_t, do_scale,
                         masks: Masks, config: Config,
                         launch: MosaicBackwardLaunch = MosaicBackwardLaunch()):
  """dK, dV (B, Tk, Hkv, D) in V's dtype, summed over each kv head's group.

  Same contract as `backward_dkdv.backward_dkdv` for the cases `mosaic_forward.supports`
  accepts; with GQA the per-query-head partials are kept in fp32 until summed.
  """
  check_supported(qkv, masks, config, "backward_dkdv_mosaic")
  batch, heads, _, head_dim = qkv.q8.shape
  kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
  group = heads // kv_heads
  out_dtype = v.dtype if group == 1 else jnp.dtype(jnp.float32)
  call = _dkdv_call
  if launch.warp_specialized and kv_len % (COMPUTE_WGS * BLOCK) == 0:
    call = _dkdv_ws_call
  dk, dv = call(qkv.q8, qkv.q8_t, qkv.q_scale, qkv.k8, qkv.k_scale, v, lse, delta, do,
                do8_t, do_scale, causal=config.causal, out_dtype=out_dtype, launch=launch)
  if group > 1:
    sum_group = lambda x: x.reshape(batch, kv_len, kv_heads, group, head_dim).sum(axis=3)
    dk, dv = sum_group(dk).astype(v.dtype), sum_group(dv).astype(v.dtype)
  return dk, dv


def _dq_update(dq, *, i, j, masked: bool, b, kvh, q_smem, do_smem, q_scale_row, lse_row,
               delta_row, ks_ref, tiles, bars, ds_smem, bit_tricks: bool):
  """One key block j of query block i's dQ (backward_dq's kv_step).

  `tiles` are the smem tiles (K8 (64, D), K8^T (D, 64), V (64, D)) of key
  block j and `bars` the barriers that say they arrived.
  """
  k_tile, kt_tile, v_tile = tiles
  k_bar, kt_bar, v_bar = bars
  row = plgpu.Layout.WGMMA.reduce(1)
  tile = (BLOCK, BLOCK)
  kv = pl.ds(j * BLOCK, BLOCK)
  k_scale_row = plgpu.load(ks_ref.at[b, kvh, kv], layout=row, optimized=False)
  plgpu.barrier_wait(k_bar)
  plgpu.barrier_wait(v_bar)
  s, dp = _two_dots((q_smem, k_tile, tile, jnp.int32), (do_smem, v_tile, tile, jnp.float32))
  _, ds = _p_and_ds(s, dp, q_scale_row * k_scale_row, lse_row, delta_row, q_start=i * BLOCK,
                    kv_start=j * BLOCK, masked=masked, transposed=False,
                    bit_tricks=bit_tricks)
  ds_scale = _quantize_rows_to_smem(ds, ds_smem, nonnegative=False, bit_tricks=bit_tricks)
  plgpu.barrier_wait(kt_bar)
  dsk = _dot(ds_smem, kt_tile, dq.shape, jnp.int32)
  return _accumulate(dq, dsk, ds_scale * k_scale_row, bit_tricks)


def _dq_call(q8, q_scale, lse, delta, do, k8, k8_t, k_scale, v, *, config: Config,
             launch: MosaicBackwardLaunch):
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  num_kv_blocks = kv_len // BLOCK
  bit_tricks = launch.bit_tricks
  out_dtype = do.dtype
  row = plgpu.Layout.WGMMA.reduce(1)

  def kernel(q_ref, qs_ref, lse_ref, delta_ref, do_ref, k_ref, kt_ref, ks_ref, v_ref,
             dq_ref, smem, bars):
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    i = lax.axis_index("q_seq")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    q_smem, do_smem, k_smem, kt_smem, v_smem, ds_smem, dq_smem = smem
    q_bar, k_bars, kt_bars, v_bars = bars
    rows = pl.ds(i * BLOCK, BLOCK)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar.at[0])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, q_bar.at[1])
    q_scale_row = plgpu.load(qs_ref.at[b, h, rows], layout=row, optimized=False)
    lse_row = plgpu.load(lse_ref.at[b, h, rows], layout=row, optimized=False)
    delta_row = plgpu.load(delta_ref.at[b, h, rows], layout=row, optimized=False)

    def fetch(j, slot):
      kv = pl.ds(j * BLOCK, BLOCK)
      plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_smem.at[slot], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(kt_ref.at[b, kvh, :, kv], kt_smem.at[slot], kt_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_smem.at[slot], v_bars.at[slot])

    if config.causal:  # common.loop_over_kv_blocks' bounds
      full = jnp.minimum(lax.div(i * BLOCK, BLOCK), num_kv_blocks)
      end = jnp.minimum(lax.div((i + 1) * BLOCK + BLOCK - 1, BLOCK), num_kv_blocks)
    else:
      full = end = num_kv_blocks
    end = jnp.asarray(end, jnp.int32)

    @pl.when(end > 0)
    def _():
      fetch(jnp.int32(0), jnp.int32(0))

    plgpu.barrier_wait(q_bar.at[0])
    plgpu.barrier_wait(q_bar.at[1])

    def kv_step(j, dq, *, masked: bool):
      slot = lax.rem(j, jnp.array(SLOTS, j.dtype))

      @pl.when(j + 1 < end)
      def _():
        fetch(j + 1, lax.rem(j + 1, jnp.array(SLOTS, j.dtype)))

      return _dq_update(
          dq, i=i, j=j, masked=masked, b=b, kvh=kvh, q_smem=q_smem, do_smem=do_smem,
          q_scale_row=q_scale_row, lse_row=lse_row, delta_row=delta_row, ks_ref=ks_ref,
          tiles=(k_smem.at[slot], kt_smem.at[slot], v_smem.at[slot]),
          bars=(k_bars.at[slot], kt_bars.at[slot], v_bars.at[slot]), ds_smem=ds_smem,
          bit_tricks=bit_tricks)

    dq = _acc((BLOCK, head_dim))
    dq = lax.fori_loop(0, full, functools.partial(kv_step, masked=False), dq)
    if config.causal:
      dq = lax.fori_loop(full, end, functools.partial(kv_step, masked=True), dq)
    _write_tile((dq * config.scale).astype(out_dtype), dq_smem, dq_ref.at[b, rows, h])

  i8, fdt = jnp.int8, v.dtype
  smem = (
      plgpu.SMEM((BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # Q8
      plgpu.SMEM((BLOCK, head_dim), do.dtype, transforms=smem_transforms(head_dim, do.dtype)),
      plgpu.SMEM((SLOTS, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # K8
      plgpu.SMEM((SLOTS, head_dim, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # K8^T
      plgpu.SMEM((SLOTS, BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # V
      plgpu.SMEM((BLOCK, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # dS8
      plgpu.SMEM((BLOCK, head_dim), out_dtype, transforms=smem_transforms(head_dim, out_dtype)),
  )
  bars = (plgpu.Barrier(num_barriers=2),) + (plgpu.Barrier(num_barriers=SLOTS),) * 3
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
      scratch_types=(smem, bars),
      grid=(heads, q_len // BLOCK, batch),
      grid_names=("heads", "q_seq", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=launch.approx_math),
      kernel_name="sagebwd_backward_dq_mosaic",  # its name in profiles
  )(q8, q_scale, lse, delta, do, k8, k8_t, k_scale, v)


def _dq_ws_call(q8, q_scale, lse, delta, do, k8, k8_t, k_scale, v, *, config: Config,
                launch: MosaicBackwardLaunch):
  """dQ with warp specialization: two compute warpgroups own one query block
  each (128 rows per CTA) and share the key-side tiles (K8, K8^T, V) that a
  producer warpgroup streams through a `max_concurrent_steps`-deep ring."""
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  num_kv_blocks = kv_len // BLOCK
  num_q_tiles = q_len // (COMPUTE_WGS * BLOCK)
  wgs = COMPUTE_WGS
  steps = launch.max_concurrent_steps
  out_dtype = do.dtype
  row = plgpu.Layout.WGMMA.reduce(1)

  def kv_bounds(qi):  # common.loop_over_kv_blocks' bounds for query block qi
    if not config.causal:
      return jnp.int32(num_kv_blocks), jnp.int32(num_kv_blocks)
    full = jnp.minimum(lax.div(qi * BLOCK, BLOCK), num_kv_blocks)
    end = jnp.minimum(lax.div((qi + 1) * BLOCK + BLOCK - 1, BLOCK), num_kv_blocks)
    return jnp.asarray(full, jnp.int32), jnp.asarray(end, jnp.int32)

  def kernel(q_ref, qs_ref, lse_ref, delta_ref, do_ref, k_ref, kt_ref, ks_ref, v_ref,
             dq_ref, scoped):
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    t = lax.axis_index("q_seq")
    if config.causal:  # the longest query tiles launch first
      t = num_q_tiles - 1 - t
    wg = lax.axis_index("wg")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    smem, (q_bars, do_bars), ring_bars, consumed = scoped
    q_smem2, do_smem2, k_ring, kt_ring, v_ring, ds_smem2, dq_smem2 = smem
    k_bars, kt_bars, v_bars = ring_bars
    cta_end = kv_bounds(t * wgs + wgs - 1)[1]  # key blocks the last query block sees
    slot_of = lambda j: lax.rem(j, jnp.array(steps, j.dtype))

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      i = t * wgs + wg  # this warpgroup's query block
      rows = pl.ds(i * BLOCK, BLOCK)
      q_smem, do_smem, ds_smem = q_smem2.at[wg], do_smem2.at[wg], ds_smem2.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bars.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, do_bars.at[wg])
      q_scale_row = plgpu.load(qs_ref.at[b, h, rows], layout=row, optimized=False)
      lse_row = plgpu.load(lse_ref.at[b, h, rows], layout=row, optimized=False)
      delta_row = plgpu.load(delta_ref.at[b, h, rows], layout=row, optimized=False)
      plgpu.barrier_wait(q_bars.at[wg])
      plgpu.barrier_wait(do_bars.at[wg])

      def kv_step(j, dq, *, masked: bool):
        slot = slot_of(j)
        dq = _dq_update(
            dq, i=i, j=j, masked=masked, b=b, kvh=kvh, q_smem=q_smem, do_smem=do_smem,
            q_scale_row=q_scale_row, lse_row=lse_row, delta_row=delta_row, ks_ref=ks_ref,
            tiles=(k_ring.at[slot], kt_ring.at[slot], v_ring.at[slot]),
            bars=(k_bars.at[slot], kt_bars.at[slot], v_bars.at[slot]), ds_smem=ds_smem,
            bit_tricks=launch.bit_tricks)
        plgpu.barrier_arrive(consumed.at[slot])
        return dq

      full, end = kv_bounds(i)
      dq = lax.fori_loop(0, full, functools.partial(kv_step, masked=False),
                         _acc((BLOCK, head_dim)))
      dq = lax.fori_loop(full, end, functools.partial(kv_step, masked=True), dq)

      @pl.loop(end, cta_end)
      def _release(j):  # blocks only the other warpgroup needs
        slot = slot_of(j)
        for bar in (k_bars, kt_bars, v_bars):
          plgpu.barrier_wait(bar.at[slot])
        plgpu.barrier_arrive(consumed.at[slot])

      dq_smem = dq_smem2.at[wg]
      _write_tile((dq * config.scale).astype(out_dtype), dq_smem, dq_ref.at[b, rows, h])

    @pl.when(wg == wgs)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def load(j):
        slot, kv = slot_of(j), pl.ds(j * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_ring.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(kt_ref.at[b, kvh, :, kv], kt_ring.at[slot], kt_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_ring.at[slot], v_bars.at[slot])

      @pl.loop(0, jnp.minimum(steps, cta_end))
      def _prologue(j):
        load(j)

      @pl.loop(steps, cta_end)
      def _ring(j):
        plgpu.barrier_wait(consumed.at[slot_of(j)])  # block j - steps is done
        load(j)

      @pl.loop(jnp.maximum(cta_end - steps, 0), cta_end)
      def _drain(j):  # observe the last consumptions too
        plgpu.barrier_wait(consumed.at[slot_of(j)])

  i8, fdt = jnp.int8, v.dtype
  smem = (
      plgpu.SMEM((wgs, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # Q8
      plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),  # dO
      plgpu.SMEM((steps, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # K8
      plgpu.SMEM((steps, head_dim, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # K8^T
      plgpu.SMEM((steps, BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # V
      plgpu.SMEM((wgs, BLOCK, BLOCK), i8, transforms=smem_transforms(BLOCK, i8)),  # dS8
      plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),  # dQ
  )

  barriers = ((plgpu.Barrier(num_barriers=wgs),) * 2,
              (plgpu.Barrier(num_barriers=steps),) * 3,
              plgpu.Barrier(num_arrivals=wgs, num_barriers=steps))
  return warp_specialized_kernel(
      kernel, scratch=smem, barriers=barriers,
      out_type=jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
      grid=(heads, num_q_tiles, batch), grid_names=("heads", "q_seq", "batch"),
      approx_math=launch.approx_math, name="sagebwd_backward_dq_mosaic",
  )(q8, q_scale, lse, delta, do, k8, k8_t, k_scale, v)


def backward_dq_mosaic(qkv: QuantizedQKV, v, lse, delta, do, masks: Masks, config: Config,
                       launch: MosaicBackwardLaunch = MosaicBackwardLaunch()):
  """dQ (B, Tq, H, D) in dO's dtype; same contract as `backward_dq.backward_dq`
  for the cases `mosaic_forward.supports` accepts."""
  check_supported(qkv, masks, config, "backward_dq_mosaic")
  call = _dq_call
  if launch.warp_specialized and qkv.q8.shape[2] % (COMPUTE_WGS * BLOCK) == 0:
    call = _dq_ws_call
  return call(qkv.q8, qkv.q_scale, lse, delta, do, qkv.k8, qkv.k8_t, qkv.k_scale, v,
              config=config, launch=launch)
