"""Loss curves of one or more runs in one PNG, and their telemetry in another.

    python -m train.plot runs/tiny [runs/other ...] [--out FILE.png] [--x tokens]

Without --out, one run's plot goes beside it (<run>/loss.png, as training
writes it) and several runs' into their common folder, named after them
(runs/loss-tiny-vs-other.png).

Top: train loss drawn thin (a moving average on top), validation loss with
markers, one colour per run, and the loss of a uniform guess over the
vocabulary (ln 256 = 5.545 for bytes). Bottom: the learning rate. The title
names each run with its attention and tokens per step (from config.json).

Runs trained with `--telemetry-every` also get `<out>-telemetry.png`: one
panel per telemetry key (train/telemetry.py), a thin line per layer and a
thick one for the largest over the layers, one colour per run.
"""

from __future__ import annotations

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from train.cli import ArgumentParser  # noqa: E402
from train.metrics import TELEMETRY_VALUES, MetricsError, kind, read  # noqa: E402
from train.rundir import RunError, saved_config  # noqa: E402

TELEMETRY_TITLES = {"o_rel_l2": "O rel. L2", "dq_rel_l2": "dQ rel. L2",
                    "dk_rel_l2": "dK rel. L2", "dv_rel_l2": "dV rel. L2",
                    "ds_rel_l2": "dS quantization rel. L2", "max_abs_q": "max |q|",
                    "max_abs_k": "max |k|", "max_logit": "max attention logit"}


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
  if len(y) < window or window < 2:
    return y
  c = np.cumsum(np.insert(y, 0, 0.0))
  head = c[1:window] / np.arange(1, window)
  return np.concatenate([head, (c[window:] - c[:-window]) / window])


def load_run(run: str) -> tuple[str, list[dict], dict]:
  """(name, metrics rows, config.json or {}) of a run folder or a metrics file."""
  path = run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")
  if not os.path.exists(path):
    raise ValueError(f"{run!r} has no metrics.jsonl: not a run folder")
  rows = read(path)
  if not rows:
    raise MetricsError(f"{path} has no rows: the run has not logged a step yet")
  try:
    config = saved_config(os.path.dirname(path)) or {}
  except RunError as e:
    raise ValueError(str(e)) from e
  name = os.path.basename(os.path.abspath(os.path.dirname(path)))
  return name, rows, config


def _vocab(config: dict) -> int | None:
  """The run's vocabulary: saved, or bytes for text data (runs saved before
  config.json recorded it)."""
  if isinstance(config.get("vocab_size"), int):
    return config["vocab_size"]
  if config and not any(str(p).endswith(".bin") for p in config.get("data") or []):
    return 256
  return None


