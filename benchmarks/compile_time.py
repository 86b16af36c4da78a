"""How long the op takes to trace, lower and compile, against full-precision
attention, and whether that grows with the call sites of a program.

    # (a) forward+backward at B=4 T=1024 H=8 D=64 against jax.nn's (the loss
    #     closes over a fixed dO), and whether XLA's slow-operation alarm
    #     (constant folding) fires at T=4096
    python -m benchmarks.compile_time --part op
    # (b) the gradient of n chained calls at distinct call sites (n = 1, 2, 4,
    #     12; B=2 T=2048 H=12 D=64, causal), each n in a fresh process: trace,
    #     lower and compile apart, and the lowering time of each kernel
    python -m benchmarks.compile_time --part chain
    # (b) without a GPU for the GPU's kernels: lowered for CUDA as on an H200
    #     (Mosaic and Triton kernels, Triton's for sm_90), not compiled; needs
    #     jax-triton and a jax CUDA plugin (jax-cuda12-plugin) importable
    python -m benchmarks.compile_time --part chain --cuda
    # (c) `python -m train`'s train step (built as train builds it; small
    #     preset, T=2048, batch 8 by default), with --attention sage and full,
    #     each in a fresh process: trace, lower, compile and the kernels'
    #     lowerings apart
    python -m benchmarks.compile_time --part step [--preset small --seq-len 2048 --batch-size 8]
    # (d) the same train step cold and warm, as `python -m train` meets it
    #     with its persistent compilation cache: cold in a fresh process with
    #     an empty cache (jax's, and Triton's own), warm in a second fresh
    #     process once the first has filled it; with the first and second
    #     step's time (a kernel that compiles or loads on its first call shows
    #     there)
    python -m benchmarks.compile_time --part cache [--preset small --seq-len 2048 --batch-size 8]

The op runs its default implementation: the GPU's kernels on a GPU, the
pure-JAX reference on the CPU. Each figure is one measurement (compile times
vary by some 10% between runs); JAX's persistent compilation cache is off
but in (d).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import benchmarks
from sagebwd_jax import dot_product_attention

ALARM = "Constant folding an instruction is taking"
# The lines of XLA's alarm message besides the first (which holds ALARM).
_ALARM_LINES = ("slow_operation_alarm", "  %", "This isn't necessarily a bug",
                "If you'd like to file a bug")


@dataclasses.dataclass
class Timing:
  trace_s: float
  lower_s: float
  compile_s: float | None  # None: lowered for another platform, not compiled
  alarm: bool = False  # XLA's slow-operation alarm fired while compiling
  kernels: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  steps_s: list[float] = dataclasses.field(default_factory=list)  # (d): first, second step
  cache_hits: int | None = None  # (d): programs loaded from the persistent cache


@contextlib.contextmanager
def _stderr_captured(lines: list[str]):
  """What the process (XLA's C++ included) writes to stderr, into `lines`."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+") as f:
    os.dup2(f.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      lines += f.read().splitlines()


@contextlib.contextmanager
def _kernel_lowerings(times: dict[str, list[float]]):
  """Times each lowering of a kernel (Pallas calls, the Mosaic GPU kernels'
  `mpmd_map`, jax_triton calls), by name."""
  from jax._src.interpreters import mlir
  from jax._src.pallas.mpmd import mpmd_map_p
  from jax._src.pallas.pallas_call import pallas_call_p
  primitives = [pallas_call_p, mpmd_map_p]
  with contextlib.suppress(ImportError):
    from jax_triton.triton_lib import triton_kernel_call_p
    primitives.append(triton_kernel_call_p)
  tables = [mlir._lowerings, *mlir._platform_specific_lowerings.values()]
  saved = [(table, p, table[p]) for table in tables for p in primitives if p in table]

  def timed(rule):
    def lower(ctx, *args, **params):
      start = time.perf_counter()
      try:
        return rule(ctx, *args, **params)
      finally:
        times.setdefault(str(params.get("name")), []).append(time.perf_counter() - start)
    return lower

  for table, p, entry in saved:
    table[p] = dataclasses.replace(entry, rule=timed(entry.rule))
  try:
    yield
  finally:
    for table, p, entry in saved:
      table[p] = entry


def measure(jitted, *args, platforms: tuple[str, ...] | None = None) -> Timing:
  """Trace, lower and (unless `platforms` names others) compile `jitted`."""
  kernels: dict[str, list[float]] = {}
  t0 = time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  with _kernel_lowerings(kernels):
    lowered = traced.lower(lowering_platforms=platforms) if platforms else traced.lower()
  t2 = time.perf_counter()
  if platforms:
    return Timing(t1 - t0, t2 - t1, None, kernels=kernels)
  stderr: list[str] = []
  with _stderr_captured(stderr):
    lowered.compile()
  t3 = time.perf_counter()
  sys.stderr.write("".join(line + "\n" for line in stderr
                           if line.strip() and ALARM not in line
                           and not any(x in line for x in _ALARM_LINES)))
  return Timing(t1 - t0, t2 - t1, t3 - t2, any(ALARM in line for line in stderr), kernels)


def _inputs(batch: int, seq: int, heads: int, dim: int, n: int = 3):
  keys = jax.random.split(jax.random.key(0), n)
  return [jax.random.normal(k, (batch, seq, heads, dim), jnp.bfloat16) for k in keys]


def forward_backward(attention, seq: int) -> Timing:
  """Forward+backward of `attention` at B=4 H=8 D=64, the loss closing over a
  fixed dO (a constant of the program)."""
  q, k, v, do = _inputs(4, seq, 8, 64, 4)
  loss = lambda q, k, v: jnp.vdot(attention(q, k, v).astype(jnp.float32),
                                  do.astype(jnp.float32))
  return measure(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v)


def chain(n: int, cuda: bool) -> Timing:
  """The gradient of n op calls at distinct call sites, each call's output the
  next one's query."""
  if cuda:
    _as_on_an_h200()

  def loss(q, k, v):
    for _ in range(n):
      q = dot_product_attention(q, k, v, is_causal=True)
    return jnp.sum(q.astype(jnp.float32))

  x = jax.ShapeDtypeStruct((2, 2048, 12, 64), jnp.bfloat16)
  return measure(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), x, x, x,
                 platforms=("cuda",) if cuda else None)


def train_step(attention: str, preset: str, seq: int, batch: int,
               cache: str | None = None) -> Timing:
  """`python -m train --preset <preset> --attention <attention>`'s train step at
  `batch` x `seq` tokens (one micro-batch), built as `train` builds it. With
  `cache`, through `python -m train`'s persistent compilation cache in that
  folder, and the first two steps run and timed."""
  from train import compile_cache, data, optim, sharding
  from train.config import preset as preset_config
  from train.loop import Batches
  from train.step import build_model, make_steps
  if cache is not None:
    compile_cache.enable(cache)
  cfg = preset_config(preset, seq_len=seq, batch_size=batch, grad_accum=1, attention=attention)
  mesh = sharding.make_mesh(cfg.mesh)
  ds = data.load(cfg.data, cfg.val_fraction, cfg.seq_len)
  cfg = dataclasses.replace(cfg, vocab_size=cfg.vocab_size or ds.vocab_size)
  state, step, _ = make_steps(build_model(cfg, cfg.vocab_size, mesh), optim.optimizer(cfg), mesh)
  batches = Batches(ds, cfg, mesh)
  if cache is None:
    return measure(step, state, batches.train(0))
  compiled: list = []
  timing = measure(_Keep(step, compiled), state, batches.train(0))
  for i in range(2):
    batch_i = batches.train(i)
    t0 = time.perf_counter()
    state, metrics = compiled[0](state, batch_i)
    jax.block_until_ready(metrics)
    timing.steps_s.append(time.perf_counter() - t0)
  timing.cache_hits = compile_cache.active().hits
  return timing


class _Keep:
  """`jitted` for `measure`, keeping the executable its `.lower().compile()`
  makes in `out`."""

  def __init__(self, jitted, out: list):
    self.jitted, self.out = jitted, out

  def trace(self, *args):
    return _Keep(self.jitted.trace(*args), self.out)

  def lower(self, **kw):
    return _Keep(self.jitted.lower(**kw), self.out)

  def compile(self):
    self.out.append(self.jitted.compile())
    return self.out[-1]


def _as_on_an_h200() -> None:
  """The op picks its kernels as on an H200, whose Triton kernels jax_triton
  compiles for sm_90, on a machine without one (lowering only)."""
  import jax_triton.triton_lib as triton_lib
  from sagebwd_jax import implementations
  implementations.platform = lambda: "cuda"
  implementations.hopper = lambda: True
  triton_lib.triton_kernel_call_lib.get_compute_capability = lambda device: 90


# What a child process measures, by `--part`.
_PARTS = {"chain": chain, "step": train_step}


def _child(part: str, env: dict[str, str] | None = None, **kwargs) -> Timing:
  """`_PARTS[part](**kwargs)` in a fresh process: no kernel lowered or
  compiled before (but from the persistent cache where `kwargs` names one);
  `env`: more environment variables."""
  env = {**os.environ, **(env or {})}
  if kwargs.get("cache") is None:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  command = [sys.executable, "-m", "benchmarks.compile_time", "--one",
             json.dumps(dict(part=part, **kwargs))]
  proc = subprocess.run(command, env=env, capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
  return Timing(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _seconds(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}"


def report_op() -> None:
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # the process's first compile sets XLA up
  timings = {"sage": forward_backward(dot_product_attention, 1024),
             "jax.nn": forward_backward(jax.nn.dot_product_attention, 1024)}
  print(f"forward+backward, B=4 T=1024 H=8 D=64 bf16, on {jax.default_backend()}:")
  print("| attention | trace s | lower s | compile s |\n|---|---|---|---|")
  for name, t in timings.items():
    print(f"| {name} | {_seconds(t.trace_s)} | {_seconds(t.lower_s)} | {_seconds(t.compile_s)} |")
  ratio = timings["sage"].compile_s / timings["jax.nn"].compile_s
  print(f"compile time against jax.nn's: {ratio:.2f}x (bar: at most 3x)")
  for seq, t in ((1024, timings["sage"]), (4096, forward_backward(dot_product_attention, 4096))):
    print(f"T={seq}: the op compiled in {t.compile_s:.2f} s; XLA's slow-operation alarm "
          f"{'FIRED' if t.alarm else 'did not fire'}")


def report_chain(calls: list[int], cuda: bool) -> None:
  where = ("lowered for CUDA as on an H200, not compiled" if cuda
           else f"compiled for {jax.default_backend()}")
  print(f"gradient of n chained calls (B=2 T=2048 H=12 D=64 bf16, causal), {where}:")
  print("| n | trace s | lower s | compile s | all three / n=1's |\n|---|---|---|---|---|")
  timings = {}
  for n in calls:
    t = timings[n] = _child("chain", n=n, cuda=cuda)
    ratio = _total(t) / _total(timings[calls[0]])
    print(f"| {n} | {_seconds(t.trace_s)} | {_seconds(t.lower_s)} | {_seconds(t.compile_s)} "
          f"| {ratio:.2f} |", flush=True)
  _print_kernels(timings[calls[-1]], f"at n={calls[-1]}")


def report_step(preset: str, seq: int, batch: int) -> None:
  print(f"`python -m train --preset {preset}`'s train step, batch {batch} x T={seq}, "
        f"on {jax.default_backend()}, each attention in a fresh process:")
  print("| attention | trace s | lower s | compile s | all three |\n|---|---|---|---|---|")
  timings = {}
  for attention in ("sage", "full"):
    t = timings[attention] = _child("step", attention=attention, preset=preset, seq=seq,
                                    batch=batch)
    print(f"| {attention} | {_seconds(t.trace_s)} | {_seconds(t.lower_s)} | "
          f"{_seconds(t.compile_s)} | {_seconds(_total(t))} |", flush=True)
  print(f"sage against full: {_total(timings['sage']) / _total(timings['full']):.2f}x "
        "(issue 32's bar: at most 1.5x)")
  _print_kernels(timings["sage"], "with --attention sage")


def report_cache(preset: str, seq: int, batch: int) -> None:
  print(f"`python -m train --preset {preset}`'s train step, batch {batch} x T={seq}, on "
        f"{jax.default_backend()}, through train's persistent compilation cache: cold (a "
        f"fresh process, empty caches), then warm (a second fresh process, the caches the "
        f"first filled):")
  print("| attention | run | trace s | lower s | compile s | all three | first step s | "
        "second step s | programs from the cache |\n|---|---|---|---|---|---|---|---|---|")
  totals = {}
  for attention in ("sage", "full"):
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as root:
      # Triton keeps its own compiled kernels (~/.triton/cache): empty for the cold run too.
      env = {"TRITON_CACHE_DIR": os.path.join(root, "triton")}
      for run in ("cold", "warm"):
        t = _child("step", env=env, attention=attention, preset=preset, seq=seq, batch=batch,
                   cache=os.path.join(root, "jax"))
        totals[attention, run] = _total(t)
        first, second = (t.steps_s + [None, None])[:2]
        print(f"| {attention} | {run} | {_seconds(t.trace_s)} | {_seconds(t.lower_s)} | "
              f"{_seconds(t.compile_s)} | {_seconds(_total(t))} | {_seconds(first)} | "
              f"{_seconds(second)} | {t.cache_hits} |", flush=True)
  for attention in ("sage", "full"):
    print(f"{attention}: warm / cold (trace + lower + compile, what `python -m train` "
          f"reports as compiling the train step): "
          f"{totals[attention, 'warm'] / totals[attention, 'cold']:.2f}")


def _total(t: Timing) -> float:
  return t.trace_s + t.lower_s + (t.compile_s or 0.0)


def _print_kernels(t: Timing, where: str) -> None:
  if t.kernels:
    print(f"\nkernels lowered {where} (seconds of the lowering above):")
    print("| kernel | lowerings | s |\n|---|---|---|")
    for name, times in sorted(t.kernels.items(), key=lambda kv: -sum(kv[1])):
      print(f"| {name} | {len(times)} | {sum(times):.2f} |")


def main(argv: list[str] | None = None) -> None:
  parser = benchmarks.parser(__doc__, "benchmarks.compile_time")
  parser.add_argument("--part", choices=("op", "chain", "step", "cache", "all"), default="all",
                      help="(a) op: the op against jax.nn; (b) chain: n chained calls; "
                           "(c) step: train's train step; (d) cache: train's train step "
                           "cold and warm through the persistent compilation cache "
                           "(c and d are not in all)")
  parser.add_argument("--calls", default="1,2,4,12", help="chain: the values of n")
  parser.add_argument("--cuda", action="store_true",
                      help="chain: lower for CUDA with the H200's kernels, without a GPU")
  parser.add_argument("--preset", default="small", help="step: train's preset (default small)")
  parser.add_argument("--seq-len", type=int, default=2048, help="step: T (default 2048)")
  parser.add_argument("--batch-size", type=int, default=8, help="step: batch (default 8)")
  parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's part and arguments, JSON
  args = parser.parse_args(argv)
  if args.one is not None:
    kwargs = json.loads(args.one)
    print(json.dumps(dataclasses.asdict(_PARTS[kwargs.pop("part")](**kwargs))))
    return
  if args.part in ("op", "all"):
    report_op()
  if args.part in ("chain", "all"):
    report_chain([int(n) for n in args.calls.split(",")], args.cuda)
  if args.part == "step":
    report_step(args.preset, args.seq_len, args.batch_size)
  if args.part == "cache":
    report_cache(args.preset, args.seq_len, args.batch_size)


if __name__ == "__main__":
  main()
