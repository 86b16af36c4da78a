"""Metrics: one JSON object per line in <run>/metrics.jsonl.

Train rows: step, tokens, loss, lr, grad_norm, param_norm, tokens_per_s,
step_time. Eval rows: step, tokens, val_loss. `step` counts completed steps.
"""

from __future__ import annotations

import json
import os


class MetricsLog:
  def __init__(self, run_dir: str, resume_step: int | None, enabled: bool = True):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self.enabled = enabled  # False on all processes but the first of a multi-host run
    if not enabled:
      return
    rows = read(self.path) if resume_step is not None and os.path.exists(self.path) else []
    # Resuming drops what was logged after the checkpoint: those steps run again.
    rows = [r for r in rows if resume_step is not None and r["step"] <= resume_step]
    with open(self.path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)

  def write(self, **row) -> None:
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")


def read(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
