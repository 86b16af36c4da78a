"""`python -m train.study`: short pre-training runs that test the SageBwd
paper's four findings on pre-training, each against the seed spread.

    python -m train.study                          # the four grids at H200 scale
    python -m train.study tokens ds --seeds 3      # two of them, three seeds
    python -m train.study --scale cpu --list       # the plan, without running

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
(train/study_report.py); once a grid is complete, its plots: <grid>-curves.png
(validation loss per cell and seed) and gap-vs-tokens.png (SageBwd minus full
against tokens per step, with the seed spread). A run that fails is logged
and the others go on. A gap "exceeds the seed spread" when
its mean over seeds is larger than the largest range of either cell's final
validation loss over the seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

from train.config import Config, check
from train.metrics import kind, read
from train.rundir import NOT_COMPARED, RunError, holds_run


class StudyError(Exception):
  """A study that cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class Scale:
  """What every run of a study shares, and its tokens-per-step settings.

  `grad_accums` are the settings, smallest first, as micro-batches per step;
  the largest runs `steps_at_largest` steps and the others as many as give
  the same number of tokens.
  """

  config: dict
  grad_accums: tuple[int, ...]
  steps_at_largest: int
  high_lr: float

  def tokens_per_step(self, setting: int) -> int:
    c = self.config
    return c["batch_size"] * c["seq_len"] * self.grad_accums[setting]

  def steps(self, setting: int) -> int:
    return self.steps_at_largest * self.grad_accums[-1] // self.grad_accums[setting]


SCALES = {
    # ~25.7M parameters (D=64), context 1024, bytes; 8K, 16K and 32K tokens
    # per step, 6.6M tokens per run (800, 400 and 200 steps): a few hundred
    # steps in every cell for 800 micro-batches a run, so the four grids fit
    # about two GPU sessions.
    "h200": Scale(dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1408,
                       seq_len=1024, batch_size=8, lr=3e-3, eval_batches=8),
                  grad_accums=(1, 2, 4), steps_at_largest=200, high_lr=1e-2),
    # The plumbing in seconds: 64 and 128 tokens per step, 3 steps at the larger.
    "cpu": Scale(dict(dim=64, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=128, seq_len=32,
                      batch_size=2, lr=3e-3, eval_batches=2),
                 grad_accums=(1, 2), steps_at_largest=3, high_lr=1e-2),
}


@dataclass(frozen=True)
class Cell:
  """One setting of a grid; `setting` indexes the scale's tokens per step
  (-1: the largest). The other fields are train flags."""

  attention: str = "sage"
  setting: int = -1
  qk_norm: bool = True
  high_lr: bool = False
  smooth_k: bool = True
  smooth_q: bool = False
  ds_precision: str = "int8"

  def name(self, scale: Scale) -> str:
    parts = [self.attention, f"tps{scale.tokens_per_step(self.setting)}"]
    parts += ["noqknorm"] * (not self.qk_norm) + [f"lr{scale.high_lr:g}"] * self.high_lr
    parts += ["nosmoothk"] * (not self.smooth_k) + ["smoothq"] * self.smooth_q
    parts += [f"ds{self.ds_precision}"] * (self.ds_precision != "int8")
    return "-".join(parts)

  def largest(self, scale: Scale) -> bool:
    return self.setting % len(scale.grad_accums) == len(scale.grad_accums) - 1


@dataclass(frozen=True)
class Grid:
  """Cells and the comparisons drawn between them: (cell, baseline) indices."""

  name: str
  finding: str
  cells: tuple[Cell, ...]
  comparisons: tuple[tuple[int, int], ...]


def grids(scale: Scale) -> dict[str, Grid]:
  """The four named grids at `scale`."""
  settings = range(len(scale.grad_accums))
  sage, full = Cell(), Cell(attention="full")
  return {
      "tokens": Grid(
          "tokens", "(iii) SageBwd matches full precision at few tokens per step, not at many",
          tuple(Cell(attention=a, setting=s) for s in settings for a in ("sage", "full")),
          tuple((2 * s, 2 * s + 1) for s in settings)),
      "qknorm": Grid(
          "qknorm", "(i) QK-norm is needed for stable training at many tokens per step",
          tuple(Cell(attention=a, qk_norm=n, high_lr=True) for a in ("sage", "full")
                for n in (True, False)),
          ((1, 0), (3, 2), (0, 2), (1, 3))),
      "smoothing": Grid(
          "smoothing", "(iv) K-smoothing is essential, Q-smoothing adds little",
          (sage, Cell(smooth_k=False), Cell(smooth_q=True), full),
          ((1, 0), (2, 0), (0, 3), (1, 3))),
      "ds": Grid(
          "ds", "(ii) the quantization error comes mainly from dS",
          (sage, Cell(ds_precision="bf16"), full),
          ((0, 2), (1, 2), (1, 0))),
  }


