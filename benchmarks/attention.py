"""Attention speed on a GPU: SageBwd's kernels (Triton, Mosaic GPU) against
cuDNN BF16, XLA and jax's own Pallas `mha`, in one process, forward and
forward+backward.

    python -m benchmarks.attention [--quick] [--impls sage_triton,cudnn] [--out DIR]

Prints each measurement as it is taken, then a table (TFLOP/s-equivalent
TOPS and the ratio to cuDNN measured in the same run), and writes
attention.csv and attention.png to --out (default $OUT or .). FLOPs: forward
4*B*H*Tq*Tk*D (halved when causal), forward+backward 3.5x. Peak memory is
XLA's compiled estimate (arguments + outputs + temporaries).

Implementations (--impls): sage_triton (implementation="triton", the
default on GPUs other than Hopper), sage_mosaic ("mosaic", the default on an
H100/H200), sage_mosaic_fp8 ("mosaic" with quantization="int8_fp8": its
Mosaic forward and backward kernels), cudnn and xla
(jax.nn.dot_product_attention, BF16), cudnn_fp8 (cuDNN's FP8 attention through
jax's private `jax._src.cudnn.fused_attention_stablehlo`, the path Transformer
Engine takes: E4M3 inputs, unit scales, no backward at D=64), pallas_mha
(jax.experimental.pallas.ops.gpu.attention.mha). The last two are imported
only when asked for.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp

import benchmarks
import sagebwd_jax

IMPLEMENTATIONS = ("sage_triton", "sage_mosaic", "sage_mosaic_fp8", "cudnn", "cudnn_fp8", "xla",
                   "pallas_mha")


def implementations() -> dict:
  """{name: attn(q, k, v, causal)} for every name in IMPLEMENTATIONS."""

  def mha(q, k, v, causal):
    # Deprecated by jax: imported only when this implementation runs.
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha
    d = q.shape[-1]
    sizes = pallas_mha.BlockSizes(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                                  block_q_dq=64, block_kv_dq=64)
    return pallas_mha.mha(q, k, v, None, sm_scale=d**-0.5, causal=causal, block_sizes=sizes)

  def cudnn_fp8(q, k, v, causal):
    from jax._src.cudnn import fused_attention_stablehlo as fused  # private: only when asked
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    e4m3 = jnp.float8_e4m3fn
    mask = fused.MaskType.CAUSAL if causal else fused.MaskType.NO_MASK
    o, _, _ = fused.dot_product_attention(
        q.astype(e4m3), k.astype(e4m3), v.astype(e4m3), scale=q.shape[-1]**-0.5,
        mask_type=mask, use_fp8=True, fp8_params={key: one for key in fused.fp8_params_keys})
    return o.astype(q.dtype)

  return {
      "sage_mosaic": lambda q, k, v, causal: sagebwd_jax.dot_product_attention(
          q, k, v, is_causal=causal, implementation="mosaic"),
      "sage_mosaic_fp8": lambda q, k, v, causal: sagebwd_jax.dot_product_attention(
          q, k, v, is_causal=causal, implementation="mosaic", quantization="int8_fp8"),
      "cudnn_fp8": cudnn_fp8,
      "sage_triton": lambda q, k, v, causal: sagebwd_jax.dot_product_attention(
          q, k, v, is_causal=causal, implementation="triton"),
      "cudnn": lambda q, k, v, causal: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"),
      "xla": lambda q, k, v, causal: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla"),
      "pallas_mha": mha,
  }


def time_call(fn, *args, warmup: int = 2, rounds: int = 7, calls: int = 10) -> float:
  """Seconds per call of `fn(*args)`: the median over `rounds` of `calls`
  back-to-back calls and one wait, so the host's ~0.3 ms per synchronisation
  does not blur the ratios between implementations."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    out = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def peak_bytes(fn, *args) -> int:
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes)


def measure(name, attn, batch, seq, heads, head_dim, causal, with_memory):
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, seq, heads, head_dim)
  q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
  f = functools.partial(attn, causal=causal)
  fwd = jax.jit(f)
  loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
  fwd_bwd = jax.jit(jax.grad(loss, (0, 1, 2)))
  flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
  row = dict(impl=name, B=batch, T=seq, H=heads, D=head_dim, causal=causal)
  try:
    row["fwd_tops"] = flops / time_call(fwd, q, k, v) / 1e12
  except Exception as e:  # an implementation may not support a case
    row["fwd_tops"], row["error"] = float("nan"), type(e).__name__
  try:
    row["fwd_bwd_tops"] = 3.5 * flops / time_call(fwd_bwd, q, k, v) / 1e12
    if with_memory:
      row["fwd_bwd_peak_gib"] = peak_bytes(jax.grad(loss, (0, 1, 2)), q, k, v) / 2**30
  except Exception as e:
    row["fwd_bwd_tops"], row["error"] = float("nan"), type(e).__name__
  return row


