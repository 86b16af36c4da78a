"""The dK/dV backward kernel for Hopper (Mosaic GPU, `plgpu.kernel`).

A CTA owns one block of 64 keys, and a producer warpgroup streams the query
side (Q8, Q8^T, dO, dO8^T, and the rows' lse and Delta, of one 64-query
block a step) by TMA through a ring. Per step its two compute warpgroups
split the work on the transposed tile (rows are the keys, columns the
step's queries):

  warpgroup 0:  S^T = K8.Q8^T (int8, biased accumulator);
                pq = 255 * exp2(a - rowmax(a)), a the exponent of P^T
                  (`backward_common`), per key row (`numerics.unsigned_rows`),
                  handed to warpgroup 1 with its row exponent top;
                dV += exp2(top) * dO's scale * (P8^T.dO8)   unsigned x signed,
                  P8 from registers;
  warpgroup 1:  dP^T - Delta = V.dO^T (16-bit, from -Delta);
                dS^T (in pq's units) = pq * (dP^T - Delta), quantized per key
                  row;
                dK += dS^T's scale * exp2(top) * Q's scale * (dS8^T.Q8)
                  from registers;

where exp2(top) is P^T's row scale. Q's and dO's scales are one scalar per
step (a block's), so they fold into the row scales of the merges. Each
warpgroup holds one fp32 accumulator and one int32 product, so none spills
(one warpgroup doing all of a step held both and spilled; docs/performance.md,
seventeenth session). pq and top pass through `_PQ_BUFFERS` shared-memory
buffers, each with a barrier for "written" and one for "read". Causal: the
CTA starts at the query block holding its diagonal (masked).
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
from pallas_kernels.mosaic import pipeline, registers
from pallas_kernels.mosaic.backward_common import DkdvTuning
from pallas_kernels.mosaic.common import BLOCK, check_supported, smem_transforms
from pallas_kernels.layouts import check_layout
from pallas_kernels.types import Config, Masks, QuantizedQKV, TransposedLayout

# P^T's shared-memory buffers between the two warpgroups: warpgroup 0 forms
# the next step's while warpgroup 1 reads this one's.
_PQ_BUFFERS = 2


def _dkdv_call(q8, q8_t, q_scale, k8, k_scale, v, lse, delta, do, do8_t, do_scale, *,
               causal: bool, out_dtype, tuning: DkdvTuning):
  """q8_t, do8_t: REGISTER_B (B, H, Tq / 64, D, 64) int8 (`types.TransposedLayout`);
  scales per token (B, H, T)."""
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  num_q_blocks = q_len // BLOCK
  t_transforms = smem_transforms(BLOCK, jnp.int8)

  def kernel(q_ref, q8_t_ref, qs_ref, k_ref, ks_ref, v_ref, lse_ref, delta_ref, do_ref,
             do8_t_ref, dos_ref, dk_ref, dv_ref, scoped):
    b, h, j = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("kv_seq")
    wg = lax.axis_index("wg")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    smem, (kv_bars,), ring_bars, consumed, (pq_ready, pq_free) = scoped
    (k_smem, v_smem, q_ring, q8_t_ring, do_ring, do8_t_ring, lse_ring, delta_ring, pq_smem,
     top_smem, out_smem2) = smem
    q_bars, q8_t_bars, do_bars, do8_t_bars, lse_bars, delta_bars = ring_bars
    kv = pl.ds(j * BLOCK, BLOCK)
    if causal:
      start, full, _ = (jnp.asarray(x, jnp.int32)
                        for x in causal_blocks.q_blocks(j, BLOCK, BLOCK, num_q_blocks))
    else:
      start = full = jnp.int32(0)
    end = jnp.int32(num_q_blocks)
    ring = pipeline.Ring(tuning.max_concurrent_steps)
    pq_ring = pipeline.Ring(_PQ_BUFFERS)  # warpgroup 0 -> 1
    out_smem = out_smem2.at[wg]

    def p_and_dv():
      plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_smem, kv_bars.at[0])
      k_scale = ks_ref[b, kvh, j * BLOCK]
      plgpu.barrier_wait(kv_bars.at[0])

      def q_step(i, dv, *, masked: bool):
        slot, buf = ring.slot(i), pq_ring.slot(i - start)
        q_scale = qs_ref[b, h, i * BLOCK]
        do_scale = dos_ref[b, h, i * BLOCK]
        plgpu.barrier_wait(q_bars.at[slot])
        (s,) = bc.products([(k_smem, q_ring.at[slot])], [bc.magic()])
        f = bc.as_float(s)
        if masked:
          f = bc.causal_mask(f, row_start=j * BLOCK, col_start=i * BLOCK, rows_are_keys=True)
        plgpu.barrier_wait(lse_bars.at[slot])
        lse = bc.col_vector(lse_ring.at[slot])
        pq, top = nm.unsigned_rows(bc.exponent(f, q_scale * k_scale, lse, along=1))
        plgpu.barrier_wait(pq_free.at[buf])  # warpgroup 1 read what it held
        pq_smem.at[buf][...] = pq
        top_smem.at[buf][...] = top
        plgpu.barrier_arrive(pq_ready.at[buf])
        p8 = bc.pack_unsigned(pq)
        plgpu.barrier_wait(do8_t_bars.at[slot])
        pdo = registers.dot_from_registers((p8,), (do8_t_ring.at[slot],), t_transforms,
                                           head_dim, unsigned_a=True)
        dv = bc.merge(dv, pdo, jnp.exp2(top) * do_scale)
        plgpu.barrier_arrive(consumed.at[slot])
        return dv

      dv = lax.fori_loop(start, full, functools.partial(q_step, masked=True),
                         bc.zeros((BLOCK, head_dim)))
      dv = lax.fori_loop(full, end, functools.partial(q_step, masked=False), dv)
      for buf in range(_PQ_BUFFERS):  # observe warpgroup 1's last releases
        plgpu.barrier_wait(pq_free.at[buf])
      bc.write_tile(dv.astype(out_dtype), out_smem, dv_ref.at[b, kv, h])

    def ds_and_dk():
      plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_smem, kv_bars.at[1])
      plgpu.barrier_wait(kv_bars.at[1])
      for buf in range(_PQ_BUFFERS):  # both buffers start free
        plgpu.barrier_arrive(pq_free.at[buf])

      def q_step(i, dk):  # one loop: the masked steps' P^T arrives 0 where masked
        slot, buf = ring.slot(i), pq_ring.slot(i - start)
        q_scale = qs_ref[b, h, i * BLOCK]
        plgpu.barrier_wait(delta_bars.at[slot])
        delta = bc.col_vector(delta_ring.at[slot])
        minus_delta = -lax.broadcast_in_dim(delta, bc.TILE, [1])
        plgpu.barrier_wait(do_bars.at[slot])
        (dp,) = bc.products([(v_smem, do_ring.at[slot])], [minus_delta])
        plgpu.barrier_wait(pq_ready.at[buf])
        pq = plgpu.load(pq_smem.at[buf], layout=plgpu.Layout.WGMMA, optimized=False)
        top = bc.row_vector(top_smem.at[buf])
        plgpu.barrier_arrive(pq_free.at[buf])
        ds8, ds_scale = bc.pack_signed_rows(pq * dp)
        plgpu.barrier_wait(q8_t_bars.at[slot])
        dsq = registers.dot_from_registers((ds8,), (q8_t_ring.at[slot],), t_transforms,
                                           head_dim, unsigned_a=False)
        dk = bc.merge(dk, dsq, ds_scale * jnp.exp2(top) * q_scale)
        plgpu.barrier_arrive(consumed.at[slot])
        return dk

      dk = lax.fori_loop(start, end, q_step, bc.zeros((BLOCK, head_dim)))
      # Q was quantized as Q * scale * log2(e): dK carries log2(e) once.
      bc.write_tile((dk * nm.LN_2).astype(out_dtype), out_smem, dk_ref.at[b, kv, h])

    def compute():
      pl.when(wg == 0)(p_and_dv)
      pl.when(wg == 1)(ds_and_dk)

    def producer():
      def load(i, slot):
        rows = pl.ds(i * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_ring.at[slot], q_bars.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_ring.at[slot], lse_bars.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_ring.at[slot], do_bars.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_ring.at[slot],
                                delta_bars.at[slot])
        plgpu.copy_gmem_to_smem(do8_t_ref.at[b, h, i], do8_t_ring.at[slot], do8_t_bars.at[slot])
        plgpu.copy_gmem_to_smem(q8_t_ref.at[b, h, i], q8_t_ring.at[slot], q8_t_bars.at[slot])

      pipeline.stream(ring, first=start, end=end, load=load, consumed=(consumed,))

    pipeline.split(wg, tuning, pipeline.BACKWARD_REGISTERS, compute=compute, producer=producer)

  i8, fdt, f32 = jnp.int8, v.dtype, jnp.float32
  slots = tuning.max_concurrent_steps
  scratch = (
      plgpu.SMEM((BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # K8
      plgpu.SMEM((BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # V
      plgpu.SMEM((slots, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # Q8
      plgpu.SMEM((slots, head_dim, BLOCK), i8, transforms=t_transforms),  # Q8^T
      plgpu.SMEM((slots, BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # dO
      plgpu.SMEM((slots, head_dim, BLOCK), i8, transforms=t_transforms),  # dO8^T
      plgpu.SMEM((slots, BLOCK), f32),  # lse
      plgpu.SMEM((slots, BLOCK), f32),  # Delta
      plgpu.SMEM((_PQ_BUFFERS, BLOCK, BLOCK), f32, transforms=smem_transforms(BLOCK, f32)),  # pq
      plgpu.SMEM((_PQ_BUFFERS, BLOCK), f32),  # P^T's row exponents
      plgpu.SMEM((tuning.compute_wgs, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),  # dV, dK
  )
  wgs = tuning.compute_wgs
  barriers = ((plgpu.Barrier(num_barriers=2),),  # K, V
              (plgpu.Barrier(num_barriers=slots),) * 6,
              plgpu.Barrier(num_arrivals=wgs, num_barriers=slots),
              (plgpu.Barrier(num_barriers=_PQ_BUFFERS),) * 2)
  shape = jax.ShapeDtypeStruct((batch, kv_len, heads, head_dim), out_dtype)
  return pipeline.kernel(
      kernel, tuning=tuning, scratch=scratch, barriers=barriers, out_type=(shape, shape),
      grid=(heads, kv_len // BLOCK, batch), grid_names=("heads", "kv_seq", "batch"),
      name="sagebwd_backward_dkdv_mosaic",
  )(q8, q8_t, q_scale, k8, k_scale, v, lse, delta, do, do8_t, do_scale)


def backward_dkdv_mosaic(qkv: QuantizedQKV, v, lse, delta, do, do8_t, do_scale,
                         masks: Masks, config: Config,
                         tuning: DkdvTuning = DkdvTuning()):
  """dK, dV (B, Tk, Hkv, D) in V's dtype, summed over each kv head's group.

  Same contract as `triton.backward_dkdv.backward_dkdv` for the cases
  `mosaic.common.supports` accepts, with whole 64-token blocks, but Q8^T and dO8^T
  REGISTER_B (`types.Layouts`); P^T quantized as `backend.MOSAIC_NUMERICS`
  says. With GQA the per-query-head partials are kept in fp32 until summed.
  """
  check_supported(qkv, masks, config, "backward_dkdv_mosaic")
  for name, x8_t in (("q8_t", qkv.q8_t), ("do8_t", do8_t)):
    check_layout(name, x8_t, TransposedLayout.REGISTER_B)
  batch, heads, _, head_dim = qkv.q8.shape
  kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
  group = heads // kv_heads
  out_dtype = v.dtype if group == 1 else jnp.dtype(jnp.float32)
  dk, dv = _dkdv_call(qkv.q8, qkv.q8_t, qkv.q_scale, qkv.k8, qkv.k_scale, v, lse, delta, do,
                      do8_t, do_scale, causal=config.causal, out_dtype=out_dtype,
                      tuning=tuning)
  if group > 1:
    sum_group = lambda x: x.reshape(batch, kv_len, kv_heads, group, head_dim).sum(axis=3)
    dk, dv = sum_group(dk).astype(v.dtype), sum_group(dv).astype(v.dtype)
  return dk, dv