def figure(runs: list[str], x: str = "step") -> plt.Figure:
  """The runs' loss (top) and learning-rate (bottom) panels. ValueError naming
  the file for anything unreadable."""
  loaded = [load_run(run) for run in runs]
  fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                  gridspec_kw=dict(height_ratios=[3, 1]))
  titles, vocabs = [], set()
  for i, (label, rows, config) in enumerate(loaded):
    color = f"C{i}"
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    if train:
      xs = np.array([r[x] for r in train], float)
      ys = np.array([r["loss"] for r in train], float)
      ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
      ax.plot(xs, _smooth(ys, max(1, len(ys) // 50)), color=color, lw=1.5,
              label=f"{label} train")
      ax_lr.plot(xs, [r["lr"] for r in train], color=color, lw=1.2)
    if val:
      ax.plot([r[x] for r in val], [r["val_loss"] for r in val], "o--", color=color,
              ms=4, label=f"{label} val")
    about = [str(config["attention"])] if "attention" in config else []
    if all(k in config for k in ("batch_size", "seq_len", "grad_accum")):
      about.append(f"{config['batch_size'] * config['seq_len'] * config['grad_accum']:,} "
                   f"tokens/step")
    titles.append(label + (f" ({', '.join(about)})" if about else ""))
    if _vocab(config):
      vocabs.add(_vocab(config))
  for v in sorted(vocabs):
    ax.axhline(math.log(v), color="gray", ls=":", lw=1,
               label=f"uniform over {v:,} tokens: ln {v} = {math.log(v):.3f}")
  if vocabs:  # axhline leaves the limits alone: keep the line off the frame
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, max(hi, math.log(max(vocabs)) + 0.05 * (hi - lo)))
  ax.set_title("; ".join(titles), fontsize=10)
  ax.set_ylabel("loss (nats per token)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax_lr.set_ylabel("learning rate")
  ax_lr.set_xlabel("tokens" if x == "tokens" else "step")
  ax_lr.grid(alpha=0.3)
  fig.tight_layout()
  return fig


def telemetry_figure(runs: list[str], x: str = "step") -> plt.Figure | None:
  """The runs' telemetry, one panel per key; None if no run has any."""
  loaded = [(label, [r for r in rows if kind(r) == "telemetry"])
            for label, rows, _ in (load_run(run) for run in runs)]
  if not any(rows for _, rows in loaded):
    return None
  fig, axes = plt.subplots(2, 4, figsize=(14, 6.5), sharex=True)
  for ax, key in zip(axes.flat, TELEMETRY_VALUES):
    for i, (label, rows) in enumerate(loaded):
      rows = [r for r in rows if key in r]
      if not rows:
        continue
      xs = [r[x] for r in rows]
      layers = np.array([r[key] for r in rows], float)  # (rows, layers)
      ax.plot(xs, layers, color=f"C{i}", alpha=0.3, lw=0.8)
      ax.plot(xs, layers.max(axis=1), color=f"C{i}", lw=1.8, label=label)
    if key.endswith("rel_l2") and ax.lines and all(
        np.all(np.asarray(line.get_ydata(), float) > 0) for line in ax.lines):
      ax.set_yscale("log")
    ax.set_title(TELEMETRY_TITLES[key], fontsize=10)
    ax.grid(alpha=0.3)
  for ax in axes[-1]:
    ax.set_xlabel("tokens" if x == "tokens" else "step")
  axes.flat[0].legend(fontsize=8, title="thick: max over layers", title_fontsize=8)
  fig.suptitle("attention against full precision on one validation batch, per layer",
               fontsize=11)
  fig.tight_layout()
  return fig


def telemetry_path(out: str) -> str:
  """Where `plot` draws the telemetry of a loss plot written to `out`."""
  stem, ext = os.path.splitext(out)
  return f"{stem}-telemetry{ext or '.png'}"


def plot(runs: list[str], out: str, x: str = "step") -> str:
  """Draws `runs` into `out` (".png" added when it has no extension), and
  their telemetry, if any, into `telemetry_path(out)`; returns `out`."""
  return plot_all(runs, out, x)[0]


def plot_all(runs: list[str], out: str, x: str = "step") -> list[str]:
  """`plot`, returning every path written."""
  if not os.path.splitext(out)[1]:
    out += ".png"
  _save(figure(runs, x), out)
  telemetry = telemetry_figure(runs, x)
  if telemetry is None:
    return [out]
  _save(telemetry, telemetry_path(out))
  return [out, telemetry_path(out)]


def _save(fig: plt.Figure, out: str) -> None:
  try:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
  except OSError as e:
    raise ValueError(f"--out {out}: writing the plot failed: {e.strerror}") from e
  except ValueError as e:  # matplotlib: an extension it cannot write
    raise ValueError(f"--out {out}: {e}") from e
  finally:
    plt.close(fig)


def default_out(runs: list[str]) -> str:
  """Where `main` writes without --out (the module docstring says)."""
  folders = [run if os.path.isdir(run) else os.path.dirname(run) or "." for run in runs]
  if len(folders) == 1:
    return os.path.join(folders[0], "loss.png")
  names = [os.path.basename(os.path.abspath(f)) for f in folders]
  parents = {os.path.dirname(os.path.normpath(f)) for f in folders}
  parent = (parents.pop() if len(parents) == 1 else
            os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in folders]))
  return os.path.join(parent, "loss-" + "-vs-".join(names) + ".png")


def main(argv: list[str] | None = None) -> None:
  p = ArgumentParser(prog="python -m train.plot", description=__doc__.split("\n")[0])
  p.add_argument("runs", nargs="+", help="run folders (each with a metrics.jsonl), or "
                                         "metrics files")
  p.add_argument("--out", default=None,
                 help="image to write; .png is added without an extension (default: "
                      "<run>/loss.png for one run, loss-<run>-vs-<run>.png in the runs' "
                      "common folder for several)")
  p.add_argument("--x", choices=["step", "tokens"], default="step",
                 help="x axis (default step)")
  args = p.parse_args(argv)
  try:
    print("\n".join(plot_all(args.runs, args.out or default_out(args.runs), args.x)))
  except ValueError as e:
    raise SystemExit(f"error: {e}")


if __name__ == "__main__":
  main()
