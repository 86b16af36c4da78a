"""dQ for Hopper with FP8 products as one product (Mosaic GPU, `plgpu.kernel`):
dQ = (dS''.K'8) * b_i k_top_i / 448, from the E4M3 dS'' that the dK/dV
kernel wrote (`backward_dkdv_mosaic(..., write_ds=True)`).

dK/dV forms dS^T for its dK product anyway; rounding it a second time, in
dQ's factors (`types.Fp8Operands`), and writing it costs it a multiply, a
conversion, a transpose and one byte a score (`registers.store_transposed`),
where the dQ kernel (`backward_dq`) recomputes S and dP and runs the whole
chain again. What is left here streams one byte a score: a memory-bound
product (docs/performance.md).

Each CTA owns `compute_wgs` blocks of 64 queries, one per compute warpgroup;
the producer streams, per 64-key step, the CTA's rows of dS'' (one tile)
and K'^T's block (REGISTER_B, whose key order dS'' shares) through a ring
deep enough to stream at the SM's share of the bandwidth, and a warpgroup
adds dS''.K' into fp32 dQ, one wgmma group and its wait a step: the
tensor work is a small part of the time a step's bytes take. Causal:
query block i stops after key block i (dK/dV wrote no later one), the
longest CTAs launch first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.layouts import check_layout
from pallas_kernels.mosaic import backward_common as bc
from pallas_kernels.mosaic import pipeline, registers
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic.common import BLOCK, smem_transforms
from pallas_kernels.types import Config, Fp8Operands, TransposedLayout

# Ring slots: each holds 8 KB of dS'' and 8-16 KB of K'^T; six keep ~100 KB
# in flight, what an SM needs to stream at its share of the HBM bandwidth.
RING_SLOTS = 6


def _dq_product_call(ds8, k8_t, row_out, *, causal: bool, out_dtype, tuning: BackwardTuning):
  """ds8 (B, H, Tk / 64, Tq, 64) and k8_t REGISTER_B (B, Hkv, Tk / 64, D, 64),
  E4M3; row_out (B, H, Tq): dQ's factor per row."""
  batch, heads, num_steps, q_len, _ = ds8.shape
  kv_heads, head_dim = k8_t.shape[1], k8_t.shape[3]
  group = heads // kv_heads
  wgs = tuning.compute_wgs
  rows_per_cta = wgs * BLOCK
  num_q_tiles = q_len // rows_per_cta
  transforms = smem_transforms(BLOCK, ds8.dtype)

  def kernel(ds_ref, k8_t_ref, row_out_ref, dq_ref, scoped):
    b, h, t = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    if causal:  # the longest query tiles launch first (shorter tail)
      t = num_q_tiles - 1 - t
    wg = lax.axis_index("wg")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    (ds_ring, k_ring, dq_smem2), (ds_bars, k_bars), consumed = scoped
    ring = pipeline.Ring(tuning.max_concurrent_steps)
    # Query block i sees key blocks [0, i] causal (dK/dV wrote those only).
    end_of = lambda i: i + 1 if causal else jnp.int32(num_steps)
    cta_end = end_of(t * wgs + wgs - 1)
    schedule = pipeline.Schedule(None, tuning, wg)

    def compute():
      i = t * wgs + wg
      end = end_of(i)

      def issue(j, dq):
        slot = ring.slot(j)
        plgpu.barrier_wait(ds_bars.at[slot])
        plgpu.barrier_wait(k_bars.at[slot])
        ds_tile = ds_ring.at[slot, pl.ds(wg * BLOCK, BLOCK)]
        return registers.dots((dq, ((ds_tile, transforms),), (k_ring.at[slot],), transforms),
                              wait=False)

      def step(j, carry):
        """Step j's product, issued and waited for; its slot released."""
        dq_group = issue(j, carry)
        (dq,) = registers.wait_for(dq_group)
        plgpu.barrier_arrive(consumed.at[ring.slot(j)])
        return dq

      dq = lax.fori_loop(0, end, step, bc.zeros((BLOCK, head_dim)))
      pipeline.release(ring, end, cta_end, bars=(ds_bars, k_bars), consumed=(consumed,),
                       schedule=schedule)
      rows = pl.ds(i * BLOCK, BLOCK)
      dq = dq * lax.broadcast_in_dim(bc.row_vector(row_out_ref.at[b, h, rows]), dq.shape, [0])
      bc.write_tile(dq.astype(out_dtype), dq_smem2.at[wg], dq_ref.at[b, rows, h])

    def producer():
      rows = pl.ds(t * rows_per_cta, rows_per_cta)

      def load(j, slot):
        plgpu.copy_gmem_to_smem(ds_ref.at[b, h, j, rows], ds_ring.at[slot], ds_bars.at[slot])
        plgpu.copy_gmem_to_smem(k8_t_ref.at[b, kvh, j], k_ring.at[slot], k_bars.at[slot])

      pipeline.stream(ring, first=jnp.int32(0), end=cta_end, groups=((load, (consumed,)),))

    pipeline.split(wg, tuning, pipeline.BACKWARD_REGISTERS, compute=compute, producer=producer)

  slots = tuning.max_concurrent_steps
  scratch = (
      plgpu.SMEM((slots, rows_per_cta, BLOCK), ds8.dtype, transforms=transforms),  # dS''
      plgpu.SMEM((slots, head_dim, BLOCK), k8_t.dtype, transforms=transforms),  # K'^T
      plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                 transforms=smem_transforms(head_dim, out_dtype)),  # dQ
  )
  barriers = ((plgpu.Barrier(num_barriers=slots),) * 2,
              plgpu.Barrier(num_arrivals=wgs, num_barriers=slots))
  return pipeline.kernel(
      kernel, tuning=tuning, scratch=scratch, barriers=barriers,
      out_type=jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
      grid=(heads, num_q_tiles, batch), grid_names=("heads", "q_seq", "batch"),
      name="sagebwd_backward_dq_product_fp8_mosaic",
  )(ds8, k8_t, row_out)