def run_config(scale: Scale, cell: Cell, seed: int, out: str, data: list[str]) -> Config:
  """The train configuration of one run of `cell`."""
  steps = scale.steps(cell.setting)
  name = f"{cell.name(scale)}-s{seed}"
  return Config(**{
      **scale.config, "name": name, "out": os.path.join(out, name), "seed": seed,
      "data": list(data), "progress": False, "attention": cell.attention,
      "qk_norm": cell.qk_norm, "smooth_k": cell.smooth_k, "smooth_q": cell.smooth_q,
      "ds_precision": cell.ds_precision,
      "lr": scale.high_lr if cell.high_lr else scale.config["lr"],
      "grad_accum": scale.grad_accums[cell.setting], "steps": steps,
      "warmup": max(1, steps // 10), "eval_every": max(1, steps // 8), "ckpt_every": 0,
      "telemetry_every": max(1, steps // 4) if cell.largest(scale) else 0})


def run_status(cfg: Config) -> str:
  """"done", "diverged" (a non-finite train row), "partial" or "absent"."""
  path = os.path.join(cfg.out, "metrics.jsonl")
  if not os.path.exists(path):
    return "partial" if holds_run(cfg.out) else "absent"
  rows = read(path, warn=lambda message: None)
  if any(kind(r) == "train" and not all(math.isfinite(r.get(k, 0.0)) for k in
                                        ("loss", "grad_norm", "param_norm")) for r in rows):
    return "diverged"
  if any(kind(r) == "eval" and r["step"] == cfg.steps for r in rows):
    return "done"
  return "partial"


def _check_saved(cfg: Config) -> None:
  """StudyError if the run folder holds a run of other settings."""
  path = os.path.join(cfg.out, "config.json")
  if not os.path.exists(path):
    return
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise StudyError(f"cannot read {path}: {e}") from e
  now = dataclasses.asdict(cfg)
  differ = [k for k, v in now.items()
            if k in saved and k not in NOT_COMPARED and v is not None and saved[k] != v]
  if differ:
    raise StudyError(
        f"{cfg.out} holds a run with other settings ({', '.join(differ)}): this study's "
        f"--out holds another study; give another --out")


def plan(chosen: list[Grid], scale: Scale, seeds: int, out: str,
         data: list[str]) -> list[tuple[Cell, Config]]:
  """Every run of the chosen grids, once each, in grid, cell, seed order."""
  runs, seen = [], set()
  for grid in chosen:
    for cell in grid.cells:
      for seed in range(seeds):
        cfg = run_config(scale, cell, seed, out, data)
        if cfg.out not in seen:
          seen.add(cfg.out)
          runs.append((cell, cfg))
  return runs


def run(chosen: list[Grid], scale: Scale, seeds: int, out: str, data: list[str],
        log=print, compile_cache: str | None = None) -> list[str]:
  """Runs what is missing of the chosen grids, each run in a fresh process
  with jax's persistent compilation cache in `compile_cache` (None: none),
  rewriting the summary after each run; returns the paths of the summary
  files and plots. A run that fails is logged and the others go on;
  StudyError at the end names it. This process imports no jax."""
  from train import data as train_data, study_child, study_report

  runs = plan(chosen, scale, seeds, out, data)
  for _, cfg in runs:
    check(cfg)
    _check_saved(cfg)
  todo = [(cell, cfg) for cell, cfg in runs if run_status(cfg) not in ("done", "diverged")]
  tokens = sum(cfg.tokens_per_step * cfg.steps for _, cfg in todo)
  log(f"study {out}: {len(runs)} runs, {len(runs) - len(todo)} already finished; "
      f"{len(todo)} to run, {tokens / 1e6:.1f}M tokens")
  os.makedirs(out, exist_ok=True)
  if todo:  # a bad --data ends the study here, not each run; the runs read it again
    train_data.load(todo[0][1].data, todo[0][1].val_fraction, todo[0][1].seq_len)
  drawn = {g.name for g in chosen if _finished(g, scale, seeds, out, data)}
  failed = []
  for i, (_, cfg) in enumerate(todo, 1):
    t0 = time.perf_counter()
    resume = bool(holds_run(cfg.out))
    log(f"[{i}/{len(todo)}] {os.path.basename(cfg.out)}: {cfg.steps} steps of "
        f"{cfg.tokens_per_step:,} tokens" + (" (starting over: unfinished)" if resume else ""))
    try:
      result = study_child.train(dataclasses.replace(cfg, resume=resume), compile_cache)
      outcome = f"val_loss {result['val_loss']:.4f}"
    except study_child.Diverged as e:
      outcome = f"diverged: {e}"
    except study_child.Failed as e:  # one failed run, out of memory say, stops no other
      failed.append(os.path.basename(cfg.out))
      outcome = f"FAILED: {e}"
    log(f"[{i}/{len(todo)}] {os.path.basename(cfg.out)}: {outcome} "
        f"({time.perf_counter() - t0:.0f}s)")
    study_report.write_tables(chosen, scale, seeds, out, data)
    for grid in chosen:  # a stopped study keeps the plots of its finished grids
      if grid.name not in drawn and _finished(grid, scale, seeds, out, data):
        drawn.add(grid.name)
        study_report.plot_grid(grid, scale, seeds, out, data)
  paths = study_report.write_all(chosen, scale, seeds, out, data)
  if failed:
    raise StudyError(f"{len(failed)} run(s) failed: {', '.join(failed)} (the log above says "
                     f"why); the rest is in {out}, and the same command retries them")
  return paths


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
                compile_cache=None if cache == "none" else cache)
  except (StudyError, RunError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  print("\n".join(paths), file=sys.stderr)


if __name__ == "__main__":
  main()
