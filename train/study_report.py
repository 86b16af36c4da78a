"""The report of a study (train/study.py): tables and plots from its runs'
metrics.jsonl files, rewritten whole each time.

- summary.md: per grid, a table of cells (final validation loss by seed,
  mean and range; at the largest setting the last telemetry: max attention
  logit, dQ and dK relative L2, largest over layers, mean over seeds), for
  the ds grid the same telemetry layer by layer, and a table of gaps: seed
  by seed, their mean and its 95% interval, and the verdict on the finding.
- summary.csv: one row per grid, cell and seed; gaps.csv: one per gap.
- <grid>-curves.png and, with the tokens grid, gap-vs-tokens.png.

A seed gives both cells of a gap the same initialisation and batches, so the
gaps are paired: their interval comes from the per-seed differences (Student
t, n - 1 degrees of freedom), far narrower than the spread of either cell's
losses over seeds, which moves with what both cells share. One rule turns an
interval into a verdict (`judge`): "supports" when all of it lies where the
finding puts the gap, "contradicts" when none of it does, "cannot tell"
otherwise.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass, field

from train.metrics import kind, read
from train.study_plan import EXPECT, NEAR, Gap, Grid, Scale, run_config, run_status

TELEMETRY = ("max_logit", "o_rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2", "ds_rel_l2")
PER_LAYER = ("ds_rel_l2", "dq_rel_l2", "dk_rel_l2")  # the errors claim (ii) is about


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
  layers: dict[str, list[float]] = field(default_factory=dict)  # last row, PER_LAYER
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
    r.layers = {k: telemetry[-1][k] for k in PER_LAYER if k in telemetry[-1]}
  speeds = [row["tokens_per_s"] for row in train if "tokens_per_s" in row]
  r.tokens_per_s = statistics.median(speeds) if speeds else None
  return r


def t_quantile(p: float, dof: int) -> float:
  """Student t's p-quantile (1/2 < p < 1) at `dof` >= 1 degrees of freedom:
  bisection on P(|T| <= t), which is closed-form at whole dof (Abramowitz
  and Stegun 26.7.3-4) in theta = atan(t / sqrt(dof))."""
  if not 0.5 < p < 1 or dof < 1:
    raise ValueError(f"t_quantile needs 1/2 < p < 1 and dof >= 1, got p={p}, dof={dof}")
  lo, hi = 0.0, math.pi / 2
  for _ in range(100):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if _t_central(mid, dof) < 2 * p - 1 else (lo, mid)
  return math.sqrt(dof) * math.tan((lo + hi) / 2)


def _t_central(theta: float, dof: int) -> float:
  """P(|T| <= sqrt(dof) tan(theta)) for T Student t at `dof`."""
  c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
  if dof % 2 == 0:
    for k in range(1, dof // 2):
      term *= (2 * k - 1) / (2 * k) * c2
      total += term
    return math.sin(theta) * total
  if dof == 1:
    return 2 * theta / math.pi
  for k in range(1, (dof - 1) // 2):
    term *= 2 * k / (2 * k + 1) * c2
    total += term
  return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)


def paired_interval(gaps: list[float]) -> tuple[float, float] | None:
  """The 95% interval of the mean of per-seed gaps (mean +- t_{0.975, n-1}
  times their standard error); None under two seeds."""
  if len(gaps) < 2:
    return None
  half = t_quantile(0.975, len(gaps) - 1) * statistics.stdev(gaps) / math.sqrt(len(gaps))
  mean = statistics.fmean(gaps)
  return mean - half, mean + half


def judge(interval: tuple[float, float], expect: str) -> str:
  """The verdict rule: "supports" when the whole interval lies where the
  finding puts the gap (EXPECT: above 0, below 0, or within +-NEAR, that one
  closed), "contradicts" when none of it does, "cannot tell" otherwise."""
  lo, hi = interval
  inside, outside = {"above": (lo > 0, hi <= 0), "below": (hi < 0, lo >= 0),
                     "near": (-NEAR <= lo and hi <= NEAR, lo > NEAR or hi < -NEAR)}[expect]
  return "supports" if inside else "contradicts" if outside else "cannot tell"


def _value(r: Result, metric: str) -> float | None:
  if r.status != "done":
    return None
  return r.val_loss if metric == "val_loss" else r.telemetry.get(metric)


def compare(cell: list[Result], baseline: list[Result], gap: Gap) -> dict:
  """`gap` seed by seed, its mean and 95% interval over the seeds both
  cells finished, and the verdict on the finding."""
  pairs = [(_value(a, gap.metric), _value(b, gap.metric)) for a, b in zip(cell, baseline)]
  gaps = [a - gap.weight * b for a, b in pairs if a is not None and b is not None]
  mean = statistics.fmean(gaps) if gaps else None
  interval = paired_interval(gaps)
  diverged = [(name, sum(r.status == "diverged" for r in rs), len(rs))
              for name, rs in (("cell", cell), ("baseline", baseline))
              if any(r.status == "diverged" for r in rs)]
  if diverged:
    verdict = " and ".join(f"{name} diverged ({n}/{of} seeds)" for name, n, of in diverged)
  elif interval is None:
    verdict = "unfinished" if len(gaps) < len(cell) else "one seed: no interval"
  else:
    verdict = judge(interval, gap.expect)
    if len(gaps) < len(cell):
      verdict = f"unfinished ({len(gaps)}/{len(cell)} seeds), so far: {verdict}"
  return dict(gaps=gaps, mean=mean, interval=interval, verdict=verdict)


def _fmt(x, digits: int = 4, sign: bool = False) -> str:
  if x is None:
    return "-"
  return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _fmt_interval(interval) -> str:
  return "-" if interval is None else f"[{interval[0]:+.4f}, {interval[1]:+.4f}]"


def _layer_table(grid: Grid, results: list[list[Result]], scale: Scale) -> list[str]:
  """The last telemetry's PER_LAYER errors layer by layer, mean over seeds."""
  rows = []
  for cell, rs in zip(grid.cells, results):
    for k in PER_LAYER:
      per_seed = [r.layers[k] for r in rs if k in r.layers]
      if per_seed:
        rows.append((f"{cell.name(scale)} {k}", [statistics.fmean(x) for x in zip(*per_seed)]))
  if not rows:
    return []
  n = max(len(values) for _, values in rows)
  return ["", "Last telemetry by layer (relative L2 to full precision; ds_rel_l2: dS's own "
          "quantization), mean over seeds:", "",
          "| cell, error | " + " | ".join(f"layer {i}" for i in range(n)) + " |",
          "|---" * (n + 1) + "|"] + [
              f"| {name} | " + " | ".join(_fmt(v) for v in values) + " |"
              for name, values in rows]


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
        f"{seeds} seed(s). Final validation loss in nats per token. A gap is cell minus "
        "baseline at the same seed, which gives both the same initialisation and batches; "
        "its 95% interval is the mean of the n per-seed gaps +- t(0.975, n - 1) times their "
        "standard error. Verdict on the finding: supports when the whole interval lies "
        f"where the finding puts the gap (> 0, < 0, or within +-{NEAR:g}: a match), "
        "contradicts when none of it does, cannot tell otherwise."]
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
                         ds_precision=cell.ds_precision, quantization=cell.quantization,
                         status=r.status,
                         final_val_loss=r.val_loss, diverged_at=r.diverged_at,
                         tokens_per_s=r.tokens_per_s,
                         **{k: r.telemetry.get(k) for k in TELEMETRY}))
    if grid.per_layer:
      md += _layer_table(grid, results[grid.name], scale)
    md += ["", "| gap | the finding puts it | gap by seed | mean | 95% interval | verdict |",
           "|---|---|---|---|---|---|"]
    names = [cell.name(scale) for cell in grid.cells]
    for gap in grid.comparisons:
      c = compare(results[grid.name][gap.cell], results[grid.name][gap.baseline], gap)
      md.append(f"| {gap.label(names)} | {EXPECT[gap.expect]} | "
                f"{', '.join(_fmt(g, sign=True) for g in c['gaps']) or '-'} | "
                f"{_fmt(c['mean'], sign=True)} | {_fmt_interval(c['interval'])} | "
                f"{c['verdict']} |")
      lo, hi = c["interval"] or (None, None)
      gap_rows.append(dict(grid=grid.name, gap=gap.label(names), metric=gap.metric,
                           expect=EXPECT[gap.expect],
                           gaps=";".join(f"{g:.6f}" for g in c["gaps"]), seeds=len(c["gaps"]),
                           mean_gap=c["mean"], ci95_low=lo, ci95_high=hi,
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
  xs, means, errors = [], [], []
  for gap in grid.comparisons:
    x = scale.tokens_per_step(grid.cells[gap.cell].setting)
    c = compare(results[gap.cell], results[gap.baseline], gap)
    ax.plot([x] * len(c["gaps"]), c["gaps"], "o", color="C0", alpha=0.4, ms=4)
    if c["interval"] is not None:
      xs.append(x)
      means.append(c["mean"])
      errors.append((c["mean"] - c["interval"][0], c["interval"][1] - c["mean"]))
  if xs:
    ax.errorbar(xs, means, yerr=list(zip(*errors)), fmt="-s", color="C0", capsize=4,
                label="SageBwd - full: mean, 95% interval (dots: seeds)")
  ax.axhspan(-NEAR, NEAR, color="gray", alpha=0.25, label=f"a match: within +-{NEAR:g}")
  ax.axhline(0, color="black", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set(xlabel="tokens per step", ylabel="final validation loss gap (nats)",
         title="SageBwd minus full precision, same token budget, paired by seed")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, os.path.join(out, "gap-vs-tokens.png"))


def _save(fig, path: str) -> str:
  import matplotlib.pyplot as plt
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
