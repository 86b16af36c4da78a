"""`python -m train.study`: short pre-training runs that test the SageBwd
paper's four findings on pre-training, each gap with a 95% interval over
seeds, paired by seed.

    python -m train.study                          # every grid at H200 scale
    python -m train.study tokens ds --seeds 3      # two of them, three seeds
    python -m train.study --scale cpu --list       # the plan, without running
    python -m train.study --jobs 4                 # four runs at a time on one GPU
    python -m train.study tokens smoothing ds --scale h200-d128 --jobs 4
                                                   # the second round: D=128, 6 seeds

Grids (a cell is one setting, run once per seed; a cell that several grids
share runs once):

- tokens: SageBwd and full-precision attention at each tokens-per-step
  setting of the scale, with the same token budget (fewer steps at more
  tokens per step). Finding (iii): SageBwd matches full precision at few
  tokens per step and falls behind at many.
- qknorm: with and without QK-norm, SageBwd and full precision, at the
  largest setting and a high learning rate: divergence, max attention logit.
  Finding (i): QK-norm is needed for stable training at many tokens per step.
- smoothing: SageBwd with K-smoothing off, and with Q-smoothing on, against
  the default (K on, Q off) at the largest setting. Finding (iv): K-smoothing
  is essential, Q-smoothing adds little.
- ds: SageBwd with its INT8 dS products and with them in 16 bits
  (`--ds-precision bf16`) against full precision at the largest setting.
  Finding (ii): the error comes mainly from dS.
- fp8: `--quantization int8_fp8` (FP8 P and dS products) beside SageBwd's
  INT8 and full precision at the second and the largest setting (the
  `tokens` grid's runs there): the mode trains as well as both.

Every run is an ordinary run folder, <out>/<cell>-s<seed> (`python -m
train.plot` draws it), trained by `train.loop.train` in a fresh process of
its own (train/study_child.py says why: mostly the compile cache), without
checkpoints, or, at a scale that saves some (h200-d128), with its
checkpoints deleted once it finished. Runs at the largest setting record
telemetry four times (`--telemetry-every`). A run that finished or diverged
is never run again, so the same command resumes a stopped study; an
unfinished one resumes from its last checkpoint, or starts over without one.
After each run <out>/summary.md, summary.csv and gaps.csv are rewritten
(train/study_report.py), for the chosen grids and every other grid with runs
in <out>, so a study run grid by grid keeps one summary; once a grid is
complete, its plots: <grid>-curves.png (validation loss per cell and seed)
and gap-vs-tokens.png (SageBwd minus full against tokens per step, with the
95% intervals). A run that fails is logged and the others go on. Each gap
of a grid has a place its finding puts it (above 0, below 0, or near 0);
the summary says "supports" when the gap's whole 95% interval lies there,
"contradicts" when none of it does, "cannot tell" otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from train.cli import ArgumentParser
from train.config import Config, check
from train.rundir import RunError, changed_fields, holds_run, saved_config
from train.study_plan import (SCALES, Cell, Grid, Scale, StudyError, grids, plan, run_config,
                              run_status)


def _check_saved(cfg: Config) -> None:
  """StudyError if the run folder holds a run of other settings."""
  try:
    saved = saved_config(cfg.out)
  except RunError as e:
    raise StudyError(str(e)) from e
  differ = [] if saved is None else changed_fields(cfg, saved, unresolved_match=True)
  if differ:
    raise StudyError(
        f"{cfg.out} holds a run with other settings ({', '.join(differ)}): this study's "
        f"--out holds another study; give another --out")


class Stopping:
  """The study's stop requests. The first SIGINT or SIGTERM goes on to every
  run under way (`study_child.STOP_SIGNAL`: each saves its last completed
  step and ends) and starts no new run; a second ends the runs (SIGKILL) and
  the study at once. `command`: the study's own, which resumes it."""

  def __init__(self, command: str):
    self.command = command
    self.signum: int | None = None

  def _handle(self, signum: int, frame) -> None:
    del frame
    from train import study_child
    if self.signum is None:
      self.signum = signum
      study_child.signal_runs(study_child.STOP_SIGNAL)
      return
    study_child.signal_runs(signal.SIGKILL)
    print(f"stopped by {signal.Signals(signum).name} twice: the runs under way were "
          f"killed, each keeps its newest checkpoint; resume with: {self.command}",
          file=sys.stderr, flush=True)
    os._exit(128 + signum)

  @classmethod
  @contextlib.contextmanager
  def handling(cls, command: str):
    stopping = cls(command)
    previous = {s: signal.signal(s, stopping._handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
      yield stopping
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)


class Interrupted(Exception):
  """The study stopped at a signal (its line); `signum` the signal."""

  def __init__(self, line: str, signum: int):
    super().__init__(line)
    self.signum = signum


def run(chosen: list[Grid], scale: Scale, seeds: int, out: str, data: list[str],
        log=functools.partial(print, flush=True), compile_cache: str | None = None,
        jobs: int = 1, start_within: float | None = None,
        stopping: Stopping | None = None) -> list[str]:
  """Runs what is missing of the chosen grids, `jobs` at a time, each run in a
  fresh process with jax's persistent compilation cache in `compile_cache`
  (None: none), rewriting the summary after each run; returns the paths of
  the summary files and plots. No run starts once `start_within` minutes have
  passed (None: no limit), so that a job with a wall-time limit ends on finished
  runs. A run that fails is logged and the others go on; StudyError at the
  end names it. Once `stopping` has a signal, no run starts, the runs under
  way save their step and end, and Interrupted says how to resume. This
  process imports no jax."""
  from train import data as train_data, study_child, study_report

  if jobs < 1:
    raise ValueError(f"--jobs must be at least 1, got {jobs}")
  runs = plan(chosen, scale, seeds, out, data)
  for _, cfg in runs:
    check(cfg)
    _check_saved(cfg)
  todo = [cfg for _, cfg in runs if run_status(cfg) not in ("done", "diverged")]
  for _, cfg in runs:  # a study stopped between a run's end and its clean-up
    if cfg not in todo:
      _drop_checkpoints(cfg)
  if jobs > 1:  # every first seed before any second, which then finds its compiles cached
    todo.sort(key=lambda cfg: cfg.seed)
  tokens = sum(cfg.tokens_per_step * cfg.steps for cfg in todo)
  log(f"study {out}: {len(runs)} runs, {len(runs) - len(todo)} already finished; "
      f"{len(todo)} to run, {tokens / 1e6:.1f}M tokens"
      + (f", {jobs} at a time" if jobs > 1 else ""))
  os.makedirs(out, exist_ok=True)
  if todo:  # a bad --data ends the study here, not each run; the runs read it again
    train_data.load(todo[0].data, todo[0].val_fraction, todo[0].seq_len)
  reported = _reported(chosen, scale, seeds, out, data)
  plots: dict[str, list[str]] = {}  # each grid's, drawn once it is complete
  failed, skipped, stopped, lock = [], [], [], threading.Lock()
  start = time.monotonic()
  interrupted = lambda: stopping is not None and stopping.signum is not None

  def say(message: str) -> None:  # whole lines, whichever run's thread speaks
    with lock:
      log(message)

  def train(i: int, cfg: Config) -> tuple[str, float] | None:
    if interrupted():
      return None
    if start_within is not None and time.monotonic() - start > 60 * start_within:
      skipped.append(cfg)
      return None
    t0 = time.perf_counter()
    resume = bool(holds_run(cfg.out))
    say(f"[{i}/{len(todo)}] {os.path.basename(cfg.out)}: {cfg.steps} steps of "
        f"{cfg.tokens_per_step:,} tokens" + (" (unfinished: resuming)" if resume else ""))
    try:
      result = study_child.train(dataclasses.replace(cfg, resume=resume), compile_cache,
                                 share=jobs > 1)
      outcome = f"val_loss {result['val_loss']:.4f}"
      _drop_checkpoints(cfg)
    except study_child.Diverged as e:
      outcome = f"diverged: {e}"
      _drop_checkpoints(cfg)
    except study_child.Interrupted as e:
      stopped.append(cfg)
      outcome = f"interrupted: {str(e).split('; resume with:')[0]}"
    except study_child.Failed as e:  # one failed run, out of memory say, stops no other
      if interrupted():  # its process ended at the signal before it could answer
        stopped.append(cfg)
        outcome = f"interrupted ({e})"
      else:
        failed.append(os.path.basename(cfg.out))
        outcome = f"FAILED: {e}"
    return outcome, time.perf_counter() - t0

  with ThreadPoolExecutor(jobs) as pool:
    pending = {pool.submit(train, i, cfg): (i, cfg) for i, cfg in enumerate(todo, 1)}
    while pending:
      done, _ = wait(pending, return_when=FIRST_COMPLETED)
      for future in done:
        i, cfg = pending.pop(future)
        if future.result() is None:
          continue
        outcome, seconds = future.result()
        say(f"[{i}/{len(todo)}] {os.path.basename(cfg.out)}: {outcome} ({seconds:.0f}s)")
      study_report.write_tables(reported, scale, seeds, out, data)
      if interrupted():
        continue  # the runs under way are stopping: no plots, which take a while
      for grid in chosen:  # a stopped study keeps the plots of its finished grids
        if grid.name not in plots and _finished(grid, scale, seeds, out, data):
          plots[grid.name] = study_report.plot_grid(grid, scale, seeds, out, data)
  if interrupted():
    raise Interrupted(
        f"stopped by {signal.Signals(stopping.signum).name}: {len(stopped)} run(s) under way "
        f"stopped, their completed steps saved; resume with: {stopping.command}",
        stopping.signum)
  paths = study_report.write_tables(reported, scale, seeds, out, data)
  for grid in chosen:
    if grid.name not in plots:
      plots[grid.name] = study_report.plot_grid(grid, scale, seeds, out, data)
    paths += plots[grid.name]
  if skipped:
    log(f"{len(skipped)} run(s) not started: --start-within {start_within:g} minutes had "
        f"passed; the same command runs them")
  if failed:
    raise StudyError(f"{len(failed)} run(s) failed: {', '.join(failed)} (the log above says "
                     f"why); the rest is in {out}, and the same command retries them")
  return paths


def _drop_checkpoints(cfg: Config) -> None:
  """A finished run's checkpoints go: a study keeps metrics, not weights."""
  for name in ("checkpoints", "checkpoints-skipped"):
    shutil.rmtree(os.path.join(cfg.out, name), ignore_errors=True)


def _reported(chosen: list[Grid], scale: Scale, seeds: int, out: str,
              data: list[str]) -> list[Grid]:
  """The chosen grids, then every other named grid with a run in `out`: a
  study resumed grid by grid keeps one summary of all of them."""
  names = {g.name for g in chosen}
  return list(chosen) + [g for g in grids(scale).values() if g.name not in names and any(
      holds_run(cfg.out) for _, cfg in plan([g], scale, seeds, out, data))]


def _finished(grid: Grid, scale: Scale, seeds: int, out: str, data: list[str]) -> bool:
  return all(run_status(cfg) in ("done", "diverged")
             for _, cfg in plan([grid], scale, seeds, out, data))


def parser() -> argparse.ArgumentParser:
  doc = __doc__.split("\n\n", 1)
  p = ArgumentParser(prog="python -m train.study", description=doc[0],
                     epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("grids", nargs="*", metavar="GRID",
                 help="tokens, qknorm, smoothing, ds (default: all four, in that order)")
  p.add_argument("--scale", choices=list(SCALES), default="h200",
                 help="model, context and tokens per step: h200 (~25.7M parameters, "
                      "8 heads of 64, context 1024, 8K/16K/32K tokens per step, 6.6M tokens "
                      "per run, 2 seeds), h200-d128 (the same width in 4 heads of 128, "
                      "16K/32K/65K/131K tokens per step, 13.1M tokens per run, 6 seeds) or "
                      "cpu (a 1-layer toy, seconds per run); default h200")
  p.add_argument("--seeds", type=int, default=None,
                 help="seeds per cell (default: the scale's, h200 2, h200-d128 6, cpu 2)")
  p.add_argument("--steps", type=int, default=None,
                 help="steps at the largest tokens per step (the other settings run as many "
                      "tokens); default: the scale's, h200 200, h200-d128 100, cpu 3")
  p.add_argument("--out", default=None, help="the study folder (default runs/study-<scale>)")
  p.add_argument("--data", nargs="+", default=[], metavar="PATH",
                 help="as train's --data (default: this Python's stdlib sources)")
  p.add_argument("--jobs", type=int, default=1,
                 help="runs at a time, sharing the GPU, each taking memory as it needs it "
                      "(default 1); a small model leaves an H200 mostly idle, so 3-4 finish "
                      "the grids sooner")
  p.add_argument("--list", action="store_true", help="print the runs and their state; run none")
  p.add_argument("--start-within", type=float, default=None, metavar="MINUTES",
                 help="start no run after this many minutes (runs under way finish), so "
                      "that a job with a wall-time limit ends on finished runs (default: "
                      "no limit)")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="where compiled steps are kept, so that a cell's second seed and a "
                      "resumed study do not compile again (default <out>/jax-cache; 'none': "
                      "nowhere)")
  return p


def main(argv: list[str] | None = None) -> None:
  p = parser()
  args = p.parse_args(argv)
  scale = SCALES[args.scale]
  named = grids(scale)
  unknown = [g for g in args.grids if g not in named]
  if unknown:
    p.error(f"unknown grid(s) {', '.join(unknown)}: choose from {', '.join(named)}")
  seeds = scale.seeds if args.seeds is None else args.seeds
  if seeds < 1:
    p.error(f"--seeds must be >= 1, got {seeds}")
  if args.start_within is not None and not args.start_within > 0:
    p.error(f"--start-within must be a positive number of minutes, got {args.start_within}")
  if args.steps is not None:
    if args.steps < 1:
      p.error(f"--steps must be >= 1, got {args.steps}")
    scale = dataclasses.replace(scale, steps_at_largest=args.steps)
  chosen = [named[g] for g in (args.grids or named)]
  out = args.out or os.path.join("runs", f"study-{args.scale}")
  if args.list:
    runs = plan(chosen, scale, seeds, out, args.data)
    cfg = run_config(scale, Cell(), 0, out, args.data)
    print(f"scale {args.scale}: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads of "
          f"{cfg.dim // cfg.n_heads}, context {cfg.seq_len}; tokens per step "
          f"{', '.join(f'{scale.tokens_per_step(s):,}' for s in range(len(scale.grad_accums)))}"
          f" ({scale.steps(0)} down to {scale.steps(-1)} steps); {seeds} seeds per cell")
    status = {c.out: run_status(c) for _, c in runs}
    for _, c in runs:
      print(f"{os.path.basename(c.out)}: {c.steps} steps x {c.tokens_per_step:,} "
            f"tokens = {c.steps * c.tokens_per_step / 1e6:.1f}M, lr {c.lr:g}, telemetry every "
            f"{c.telemetry_every or '-'}, checkpoint every {c.ckpt_every or '-'}: "
            f"{status[c.out]}")
    left = [c for _, c in runs if status[c.out] not in ("done", "diverged")]
    print(f"{len(runs)} runs of {len({cell for cell, _ in runs})} cells, "
          f"{sum(c.steps * c.tokens_per_step for _, c in runs) / 1e6:.1f}M tokens; "
          f"{len(left)} runs, {sum(c.steps * c.tokens_per_step for c in left) / 1e6:.1f}M "
          f"tokens left")
    return
  cache = args.compile_cache or os.path.join(out, "jax-cache")
  from train import study_child
  command = shlex.join(["python", "-m", "train.study",
                        *(sys.argv[1:] if argv is None else argv)])
  study_child.resume_command = command
  with Stopping.handling(command) as stopping:
    try:
      paths = run(chosen, scale, seeds, out, args.data,
                  compile_cache=None if cache == "none" else cache, jobs=args.jobs,
                  start_within=args.start_within, stopping=stopping)
    except Interrupted as e:
      print(e, file=sys.stderr, flush=True)
      raise SystemExit(128 + e.signum)
    except (StudyError, RunError, ValueError) as e:
      raise SystemExit(f"error: {e}")
  print("\n".join(paths), file=sys.stderr)


if __name__ == "__main__":
  main()
