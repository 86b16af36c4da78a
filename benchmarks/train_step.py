"""Training step time with SageBwd against full-precision attention.

    python -m benchmarks.train_step [--preset small --seq-len 8192 --batch-size 2 --steps 20]

Runs `python -m train` once per `--attention` (sage, full) with the same
flags, in temporary run folders, without checkpoints and without the
persistent compilation cache (each compiles from scratch), and prints each
one's median step time (the first step, which compiles, excluded), the speed
ratio, both runs' training losses per step and the largest difference
between them. Extra flags after `--` go to `train` unchanged (`--
--compile-cache DIR` uses a cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import benchmarks


def run(attention: str, args: argparse.Namespace, extra: list[str], root: str) -> list[dict]:
  out = os.path.join(root, attention)
  cmd = [sys.executable, "-m", "train", "--preset", args.preset, "--seq-len", str(args.seq_len),
         "--batch-size", str(args.batch_size), "--grad-accum", "1", "--steps", str(args.steps),
         "--warmup", str(min(args.steps, 10)), "--eval-every", str(args.steps),
         "--ckpt-every", "0", "--compile-cache", "none",
         "--attention", attention, "--out", out, *extra]
  subprocess.run(cmd, check=True)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [row for row in map(json.loads, f) if "step_time" in row]


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.train_step")
  parser.add_argument("--preset", default="small", help="train's preset (default small)")
  parser.add_argument("--seq-len", type=int, default=8192, help="default 8192")
  parser.add_argument("--batch-size", type=int, default=2, help="default 2")
  parser.add_argument("--steps", type=int, default=20, help="default 20")
  args, extra = parser.parse_known_args()
  benchmarks.require_gpu("benchmarks.train_step")
  extra = [x for x in extra if x != "--"]
  with tempfile.TemporaryDirectory() as root:
    rows = {name: run(name, args, extra, root) for name in ("sage", "full")}
  median = {name: statistics.median(r["step_time"] for r in rs[1:]) for name, rs in rows.items()}
  gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(rows["sage"], rows["full"])]
  worst = max(range(len(gaps)), key=gaps.__getitem__)
  print("loss per step, sage / full: " + ", ".join(
      f"{a['loss']:.3f}/{b['loss']:.3f}" for a, b in zip(rows["sage"], rows["full"])))
  print(f"median step: sage {median['sage'] * 1e3:.1f} ms, full {median['full'] * 1e3:.1f} ms; "
        f"sage is {median['full'] / median['sage']:.2f}x as fast; "
        f"largest loss difference over {len(gaps)} steps: {gaps[worst]:.2e} "
        f"(step {rows['sage'][worst]['step']})")


if __name__ == "__main__":
  main()