def backward_dq_product(ds8: jax.Array, fp8: Fp8Operands, config: Config, out_dtype,
                        tuning: BackwardTuning = BackwardTuning(
                            schedule_barrier=False, max_concurrent_steps=RING_SLOTS)):
  """dQ (B, Tq, H, D) in `out_dtype` from dK/dV's dS'' (`ds8`, (B, H, Tk /
  64, Tq, 64) E4M3, `backward_dkdv_mosaic(..., write_ds=True)`) and the FP8
  operands' K'^T (REGISTER_B); what `backward_dq_mosaic` computes with
  `fp8`, but for the fp32 rounding of dS'' before its E4M3 one."""
  if not config.fp8 or config.causal_exact:
    raise ValueError("backward_dq_product: needs quantization='int8_fp8' and "
                     f"causal_exact=False; got {config.quantization!r}, "
                     f"causal_exact={config.causal_exact}")
  if tuning.schedule_barrier:
    raise ValueError("backward_dq_product: pass tuning=BackwardTuning(schedule_barrier=False): "
                     "its warpgroups take no turns")
  check_layout("k8_t", fp8.k8_t, TransposedLayout.REGISTER_B)
  batch, heads, num_steps, q_len, block = ds8.shape
  if (ds8.dtype != jnp.float8_e4m3fn or block != BLOCK
      or q_len % (tuning.compute_wgs * BLOCK) or fp8.k8_t.shape[2] != num_steps):
    raise ValueError(f"backward_dq_product: ds8 must be float8_e4m3fn (B, H, Tk / 64, Tq, 64) "
                     f"with Tq a multiple of {tuning.compute_wgs * BLOCK} and Tk the keys' "
                     f"{fp8.k8_t.shape[2] * BLOCK}; got {ds8.dtype} {ds8.shape}")
  return _dq_product_call(ds8, fp8.k8_t, bc.dq_row_factor(fp8, config.scale),
                          causal=config.causal, out_dtype=out_dtype, tuning=tuning)
