"""What `--telemetry-every N` costs a training run, from the run's metrics.

    python -m train --preset small --steps 40 --telemetry-every 10 --ckpt-every 0 --out runs/tel
    python -m benchmarks.telemetry_cost runs/tel [--every 50,100,250]

A telemetry call is timed by the loop apart from the step (`telemetry_s`,
compiled beforehand); a step by `step_time`. The cost at interval N is the
mean telemetry call over N times the median step.
"""

from __future__ import annotations

import os
import statistics

import benchmarks
from train.metrics import kind, read


def main(argv: list[str] | None = None) -> None:
  parser = benchmarks.parser(__doc__, "benchmarks.telemetry_cost")
  parser.add_argument("run", help="a run folder trained with --telemetry-every")
  parser.add_argument("--every", default="10,50,100,250",
                      help="comma list of intervals to state the cost at (default 10,50,100,250)")
  args = parser.parse_args(argv)
  try:
    every = [int(x) for x in args.every.split(",")]
  except ValueError:
    parser.error(f"--every: not a comma list of integers: {args.every!r}")
  rows = read(os.path.join(args.run, "metrics.jsonl"))
  steps = [r["step_time"] for r in rows if kind(r) == "train" and "step_time" in r]
  calls = [r["telemetry_s"] for r in rows if kind(r) == "telemetry"]
  if len(steps) < 2 or not calls:
    parser.error(f"{args.run}: needs timed steps and telemetry rows (train with "
                 "--telemetry-every)")
  step = statistics.median(steps[1:])  # the first step waits for the data pipeline to warm
  call = statistics.fmean(calls)
  print(f"median step {step * 1e3:.1f} ms over {len(steps) - 1} steps; telemetry call "
        f"{call * 1e3:.1f} ms (mean of {len(calls)}) = {call / step:.2f} steps")
  print("| --telemetry-every | cost (share of step time) |")
  print("|---|---|")
  for n in every:
    print(f"| {n} | {100 * call / (n * step):.2f}% |")


if __name__ == "__main__":
  main()
