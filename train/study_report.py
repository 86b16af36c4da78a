"""The report of a study (train/study.py): tables and plots from its runs'
metrics.jsonl files, rewritten whole each time.

- summary.md: per grid, a table of cells (final validation loss by seed,
  mean and range; at the largest setting the last telemetry: max attention
  logit, dQ and dK relative L2, largest over layers, mean over seeds) and
  one of comparisons (cell minus baseline, seed by seed, against the seed
  spread).
- summary.csv: one row per grid, cell and seed; gaps.csv: one per comparison.
- <grid>-curves.png and, with the tokens grid, gap-vs-tokens.png.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass, field

from train.metrics import kind, read
from train.study_plan import Grid, Scale, run_config, run_status

TELEMETRY = ("max_logit", "o_rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2", "ds_rel_l2")


@dataclass
class Result:
  """One run as its metrics tell it."""

  name: str
  seed: int
  status: str  # done, diverged, partial, absent
  val_loss: float | None = None  # at the last step, when done
  diverged_at: int | None = None
  curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, val_loss)
  telemetry: dict[str, float] = field(default_factory=dict)  # last row, max over layers
  tokens_per_s: float | None = None  # median over the steps


def result(cfg, seed: int) -> Result:
  status = run_status(cfg)
  r = Result(os.path.basename(cfg.out), seed, status)
  path = os.path.join(cfg.out, "metrics.jsonl")
  if status == "absent" or not os.path.exists(path):
    return r
  rows = read(path, warn=lambda message: None)
  r.curve = [(row["tokens"], row["val_loss"]) for row in rows if kind(row) == "eval"]
  train = [row for row in rows if kind(row) == "train"]
  if status == "done":
    r.val_loss = next(row["val_loss"] for row in rows
                      if kind(row) == "eval" and row["step"] == cfg.steps)
  if status == "diverged":
    r.diverged_at = next(row["step"] for row in train if not math.isfinite(row["loss"])
                         or not math.isfinite(row.get("grad_norm", 0.0)))
  telemetry = [row for row in rows if kind(row) == "telemetry"]
  if telemetry:
    r.telemetry = {k: max(telemetry[-1][k]) for k in TELEMETRY if k in telemetry[-1]}
  speeds = [row["tokens_per_s"] for row in train if "tokens_per_s" in row]
  r.tokens_per_s = statistics.median(speeds) if speeds else None
  return r


def compare(cell: list[Result], baseline: list[Result]) -> dict:
  """Gap of `cell` over `baseline` seed by seed, against the seed spread
  (the larger range of the two cells' final losses over the seeds). A seed
  gives both cells the same initialisation and batches, so the gaps are
  paired: `gap_range` (their own range) says how consistent they are, which
  the seed spread, moved by what both cells share, does not."""
  diverged = [name for name, rs in (("cell", cell), ("baseline", baseline))
              if any(r.status == "diverged" for r in rs)]
  pairs = [(a.val_loss, b.val_loss) for a, b in zip(cell, baseline)
           if a.val_loss is not None and b.val_loss is not None]
  gaps = [a - b for a, b in pairs]
  spread = max((max(x) - min(x) for x in zip(*pairs)), default=0.0) if len(pairs) > 1 else None
  mean = statistics.fmean(gaps) if gaps else None
  gap_range = max(gaps) - min(gaps) if len(gaps) > 1 else None
  if diverged:
    verdict = " and ".join(f"{name} diverged ({sum(r.status == 'diverged' for r in rs)}"
                           f"/{len(rs)} seeds)" for name, rs in
                           (("cell", cell), ("baseline", baseline)) if name in diverged)
  elif len(pairs) < len(cell):
    verdict = "unfinished"
  elif spread is None:
    verdict = "one seed: no spread"
  else:
    if abs(mean) > spread:
      verdict = "exceeds the seed spread"
    else:
      verdict = "within the seed spread"
      if abs(mean) > gap_range and len({g > 0 for g in gaps}) == 1:
        verdict += "; one sign in every seed, beyond the gaps' range"
  return dict(gaps=gaps, mean=mean, spread=spread, gap_range=gap_range, verdict=verdict)


def _fmt(x, digits: int = 4, sign: bool = False) -> str:
  if x is None:
    return "-"
  return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def collect(chosen: list[Grid], scale: Scale, seeds: int, out: str, data: list[str]):
  """{grid name: [[Result per seed] per cell]}."""
  return {g.name: [[result(run_config(scale, cell, s, out, data), s) for s in range(seeds)]
                   for cell in g.cells] for g in chosen}


def write_tables(chosen: list[Grid], scale: Scale, seeds: int, out: str,
                 data: list[str]) -> list[str]:
  results = collect(chosen, scale, seeds, out, data)
  md = [f"# Study {out}", "",
        f"Scale: {', '.join(f'{k} {v}' for k, v in scale.config.items())}; tokens per step "
        f"{', '.join(f'{scale.tokens_per_step(s):,}' for s in range(len(scale.grad_accums)))} "
        f"({scale.steps(-1)} steps at the largest, the same tokens at the others); "
        f"{seeds} seed(s). Final validation loss in nats per token; a gap is cell minus "
        "baseline, seed by seed; the seed spread is the larger range over seeds of the "
        "two cells' final losses; the gap range is the range of the gaps themselves (a "
        "seed gives both cells the same initialisation and batches, so a gap of one sign "
        "in every seed and beyond its range is consistent even within the seed spread)."]
  rows, gap_rows = [], []
  for grid in chosen:
    md += ["", f"## {grid.name}: {grid.finding}", "",
           "| cell | steps | final val loss by seed | mean | range | max logit | "
           "dQ rel. L2 | dK rel. L2 | dS quant. rel. L2 |", "|---|---|---|---|---|---|---|---|---|"]
    for cell, rs in zip(grid.cells, results[grid.name]):
      cfg = run_config(scale, cell, 0, out, data)
      losses = [r.val_loss for r in rs if r.val_loss is not None]
      by_seed = ", ".join(_fmt(r.val_loss) if r.val_loss is not None else
                          f"diverged at {r.diverged_at}" if r.status == "diverged"
                          else r.status for r in rs)
      tele = {k: statistics.fmean([r.telemetry[k] for r in rs if k in r.telemetry])
              for k in TELEMETRY if any(k in r.telemetry for r in rs)}
      md.append(f"| {cell.name(scale)} | {cfg.steps} | {by_seed} | "
                f"{_fmt(statistics.fmean(losses) if losses else None)} | "
                f"{_fmt(max(losses) - min(losses) if len(losses) > 1 else None)} | "
                f"{_fmt(tele.get('max_logit'), 2)} | {_fmt(tele.get('dq_rel_l2'))} | "
                f"{_fmt(tele.get('dk_rel_l2'))} | {_fmt(tele.get('ds_rel_l2'))} |")
      for r in rs:
        rows.append(dict(grid=grid.name, cell=cell.name(scale), seed=r.seed,
                         attention=cell.attention, tokens_per_step=cfg.tokens_per_step,
                         steps=cfg.steps, lr=cfg.lr, qk_norm=cell.qk_norm,
                         smooth_k=cell.smooth_k, smooth_q=cell.smooth_q,
                         ds_precision=cell.ds_precision, status=r.status,
                         final_val_loss=r.val_loss, diverged_at=r.diverged_at,
                         tokens_per_s=r.tokens_per_s,
                         **{k: r.telemetry.get(k) for k in TELEMETRY}))
    md += ["", "| cell - baseline | gap by seed | mean gap | seed spread | gap range | verdict |",
           "|---|---|---|---|---|---|"]
    for a, b in grid.comparisons:
      c = compare(results[grid.name][a], results[grid.name][b])
      names = (grid.cells[a].name(scale), grid.cells[b].name(scale))
      md.append(f"| {names[0]} - {names[1]} | "
                f"{', '.join(_fmt(g, sign=True) for g in c['gaps']) or '-'} | "
                f"{_fmt(c['mean'], sign=True)} | {_fmt(c['spread'])} | "
                f"{_fmt(c['gap_range'])} | {c['verdict']} |")
      gap_rows.append(dict(grid=grid.name, cell=names[0], baseline=names[1],
                           gaps=";".join(f"{g:.6f}" for g in c["gaps"]), mean_gap=c["mean"],
                           seed_spread=c["spread"], gap_range=c["gap_range"],
                           verdict=c["verdict"]))
  paths = [os.path.join(out, n) for n in ("summary.md", "summary.csv", "gaps.csv")]
  with open(paths[0], "w") as f:
    f.write("\n".join(md) + "\n")
  for path, table in zip(paths[1:], (rows, gap_rows)):
    with open(path, "w", newline="") as f:
      if table:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
  return paths


def plot_grid(grid: Grid, scale: Scale, seeds: int, out: str, data: list[str]) -> list[str]:
  """<grid>-curves.png, and gap-vs-tokens.png for the tokens grid."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  results = collect([grid], scale, seeds, out, data)[grid.name]
  styles = ("-", "--", ":", "-.")
  fig, ax = plt.subplots(figsize=(8, 5))
  for i, (cell, rs) in enumerate(zip(grid.cells, results)):
    for r in rs:
      if r.curve:
        ax.plot(*zip(*r.curve), styles[r.seed % len(styles)], color=f"C{i}", marker="o",
                ms=3, label=cell.name(scale) if r.seed == 0 else None)
  ax.set(xlabel="tokens", ylabel="validation loss (nats per token)",
         title=f"{grid.name}: {grid.finding}\n(line style: seed)")
  ax.title.set_fontsize(9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  paths = [_save(fig, os.path.join(out, f"{grid.name}-curves.png"))]
  if grid.name == "tokens":
    paths.append(_gap_plot(grid, results, scale, out))
  return paths


def _gap_plot(grid: Grid, results, scale: Scale, out: str) -> str:
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  xs, means, spreads = [], [], []
  for a, b in grid.comparisons:
    x = scale.tokens_per_step(grid.cells[a].setting)
    c = compare(results[a], results[b])
    ax.plot([x] * len(c["gaps"]), c["gaps"], "o", color="C0", alpha=0.5)
    if c["mean"] is not None:
      xs.append(x)
      means.append(c["mean"])
      spreads.append(c["spread"] or 0.0)
  ax.plot(xs, means, "-s", color="C0", label="SageBwd - full (mean; dots: seeds)")
  ax.fill_between(xs, [-s for s in spreads], spreads, color="gray", alpha=0.25,
                  label="± seed spread")
  ax.axhline(0, color="black", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set(xlabel="tokens per step", ylabel="final validation loss gap (nats)",
         title="SageBwd minus full precision, same token budget")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, os.path.join(out, "gap-vs-tokens.png"))


def _save(fig, path: str) -> str:
  import matplotlib.pyplot as plt
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


