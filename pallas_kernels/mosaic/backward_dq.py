"""The dQ backward kernel for Hopper (Mosaic GPU, `plgpu.kernel`).

Each CTA owns `compute_wgs` blocks of 64 queries, one per compute warpgroup,
and a producer warpgroup streams the key side (K8, K8^T, V of one 64-key
block a step) by TMA through a ring. Per step a warpgroup computes

  S, dP - Delta = Q8.K8^T (int8, biased accumulator; FP8: from zero),
        dO.V^T (16-bit, from -Delta), one wait;
  P = exp2(S * q_scale * k_scale - lse)        (`backward_common.exponent`);
  dS = P * (dP - Delta), quantized per query row, from registers into
  dQ += dS's scale * K's scale * (dS8.K8)      K8^T REGISTER_B.

With FP8 products (`Config.fp8`) a step covers 128 keys (`dq_step_keys`):
dS'' = exp2 of the exponent shifted by log2 of 448 k_scale'_j / (b_i k_top_i)
(its K' block's scale and a row factor), capped there, times dP - Delta; E4M3
from registers, dQ += dS''.K'8 into fp32 across the loop, times b_i k_top_i /
448 at the end.

Causal: the longest CTAs launch first; a warpgroup stops after the key block
holding its diagonal (masked) and releases the ring's later blocks, which
only the CTA's later warpgroups see.

With `Config.causal_exact` the 8-bit tiles read lse less q_i . m as dK/dV's
do, and the last step holds the diagonal tile, which runs in 16 bits: S =
Q16.K16^T (fp32, the rows' own lse) and its dQ term dS.(K16 - m'), m' the
block's `QuantizedQKV.k_mean_seen`, K16 - m' rounded to the inputs' dtype
in K16's tile once S has read it; the term joins dQ after the loop. INT8's
last step is the diagonal alone (`edge_step`); FP8's takes its other
half, the keys before the block, in 8 bits as any step. K16 waits in dQ's
staging tile; Q16 in a tile of its own (INT8), or with FP8, where at D=128
the 128-key ring leaves none, in Q8's bytes, fetched once the last S has
read Q8, behind the 8-bit half's chain.

Longer than 400 lines because the one loop body serves both numerics modes,
their schedules and `Config.causal_exact`'s diagonal step: split by mode,
the kernels would repeat the pipeline's frame.
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
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic.common import BLOCK, check_supported, smem_transforms
from pallas_kernels.layouts import check_layout
from pallas_kernels.types import Config, Fp8Operands, Masks, QuantizedQKV, TransposedLayout


def _dq_call(q8, q_scale, lse, delta, do, k8, k8_t, k_scale, v, step_scale, fp8_rows,
             edge_operands: bc.EdgeOperands | None, *, causal: bool, scale: float,
             tuning: BackwardTuning):
  """k8_t: REGISTER_B (B, Hkv, Tk / 64, D, 64), int8, or with FP8 products
  (`fp8_rows` given) K' in E4M3 (`types.TransposedLayout`); scales per token
  (B, H, T). `step_scale` (B, Hkv, Tk): K's block scale, or with FP8 log2 of
  K''s; `fp8_rows` (B, H, Tq): log2 of dS's row factor and dQ's row factor
  after the loop, or None; `edge_operands`: the edge tiles' operands
  (`Config.exact_edges`), or None."""
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  fp8 = fp8_rows is not None
  pipelined = fp8 and tuning.pipelined
  step_keys = dq_step_keys(fp8)
  halves = step_keys // BLOCK  # 64-key blocks (K's quantization blocks) per step
  num_steps = kv_len // step_keys
  wgs = tuning.compute_wgs
  num_q_tiles = q_len // (wgs * BLOCK)
  out_dtype = do.dtype
  t_transforms = smem_transforms(BLOCK, k8_t.dtype)
  q_transforms = smem_transforms(head_dim, jnp.int8)
  do_transforms = smem_transforms(head_dim, do.dtype)
  edges = edge_operands is not None
  means = edges and edge_operands.k_mean_seen is not None
  edge_inputs = tuple(x for x in (edge_operands or ()) if x is not None)
  multiplier = scale * nm.LOG2_E

  def kv_range(i):
    """Key steps query block i sees: [0, full) whole, [full, end) masked."""
    if not causal:
      return jnp.int32(num_steps), jnp.int32(num_steps)
    return tuple(jnp.asarray(x, jnp.int32)
                 for x in causal_blocks.kv_blocks(i, BLOCK, step_keys, num_steps))

  def kernel(q_ref, qs_ref, lse_ref, delta_ref, do_ref, k_ref, k8_t_ref, ks_ref, v_ref,
             step_ref, *refs):
    edge_refs, refs = refs[:len(edge_inputs)], refs[len(edge_inputs):]
    row_refs, (dq_ref, scoped) = refs[:-2], refs[-2:]
    b, h, t = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    if causal:  # the longest query tiles launch first (shorter tail)
      t = num_q_tiles - 1 - t
    wg = lax.axis_index("wg")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    smem, (q_bars, do_bars), ring_bars, releases, sched, *edge_bars = scoped
    # Pipelined, K8^T's slots (read by dQ's product, a step later) are
    # released on their own barriers, K8's and V's once S and dP are done.
    consumed, consumed_t = releases if pipelined else releases * 2
    q_smem2, do_smem2, k_ring, k8_t_ring, v_ring, dq_smem2, *edge_smem = smem
    q_smem, dq_smem = q_smem2.at[wg], dq_smem2.at[wg]
    if edges:
      # K16 (then K16 - m') in dQ's staging tile until the last step is done;
      # Q16 in its own tile, or with FP8 in Q8's once its last S is done.
      dq_smem, k16_smem = bc.shared_tiles(dq_smem2, wg)
      if fp8:
        q_smem, q16_smem = bc.shared_tiles(q_smem2, wg)
      else:
        q16_smem2, *edge_smem = edge_smem
        q16_smem = q16_smem2.at[wg]
      mean_smem2 = edge_smem[0] if means else None
    k_bars, k8_t_bars, v_bars = ring_bars
    cta_end = kv_range(t * wgs + wgs - 1)[1]
    ring = pipeline.Ring(tuning.max_concurrent_steps)
    # Causal, the overlap takes the diagonal's step first, then the whole
    # ones: a masked step after its loop runs ptxas out of registers (C7511).
    # Ring position i holds key step `key_step(i)`; every warpgroup of a CTA
    # ends at cta_end here (128-key steps, 64-row blocks).
    diagonal_first = causal and pipelined and tuning.overlap

    def key_step(i):
      return jnp.where(i == 0, cta_end - 1, i - 1) if diagonal_first else i

    schedule = pipeline.Schedule(sched, tuning, wg)

    def compute():
      i = t * wgs + wg  # this warpgroup's query block
      rows = pl.ds(i * BLOCK, BLOCK)

      def load_edge():
        """The diagonal tile's operands but FP8's Q16 (`fetch_q16`): K16 and
        m' into shared memory, the rows' lse into registers."""
        _, k16_ref, lse_ref, *mean_ref = edge_refs
        plgpu.copy_gmem_to_smem(k16_ref.at[b, rows, kvh], k16_smem, edge_bars[1].at[wg])
        if means:
          plgpu.copy_gmem_to_smem(mean_ref[0].at[b, kvh, i], mean_smem2.at[wg],
                                  edge_bars[2].at[wg])
        if not fp8:
          fetch_q16()
        return bc.row_vector(lse_ref.at[b, h, rows])

      def fetch_q16():
        plgpu.copy_gmem_to_smem(edge_refs[0].at[b, rows, h], q16_smem,
                                edge_bars[0].at[wg])

      do_smem = do_smem2.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bars.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, do_bars.at[wg])
      if edges:  # the diagonal's keys are the block's own 64 positions
        edge_lse = load_edge()
      q_scale = qs_ref[b, h, i * BLOCK]
      lse = bc.row_vector(lse_ref.at[b, h, rows])
      delta = bc.row_vector(delta_ref.at[b, h, rows])
      if fp8:  # dS times 2**shift, shift = log2 of its row factor + K''s block's
        row_shift, row_out = (bc.row_vector(ref.at[b, h, rows]) for ref in row_refs)
      plgpu.barrier_wait(q_bars.at[wg])
      plgpu.barrier_wait(do_bars.at[wg])

      tile = (BLOCK, step_keys)
      minus_delta = lambda: -lax.broadcast_in_dim(delta, tile, [0])
      starts = lambda: (bc.magic(tile), minus_delta())

      def edge_scores():
        """The diagonal tile's S = Q16.K16^T pair, fp32 from 0."""
        plgpu.barrier_wait(edge_bars[0].at[wg])
        plgpu.barrier_wait(edge_bars[1].at[wg])
        return (q16_smem, k16_smem), bc.zeros(bc.TILE)

      def edge_ds(s, dp):
        """The diagonal tile's dS, in the inputs' dtype, from its fp32 S and
        dP - Delta: P in the exact frame (the rows' own lse)."""
        f = bc.causal_mask(s, row_start=i * BLOCK, col_start=i * BLOCK, rows_are_keys=False)
        p = jnp.exp2(bc.edge_exponent(f, multiplier, edge_lse, along=0))
        return (p * dp).astype(k16_smem.dtype)

      def edge_dq(ds):
        """dS.(K16 - m') of the diagonal tile, fp32. S has read K16: its tile
        takes K16 - m' in place, rounded to the inputs' dtype."""
        k16 = k16_smem
        if means:
          plgpu.barrier_wait(edge_bars[2].at[wg])
          mean = bc.col_vector(mean_smem2.at[wg])
          k16[...] = (k16[...].astype(jnp.float32)
                      - lax.broadcast_in_dim(mean, (BLOCK, head_dim), [1])).astype(k16.dtype)
          plgpu.commit_smem()
        return pl.run_state(lambda acc: plgpu.wgmma(acc, ds, k16))(
            plgpu.ACC.init(bc.zeros((BLOCK, head_dim))))

      def edge_half(dp):
        """dQ's diagonal term in FP8's 128-key step: S of the diagonal's half
        from Q16 and K16, its dP - Delta picked from the step's."""
        (s,) = bc.products(*zip(edge_scores()))
        dp = lax.cond(lax.rem(i, 2) == 0, lambda: dp[:, :BLOCK], lambda: dp[:, BLOCK:])
        return edge_dq(edge_ds(s, dp))

      def scalars(j):
        """Step j's K block scales and step scales, one pair per 64-key
        block, loaded from global memory: a pipelined step asks for the next
        step's before its wait, so the loads' latency hides behind it."""
        return [(ks_ref[b, kvh, blk * BLOCK], step_ref[b, kvh, blk * BLOCK])
                for blk in (j * halves + half for half in range(halves))]

      def chain(j, s, dp, scales, *, masked: bool, edge: bool = False):
        """dS of step j from S and dP - Delta: with FP8 its E4M3 tiles, else
        the int8 tile and its row scales, and K's block scale. With `edge`
        (FP8), of the step's keys before the block's diagonal only."""
        if edge:  # no product reads Q8 any more
          fetch_q16()
        f = bc.scores(s, biased=not pipelined)
        if edge:
          f = bc.keys_before(f, i * BLOCK, col_start=j * step_keys)
        elif masked:
          f = bc.causal_mask(f, row_start=i * BLOCK, col_start=j * step_keys,
                             rows_are_keys=False)
        ds8s = []
        for half, (k_scale, step) in enumerate(scales):  # each 64-key block's own
          cols = slice(half * BLOCK, (half + 1) * BLOCK)
          f_h, dp_h = (f, dp) if halves == 1 else (f[:, cols], dp[:, cols])
          if fp8:
            shift = row_shift + step
            p = jnp.exp2(bc.exponent(f_h, q_scale * k_scale, lse - shift, along=0, cap=shift))
            ds8s.append(registers.pack_e4m3(p * dp_h))
          else:
            p = jnp.exp2(bc.exponent(f_h, q_scale * k_scale, lse, along=0))
            return bc.pack_signed_rows(p * dp_h), step
        return tuple(ds8s)

      def kv_step(j, dq, *, masked: bool, edge: bool = False):
        slot = ring.slot(j)
        scales = scalars(j)
        with jax.named_scope("wait_kv"):
          plgpu.barrier_wait(k_bars.at[slot])
          plgpu.barrier_wait(v_bars.at[slot])
        with jax.named_scope("s_dp"):
          s, dp = bc.products([(q_smem, k_ring.at[slot]), (do_smem, v_ring.at[slot])],
                              starts(), schedule)
        with jax.named_scope("elementwise"):
          if fp8:
            ds8s = chain(j, s, dp, scales, masked=masked, edge=edge)
          else:
            (ds8, ds_scale), step = chain(j, s, dp, scales, masked=masked)
        with jax.named_scope("wait_turn"):
          schedule.arrive()  # elementwise work done: the other warpgroup may issue
          plgpu.barrier_wait(k8_t_bars.at[slot])
          schedule.wait()
        k8_t_tiles = tuple(k8_t_ring.at[slot, half] for half in range(halves))
        with jax.named_scope("dq"):
          if fp8:
            (dq,) = registers.dots((dq, ds8s, k8_t_tiles, t_transforms))
          else:
            (dsk,) = registers.dots((None, (ds8,), k8_t_tiles, t_transforms))
            dq = bc.merge(dq, dsk, ds_scale * step)
        plgpu.barrier_arrive(consumed.at[slot])
        return (dq, edge_half(dp)) if edge else dq

      def edge_step(j, dq):
        """INT8's last causal step, whose 64 keys are the diagonal's: all in
        16 bits (S with dP under one wait), none in 8."""
        slot = ring.slot(j)
        plgpu.barrier_wait(k_bars.at[slot])
        plgpu.barrier_wait(v_bars.at[slot])
        s, dp = bc.products(*zip(edge_scores(), ((do_smem, v_ring.at[slot]), minus_delta())),
                            schedule)
        ds16 = edge_ds(s, dp)
        schedule.arrive()
        plgpu.barrier_wait(k8_t_bars.at[slot])
        schedule.wait()
        dq_edge = edge_dq(ds16)
        plgpu.barrier_arrive(consumed.at[slot])
        return dq, dq_edge

      def issue_s_dp(j):
        """S (fresh) and dP of step j, issued and left in flight."""
        slot = ring.slot(j)
        with jax.named_scope("tiles_s_dp"):
          plgpu.barrier_wait(k_bars.at[slot])
          plgpu.barrier_wait(v_bars.at[slot])
        return registers.dots(
            (None, ((q_smem, q_transforms),), (k_ring.at[slot],), q_transforms),
            (minus_delta(), ((do_smem, do_transforms),), (v_ring.at[slot],), do_transforms),
            wait=False)

      def issue_dq(j, dq, ds8s):
        """dq + dS.K' of step j, left in flight."""
        slot = ring.slot(j)
        with jax.named_scope("tiles_dq"):
          plgpu.barrier_wait(k8_t_bars.at[slot])
        k8_t_tiles = tuple(k8_t_ring.at[slot, half] for half in range(halves))
        return registers.dots((dq, ds8s, k8_t_tiles, t_transforms), wait=False)

      def pipelined_step(j, carry, *, masked: bool, last: bool = False, edge: bool = False):
        """Step j, its S and dP issued and waited for by step j - 1: dQ's
        product goes out with S and dP of step j + 1, the warpgroup takes its
        turn (the other one's chain runs under these products), and one wait
        covers them all, so that no product is in flight across the loop's
        back edge."""
        s, dp, dq, scales = carry
        slot = ring.slot(j)
        # S and dP are done with K8 and V: their slot goes back to the
        # producer a chain before the next step's S and dP need its successor.
        plgpu.barrier_arrive(consumed.at[slot])
        with jax.named_scope("elementwise"):
          ds8s = chain(j, s, dp, scales, masked=masked, edge=edge)
        with schedule.issuing(), jax.named_scope("issue"):
          dq_group = issue_dq(j, dq, ds8s)
          if edge:  # the last step: the diagonal's term computed under dQ's product
            in_flight = (dq_group, registers.InFlight((edge_half(dp),), ()))
          else:
            in_flight = (dq_group,) if last else (issue_s_dp(j + 1), dq_group)
          following = () if last else (scalars(j + 1),)
        with jax.named_scope("wait"):
          done = registers.wait_for(*in_flight)
        plgpu.barrier_arrive(consumed_t.at[slot])  # dQ's product read K8^T
        return (*done, *following)

      def pipelined_steps(full, end, zero):
        """Steps [0, end) as `pipelined_step`s: whole ones, masked ones, then
        the last (masked when causal: a whole block's mask keeps all).
        Returns dQ and, with edges, the diagonal's term."""
        last = end - 1
        with schedule.issuing():
          s_dp, following = issue_s_dp(jnp.int32(0)), scalars(jnp.int32(0))
        carry = (*registers.wait_for(s_dp), zero, following)
        carry = lax.fori_loop(0, jnp.minimum(full, last),
                              functools.partial(pipelined_step, masked=False), carry)
        carry = lax.fori_loop(jnp.minimum(full, last), last,
                              functools.partial(pipelined_step, masked=True), carry)
        return pipelined_step(last, carry, masked=causal, last=True, edge=edges)

      def overlap_step(j, carry, *, masked: bool):
        """The step at ring position j: its dQ product under position j + 1's
        chain: position j + 1's S and dP go out first, then j's product, the
        warpgroup takes its turn, waits for S and dP alone (groups complete
        in order) and runs j + 1's chain while the product runs; then it
        waits for that. Nothing is in flight across the loop's back edge."""
        ds8s, dq, scales = carry  # scales: position j + 1's
        with schedule.issuing(), jax.named_scope("issue"):
          s_dp = issue_s_dp(j + 1)
          dq_group = issue_dq(j, dq, ds8s)
          following = scalars(key_step(jnp.minimum(j + 2, end - 1)))
        with jax.named_scope("wait"):
          s, dp = registers.wait_for(s_dp, pending=1)
        plgpu.barrier_arrive(consumed.at[ring.slot(j + 1)])  # K8 and V
        with jax.named_scope("elementwise"):
          next_ds8s = chain(key_step(j + 1), s, dp, scales, masked=masked)
        with jax.named_scope("wait_dq"):
          (dq,) = registers.wait_for(dq_group)
        plgpu.barrier_arrive(consumed_t.at[ring.slot(j)])  # K8^T
        return next_ds8s, dq, following

      def overlap_steps(end, zero):
        """Ring positions [0, end) with each chain but the first under the
        position before's dQ product (`overlap_step`); causal, the first is
        the diagonal's step, the one masked. Returns (dQ,)."""
        with schedule.issuing():
          s_dp, scales = issue_s_dp(jnp.int32(0)), scalars(key_step(jnp.int32(0)))
        s, dp = registers.wait_for(s_dp)
        plgpu.barrier_arrive(consumed.at[ring.slot(jnp.int32(0))])
        carry = (chain(key_step(jnp.int32(0)), s, dp, scales, masked=causal), zero,
                 scalars(key_step(jnp.minimum(1, end - 1))))
        segments = ((0, end - 1, functools.partial(overlap_step, masked=False), False),)

        def last_dq(carry):
          ds8s, dq, _ = carry
          last = end - 1
          with schedule.issuing(), jax.named_scope("issue"):
            dq_group = issue_dq(last, dq, ds8s)
          (dq,) = registers.wait_for(dq_group)
          plgpu.barrier_arrive(consumed_t.at[ring.slot(last)])
          return (dq,)

        return registers.steps(carry, segments, last_dq)

      full, end = kv_range(i)
      zero = bc.zeros((BLOCK, head_dim))
      schedule.lead_in()
      if pipelined and tuning.overlap:
        dq, *dq_edge = overlap_steps(end, zero)
      elif pipelined:
        dq, *dq_edge = pipelined_steps(full, end, zero)
      else:
        dq = lax.fori_loop(0, full, functools.partial(kv_step, masked=False), zero)
        if edges:  # the one masked step holds the diagonal
          dq, *dq_edge = (kv_step(full, dq, masked=True, edge=True) if fp8
                          else edge_step(full, dq))
        else:
          dq = lax.fori_loop(full, end, functools.partial(kv_step, masked=True), dq)
      schedule.lead_out()
      pipeline.release(ring, end, cta_end, bars=ring_bars, consumed=releases,
                       schedule=schedule)
      # Q was quantized as Q * scale * log2(e); dS is in base-2 units: dQ takes
      # `scale` (FP8: in its row factor), the diagonal's 16-bit term too.
      dq = dq * lax.broadcast_in_dim(row_out, dq.shape, [0]) if fp8 else dq * scale
      if edges:
        dq = dq + dq_edge[0] * scale
      bc.write_tile(dq.astype(out_dtype), dq_smem, dq_ref.at[b, rows, h])

    def producer():
      def load_first(i, slot):  # what S and dP read
        kv = pl.ds(key_step(i) * step_keys, step_keys)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_ring.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_ring.at[slot], v_bars.at[slot])

      def load_last(i, slot):  # what dQ's product reads
        plgpu.copy_gmem_to_smem(k8_t_ref.at[b, kvh, pl.ds(key_step(i) * halves, halves)],
                                k8_t_ring.at[slot], k8_t_bars.at[slot])

      if pipelined:
        groups = ((load_first, (consumed,)), (load_last, (consumed_t,)))
      else:
        groups = ((lambda j, slot: (load_first(j, slot), load_last(j, slot)), (consumed,)),)
      pipeline.stream(ring, first=jnp.int32(0), end=cta_end, groups=groups)

    pipeline.split(wg, tuning, pipeline.BACKWARD_REGISTERS, compute=compute, producer=producer)

  i8, fdt = jnp.int8, v.dtype
  slots = tuning.max_concurrent_steps
  q8_tile = plgpu.SMEM((wgs, BLOCK, head_dim), i8, transforms=q_transforms)  # Q8
  dq_tile = plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                       transforms=smem_transforms(head_dim, out_dtype))  # dQ
  edge_scratch = ()
  if edges:
    dtype16 = edge_operands.q16.dtype
    # FP8 at D=128 leaves no 16-bit tile free beside the 128-key ring: Q16
    # shares Q8's bytes, fetched after the last S (`chain`), whose 8-bit
    # half hides the load; INT8 prefetches it into its own tile.
    if fp8:
      q8_tile = bc.sharing(q8_tile, dtype16)
    else:
      edge_scratch = (plgpu.SMEM((wgs, BLOCK, head_dim), dtype16,
                                 transforms=smem_transforms(head_dim, dtype16)),)
    dq_tile = bc.sharing(dq_tile, dtype16)
    if means:
      edge_scratch += (plgpu.SMEM((wgs, head_dim), jnp.float32),)  # m'
  scratch = (
      q8_tile,
      plgpu.SMEM((wgs, BLOCK, head_dim), do.dtype, transforms=do_transforms),  # dO
      plgpu.SMEM((slots, step_keys, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # K8
      plgpu.SMEM((slots, halves, head_dim, BLOCK), k8_t.dtype, transforms=t_transforms),  # K8^T
      plgpu.SMEM((slots, step_keys, head_dim), fdt,
                 transforms=smem_transforms(head_dim, fdt)),  # V
      dq_tile,
      *edge_scratch,
  )
  barriers = ((plgpu.Barrier(num_barriers=wgs),) * 2,
              (plgpu.Barrier(num_barriers=slots),) * 3,
              (plgpu.Barrier(num_arrivals=wgs, num_barriers=slots),) * (
                  2 if pipelined else 1),
              pipeline.Schedule.barrier(tuning))
  if edges:
    barriers += (plgpu.Barrier(num_barriers=wgs),) * (2 + means)  # Q16's, K16's, m''s
  return pipeline.kernel(
      kernel, tuning=tuning, scratch=scratch, barriers=barriers,
      out_type=jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
      grid=(heads, num_q_tiles, batch), grid_names=("heads", "q_seq", "batch"),
      name="sagebwd_backward_dq_fp8_mosaic" if fp8 else "sagebwd_backward_dq_mosaic",
  )(q8, q_scale, lse, delta, do, k8, k8_t, k_scale, v, step_scale, *edge_inputs,
    *(fp8_rows or ()))


def dq_step_keys(fp8: bool) -> int:
  """Keys of one dQ step (one ring slot). 128 with FP8 products: S and dP each
  one wgmma of N = 128, whose shared-memory operands then keep up with the
  tensor cores, and half the per-step waits (dQ 1.22 -> 1.00 ms at B4 T4096
  H16 D128, docs/performance-log.md); INT8's merge and per-step row maxima
  would need registers that 128 keys leave no room for."""
  return 2 * BLOCK if fp8 else BLOCK


def backward_dq_mosaic(qkv: QuantizedQKV, v, lse, delta, do, masks: Masks, config: Config,
                       tuning: BackwardTuning = BackwardTuning(),
                       fp8: Fp8Operands | None = None):
  """dQ (B, Tq, H, D) in dO's dtype; same contract as
  `triton.backward_dq.backward_dq` for the cases `mosaic.common.supports`
  accepts, with whole CTA tiles, but K8^T REGISTER_B (`types.Layouts`); dS
  quantized as there. With `Config.fp8`, `fp8` (its operands,
  `fp8_operands`) gives K' and dS's FP8 factors. With `Config.causal_exact`
  the scores are the forward's (from `QuantizedQKV.q16`, `k16` and
  `k_mean`), and the diagonal's dQ is dS.(K - m') in 16 bits
  (`QuantizedQKV.k_mean_seen`)."""
  check_supported(qkv, masks, config, "backward_dq_mosaic",
                  max(tuning.compute_wgs * BLOCK, dq_step_keys(config.fp8)))
  if config.fp8 != (fp8 is not None):
    raise ValueError("backward_dq_mosaic: `fp8` (the FP8 operands) is given exactly when "
                     f"quantization='int8_fp8'; got quantization={config.quantization!r}")
  if config.fp8 and config.exact_edges and tuning.overlap:
    raise ValueError("backward_dq_mosaic: tuning=BackwardTuning(overlap=True) does not take "
                     "causal_exact's 16-bit diagonal; pass overlap=False")
  k8_t = qkv.k8_t if fp8 is None else fp8.k8_t
  check_layout("k8_t", k8_t, TransposedLayout.REGISTER_B)
  lse, edge_operands = bc.causal_exact_operands(qkv, lse, config, "backward_dq_mosaic")
  if fp8 is None:
    step_scale, fp8_rows = qkv.k_scale, None
  else:
    fp8_rows = (jnp.log2(nm.inverse_scale(fp8.ds_bound * fp8.k_top, nm.E4M3_MAX)),
                bc.dq_row_factor(fp8, config.scale))
    step_scale = jnp.log2(fp8.k_scale)
  return _dq_call(qkv.q8, qkv.q_scale, lse, delta, do, qkv.k8, k8_t, qkv.k_scale, v,
                  step_scale, fp8_rows, edge_operands, causal=config.causal, scale=config.scale,
                  tuning=tuning)