def impl_names(parser: argparse.ArgumentParser, value: str) -> list[str]:
  """--impls as a list; parser.error naming any unknown one."""
  names = value.split(",")
  unknown = [n for n in names if n not in IMPLEMENTATIONS]
  if unknown:
    parser.error(f"--impls: unknown {unknown}; choose from {', '.join(IMPLEMENTATIONS)}")
  return names


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.attention")
  parser.add_argument("--quick", action="store_true",
                      help="one shape only: B=4, T=4096, H=16, D=128")
  parser.add_argument("--impls", default="sage_triton,cudnn,xla,pallas_mha",
                      help=f"comma list of {', '.join(IMPLEMENTATIONS)} "
                           f"(default sage_triton,cudnn,xla,pallas_mha)")
  parser.add_argument("--seqs", default="1024,2048,4096,8192,16384",
                      help="sequence lengths, B = 16384 / T (default 1024,...,16384)")
  parser.add_argument("--dims", default="128,64",
                      help="head dims, H = 2048 / D (default 128,64)")
  parser.add_argument("--out", default=os.environ.get("OUT", "."),
                      help="folder for attention.csv and attention.png (default $OUT or .)")
  args = parser.parse_args()
  names = impl_names(parser, args.impls)
  benchmarks.require_gpu("benchmarks.attention")
  impls = {k: v for k, v in implementations().items() if k in names}
  if args.quick:
    shapes = [(4, 4096, 16, 128)]
  else:
    shapes = [(16384 // t, t, 2048 // d, d) for d in map(int, args.dims.split(","))
              for t in map(int, args.seqs.split(","))]
  cases = [(shape, causal, name) for shape in shapes for causal in (False, True)
           for name in impls
           if not (name == "xla" and shape[1] > 8192)]  # xla: B*H*T*T fp32 logits
  print(f"{len(cases)} measurements, each compiled, then timed over 7 rounds of 10 calls",
        flush=True)
  rows = []
  for i, ((batch, seq, heads, head_dim), causal, name) in enumerate(cases, 1):
    with_memory = seq == 16384 and name in ("sage_mosaic", "sage_triton", "cudnn")
    rows.append(measure(name, impls[name], batch, seq, heads, head_dim, causal, with_memory))
    print(f"[{i}/{len(cases)}] {_fmt(rows[-1])}", flush=True)
  _ratios(rows)
  print("\n" + _table(rows))
  _write(rows, args.out)


def _ratios(rows):
  cudnn = {(r["T"], r["D"], r["causal"]): r for r in rows if r["impl"] == "cudnn"}
  for r in rows:
    ref = cudnn.get((r["T"], r["D"], r["causal"]))
    for key in ("fwd", "fwd_bwd"):
      if ref:
        r[f"{key}_vs_cudnn"] = r[f"{key}_tops"] / ref[f"{key}_tops"]


def _fmt(r):
  return (f"{r['impl']:>10} B={r['B']} T={r['T']:>5} H={r['H']} D={r['D']} "
          f"causal={r['causal']!s:5} fwd {r['fwd_tops']:6.1f} fwd+bwd {r['fwd_bwd_tops']:6.1f}"
          + (f" peak {r['fwd_bwd_peak_gib']:.2f} GiB" if "fwd_bwd_peak_gib" in r else "")
          + (f" ({r['error']})" if "error" in r else ""))


def _table(rows):
  head = "| impl | B | T | H | D | causal | fwd TOPS | x cuDNN | fwd+bwd TOPS | x cuDNN | peak GiB |"
  lines = [head, "|" + "---|" * 11]
  for r in rows:
    peak = f"{r['fwd_bwd_peak_gib']:.2f}" if "fwd_bwd_peak_gib" in r else "-"
    lines.append(
        f"| {r['impl']} | {r['B']} | {r['T']} | {r['H']} | {r['D']} | {r['causal']} | "
        f"{r['fwd_tops']:.1f} | {r.get('fwd_vs_cudnn', float('nan')):.2f} | "
        f"{r['fwd_bwd_tops']:.1f} | {r.get('fwd_bwd_vs_cudnn', float('nan')):.2f} | {peak} |")
  return "\n".join(lines)


def write_csv(rows: list[dict], out: str, name: str):
  """Rows (dicts, keys may differ) to out/name, one column per key seen."""
  os.makedirs(out, exist_ok=True)
  fields = sorted({k for r in rows for k in r})
  with open(os.path.join(out, name), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)


def _write(rows, out):
  write_csv(rows, out, "attention.csv")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cases = sorted({(r["D"], r["causal"]) for r in rows})
  fig, axes = plt.subplots(2, len(cases), figsize=(4.5 * len(cases), 7), squeeze=False)
  for col, (d, causal) in enumerate(cases):
    for row_i, key in enumerate(("fwd_tops", "fwd_bwd_tops")):
      ax = axes[row_i][col]
      for impl in dict.fromkeys(r["impl"] for r in rows):
        pts = [(r["T"], r[key]) for r in rows
               if r["impl"] == impl and r["D"] == d and r["causal"] == causal]
        if pts:
          ax.plot(*zip(*pts), marker="o", label=impl)
      ax.set_xscale("log", base=2)
      ax.set_title(f"{'fwd' if row_i == 0 else 'fwd+bwd'}, D={d}, causal={causal}")
      ax.set_xlabel("sequence length (B*T = 16k)")
      ax.set_ylabel("TOPS")
      ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "attention.png"), dpi=100)


if __name__ == "__main__":
  main()
