"""Where a Mosaic FP8 kernel's warpgroups spend their cycles, from Mosaic
GPU's on-device profiler: each compute warpgroup records the SM clock at the
bounds of the kernel's `jax.named_scope` regions (S and dP's products, the
elementwise chain, the waits, the dK/dV, dQ or P.V products), and this
script prints each region's mean cycles per step and share of the loop.

    python -m benchmarks.mosaic_profile --batch 1 --seq 2048 --heads 8 \
        [--variants mosaic_fp8,forward_mosaic_fp8]

One call of each FP8 variant's dK/dV and dQ kernels (the variants of
`benchmarks.mosaic_backward`), or of its forward (`forward_` and a variant
of `benchmarks.mosaic_forward`), not causal; `forward_causal` and
`forward_causal_exact`: the forward, causal, without and with causal_exact.
B=1 T=2048 H=8 D=128 is one wave of 128 CTAs on an H100 or H200, one CTA
per SM as at any larger shape. The profiler's own stores (~12 cycles a bound)
are inside the figures. Needs a GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import json
import os
import statistics
import tempfile

import jax

from benchmarks import mosaic_forward
from benchmarks.mosaic_backward import VARIANTS, fp8_arguments, fp8_inputs, fp8_kernels
from benchmarks.variants import parse_args, random_inputs
from pallas_kernels.mosaic import pipeline
from pallas_kernels.mosaic.forward import forward_mosaic
from pallas_kernels.types import Config, Masks


def region_cycles(trace: dict) -> dict[str, list[float]]:
  """{region: [cycles of each occurrence]} over the compute warpgroups'
  traces, and each one's span as "loop". The producer's trace, which holds
  only the region Mosaic GPU opens at a kernel's start, is left out."""
  by_thread = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    by_thread[event["tid"]].append(event)
  cycles = collections.defaultdict(list)
  for events in by_thread.values():
    if len({event["name"] for event in events}) < 2:
      continue
    stack = []
    for event in events:  # ts: start time (ns) + clock cycles, / 1000
      if event["ph"] == "B":
        stack.append(event)
      else:
        begin = stack.pop()
        cycles[begin["name"]].append((event["ts"] - begin["ts"]) * 1e3)
    if events:
      cycles["loop"].append((events[-1]["ts"] - events[0]["ts"]) * 1e3)
  return cycles


def report(name: str, folder: str):
  """Prints the regions of the traces the profiler wrote to `folder`: mean
  cycles an occurrence, occurrences a warpgroup, share of the warpgroups'
  spans (first region's start to last region's end). The `tiles_` regions
  (a product's barrier waits) lie inside the issue region."""
  for path in sorted(glob.glob(os.path.join(folder, "*-trace.json"))):
    with open(path) as f:
      cycles = region_cycles(json.load(f))
    spans = cycles.pop("loop")
    # The tiles' waits nest in the issue region and one more runs before the
    # loop: they do not count steps.
    steps = max(len(c) for r, c in cycles.items() if not r.startswith("tiles_")) / len(spans)
    print(f"{name}: {len(spans)} compute warpgroups, {steps:.1f} steps each, "
          f"{sum(spans) / len(spans) / steps:,.0f} cycles a step")
    for region in sorted(cycles, key=lambda r: sum(cycles[r]), reverse=True):
      c = cycles[region]
      print(f"  {region:12} {statistics.mean(c):8,.0f} cycles x {len(c) / len(spans):5.1f}"
            f"  {sum(c) / sum(spans):6.1%}")


FORWARD = "forward_"
FORWARD_VARIANTS = {FORWARD + name: tuning for name, tuning in mosaic_forward.VARIANTS.items()
                    if name.startswith(mosaic_forward.FP8_PREFIX)}
# The FP8 forward's default schedule, causal, without and with causal_exact
# (its value here).
CAUSAL_FORWARD = {"forward_causal": False, "forward_causal_exact": True}


def profile(name: str, run, seq: int):
  """Runs `run` once under the profiler (six regions a step at most, 64 keys
  or queries a step) and prints its regions."""
  with tempfile.TemporaryDirectory() as folder:
    os.environ[pipeline.PROFILE_ENV] = f"{folder}:{6 * seq // 64 + 16}"
    try:
      jax.block_until_ready(run())
      jax.effects_barrier()
    finally:
      del os.environ[pipeline.PROFILE_ENV]
    report(name, folder)


def main():
  fp8_backward = {name: tuning for name, tuning in VARIANTS.items() if "fp8" in name}
  args, names = parse_args(__doc__, "benchmarks.mosaic_profile",
                           {**fp8_backward, **FORWARD_VARIANTS, **CAUSAL_FORWARD})
  q, k, v, do = random_inputs(args, 4)
  config = Config(scale=args.head_dim**-0.5, causal=False, smooth_q=False, block_q=64,
                  block_kv=64, quantization="int8_fp8")
  (qkv, v8, lse, pre, do8), _, _ = jax.block_until_ready(
      jax.jit(functools.partial(fp8_inputs, config=config))(q, k, v, do))
  for name in names:
    if name in CAUSAL_FORWARD:
      causal = dataclasses.replace(config, causal=True, causal_exact=CAUSAL_FORWARD[name])
      causal_qkv = mosaic_forward.exact_inputs(q, k, v, causal)
      profile(name, lambda: forward_mosaic(causal_qkv, Masks(), causal, v.dtype), args.seq)
      continue
    if name in FORWARD_VARIANTS:
      profile(name, lambda: forward_mosaic(qkv, Masks(), config, v.dtype,
                                           FORWARD_VARIANTS[name]), args.seq)
      continue
    for kernel, fn, arguments in zip(("dkdv", "dq"), fp8_kernels(name, config),
                                     fp8_arguments(qkv, v8, lse, pre, do8)):
      profile(f"{name} {kernel}", lambda: fn(*arguments), args.seq)


if __name__ == "__main__":
  main()
