"""Loss curves of one or more runs in one PNG.

    python -m train.plot runs/tiny runs/other [--out loss.png] [--x tokens]

Train loss is drawn thin (with a moving average on top), validation loss
with markers, one colour per run.
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from train.metrics import read  # noqa: E402


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
  if len(y) < window or window < 2:
    return y
  c = np.cumsum(np.insert(y, 0, 0.0))
  head = c[1:window] / np.arange(1, window)
  return np.concatenate([head, (c[window:] - c[:-window]) / window])


def plot(runs: list[str], out: str, x: str = "step") -> str:
  fig, ax = plt.subplots(figsize=(8, 5))
  for i, run in enumerate(runs):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
      raise ValueError(f"{run!r} has no metrics.jsonl: not a run folder")
    rows = read(path)
    color = f"C{i}"
    label = os.path.basename(os.path.normpath(run))
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    if train:
      xs = np.array([r[x] for r in train], float)
      ys = np.array([r["loss"] for r in train], float)
      ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
      ax.plot(xs, _smooth(ys, max(1, len(ys) // 50)), color=color, lw=1.5,
              label=f"{label} train")
    if val:
      ax.plot([r[x] for r in val], [r["val_loss"] for r in val], "o--", color=color,
              ms=4, label=f"{label} val")
  ax.set_xlabel("tokens" if x == "tokens" else "step")
  ax.set_ylabel("loss (nats per token)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.split("\n")[0])
  p.add_argument("runs", nargs="+", help="run folders (each with a metrics.jsonl)")
  p.add_argument("--out", default="loss.png", help="PNG to write (default loss.png)")
  p.add_argument("--x", choices=["step", "tokens"], default="step")
  args = p.parse_args(argv)
  try:
    print(plot(args.runs, args.out, args.x))
  except ValueError as e:
    raise SystemExit(f"error: {e}")


if __name__ == "__main__":
  main()
