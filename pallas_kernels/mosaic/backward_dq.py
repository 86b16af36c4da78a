"""The dQ backward kernel for Hopper (Mosaic GPU, `plgpu.kernel`).

One CTA per (query head, query block, batch) loops over the key blocks its
queries see:
  S  = wgmma_int8(Q8, K8^T), dP = wgmma_bf16(dO, V^T)  (one wait for both)
  dS quantized per query row, staged through shared memory
  dQ += wgmma_int8(dS8, K8)         B = the K8^T tile (D, 64) of `qkv.k8_t`
With `MosaicBackwardLaunch(warp_specialized=True)` two compute warpgroups own
64 queries each and share K8, K8^T and V, which a producer warpgroup streams
through a ring; causal CTAs launch longest first, and the first warpgroup
releases the ring slot of the key block only the second one sees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import causal_blocks
from pallas_kernels.mosaic import backward_common as bc
from pallas_kernels.mosaic.backward_common import SLOTS, MosaicBackwardLaunch
from pallas_kernels.mosaic.common import (BLOCK, COMPUTE_WGS, check_supported, smem_transforms,
                                          warp_specialized_kernel)
from pallas_kernels.types import Config, Masks, QuantizedQKV


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
  s, dp = bc.two_dots((q_smem, k_tile, tile, jnp.int32), (do_smem, v_tile, tile, jnp.float32))
  _, ds = bc.p_and_ds(s, dp, q_scale_row * k_scale_row, lse_row, delta_row, q_start=i * BLOCK,
                    kv_start=j * BLOCK, masked=masked, transposed=False,
                    bit_tricks=bit_tricks)
  ds_scale = bc.quantize_rows_to_smem(ds, ds_smem, nonnegative=False, bit_tricks=bit_tricks)
  plgpu.barrier_wait(kt_bar)
  dsk = bc.dot(ds_smem, kt_tile, dq.shape, jnp.int32)
  return bc.accumulate(dq, dsk, ds_scale * k_scale_row, bit_tricks)


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

    if config.causal:
      full, end = causal_blocks.kv_blocks(i, BLOCK, BLOCK, num_kv_blocks)
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

    dq = bc.acc((BLOCK, head_dim))
    dq = lax.fori_loop(0, full, functools.partial(kv_step, masked=False), dq)
    if config.causal:
      dq = lax.fori_loop(full, end, functools.partial(kv_step, masked=True), dq)
    bc.write_tile((dq * config.scale).astype(out_dtype), dq_smem, dq_ref.at[b, rows, h])

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

  def kv_bounds(qi):  # causal_blocks.kv_blocks as int32, whole for non-causal
    if not config.causal:
      return jnp.int32(num_kv_blocks), jnp.int32(num_kv_blocks)
    full, end = causal_blocks.kv_blocks(qi, BLOCK, BLOCK, num_kv_blocks)
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
                         bc.acc((BLOCK, head_dim)))
      dq = lax.fori_loop(full, end, functools.partial(kv_step, masked=True), dq)

      @pl.loop(end, cta_end)
      def _release(j):  # blocks only the other warpgroup needs
        slot = slot_of(j)
        for bar in (k_bars, kt_bars, v_bars):
          plgpu.barrier_wait(bar.at[slot])
        plgpu.barrier_arrive(consumed.at[slot])

      dq_smem = dq_smem2.at[wg]
      bc.write_tile((dq * config.scale).astype(out_dtype), dq_smem, dq_ref.at[b, rows, h])

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
  """dQ (B, Tq, H, D) in dO's dtype; same contract as `triton.backward_dq.backward_dq`
  for the cases `mosaic.common.supports` accepts."""
  check_supported(qkv, masks, config, "backward_dq_mosaic")
  call = _dq_call
  if launch.warp_specialized and qkv.q8.shape[2] % (COMPUTE_WGS * BLOCK) == 0:
    call = _dq_ws_call
  return call(qkv.q8, qkv.q_scale, lse, delta, do, qkv.k8, qkv.k8_t, qkv.k_scale, v,
              config=config, launch=launch)
