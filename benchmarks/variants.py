"""What the kernel-variant benchmarks (mosaic_forward.py, mosaic_backward.py)
share: their flags, their inputs, and rows of timed kernels with the ratio to
cuDNN in the same run."""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

import benchmarks
from sagebwd_jax import metrics


def parse_args(doc: str, module: str, variants: dict) -> tuple[argparse.Namespace, list[str]]:
  """The shape, variant and output flags of the script `module`; returns the
  args and the variant names (ends the script without a GPU)."""
  parser = benchmarks.parser(doc, module)
  parser.add_argument("--batch", type=int, default=4, help="B (default 4)")
  parser.add_argument("--seq", type=int, default=4096, help="T (default 4096)")
  parser.add_argument("--heads", type=int, default=16, help="H (default 16)")
  parser.add_argument("--head-dim", type=int, default=128, help="D (default 128)")
  parser.add_argument("--variants", default="all",
                      help=f"comma list of {', '.join(sorted(variants))}, or all (default)")
  parser.add_argument("--out", default=os.environ.get("OUT"),
                      help="folder for the CSV (default $OUT, else none)")
  args = parser.parse_args()
  names = sorted(variants) if args.variants == "all" else args.variants.split(",")
  unknown = sorted(set(names) - set(variants))
  if unknown:
    parser.error(f"unknown variants {unknown}; choose from {sorted(variants)}")
  benchmarks.require_gpu(module)
  return args, names


def random_inputs(args: argparse.Namespace, count: int) -> list[jax.Array]:
  """`count` standard normal bf16 arrays shaped (batch, seq, heads, head_dim)."""
  shape = (args.batch, args.seq, args.heads, args.head_dim)
  return [jax.random.normal(key, shape, jnp.bfloat16)
          for key in jax.random.split(jax.random.key(0), count)]


def rel_l2(x, ref) -> float:
  return float(metrics.relative_l2(x, ref))


class Rows:
  """Timed kernels of one benchmark, printed as they come."""

  def __init__(self, args: argparse.Namespace, width: int):
    self.shape = dict(B=args.batch, T=args.seq, H=args.heads, D=args.head_dim)
    self.width = width
    self.rows: list[dict] = []

  def record(self, name: str, sec: float, *, causal: bool, flops: float, **extra) -> dict:
    """One row: `name` took `sec` seconds for `flops` (TOPS = flops / sec)."""
    row = dict(impl=name, **self.shape, causal=causal, ms=sec * 1e3, tops=flops / sec / 1e12,
               **extra)
    self.rows.append(row)
    print(f"{name:>{self.width}} causal={causal!s:5} {sec * 1e3:8.3f} ms {row['tops']:7.1f} TOPS "
          + " ".join(f"{k}={v:.3g}" for k, v in extra.items()), flush=True)
    return row

  def failed(self, name: str, causal: bool, error: Exception):
    """Reports a variant that did not compile or run; the others go on."""
    print(f"{name:>{self.width}} causal={causal!s:5} FAILED {type(error).__name__}: "
          f"{error}"[:3000], flush=True)

  def ratios(self, causal: bool, reference: dict):
    """x_cudnn of this causality's rows: TOPS over the `reference` row's."""
    for row in self.rows:
      if row["causal"] == causal:
        row["x_cudnn"] = row["tops"] / reference["tops"]
