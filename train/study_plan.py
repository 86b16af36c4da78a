"""What a study runs: its scales, cells and grids, the gaps each grid draws
and where its finding puts them, each run's train configuration, and whether
a run is done (`python -m train.study` runs them, train/study_report.py
tabulates them and judges each gap against its finding)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from train.config import Config
from train.metrics import kind, read
from train.rundir import holds_run


class StudyError(Exception):
  """A study that cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class Scale:
  """What every run of a study shares, and its tokens-per-step settings.

  `grad_accums` are the settings, smallest first, as micro-batches per step;
  the largest runs `steps_at_largest` steps and the others as many as give
  the same number of tokens. `seeds`: the default seeds per cell.
  `checkpoints`: how many a run saves, so that a study stopped mid-run (a
  job's wall-time limit) resumes it from the last, not from step 0; 0: none.
  The study deletes a finished run's checkpoints.
  """

  config: dict
  grad_accums: tuple[int, ...]
  steps_at_largest: int
  high_lr: float
  seeds: int = 2
  checkpoints: int = 0

  def tokens_per_step(self, setting: int) -> int:
    c = self.config
    return c["batch_size"] * c["seq_len"] * self.grad_accums[setting]

  def steps(self, setting: int) -> int:
    return self.steps_at_largest * self.grad_accums[-1] // self.grad_accums[setting]


SCALES = {
    # ~25.7M parameters (D=64), context 1024, bytes; 8K, 16K and 32K tokens
    # per step, 6.6M tokens per run (800, 400 and 200 steps): a few hundred
    # steps in every cell for 800 micro-batches a run, so the four grids take
    # well under an hour of one H200 (24 of their 26 runs in about 15 minutes,
    # four at a time, 2026-12-01).
    "h200": Scale(dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1408,
                       seq_len=1024, batch_size=8, lr=3e-3, eval_batches=8),
                  grad_accums=(1, 2, 4), steps_at_largest=200, high_lr=1e-2),
    # The second round: head dim 128 (4 heads of the same width),
    # 16K to 131K tokens per step (micro-batches of 16 x 1024, 1 to 8 per
    # step), 13.1M tokens per run (800 down to 100 steps), six seeds to
    # resolve gaps the first round's two could not; runs long enough to span
    # a job's wall-time limit resume from one of four checkpoints.
    "h200-d128": Scale(dict(dim=512, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=1408,
                            seq_len=1024, batch_size=16, lr=3e-3, eval_batches=8),
                       grad_accums=(1, 2, 4, 8), steps_at_largest=100, high_lr=1e-2, seeds=6,
                       checkpoints=4),
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
  quantization: str = "int8"

  def name(self, scale: Scale) -> str:
    parts = [self.attention, f"tps{scale.tokens_per_step(self.setting)}"]
    parts += ["noqknorm"] * (not self.qk_norm) + [f"lr{scale.high_lr:g}"] * self.high_lr
    parts += ["nosmoothk"] * (not self.smooth_k) + ["smoothq"] * self.smooth_q
    parts += [f"ds{self.ds_precision}"] * (self.ds_precision != "int8")
    parts += [self.quantization.replace("_", "")] * (self.quantization != "int8")
    return "-".join(parts)

  def largest(self, scale: Scale) -> bool:
    return self.setting % len(scale.grad_accums) == len(scale.grad_accums) - 1


# Final validation losses this close (nats per token) count as a match: the
# finding "SageBwd matches full precision" puts the gap within +-NEAR.
NEAR = 0.02
# Where a finding puts a gap: its region, closed at NEAR, open at 0.
EXPECT = {"above": "> 0", "below": "< 0", "near": f"within +-{NEAR:g}"}


@dataclass(frozen=True)
class Gap:
  """`metric` of cell minus `weight` times baseline's, seed by seed, and
  where the grid's finding puts it (a key of EXPECT). `metric`: val_loss (the
  final validation loss) or a telemetry key (its last record, largest over
  layers); a weight of 0.5 on an error asks whether the cell removes most of
  the baseline's."""

  cell: int
  baseline: int
  expect: str
  metric: str = "val_loss"
  weight: float = 1.0

  def label(self, names: list[str]) -> str:
    times = "" if self.weight == 1 else f"{self.weight:g} x "
    metric = "" if self.metric == "val_loss" else f"{self.metric}: "
    return f"{metric}{names[self.cell]} - {times}{names[self.baseline]}"


