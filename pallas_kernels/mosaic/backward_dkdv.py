"""The dK/dV backward kernel for Hopper (Mosaic GPU, `plgpu.kernel`).

One CTA per (query head, key block, batch) loops over the query blocks that
see its keys, on transposed tiles so every int8 operand is K-major:
  S^T  = wgmma_int8(K8, Q8^T)       B = the Q8 tile (64, D), stored (N, K)
  dP^T = wgmma_bf16(V, dO^T)        fp32 accumulator
  P^T, dS^T quantized per key row, staged through shared memory
  dV  += wgmma_int8(P8^T, dO8)      B = the dO8^T tile (D, 64) of `do8_t`
  dK  += wgmma_int8(dS8^T, Q8)      B = the Q8^T tile (D, 64) of `qkv.q8_t`
S^T and dP^T are issued back to back under one wait. With one warpgroup
(the default launch) the CTA owns 64 keys and prefetches the next query
block's tiles by TMA into the other of two slots; with
`MosaicBackwardLaunch(warp_specialized=True)` two compute warpgroups own 64
keys each and share the query side's tiles, which a producer warpgroup
streams through a `max_concurrent_steps`-deep ring (FlashAttention-3 style).
Under causality a warpgroup waits on and releases the ring slots of the
query blocks only the other one needs. Shared memory at D = 128 with GQA
(fp32 partials) allows a ring of 2; MHA or D = 64 allows 3.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import causal_blocks
from pallas_kernels import numerics as nm
from pallas_kernels.mosaic import backward_common as bc
from pallas_kernels.mosaic.backward_common import SLOTS, MosaicBackwardLaunch
from pallas_kernels.mosaic.common import (BLOCK, COMPUTE_WGS, check_supported, smem_transforms,
                                          warp_specialized_kernel)
from pallas_kernels.types import Config, Masks, QuantizedQKV


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
  s_t, dp_t = bc.two_dots((k_smem, q_tile, tile, jnp.int32), (v_smem, do_tile, tile, jnp.float32))
  p_t, ds_t = bc.p_and_ds(s_t, dp_t, q_scale_row * k_scale_row, lse_col, delta_col,
                        q_start=i * BLOCK, kv_start=j * BLOCK, masked=masked,
                        transposed=True, bit_tricks=bit_tricks)
  p_scale = bc.quantize_rows_to_smem(p_t, p_smem, nonnegative=True, bit_tricks=bit_tricks)
  ds_scale = bc.quantize_rows_to_smem(ds_t, ds_smem, nonnegative=False, bit_tricks=bit_tricks)

  plgpu.barrier_wait(dot_bar)
  pv = bc.dot(p_smem, dot_tile, (BLOCK, dk.shape[1]), jnp.int32)
  dv = bc.accumulate(dv, pv, p_scale * do_scale_row, bit_tricks)
  plgpu.barrier_wait(qt_bar)
  dsq = bc.dot(ds_smem, qt_tile, (BLOCK, dk.shape[1]), jnp.int32)
  dk = bc.accumulate(dk, dsq, ds_scale * q_scale_row, bit_tricks)
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
      start, full, end = causal_blocks.q_blocks(j, BLOCK, BLOCK, num_q_blocks)
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

    carry = (bc.acc((BLOCK, head_dim)), bc.acc((BLOCK, head_dim)))
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
      cta_start = causal_blocks.q_blocks(t * wgs, BLOCK, BLOCK, num_q_blocks)[0]
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
        start, full, _ = causal_blocks.q_blocks(j, BLOCK, BLOCK, num_q_blocks)

        @pl.loop(cta_start, start)
        def _release(i):  # blocks only the other warpgroup needs
          slot = slot_of(i)
          for bar in (q_bars, qt_bars, do_bars, dot_bars):
            plgpu.barrier_wait(bar.at[slot])
          plgpu.barrier_arrive(consumed.at[slot])
      else:
        start = full = jnp.int32(0)
      carry = (bc.acc((BLOCK, head_dim)), bc.acc((BLOCK, head_dim)))
      carry = lax.fori_loop(start, full, functools.partial(q_step, masked=True), carry)
      dk, dv = lax.fori_loop(full, end, functools.partial(q_step, masked=False), carry)
      # One staging buffer for both (fp32 dK and dV at D = 128 would not fit).
      out_smem = out_smem2.at[wg]
      for x, dst in (((dk * nm.LN_2), dk_ref), (dv, dv_ref)):
        bc.write_tile(x.astype(out_dtype), out_smem, dst.at[b, kv, h])

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

  Same contract as `triton.backward_dkdv.backward_dkdv` for the cases `mosaic.common.supports`
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

