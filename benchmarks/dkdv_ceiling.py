"""What bounds the FP8 dK/dV loop: its CTA with parts taken away.

    python -m benchmarks.dkdv_ceiling [--batch 4 --seq 4096 --heads 16] [--slots 2] [--chain 6]

The FP8 dK/dV kernel (`pallas_kernels.mosaic.backward_dkdv`, the overlap
schedule `backend.launches` picks) runs a CTA of two compute warpgroups of
64 keys each and a producer that streams, per 64-query step, Q8, Q8^T, dO,
dO8^T and three row vectors (40.75 KB at D=128) by TMA through a ring.
This script builds that CTA (the same tiles, swizzles, ring, barriers,
register budget and grid order) and times it with parts removed, B H T of
the benchmark shape, D=128, not causal:

- `stream`: the producer's loads alone; the compute warpgroups wait for
  each tile and release it. Also reported as bytes delivered to shared
  memory per second.
- `products`: the loop's wgmmas alone, on tiles loaded once: S^T (int8)
  and dP^T (16-bit) from shared memory, dV and dK (E4M3) from register A
  tiles that a two-instruction chain makes of them, in the overlap's order
  (step i + 1's S^T and dP^T, then step i's dV and dK).
- `both`: the products on the streamed tiles.

Each runs with the stream read by every CTA from L2 (`cluster 1`, as the
kernel does) and multicast to the two CTAs of neighbouring key blocks
(`cluster 2`: a cluster of two along the key axis; each CTA loads half of
every tile for both, so L2 serves half the bytes). Then `products` and
`both` again with the chain brought to the kernel's length (`--chain`
multiply-adds per score), the warpgroups unordered and in issue turns
(`pipeline.Tuning.issue_turns`): whether an order hides the chain under
the products. The kernel itself (`mosaic_fp8_overlap_nosched` of
`benchmarks.mosaic_backward`) runs in the same process for comparison.
Writes dkdv_ceiling.csv to --out (default $OUT, else nothing).
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

import benchmarks
from benchmarks import mosaic_backward
from benchmarks.attention import time_call, write_csv
from benchmarks.variants import random_inputs
from pallas_kernels.mosaic import backward_common as bc
from pallas_kernels.mosaic import pipeline, registers
from pallas_kernels.mosaic.common import BLOCK, smem_transforms
from pallas_kernels.types import Config

MODES = ("stream", "products", "both")
HEAD_DIM = 128
WGS = 2
COLUMNS = 3  # lse, Delta, dS^T's column factor
# Multiply-adds per score that take the products' chain (7.3 instructions
# per score) to the kernel's 13.5 (`benchmarks.sass`, 2026-12-07).
KERNEL_CHAIN = 6


def step_bytes(head_dim: int = HEAD_DIM) -> int:
  """Bytes the producer loads per 64-query step: Q8, Q8^T, dO8^T (one byte
  an element), dO (two) and the row vectors (fp32)."""
  return BLOCK * head_dim * (1 + 1 + 2 + 1) + COLUMNS * BLOCK * 4


def ceiling_call(mode: str, *, batch: int, heads: int, seq: int, slots: int, cluster: int,
                 chain: int = 0, issue_turns: bool = False):
  """The kernel of `mode` (see the module's docstring) on (B, H, T, D)
  operands in the FP8 dK/dV kernel's layouts; returns a function of them.
  `chain`: dependent multiply-adds per score added to the chain (each one
  instruction per score); `issue_turns`: the warpgroups issue in turn
  (`pipeline.Tuning.issue_turns`)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
  if cluster not in (1, 2):
    raise ValueError(f"cluster must be 1 or 2; got {cluster}")
  d, f8, bf16, i8 = HEAD_DIM, jnp.float8_e4m3fn, jnp.bfloat16, jnp.int8
  n_q, ctas = seq // BLOCK, seq // (WGS * BLOCK)
  if ctas % cluster:
    raise ValueError(f"{ctas} key CTAs do not split into clusters of {cluster}")
  streamed, products = mode != "products", mode != "stream"
  multicast = "pair" if cluster == 2 else None
  t_transforms, k_transforms = smem_transforms(BLOCK, f8), smem_transforms(d, i8)
  v_transforms = smem_transforms(d, bf16)
  ring = pipeline.Ring(slots)
  tuning = pipeline.Tuning(compute_wgs=WGS, max_concurrent_steps=slots,
                           schedule_barrier=False, pipelined=True, overlap=True,
                           issue_turns=issue_turns)

  def kernel(q_ref, q8_t_ref, do_ref, do8_t_ref, col_ref, k_ref, v_ref, out_ref, scoped):
    smem, (k_bar, v_bar), ring_bars, (consumed, consumed_t), turns = scoped
    k_smem, v_smem, q_ring, q8_t_ring, do_ring, do8_t_ring, col_ring, out_smem = smem
    q_bars, do_bars, q8_t_bars, do8_t_bars, *col_bars = ring_bars
    b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    t = lax.axis_index("kv_seq") * cluster + (lax.axis_index("pair") if multicast else 0)
    schedule = pipeline.Schedule(turns, tuning, wg)

    def load_first(i, slot):
      rows = pl.ds(i * BLOCK, BLOCK)
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_ring.at[slot], q_bars.at[slot],
                              collective_axes=multicast)
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_ring.at[slot], do_bars.at[slot],
                              collective_axes=multicast)
      for c, bar in enumerate(col_bars):
        plgpu.copy_gmem_to_smem(col_ref.at[c, b, h, rows], col_ring.at[slot, c], bar.at[slot],
                                collective_axes=multicast)

    def load_last(i, slot):
      plgpu.copy_gmem_to_smem(do8_t_ref.at[b, h, i], do8_t_ring.at[slot],
                              do8_t_bars.at[slot], collective_axes=multicast)
      plgpu.copy_gmem_to_smem(q8_t_ref.at[b, h, i], q8_t_ring.at[slot], q8_t_bars.at[slot],
                              collective_axes=multicast)

    def wait_first(slot):
      for bar in (q_bars, do_bars, *col_bars):
        plgpu.barrier_wait(bar.at[slot])

    def wait_last(slot):
      for bar in (do8_t_bars, q8_t_bars):
        plgpu.barrier_wait(bar.at[slot])

    def compute():
      kv = pl.ds((t * WGS + wg) * BLOCK, BLOCK)
      plgpu.copy_gmem_to_smem(k_ref.at[b, h, kv], k_smem.at[wg], k_bar.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[b, kv, h], v_smem.at[wg], v_bar.at[wg])
      plgpu.barrier_wait(k_bar.at[wg])
      plgpu.barrier_wait(v_bar.at[wg])
      if not streamed:  # the ring's tiles, loaded once
        for slot in range(slots):
          wait_first(slot)
          wait_last(slot)

      def release(consumed_bars, slot):
        if streamed:
          plgpu.barrier_arrive(consumed_bars.at[slot])

      if not products:
        @pl.loop(0, n_q)
        def _stream(i):
          slot = ring.slot(i)
          wait_first(slot)
          wait_last(slot)
          release(consumed, slot)
          release(consumed_t, slot)
        return

      def issue_s_dp(i):
        slot = ring.slot(i)
        if streamed:
          wait_first(slot)
        return registers.dots(
            (None, ((k_smem.at[wg], k_transforms),), (q_ring.at[slot],), k_transforms),
            (None, ((v_smem.at[wg], v_transforms),), (do_ring.at[slot],), v_transforms),
            wait=False)

      def chain_of(i, s_dp):
        s, dp = registers.wait_for(s_dp, pending=1 if i is not None else 0)
        if i is not None:
          release(consumed, ring.slot(i))
        p = bc.scores(s, biased=False) * dp
        for _ in range(chain):
          p = p * 0.5 + dp
        return registers.pack_e4m3(p), registers.pack_e4m3(dp)

      def issue_dv_dk(i, dk, dv, p8, ds8):
        slot = ring.slot(i)
        if streamed:
          wait_last(slot)
        return registers.dots((dv, (p8,), (do8_t_ring.at[slot],), t_transforms),
                              (dk, (ds8,), (q8_t_ring.at[slot],), t_transforms), wait=False)

      def step(i, carry):  # the overlap's order: step i + 1's S^T and dP^T first
        p8, ds8, dk, dv = carry
        with schedule.issuing():
          s_dp = issue_s_dp(i + 1)
          dv_dk = issue_dv_dk(i, dk, dv, p8, ds8)
        p8, ds8 = chain_of(i + 1, s_dp)
        dv, dk = registers.wait_for(dv_dk)
        release(consumed_t, ring.slot(i))
        return p8, ds8, dk, dv

      schedule.lead_in()
      with schedule.issuing():
        first = issue_s_dp(jnp.int32(0))
      p8, ds8 = chain_of(None, first)
      release(consumed, 0)
      zeros = bc.zeros((BLOCK, d))
      p8, ds8, dk, dv = lax.fori_loop(0, n_q - 1, step, (p8, ds8, zeros, zeros))
      last = jnp.int32(n_q - 1)
      with schedule.issuing():
        dv_dk = issue_dv_dk(last, dk, dv, p8, ds8)
      dv, dk = registers.wait_for(dv_dk)
      release(consumed_t, ring.slot(last))
      bc.write_tile((dk + dv).astype(bf16), out_smem.at[wg], out_ref.at[b, kv, h])

    def producer():
      if streamed:
        groups = ((load_first, (consumed,)), (load_last, (consumed_t,)))
        pipeline.stream(ring, first=jnp.int32(0), end=jnp.int32(n_q), groups=groups)
      else:
        for slot in range(slots):
          load_first(slot, slot)
          load_last(slot, slot)

    pipeline.split(wg, tuning, pipeline.BACKWARD_REGISTERS, compute=compute, producer=producer)

  scratch = (
      plgpu.SMEM((WGS, BLOCK, d), i8, transforms=k_transforms),  # K8
      plgpu.SMEM((WGS, BLOCK, d), bf16, transforms=v_transforms),  # V
      plgpu.SMEM((slots, BLOCK, d), i8, transforms=k_transforms),  # Q8
      plgpu.SMEM((slots, d, BLOCK), f8, transforms=t_transforms),  # Q8^T
      plgpu.SMEM((slots, BLOCK, d), bf16, transforms=v_transforms),  # dO
      plgpu.SMEM((slots, d, BLOCK), f8, transforms=t_transforms),  # dO8^T
      plgpu.SMEM((slots, COLUMNS, BLOCK), jnp.float32),  # lse, Delta, dS^T's factor
      plgpu.SMEM((WGS, BLOCK, d), bf16, transforms=v_transforms),  # the output's staging
  )
  if multicast:
    release_bar = plgpu.ClusterBarrier(collective_axes=(multicast,), num_arrivals=WGS,
                                       num_barriers=slots)
  else:
    release_bar = plgpu.Barrier(num_arrivals=WGS, num_barriers=slots)
  barriers = ((plgpu.Barrier(num_barriers=WGS),) * 2,
              (plgpu.Barrier(num_barriers=slots),) * (4 + COLUMNS),
              (release_bar,) * 2,
              pipeline.Schedule.barrier(tuning))

  def entry(*refs):
    pl.run_scoped(lambda *scoped: kernel(*refs, scoped), scratch, *barriers,
                  collective_axes="wg")

  return plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct((batch, seq, heads, d), bf16),
      grid=(heads, ctas // cluster, batch), grid_names=("heads", "kv_seq", "batch"),
      cluster=(1, cluster, 1) if multicast else (),
      cluster_names=("heads_pair", multicast, "batch_pair") if multicast else (),
      num_threads=WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      kernel_name=f"dkdv_ceiling_{mode}")