@dataclass(frozen=True)
class Grid:
  """Cells and the gaps drawn between them; `per_layer`: the summary gives
  the last telemetry layer by layer."""

  name: str
  finding: str
  cells: tuple[Cell, ...]
  comparisons: tuple[Gap, ...]
  per_layer: bool = False


def grids(scale: Scale) -> dict[str, Grid]:
  """The five named grids at `scale`. The paper has SageBwd match full
  precision up to 260K tokens per step (falling behind at 2.1M), beyond every
  setting of these scales: so every SageBwd-minus-full gap is expected near 0.
  `fp8` puts quantization="int8_fp8" beside both at the second and the largest
  setting, sharing the `tokens` grid's runs there."""
  settings = range(len(scale.grad_accums))
  sage, full = Cell(), Cell(attention="full")
  fp8_settings = sorted({min(1, len(settings) - 1), len(settings) - 1})
  return {
      "tokens": Grid(
          "tokens", "(iii) SageBwd matches full precision at few tokens per step, not at many",
          tuple(Cell(attention=a, setting=s) for s in settings for a in ("sage", "full")),
          tuple(Gap(2 * s, 2 * s + 1, "near") for s in settings)),
      "qknorm": Grid(
          "qknorm", "(i) QK-norm is needed for stable training at many tokens per step",
          tuple(Cell(attention=a, qk_norm=n, high_lr=True) for a in ("sage", "full")
                for n in (True, False)),
          (Gap(1, 0, "above"), Gap(3, 2, "above"), Gap(0, 2, "near"), Gap(1, 3, "above"))),
      "smoothing": Grid(
          "smoothing", "(iv) K-smoothing is essential, Q-smoothing adds little",
          (sage, Cell(smooth_k=False), Cell(smooth_q=True), full),
          (Gap(1, 0, "above"), Gap(2, 0, "near"), Gap(0, 3, "near"), Gap(1, 3, "above"))),
      "ds": Grid(
          "ds", "(ii) the quantization error comes mainly from dS",
          (sage, Cell(ds_precision="bf16"), full),
          (Gap(0, 2, "near"), Gap(1, 2, "near"), Gap(1, 0, "below"),
           Gap(1, 0, "below", "dq_rel_l2", 0.5), Gap(1, 0, "below", "dk_rel_l2", 0.5)),
          per_layer=True),
      "fp8": Grid(
          "fp8", "FP8 P and dS products (int8_fp8) train as well as INT8 and full precision",
          tuple(Cell(attention=a, setting=s, quantization=q) for s in fp8_settings
                for a, q in (("sage", "int8"), ("sage", "int8_fp8"), ("full", "int8"))),
          tuple(gap for i in range(len(fp8_settings))
                for gap in (Gap(3 * i + 1, 3 * i + 2, "near"), Gap(3 * i, 3 * i + 2, "near"),
                            Gap(3 * i + 1, 3 * i, "near")))),
  }


def run_config(scale: Scale, cell: Cell, seed: int, out: str, data: list[str]) -> Config:
  """The train configuration of one run of `cell`."""
  steps = scale.steps(cell.setting)
  name = f"{cell.name(scale)}-s{seed}"
  return Config(**{
      **scale.config, "name": name, "out": os.path.join(out, name), "seed": seed,
      "data": list(data), "progress": False, "attention": cell.attention,
      "qk_norm": cell.qk_norm, "smooth_k": cell.smooth_k, "smooth_q": cell.smooth_q,
      "ds_precision": cell.ds_precision, "quantization": cell.quantization,
      "lr": scale.high_lr if cell.high_lr else scale.config["lr"],
      "grad_accum": scale.grad_accums[cell.setting], "steps": steps,
      "warmup": max(1, steps // 10), "eval_every": max(1, steps // 8),
      "ckpt_every": max(1, steps // scale.checkpoints) if scale.checkpoints else 0,
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
