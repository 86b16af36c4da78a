"""What reducing dQ in global memory would cost a fused Hopper backward.

    python -m benchmarks.dq_reduce [--batch 4 --seq 4096 --heads 16 --head-dim 128]

A fused backward (one kernel per key block, as FlashAttention-3's) adds each
step's dQ partial, a 64 x D tile, into dQ in global memory. This times that
traffic alone, with no arithmetic: every key-block CTA sends T / 64 tiles from
shared memory by TMA, either as reduce-adds (`copy_smem_to_gmem(...,
reduction_op="add")`) or as plain stores of the same bytes. Variants: the
partials in fp32 or bf16; 128 or 256 keys per CTA (fewer, larger partials);
every CTA walking the query blocks in the same order ("lockstep": the CTAs of
one head add into the same dQ rows at once) or each starting at its own
offset ("staggered"). Prints GB moved, ms and TB/s per variant, and cuDNN
BF16's whole backward at the same shape for scale. Needs a Hopper GPU.
"""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

import benchmarks
from benchmarks.attention import time_call, write_csv

ROWS = 64  # query rows of one dQ partial tile
DEPTH = 2  # partial tiles in flight per CTA


def reduce_kernel(heads: int, seq: int, head_dim: int, keys_per_cta: int, dtype, *,
                  reduce: bool, staggered: bool):
  """A jitted kernel that sends every key block's partial tiles into dQ
  (heads, seq, head_dim); returns it and the bytes it sends."""
  key_blocks, steps = seq // keys_per_cta, seq // ROWS

  def body(dq_ref, smem):
    kb, bh = lax.axis_index("kb"), lax.axis_index("bh")
    for s in range(DEPTH):
      smem[s] = plgpu.layout_cast(jnp.full((ROWS, head_dim), 1.0, dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    first = kb * (steps // key_blocks) if staggered else 0

    @pl.loop(0, steps)
    def _step(i):
      block = lax.rem(first + i, steps)
      plgpu.copy_smem_to_gmem(smem.at[lax.rem(i, DEPTH)],
                              dq_ref.at[bh, pl.ds(block * ROWS, ROWS)],
                              reduction_op="add" if reduce else None)
      plgpu.wait_smem_to_gmem(DEPTH - 1, wait_read_only=True)

    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((heads, seq, head_dim), dtype),
                        scratch_types=[plgpu.SMEM((DEPTH, ROWS, head_dim), dtype)],
                        grid=(key_blocks, heads), grid_names=("kb", "bh"),
                        kernel_name="dq_reduce")
  nbytes = key_blocks * heads * seq * head_dim * jnp.dtype(dtype).itemsize
  return jax.jit(kernel), nbytes


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.dq_reduce")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--out", default=os.environ.get("OUT"),
                      help="folder for dq_reduce.csv (default $OUT; none: no file)")
  args = parser.parse_args()
  benchmarks.require_gpu("benchmarks.dq_reduce")
  if not any(getattr(dev, "compute_capability", None) == "9.0" for dev in jax.devices()):
    parser.error(f"needs a Hopper GPU (sm_90: TMA reduce-add); this machine has "
                 f"{jax.devices()}")
  b, t, h, d = args.batch, args.seq, args.heads, args.head_dim

  q, k, v, do = (jax.random.normal(key, (b, t, h, d), jnp.bfloat16)
                 for key in jax.random.split(jax.random.key(0), 4))
  attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
  cudnn_bwd = (time_call(jax.jit(jax.grad(loss, (0, 1, 2))), q, k, v)
               - time_call(jax.jit(attn), q, k, v))
  print(f"cuDNN BF16 backward (forward+backward minus forward): {cudnn_bwd * 1e3:.3f} ms",
        flush=True)

  rows = []
  variants = itertools.product((jnp.float32, jnp.bfloat16), (128, 256), (False, True),
                               (True, False))
  for dtype, keys, staggered, reduce in variants:
    name = (f"{jnp.dtype(dtype).name} {keys} keys/CTA {'staggered' if staggered else 'lockstep'} "
            f"{'reduce-add' if reduce else 'store'}")
    try:
      fn, nbytes = reduce_kernel(b * h, t, d, keys, dtype, reduce=reduce, staggered=staggered)
      sec = time_call(fn)
    except Exception as e:  # report and go on with the other variants
      print(f"{name}: FAILED {type(e).__name__}: {e}"[:2000], flush=True)
      continue
    row = dict(dtype=jnp.dtype(dtype).name, keys_per_cta=keys, staggered=staggered,
               reduce=reduce, gb=nbytes / 1e9, ms=sec * 1e3, tb_s=nbytes / sec / 1e12,
               x_cudnn_bwd=sec / cudnn_bwd)
    rows.append(row)
    print(f"{name}: {row['gb']:.2f} GB {row['ms']:.3f} ms {row['tb_s']:.2f} TB/s "
          f"({row['x_cudnn_bwd']:.2f} x cuDNN's backward)", flush=True)

  print(f"\n| partials | keys/CTA | order | op | GB | ms | TB/s | x cuDNN bwd "
        f"(B={b} T={t} H={h} D={d}) |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['dtype']} | {r['keys_per_cta']} | "
          f"{'staggered' if r['staggered'] else 'lockstep'} | "
          f"{'reduce-add' if r['reduce'] else 'store'} | {r['gb']:.2f} | {r['ms']:.3f} | "
          f"{r['tb_s']:.2f} | {r['x_cudnn_bwd']:.2f} |")
  if args.out:
    write_csv(rows, args.out, "dq_reduce.csv")


if __name__ == "__main__":
  main()
