"""`python -m train.study`: short pre-training runs that test the SageBwd
paper's four findings on pre-training, each against the seed spread.

    python -m train.study                          # the four grids at H200 scale
    python -m train.study tokens ds --seeds 3      # two of them, three seeds
    python -m train.study --scale cpu --list       # the plan, without running
    python -m train.study --jobs 4                 # four runs at a time on one GPU

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

Every run is an ordinary run folder, <out>/<cell>-s<seed> (`python -m
train.plot` draws it), trained by `train.loop.train` in a fresh process of
its own (train/study_child.py says why: mostly the compile cache), without
checkpoints. Runs at the largest setting record telemetry four times
(`--telemetry-every`). A run that finished or diverged is never run again, so
the same command resumes a stopped study; an unfinished one starts over.
After each run <out>/summary.md, summary.csv and gaps.csv are rewritten
(train/study_report.py), for the chosen grids and every other grid with runs
in <out>, so a study run grid by grid keeps one summary; once a grid is
complete, its plots: <grid>-curves.png (validation loss per cell and seed)
and gap-vs-tokens.png (SageBwd minus full against tokens per step, with the
seed spread). A run that fails is logged
and the others go on. A gap "exceeds the seed spread" when
its mean over seeds is larger than the largest range of either cell's final
validation loss over the seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from train.config import Config, check
from train.rundir import RunError, changed_fields, holds_run, saved_config
from train.study_plan import SCALES, Grid, Scale, StudyError, grids, plan, run_status


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


def run(chosen: list[Grid], scale: Scale, seeds: int, out: str, data: list[str],
        log=functools.partial(print, flush=True), compile_cache: str | None = None,
        jobs: int = 1) -> list[str]:
  """Runs what is missing of the chosen grids, `jobs` at a time, each run in a
  fresh process with jax's persistent compilation cache in `compile_cache`
  (None: none), rewriting the summary after each run; returns the paths of
  the summary files and plots. A run that fails is logged and the others go
  on; StudyError at the end names it. This process imports no jax."""
  from train import data as train_data, study_child, study_report

  if jobs < 1:
    raise ValueError(f"--jobs must be at least 1, got {jobs}")
  runs = plan(chosen, scale, seeds, out, data)
  for _, cfg in runs:
    check(cfg)
    _check_saved(cfg)
  todo = [cfg for _, cfg in runs if run_status(cfg) not in ("done", "diverged")]
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
  failed, lock = [], threading.Lock()

  def say(message: str) -> None:  # whole lines, whichever run's thread speaks
    with lock:
      log(message)

  def train(i: int, cfg: Config) -> tuple[str, float]:
    t0 = time.perf_counter()
    resume = bool(holds_run(cfg.out))
    say(f"[{i}/{len(todo)}] {os.path.basename(cfg.out)}: {cfg.steps} steps of "
        f"{cfg.tokens_per_step:,} tokens" + (" (starting over: unfinished)" if resume else ""))
    try:
      result = study_child.train(dataclasses.replace(cfg, resume=resume), compile_cache,
                                 share=jobs > 1)
      outcome = f"val_loss {result['val_loss']:.4f}"
    except study_child.Diverged as e:
      outcome = f"diverged: {e}"
    except study_child.Failed as e:  # one failed run, out of memory say, stops no other
      failed.append(os.path.basename(cfg.out))
      outcome = f"FAILED: {e}"
    return outcome, time.perf_counter() - t0

  with ThreadPoolExecutor(jobs) as pool:
    pending = {pool.submit(train, i, cfg): (i, cfg) for i, cfg in enumerate(todo, 1)}
    while pending:
      done, _ = wait(pending, return_when=FIRST_COMPLETED)
      for future in done:
        i, cfg = pending.pop(future)
        outcome, seconds = future.result()
        say(f"[{i}/{len(todo)}] {os.path.basename(cfg.out)}: {outcome} ({seconds:.0f}s)")
      study_report.write_tables(reported, scale, seeds, out, data)
      for grid in chosen:  # a stopped study keeps the plots of its finished grids
        if grid.name not in plots and _finished(grid, scale, seeds, out, data):
          plots[grid.name] = study_report.plot_grid(grid, scale, seeds, out, data)
  paths = study_report.write_tables(reported, scale, seeds, out, data)
  for grid in chosen:
    if grid.name not in plots:
      plots[grid.name] = study_report.plot_grid(grid, scale, seeds, out, data)
    paths += plots[grid.name]
  if failed:
    raise StudyError(f"{len(failed)} run(s) failed: {', '.join(failed)} (the log above says "
                     f"why); the rest is in {out}, and the same command retries them")
  return paths


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
  p = argparse.ArgumentParser(prog="python -m train.study", description=doc[0],
                              epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("grids", nargs="*", metavar="GRID",
                 help="tokens, qknorm, smoothing, ds (default: all four, in that order)")
  p.add_argument("--scale", choices=list(SCALES), default="h200",
                 help="model, context and tokens per step: h200 (~25.7M parameters, "
                      "context 1024, 8K/16K/32K tokens per step, 6.6M tokens per run) or "
                      "cpu (a 1-layer toy, seconds per run); default h200")
  p.add_argument("--seeds", type=int, default=2, help="seeds per cell (default 2)")
  p.add_argument("--steps", type=int, default=None,
                 help="steps at the largest tokens per step (the other settings run as many "
                      "tokens); default: the scale's, h200 200, cpu 3")
  p.add_argument("--out", default=None, help="the study folder (default runs/study-<scale>)")
  p.add_argument("--data", nargs="+", default=[], metavar="PATH",
                 help="as train's --data (default: this Python's stdlib sources)")
  p.add_argument("--jobs", type=int, default=1,
                 help="runs at a time, sharing the GPU, each taking memory as it needs it "
                      "(default 1); a small model leaves an H200 mostly idle, so 3-4 finish "
                      "the grids sooner")
  p.add_argument("--list", action="store_true", help="print the runs and their state; run none")
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
  if args.seeds < 1:
    p.error(f"--seeds must be >= 1, got {args.seeds}")
  if args.steps is not None:
    if args.steps < 1:
      p.error(f"--steps must be >= 1, got {args.steps}")
    scale = dataclasses.replace(scale, steps_at_largest=args.steps)
  chosen = [named[g] for g in (args.grids or named)]
  out = args.out or os.path.join("runs", f"study-{args.scale}")
  if args.list:
    runs = plan(chosen, scale, args.seeds, out, args.data)
    for _, cfg in runs:
      print(f"{os.path.basename(cfg.out)}: {cfg.steps} steps x {cfg.tokens_per_step:,} "
            f"tokens, lr {cfg.lr:g}, telemetry every {cfg.telemetry_every or '-'}: "
            f"{run_status(cfg)}")
    print(f"{len(runs)} runs of {len({cell for cell, _ in runs})} cells, "
          f"{sum(c.steps * c.tokens_per_step for _, c in runs) / 1e6:.1f}M tokens")
    return
  cache = args.compile_cache or os.path.join(out, "jax-cache")
  try:
    paths = run(chosen, scale, args.seeds, out, args.data,
                compile_cache=None if cache == "none" else cache, jobs=args.jobs)
  except (StudyError, RunError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  print("\n".join(paths), file=sys.stderr)


if __name__ == "__main__":
  main()