def operands(batch: int, heads: int, seq: int):
  """Random operands in the kernel's layouts: Q8 (B, H, T, D), Q8^T and dO8^T
  (B, H, T / 64, D, 64), dO (B, T, H, D), the row vectors (3, B, H, T), K8
  (B, H, T, D), V (B, T, H, D)."""
  d, keys = HEAD_DIM, jax.random.split(jax.random.key(0), 7)
  ints = lambda key, shape: jax.random.randint(key, shape, -64, 64, jnp.int8)
  small = lambda key, shape, dtype: (0.1 * jax.random.normal(key, shape)).astype(dtype)
  t_shape = (batch, heads, seq // BLOCK, d, BLOCK)
  return (ints(keys[0], (batch, heads, seq, d)),
          small(keys[1], t_shape, jnp.float8_e4m3fn),
          small(keys[2], (batch, seq, heads, d), jnp.bfloat16),
          small(keys[3], t_shape, jnp.float8_e4m3fn),
          small(keys[4], (COLUMNS, batch, heads, seq), jnp.float32),
          ints(keys[5], (batch, heads, seq, d)),
          small(keys[6], (batch, seq, heads, d), jnp.bfloat16))


def kernel_ms(batch: int, heads: int, seq: int) -> float:
  """ms per call of the FP8 dK/dV kernel with the overlap (not causal), on
  the op's operands of random inputs (`benchmarks.mosaic_backward`'s)."""
  config = Config(scale=HEAD_DIM**-0.5, causal=False, smooth_q=False, block_q=BLOCK,
                  block_kv=BLOCK, quantization="int8_fp8")
  shape = argparse.Namespace(batch=batch, seq=seq, heads=heads, head_dim=HEAD_DIM)
  inputs, _, _ = jax.jit(functools.partial(mosaic_backward.fp8_inputs, config=config))(
      *random_inputs(shape, 4))
  dkdv, _ = mosaic_backward.fp8_kernels("mosaic_fp8_overlap_nosched", config)
  dkdv_args, _ = mosaic_backward.fp8_arguments(*inputs)
  return time_call(jax.jit(dkdv), *dkdv_args) * 1e3


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.dkdv_ceiling")
  parser.add_argument("--batch", type=int, default=4, help="B (default 4)")
  parser.add_argument("--seq", type=int, default=4096, help="T (default 4096)")
  parser.add_argument("--heads", type=int, default=16, help="H (default 16)")
  parser.add_argument("--slots", type=int, default=2, help="ring slots (default 2, the kernel's)")
  parser.add_argument("--chain", type=int, default=KERNEL_CHAIN,
                      help=f"multiply-adds per score that bring the chain to the kernel's "
                           f"length (default {KERNEL_CHAIN})")
  parser.add_argument("--out", default=os.environ.get("OUT"),
                      help="folder for the CSV (default $OUT, else none)")
  args = parser.parse_args()
  benchmarks.require_gpu("benchmarks.dkdv_ceiling")
  b, h, t = args.batch, args.heads, args.seq
  kernel = kernel_ms(b, h, t)
  print(f"the FP8 dK/dV kernel (overlap): {kernel:.3f} ms", flush=True)
  inputs = operands(b, h, t)
  steps = b * h * (t // (WGS * BLOCK)) * (t // BLOCK)  # CTA steps per call
  # (mode, cluster, chain, issue turns): the parts alone and together, from
  # L2 and multicast; then with the kernel's chain length, unordered and in
  # turns.
  runs = [(mode, cluster, 0, False) for cluster in (1, 2) for mode in MODES]
  runs += [(mode, 1, args.chain, turns) for turns in (False, True)
           for mode in ("products", "both")]
  rows = []
  for mode, cluster, chain, turns in runs:
    fn = jax.jit(ceiling_call(mode, batch=b, heads=h, seq=t, slots=args.slots,
                              cluster=cluster, chain=chain, issue_turns=turns))
    ms = time_call(fn, *inputs) * 1e3
    # Bytes landed in shared memory per second; L2 serves 1 / cluster of them.
    smem_rate = steps * step_bytes() / ms / 1e9 if mode != "products" else float("nan")
    row = dict(mode=mode, cluster=cluster, chain=chain, issue_turns=turns, slots=args.slots,
               ms=round(ms, 3), smem_tb_s=round(smem_rate, 2),
               l2_tb_s=round(smem_rate / cluster, 2), kernel_ms=round(kernel, 3), B=b, H=h,
               T=t, D=HEAD_DIM)
    print(row, flush=True)
    rows.append(row)
  if args.out:
    write_csv(rows, args.out, "dkdv_ceiling.csv")


if __name__ == "__main__":
  main()
