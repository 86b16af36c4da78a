"""The dK/dV backward kernel for Hopper (Mosaic GPU, `plgpu.kernel`).

Each CTA owns `compute_wgs` blocks of 64 keys, one per compute warpgroup, and
a producer warpgroup streams the query side (Q8, Q8^T, dO, dO8^T, and the
rows' lse and Delta, of one 64-query block a step) by TMA through a ring.
Per step a warpgroup computes, on transposed tiles (rows are its keys,
columns the step's queries):

  S^T = K8.Q8^T (int8, biased accumulator);
  pq = 255 * exp2(a - rowmax(a)), a the exponent of P^T (`backward_common`),
        per key row (`numerics.unsigned_rows`);
  dP^T - Delta = V.dO^T (16-bit, from -Delta);
  dS^T (in pq's units) = pq * (dP^T - Delta), quantized per key row;
  dV += exp2(top) * dO's scale * (P8^T.dO8)      unsigned x signed, P8 from registers
  dK += dS^T's scale * exp2(top) * Q's scale * (dS8^T.Q8)   from registers

where exp2(top) is P^T's row scale. Q's and dO's scales are one scalar per
step (a block's), so they fold into the row scales of the merges.

With FP8 products (`Config.fp8`; the operands and factors of
`types.Fp8Operands`) dP^T is issued with S^T, and

  P'^T = P^T * p_factor: exp2 of the exponent less log2 p_factor (per
        query, in the lse column), capped at its step's (a scalar);
  dS'^T = P'^T * (dP^T * c - Delta * c), c = 448 q_fold / (b * p_factor) per
        query (a column), from dP^T started at zero (fresh where the
        pipelined schedules issue it, with S^T: no move sets them);
  dV += P'^T.dO8, dK += dS'^T.Q'8      E4M3 from registers, into fp32 dV and
        dK across the loop; their group scales multiply them at the end.

With the overlap it can also write dQ's dS'' (dS' times a scalar a step,
E4M3, transposed through shared memory by `registers.store_transposed`),
of which `backward_dq_product` makes dQ in one product.

Causal: a
warpgroup starts at the query block holding its diagonal (masked); the ring
starts at the CTA's first warpgroup's, and later warpgroups release the
blocks only earlier ones need.

With `Config.causal_exact` (docs/algorithm.md, "Statistics over what each row
sees") the 8-bit tiles read lse less each row's q_i . m, which K8 lacks
(`backward_common.causal_exact_operands`), so their steps add nothing; and
the diagonal, the one masked step, runs in the exact frame: S^T = K16.Q16^T
with fp32 accumulation and the rows' own lse, P^T and dS^T quantized for dV
and dK as every step's. K16 is its A operand from registers, Q16 waits in
the output's staging tile (unused until the loop ends). The pipelined
schedule runs it as a chain of one step: its fp32 S^T is not the 8-bit
steps' accumulator type.

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


def _dkdv_call(q8, q8_t, q_scale, k8, k_scale, v, do, do8_t, step_scale, columns, out_scales,
               edge_operands: bc.EdgeOperands | None, ds_factors, *, causal: bool,
               multiplier: float, out_dtype, tuning: BackwardTuning):
  """q8_t, do8_t: REGISTER_B (B, H, Tq / 64, D, 64), int8 or with FP8
  products (`out_scales` given) E4M3 (`types.TransposedLayout`); scales per
  token (B, H, T). `step_scale` (B, H, Tq): dO's block scale, or with FP8
  log2 of `Fp8Operands.p_factor`; `columns`: the query rows' vectors each
  step reads, (lse, Delta) or with FP8 (lse less log2 p_factor, -Delta * c,
  c: dS^T's column factor);
  `out_scales`: dK's and dV's factors after the loop (B, Hkv), or None;
  `edge_operands`: the edge tiles' operands (`Config.exact_edges`), whose scores
  `multiplier` scales, or None; `ds_factors` (FP8, the overlap): dQ's dS''
  over dK's dS' per query (B, H, Tq) and per key (K''s block scale, (B, Hkv,
  Tk)), for dS'' in E4M3 as a third output (`backward_dq_product`'s
  operand, (B, H, Tk / 64, Tq, 64)), or None."""
  batch, heads, q_len, head_dim = q8.shape
  kv_heads, kv_len = k8.shape[1], k8.shape[2]
  group = heads // kv_heads
  num_q_blocks = q_len // BLOCK
  wgs = tuning.compute_wgs
  fp8 = out_scales is not None
  pipelined = fp8 and tuning.pipelined
  t_transforms = smem_transforms(BLOCK, q8_t.dtype)
  k_transforms = smem_transforms(head_dim, jnp.int8)
  v_transforms = smem_transforms(head_dim, v.dtype)
  edges = edge_operands is not None
  edge_inputs = (edge_operands.q16, edge_operands.k16, edge_operands.lse) if edges else ()
  writes_ds = ds_factors is not None
  ds_transforms = smem_transforms(BLOCK, jnp.float8_e4m3fn)

  def q_range(j):
    """Query blocks key block j sees: [start, full) masked, [full, end) whole."""
    if not causal:
      return jnp.int32(0), jnp.int32(0), jnp.int32(num_q_blocks)
    return tuple(jnp.asarray(x, jnp.int32)
                 for x in causal_blocks.q_blocks(j, BLOCK, BLOCK, num_q_blocks))

  def kernel(q_ref, q8_t_ref, qs_ref, k_ref, ks_ref, v_ref, do_ref, do8_t_ref, step_ref, *refs):
    edge_refs, refs = refs[:len(edge_inputs)], refs[len(edge_inputs):]
    ds_factor_refs, refs = refs[:len(ds_factors or ())], refs[len(ds_factors or ()):]
    outputs = 3 if writes_ds else 2
    col_refs, out_scale_refs = refs[:len(columns)], refs[len(columns):-outputs - 1]
    (dk_ref, dv_ref, *ds_ref), scoped = refs[-outputs - 1:-1], refs[-1]
    b, h, t = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("kv_seq")
    wg = lax.axis_index("wg")
    kvh = lax.div(h, jnp.array(group, h.dtype))
    smem, (k_bars, v_bars), ring_bars, releases, sched, *edge_bars = scoped
    # Pipelined, Q8^T's and dO8^T's slots (read by dV and dK, a step later)
    # are released on their own barriers, the rest's once S^T and dP^T are
    # done.
    consumed, consumed_t = releases if pipelined else releases * 2
    k_smem2, v_smem2, q_ring, q8_t_ring, do_ring, do8_t_ring, col_rings, out_smem2, *ds_smem2 = smem
    if edges:  # Q16 in the output's staging tile until the loop's first step is done
      out_smem, q16_smem = bc.shared_tiles(out_smem2, wg)
    else:
      out_smem = out_smem2.at[wg]  # one staging tile for both (fp32 GQA partials)
    q_bars, q8_t_bars, do_bars, do8_t_bars, *col_bars = ring_bars
    cta_start = q_range(t * wgs)[0]
    end = jnp.int32(num_q_blocks)
    ring = pipeline.Ring(tuning.max_concurrent_steps)
    schedule = pipeline.Schedule(sched, tuning, wg)

    def load_edge(rows):
      """The diagonal tile's operands: Q16 into shared memory, K16 (the A
      operand of its S^T) and the queries' lse into registers, their latency
      behind K8's and V's. K16 has no tile of its own: at D=128 with a ring
      of 3 none is left."""
      q16_ref, k16_ref, lse_ref = edge_refs
      plgpu.copy_gmem_to_smem(q16_ref.at[b, rows, h], q16_smem, edge_bars[0].at[wg])
      return (plgpu.load(k16_ref.at[b, rows, kvh], layout=plgpu.Layout.WGMMA, optimized=False),
              bc.col_vector(lse_ref.at[b, h, rows]))

    def compute():
      j = t * wgs + wg  # this warpgroup's key block
      kv = pl.ds(j * BLOCK, BLOCK)
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      plgpu.copy_gmem_to_smem(k_ref.at[b, kvh, kv], k_smem, k_bars.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_smem, v_bars.at[wg])
      if edges:  # the diagonal's queries are the block's own 64 positions
        edge_k16, edge_lse = load_edge(kv)
      k_scale = ks_ref[b, kvh, j * BLOCK]
      if writes_ds:
        key_factor = ds_factor_refs[1][b, kvh, j * BLOCK]
      plgpu.barrier_wait(k_bars.at[wg])
      plgpu.barrier_wait(v_bars.at[wg])

      def edge_scores():
        """S^T of the diagonal tile from K16 and Q16 (fp32, from 0), in place
        of K8.Q8^T."""
        plgpu.barrier_wait(edge_bars[0].at[wg])
        return (edge_k16, q16_smem), bc.zeros(bc.TILE)

      def column(slot, c):
        plgpu.barrier_wait(col_bars[c].at[slot])
        return bc.col_vector(col_rings.at[slot, c])

      def exponent(i, s, q_scale, *, masked: bool, shift=None, edge: bool = False, lse=None):
        """The exponent of P^T of step i from S^T (less `shift`, capped
        there); with `edge`, the diagonal's fp32 S^T. `lse`: the ring's
        column, if read already."""
        f = s if edge else bc.scores(s, biased=not pipelined)
        if masked:
          f = bc.causal_mask(f, row_start=j * BLOCK, col_start=i * BLOCK, rows_are_keys=True)
        if lse is None:
          lse = column(ring.slot(i), 0)
        if edge:  # the rows' own lse: the ring's lacks their q_i . m
          lse = edge_lse if shift is None else edge_lse - shift
          return bc.edge_exponent(f, multiplier, lse, along=1, cap=shift)
        # FP8: the ring's lse column is less the shift already.
        return bc.exponent(f, q_scale * k_scale, lse, along=1, cap=shift)

      def scalars(i):
        """Step i's Q block scale and step scale (writing dS'', also its
        factor over dS'), loaded from global memory: a pipelined step asks
        for the next step's before its wait, so the loads' latency hides
        behind it."""
        if writes_ds:
          return (qs_ref[b, h, i * BLOCK], step_ref[b, h, i * BLOCK],
                  ds_factor_refs[0][b, h, i * BLOCK] * key_factor)
        return qs_ref[b, h, i * BLOCK], step_ref[b, h, i * BLOCK]

      def write_ds(i, ds8):
        """dS'' of step i (this warpgroup's keys by the step's queries) to
        global memory, transposed (`registers.store_transposed`), through
        one of two staging tiles, which the store of step i - 2 has read."""
        staging = ds_smem2[0].at[wg, lax.rem(i, 2)]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        registers.store_transposed(ds8, staging, ds_transforms)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staging, ds_ref[0].at[b, h, j, pl.ds(i * BLOCK, BLOCK)])

      def scaled_dp(slot, dp):
        """(dP^T - Delta) * c from dP^T started at zero: one FMA a score, and
        the two column vectors it reads free before P^T's chain."""
        col = lambda c: lax.broadcast_in_dim(column(slot, c), bc.TILE, [1])
        return dp * col(2) + col(1)

      def fp8_chain(i, s, dp_c, q_scale, step, *, masked: bool, edge: bool = False, lse=None,
                    ds_factor=None):
        """P'^T = P^T * p_factor (the exponent shifted by its log2, capped
        there) and dS'^T = P'^T * `dp_c` (`scaled_dp`) of step i, in E4M3;
        with `ds_factor`, dQ's dS'' = dS' * ds_factor written (`write_ds`).
        `lse`: the ring's column, if read already."""
        p = jnp.exp2(exponent(i, s, q_scale, masked=masked, shift=step, edge=edge, lse=lse))
        ds = p * dp_c
        if ds_factor is not None:
          write_ds(i, registers.pack_e4m3(ds * ds_factor))
        return registers.pack_e4m3(p), registers.pack_e4m3(ds)

      def q_step(i, carry, *, masked: bool, edge: bool = False):
        dk, dv = carry
        slot = ring.slot(i)
        q_scale, step = scalars(i)
        with jax.named_scope("wait_q"):
          plgpu.barrier_wait(q_bars.at[slot])
        s_product = edge_scores() if edge else ((k_smem, q_ring.at[slot]), bc.magic())

        def dp_product():
          start = (bc.zeros(bc.TILE) if fp8
                   else -lax.broadcast_in_dim(column(slot, 1), bc.TILE, [1]))
          plgpu.barrier_wait(do_bars.at[slot])
          return (v_smem, do_ring.at[slot]), start

        if fp8:  # dP^T with S^T under one wait: -10% (docs/performance-log.md)
          with jax.named_scope("s_dp"):
            (s, dp) = bc.products(*zip(s_product, dp_product()), schedule)
        else:
          with jax.named_scope("s"):
            (s,) = bc.products(*zip(s_product), schedule)
        with jax.named_scope("elementwise"):
          if fp8:
            p8, ds8 = fp8_chain(i, s, scaled_dp(slot, dp), q_scale, step, masked=masked,
                                edge=edge)
          else:
            pq, top = nm.unsigned_rows(exponent(i, s, q_scale, masked=masked, edge=edge))
            # dP^T only now: with S^T, P^T and the int32 products of dK and dV
            # it would not fit the registers (FP8 adds into dK and dV).
            (dp,) = bc.products(*zip(dp_product()))
            p8 = bc.pack_unsigned(pq)
            ds8, ds_scale = bc.pack_signed_rows(pq * dp)
        with jax.named_scope("wait_turn"):
          schedule.arrive()  # elementwise work done: the other warpgroup may issue
          plgpu.barrier_wait(do8_t_bars.at[slot])
          plgpu.barrier_wait(q8_t_bars.at[slot])
          schedule.wait()
        with jax.named_scope("dv_dk"):
          if fp8:
            dv, dk = registers.dots((dv, (p8,), (do8_t_ring.at[slot],), t_transforms),
                                    (dk, (ds8,), (q8_t_ring.at[slot],), t_transforms))
          else:
            p_scale = jnp.exp2(top)
            (pdo,) = registers.dots((None, (p8,), (do8_t_ring.at[slot],), t_transforms),
                                    unsigned_a=True)
            dv = bc.merge(dv, pdo, p_scale * step)
            (dsq,) = registers.dots((None, (ds8,), (q8_t_ring.at[slot],), t_transforms))
            dk = bc.merge(dk, dsq, ds_scale * p_scale * q_scale)
        plgpu.barrier_arrive(consumed.at[slot])
        return dk, dv

      def issue_s_dp(i, *, edge: bool = False):
        """S^T and dP^T of step i, issued fresh and left in flight (the
        diagonal's waited for: K16, their A operand, is in registers)."""
        slot = ring.slot(i)
        with jax.named_scope("tiles_s_dp"):
          plgpu.barrier_wait(q_bars.at[slot])
          plgpu.barrier_wait(do_bars.at[slot])
        if edge:
          return registers.InFlight(
              bc.products(*zip(edge_scores(), ((v_smem, do_ring.at[slot]), bc.zeros(bc.TILE)))),
              ())
        return registers.dots(
            (None, ((k_smem, k_transforms),), (q_ring.at[slot],), k_transforms),
            (None, ((v_smem, v_transforms),), (do_ring.at[slot],), v_transforms), wait=False)

      def released_chain(i, s, dp, step_scalars, *, masked: bool, edge: bool = False):
        """`fp8_chain` of step i from its finished S^T and dP^T, the chain's
        columns read first (dP^T scaled, then lse), so that the tiles S^T and
        dP^T read (Q8, dO, the rows' vectors) go back to the producer a chain
        before the next step's S^T and dP^T need their successors."""
        slot = ring.slot(i)
        dp_c, lse = scaled_dp(slot, dp), column(slot, 0)
        plgpu.barrier_arrive(consumed.at[slot])
        q_scale, step, *ds_factor = step_scalars
        return fp8_chain(i, s, dp_c, q_scale, step, masked=masked, edge=edge, lse=lse,
                         ds_factor=ds_factor[0] if ds_factor else None)

      def issue_dv_dk(i, dk, dv, p8, ds8):
        """(dV + P'^T.dO8, dK + dS'^T.Q'8) of step i, left in flight."""
        slot = ring.slot(i)
        with jax.named_scope("tiles_dv_dk"):
          plgpu.barrier_wait(do8_t_bars.at[slot])
          plgpu.barrier_wait(q8_t_bars.at[slot])
        return registers.dots((dv, (p8,), (do8_t_ring.at[slot],), t_transforms),
                              (dk, (ds8,), (q8_t_ring.at[slot],), t_transforms), wait=False)

      def pipelined_step(i, carry, *, masked: bool, last: bool = False, edge: bool = False):
        """Step i with FP8 products, its S^T and dP^T issued and waited for by
        step i - 1: dV and dK of step i go out with S^T and dP^T of step i + 1,
        the warpgroup takes its turn (the other one's chain runs under these
        products), and one wait covers them all, so that no product is in
        flight across the loop's back edge."""
        s, dp, dk, dv, step_scalars = carry
        slot = ring.slot(i)
        with jax.named_scope("elementwise"):
          p8, ds8 = released_chain(i, s, dp, step_scalars, masked=masked, edge=edge)
        with schedule.issuing(), jax.named_scope("issue"):
          dv_dk = issue_dv_dk(i, dk, dv, p8, ds8)
          in_flight = (dv_dk,) if last else (issue_s_dp(i + 1), dv_dk)
          following = () if last else (scalars(i + 1),)
        with jax.named_scope("wait"):
          *s_dp, dv, dk = registers.wait_for(*in_flight)
        plgpu.barrier_arrive(consumed_t.at[slot])  # dV and dK read Q8^T and dO8^T
        return (*s_dp, dk, dv, *following)

      def pipelined_steps(start, end, carry, *, edge: bool = False):
        """Steps [start, end) as `pipelined_step`s: masked ones, whole ones,
        then the last (masked when causal: a whole block's mask keeps all);
        with `edge`, the one step of the diagonal."""
        with schedule.issuing():
          s_dp, following = issue_s_dp(start, edge=edge), scalars(start)
        carry = (*registers.wait_for(s_dp), *carry, following)
        last = end - 1
        if not edge:
          carry = lax.fori_loop(start, jnp.minimum(full, last),
                                functools.partial(pipelined_step, masked=True), carry)
          carry = lax.fori_loop(jnp.minimum(full, last), last,
                                functools.partial(pipelined_step, masked=False), carry)
        return pipelined_step(last, carry, masked=causal, last=True, edge=edge)

      def overlap_step(i, carry, *, masked: bool):
        """Step i's dV and dK under step i + 1's chain: step i + 1's S^T and
        dP^T go out first, then step i's dV and dK, the warpgroup takes its
        turn, waits for S^T and dP^T alone (groups complete in order) and
        runs step i + 1's chain while dV and dK run; then it waits for
        those. Nothing is in flight across the loop's back edge."""
        p8, ds8, dk, dv, step_scalars = carry  # step_scalars: step i + 1's
        with schedule.issuing(), jax.named_scope("issue"):
          s_dp = issue_s_dp(i + 1)
          dv_dk = issue_dv_dk(i, dk, dv, p8, ds8)
          following = scalars(jnp.minimum(i + 2, end - 1))
        with jax.named_scope("wait"):
          s, dp = registers.wait_for(s_dp, pending=1)
        with jax.named_scope("elementwise"):
          next_p8, next_ds8 = released_chain(i + 1, s, dp, step_scalars, masked=masked)
        with jax.named_scope("wait_dv_dk"):
          dv, dk = registers.wait_for(dv_dk)
        plgpu.barrier_arrive(consumed_t.at[ring.slot(i)])  # Q8^T and dO8^T
        return next_p8, next_ds8, dk, dv, following

      def overlap_steps(start, carry):
        """Steps [start, end) with each chain but the first under the step
        before's dV and dK (`overlap_step`); the chains of steps [start,
        full) masked. Returns dK, dV."""
        with schedule.issuing():
          s_dp, step_scalars = issue_s_dp(start), scalars(start)
        s, dp = registers.wait_for(s_dp)
        # Masking a step the keys see whole changes nothing: the first chain
        # is masked whenever causal.
        carry = (*released_chain(start, s, dp, step_scalars, masked=causal), *carry,
                 scalars(jnp.minimum(start + 1, end - 1)))
        last = end - 1
        split = jnp.clip(full - 1, start, last)  # iteration i runs step i + 1's chain
        # Causal, at most one masked chain after the first: the diagonal's
        # block, after (second warpgroup, schedule barrier) the CTA's first.
        segments = ((start, split, functools.partial(overlap_step, masked=causal), causal),
                    (split, last, functools.partial(overlap_step, masked=False), False))

        def last_dv_dk(carry):
          p8, ds8, dk, dv, _ = carry
          with schedule.issuing(), jax.named_scope("issue"):
            dv_dk = issue_dv_dk(last, dk, dv, p8, ds8)
          dv, dk = registers.wait_for(dv_dk)
          plgpu.barrier_arrive(consumed_t.at[ring.slot(last)])
          return dk, dv

        return registers.steps(carry, segments, last_dv_dk)

      start, full, _ = q_range(j)
      if pipelined and (tuning.schedule_barrier or tuning.issue_turns):
        # Every warpgroup takes a turn at each of its CTA's steps (without
        # causal_exact: `backward_dkdv_mosaic` refuses it here).
        start = cta_start
      # With edges the diagonal's step (the one masked, causal 64 x 64) runs
      # first, from Q16 and K16 (fp32 S^T, another accumulator's type), and
      # the whole blocks [full, end) after it.
      pipeline.release(ring, cta_start, start, bars=ring_bars, consumed=releases,
                       schedule=schedule)
      schedule.lead_in()
      zeros = (bc.zeros((BLOCK, head_dim)), bc.zeros((BLOCK, head_dim)))
      if pipelined and tuning.overlap:
        dk, dv = overlap_steps(start, zeros)
      elif pipelined:
        if edges:  # the last key block has the diagonal alone
          dk, dv = lax.cond(full < end, functools.partial(pipelined_steps, full, end),
                            lambda carry: carry, pipelined_steps(start, full, zeros, edge=True))
        else:
          dk, dv = pipelined_steps(start, end, zeros)
      else:
        if edges:
          carry = q_step(start, zeros, masked=True, edge=True)
        else:
          carry = lax.fori_loop(start, full, functools.partial(q_step, masked=True), zeros)
        dk, dv = lax.fori_loop(full, end, functools.partial(q_step, masked=False), carry)
      schedule.lead_out()
      # Q was quantized as Q * scale * log2(e): dK carries log2(e) once (FP8:
      # in its factor).
      if fp8:
        dk_factor, dv_factor = (ref[b, kvh] for ref in out_scale_refs)
        dv = dv * dv_factor
      else:
        dk_factor = nm.LN_2
      for x, dst in ((dk * dk_factor, dk_ref), (dv, dv_ref)):
        bc.write_tile(x.astype(out_dtype), out_smem, dst.at[b, kv, h])

    def producer():
      def load_first(i, slot):  # what S^T, dP^T and the chain read
        rows = pl.ds(i * BLOCK, BLOCK)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_ring.at[slot], q_bars.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_ring.at[slot], do_bars.at[slot])
        for c, (ref, bar) in enumerate(zip(col_refs, col_bars)):
          plgpu.copy_gmem_to_smem(ref.at[b, h, rows], col_rings.at[slot, c], bar.at[slot])

      def load_last(i, slot):  # what dV and dK read
        plgpu.copy_gmem_to_smem(do8_t_ref.at[b, h, i], do8_t_ring.at[slot], do8_t_bars.at[slot])
        plgpu.copy_gmem_to_smem(q8_t_ref.at[b, h, i], q8_t_ring.at[slot], q8_t_bars.at[slot])

      if pipelined:
        groups = ((load_first, (consumed,)), (load_last, (consumed_t,)))
      else:
        groups = ((lambda i, slot: (load_first(i, slot), load_last(i, slot)), (consumed,)),)
      pipeline.stream(ring, first=cta_start, end=end, groups=groups)

    pipeline.split(wg, tuning, pipeline.BACKWARD_REGISTERS, compute=compute, producer=producer)

  i8, fdt = jnp.int8, v.dtype
  slots = tuning.max_concurrent_steps
  scratch = (
      plgpu.SMEM((wgs, BLOCK, head_dim), i8, transforms=k_transforms),  # K8
      plgpu.SMEM((wgs, BLOCK, head_dim), fdt, transforms=v_transforms),  # V
      plgpu.SMEM((slots, BLOCK, head_dim), i8, transforms=smem_transforms(head_dim, i8)),  # Q8
      plgpu.SMEM((slots, head_dim, BLOCK), q8_t.dtype, transforms=t_transforms),  # Q8^T
      plgpu.SMEM((slots, BLOCK, head_dim), fdt, transforms=smem_transforms(head_dim, fdt)),  # dO
      plgpu.SMEM((slots, head_dim, BLOCK), do8_t.dtype, transforms=t_transforms),  # dO8^T
      plgpu.SMEM((slots, len(columns), BLOCK), jnp.float32),  # lse, Delta, ...
  )
  out_tile = plgpu.SMEM((wgs, BLOCK, head_dim), out_dtype,
                        transforms=smem_transforms(head_dim, out_dtype))  # dK, then dV
  scratch += (bc.sharing(out_tile, edge_operands.q16.dtype) if edges else out_tile,)
  if writes_ds:  # dS'' staging, two tiles a warpgroup
    scratch += (plgpu.SMEM((wgs, 2, BLOCK, BLOCK), jnp.float8_e4m3fn, transforms=ds_transforms),)
  barriers = ((plgpu.Barrier(num_barriers=wgs),) * 2,
              (plgpu.Barrier(num_barriers=slots),) * (4 + len(columns)),
              (plgpu.Barrier(num_arrivals=wgs, num_barriers=slots),) * (
                  2 if pipelined else 1),
              pipeline.Schedule.barrier(tuning))
  if edges:
    barriers += (plgpu.Barrier(num_barriers=wgs),)  # Q16's
  shape = jax.ShapeDtypeStruct((batch, kv_len, heads, head_dim), out_dtype)
  out_type = (shape, shape)
  if writes_ds:
    out_type += (jax.ShapeDtypeStruct((batch, heads, kv_len // BLOCK, q_len, BLOCK),
                                      jnp.float8_e4m3fn),)
  return pipeline.kernel(
      kernel, tuning=tuning, scratch=scratch, barriers=barriers, out_type=out_type,
      grid=(heads, kv_len // (wgs * BLOCK), batch), grid_names=("heads", "kv_seq", "batch"),
      name="sagebwd_backward_dkdv_fp8_mosaic" if fp8 else "sagebwd_backward_dkdv_mosaic",
  )(q8, q8_t, q_scale, k8, k_scale, v, do, do8_t, step_scale, *edge_inputs, *(ds_factors or ()),
    *columns, *(out_scales or ()))



def backward_dkdv_mosaic(qkv: QuantizedQKV, v, lse, delta, do, do8_t, do_scale,
                         masks: Masks, config: Config,
                         tuning: BackwardTuning = BackwardTuning(),
                         fp8: Fp8Operands | None = None, write_ds: bool = False):
  """dK, dV (B, Tk, Hkv, D) in V's dtype, summed over each kv head's group;
  with `write_ds` (FP8, the overlap) also dQ's dS'' in E4M3, (B, H, Tk / 64,
  Tq, 64), the operand of `backward_dq_product`.

  Same contract as `triton.backward_dkdv.backward_dkdv` for the cases
  `mosaic.common.supports` accepts, with whole CTA tiles, but Q8^T and dO8^T
  REGISTER_B (`types.Layouts`); P^T quantized as `backend.MOSAIC_NUMERICS`
  says. With GQA the per-query-head partials are kept in fp32 until summed.
  With `Config.fp8`, `fp8` (its operands, `fp8_operands`) gives dK's
  second operand and the FP8 factors, and dO8^T is E4M3. With
  `Config.causal_exact` the scores are the forward's (from
  `QuantizedQKV.q16`, `k16` and `k_mean`).
  """
  check_supported(qkv, masks, config, "backward_dkdv_mosaic", tuning.compute_wgs * BLOCK)
  if config.fp8 != (fp8 is not None):
    raise ValueError("backward_dkdv_mosaic: `fp8` (the FP8 operands) is given exactly when "
                     f"quantization='int8_fp8'; got quantization={config.quantization!r}")
  if config.exact_edges and config.fp8 and tuning.overlap:
    raise ValueError("backward_dkdv_mosaic: tuning=BackwardTuning(overlap=True) does not take "
                     "causal_exact's 16-bit diagonal; pass overlap=False")
  if (config.exact_edges and config.fp8 and tuning.pipelined
      and (tuning.schedule_barrier or tuning.issue_turns)):
    # The diagonal runs as a chain of its own, whose turns the warpgroups
    # would not take equally often.
    raise ValueError("backward_dkdv_mosaic: tuning=BackwardTuning(pipelined=True) with the "
                     "schedule barrier or issue turns does not take causal_exact; pass "
                     "schedule_barrier=False, issue_turns=False")
  if write_ds and not (config.fp8 and tuning.pipelined and tuning.overlap):
    raise ValueError("backward_dkdv_mosaic: write_ds=True needs quantization='int8_fp8' and "
                     "tuning=BackwardTuning(pipelined=True, overlap=True)")
  q8_t = qkv.q8_t if fp8 is None else fp8.q8_t
  for name, x8_t in (("q8_t", q8_t), ("do8_t", do8_t)):
    check_layout(name, x8_t, TransposedLayout.REGISTER_B)
  batch, heads, _, head_dim = qkv.q8.shape
  kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
  group = heads // kv_heads
  out_dtype = v.dtype if group == 1 else jnp.dtype(jnp.float32)
  lse, edge_operands = bc.causal_exact_operands(qkv, lse, config, "backward_dkdv_mosaic")
  ds_factors = None
  if fp8 is None:
    step_scale, columns, out_scales = do_scale, (lse, delta), None
  else:
    # dS^T's column factor over P's: the kernel forms dS^T * factor from P^T * p_factor.
    positive = fp8.p_factor > 0
    ds_col = jnp.where(positive, nm.inverse_scale(fp8.ds_bound, nm.E4M3_MAX) * fp8.q_fold
                       / jnp.where(positive, fp8.p_factor, 1.0), 0.0)
    step_scale = jnp.log2(fp8.p_factor)
    columns = (lse - step_scale, -delta * ds_col, ds_col)
    out_scales = (fp8.dk_scale * nm.LN_2, fp8.dv_scale)
    if write_ds:
      # dS'' / dS' = k_scale'_j / (k_top_i q_fold_i) (`types.Fp8Operands`); a
      # row whose keys are all zero (k_top 0) gets dQ = 0 from any dS''.
      ds_factors = (nm.inverse_scale(fp8.k_top * fp8.q_fold, 1.0), fp8.k_scale)
  dk, dv, *ds = _dkdv_call(qkv.q8, q8_t, qkv.q_scale, qkv.k8, qkv.k_scale, v, do, do8_t,
                           step_scale, columns, out_scales, edge_operands, ds_factors,
                           causal=config.causal, multiplier=config.scale * nm.LOG2_E,
                           out_dtype=out_dtype, tuning=tuning)
  if group > 1:
    sum_group = lambda x: x.reshape(batch, kv_len, kv_heads, group, head_dim).sum(axis=3)
    dk, dv = sum_group(dk).astype(v.dtype), sum_group(dv).astype(v.dtype)
  return (dk, dv, *ds)

