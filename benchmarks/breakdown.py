"""Where the time goes: GPU time per kernel of one attention call, from a
`jax.profiler` trace, forward and forward+backward.

    python -m benchmarks.breakdown [--impls sage_triton,cudnn] [--seq 4096] [--out DIR]

For each implementation and causality, runs the jitted forward and gradient
`--iters` times under the profiler and prints, per kernel, its GPU time
per call (summed over launches), the launches per call and its share, then
the whole call's kernel time. Complements `benchmarks.attention` (wall
time): gaps between kernels and host overhead do not show here. Writes
breakdown.csv to --out (default $OUT or .).
"""

from __future__ import annotations

import collections
import functools
import glob
import os
import tempfile

import jax
import jax.numpy as jnp

import benchmarks
from benchmarks.attention import IMPLEMENTATIONS, impl_names, implementations, write_csv


def kernel_times(planes, iters: int) -> dict[str, tuple[float, float]]:
  """{kernel: (device seconds per call, launches per call)} over the GPU
  planes of a trace (`jax.profiler.ProfileData(...).planes`).

  Kernels are the events of the planes' stream lines; XLA's own summary
  lines (modules, ops, steps) repeat the same time and are skipped.
  """
  total = collections.defaultdict(float)
  count = collections.Counter()
  for plane in planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      for event in line.events:
        total[event.name] += event.duration_ns * 1e-9
        count[event.name] += 1
  return {name: (total[name] / iters, count[name] / iters) for name in total}


def profile(fn, args, iters: int) -> dict[str, tuple[float, float]]:
  """`kernel_times` of `iters` calls of the compiled `fn(*args)`."""
  jax.block_until_ready(fn(*args))  # compile outside the trace
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(iters):
        jax.block_until_ready(fn(*args))
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    return kernel_times(data.planes, iters)


def report(label: str, times: dict[str, tuple[float, float]], width: int = 60) -> list[str]:
  """Kernels sorted by time, each with ms per call, launches and share."""
  whole = sum(t for t, _ in times.values())
  if not whole:
    return [f"{label}: no GPU kernels in the trace"]
  lines = [f"{label}: {whole * 1e3:.3f} ms of kernels per call"]
  for name, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
    short = name if len(name) <= width else name[:width - 3] + "..."
    lines.append(f"  {t * 1e3:8.3f} ms  x{n:<5g} {100 * t / whole:5.1f}%  {short}")
  return lines


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.breakdown")
  parser.add_argument("--impls", default="sage_triton,sage_mosaic,cudnn",
                      help=f"comma list of {', '.join(IMPLEMENTATIONS)} "
                           f"(default sage_triton,sage_mosaic,cudnn)")
  parser.add_argument("--batch", type=int, default=4, help="B (default 4)")
  parser.add_argument("--seq", type=int, default=4096, help="T (default 4096)")
  parser.add_argument("--heads", type=int, default=16, help="H (default 16)")
  parser.add_argument("--dim", type=int, default=128, help="D (default 128)")
  parser.add_argument("--iters", type=int, default=10, help="calls profiled (default 10)")
  parser.add_argument("--out", default=os.environ.get("OUT", "."),
                      help="folder for breakdown.csv (default $OUT or .)")
  args = parser.parse_args()
  names = impl_names(parser, args.impls)
  benchmarks.require_gpu("benchmarks.breakdown")
  impls = implementations()
  shape = (args.batch, args.seq, args.heads, args.dim)
  q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16)
                 for key in jax.random.split(jax.random.key(0), 4))
  rows = []
  for causal in (False, True):
    for name in names:
      f = functools.partial(impls[name], causal=causal)
      loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * do)
      for mode, fn in (("fwd", jax.jit(f)), ("fwd_bwd", jax.jit(jax.grad(loss, (0, 1, 2))))):
        times = profile(fn, (q, k, v), args.iters)
        print("\n".join(report(f"{name} {mode} causal={causal} {shape}", times)), flush=True)
        rows += [dict(impl=name, mode=mode, causal=causal, kernel=kernel, ms=t * 1e3,
                      launches=n) for kernel, (t, n) in times.items()]
  write_csv(rows, args.out, "breakdown.csv")


if __name__ == "__main__":
  main()
