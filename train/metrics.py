"""Metrics: one JSON object per line in <run>/metrics.jsonl, safe from crashes.

Train rows: step, tokens, loss, lr, grad_norm, param_norm, tokens_per_s,
step_time, and mfu where the devices' peak is known (train/flops.py). Eval rows: step, tokens, val_loss. Telemetry rows
(`--telemetry-every`, train/telemetry.py): step, tokens, telemetry_s and
`TELEMETRY_VALUES`, each a list with one value per layer (no ds_rel_l2 under
full-precision attention). `step` counts completed steps.

Each row is appended by one write of the whole line to a file opened for
appending, so a process killed mid-write leaves at most a torn last line:
`read` drops it with a warning naming the file. Any other line that is not a
complete row is an error naming the file and the line. On resume the rows
logged after the checkpoint are dropped (those steps run again) and the file
is replaced whole (`write_atomic`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable

from train.rundir import os_error, write_atomic

# Keys every row of each kind has.
TRAIN_KEYS = ("step", "tokens", "loss", "lr")
EVAL_KEYS = ("step", "tokens", "val_loss")
TELEMETRY_KEYS = ("step", "tokens", "max_logit")
TELEMETRY_VALUES = ("o_rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2", "ds_rel_l2",
                    "max_abs_q", "max_abs_k", "max_logit")


class MetricsError(ValueError):
  """A metrics file that cannot be read; the message names the file and line."""


def _warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr)


def _check_row(row, path: str, number: int) -> dict:
  if not isinstance(row, dict):
    raise MetricsError(f"{path} line {number}: not a JSON object")
  keys = {"train": TRAIN_KEYS, "eval": EVAL_KEYS, "telemetry": TELEMETRY_KEYS}[kind(row)]
  missing = [k for k in keys if k not in row]
  if kind(row) == "eval" and "val_loss" not in row:
    missing = ["loss or val_loss"]
  if missing:
    raise MetricsError(f"{path} line {number}: a row without {', '.join(missing)}")
  if isinstance(row["step"], bool) or not isinstance(row["step"], int):
    raise MetricsError(f"{path} line {number}: step must be an integer, got {row['step']!r}")
  return row


def kind(row: dict) -> str:
  """"train", "eval" or "telemetry"."""
  return "train" if "loss" in row else "telemetry" if "max_logit" in row else "eval"


def read(path: str, warn: Callable[[str], None] = _warn) -> list[dict]:
  """The rows of a metrics file; a torn last line is dropped with a warning."""
  if os.path.isdir(path):
    raise MetricsError(f"{path} is a folder, not a metrics file")
  try:
    with open(path, "rb") as f:
      lines = f.read().split(b"\n")
  except OSError as e:
    raise MetricsError(f"cannot read {path}: {e.strerror}") from e
  numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
  rows = []
  for i, line in numbered:
    try:
      row = json.loads(line)
    except ValueError as e:
      if i == numbered[-1][0]:
        warn(f"{path} line {i}: dropped a torn last line (what a crash during a write "
             f"leaves): {line[:60].decode(errors='replace')!r}")
        break
      raise MetricsError(f"{path} line {i}: not JSON ({e})") from e
    rows.append(_check_row(row, path, i))
  return rows


def _append(fd: int, data: bytes) -> None:
  while data:
    data = data[os.write(fd, data):]


class MetricsLog:
  """Appends rows to <run_dir>/metrics.jsonl; remembers the last of each kind
  (`last_train`, `last_eval`, `last_telemetry`).

  `keep_until`: the step the run continues from; rows up to it are kept (none
  for a fresh run, or one resumed at step 0). `enabled`: False on every
  process but the first, which alone writes.
  """

  def __init__(self, run_dir: str, keep_until: int, enabled: bool = True,
               warn: Callable[[str], None] = _warn):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self.enabled, self.fd = enabled, None
    self.last_train: dict = {}
    self.last_eval: dict = {}
    self.last_telemetry: dict = {}
    if not enabled:
      return
    rows = read(self.path, warn) if keep_until and os.path.exists(self.path) else []
    rows = [r for r in rows if r["step"] <= keep_until]
    write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
      self._remember(r)
    try:
      self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
    except OSError as e:
      raise os_error(f"opening {self.path}", e) from e

  def _remember(self, row: dict) -> None:
    if kind(row) == "train":
      self.last_train = row
    elif kind(row) == "eval":
      self.last_eval = row
    else:
      self.last_telemetry = row

  def write(self, **row) -> None:
    self._remember(row)
    if not self.enabled:
      return
    try:
      _append(self.fd, (json.dumps(row) + "\n").encode())
    except OSError as e:
      raise os_error(f"writing {self.path}", e) from e

  def sync(self) -> None:
    """To disk (not just to the operating system), as a checkpoint is."""
    if self.fd is not None:
      try:
        os.fsync(self.fd)
      except OSError as e:
        raise os_error(f"writing {self.path}", e) from e

  def close(self) -> None:
    if self.fd is not None:
      os.close(self.fd)
      self.fd = None

  def summary(self) -> dict:
    """The last train row's step and loss, and the last validation loss."""
    nan = math.nan
    return dict(step=self.last_train.get("step", 0), loss=self.last_train.get("loss", nan),
                val_loss=self.last_eval.get("val_loss", nan))
