"""The run folder: which one a run writes, never losing the one before.

- `--out DIR` names it. Without `--out` a fresh run takes `runs/<name>`, or
  `runs/<name>-2`, `-3`, ... when those hold runs; `--resume` takes the
  newest of them.
- A folder that holds a run (config.json, metrics.jsonl or checkpoints/) is
  resumed (`--resume`) or started over (`--overwrite`, which deletes only the
  files a run writes); anything else is refused with a message saying so.
- One process at a time: a lock on `<run>/.lock`, released by the operating
  system when the process dies, however it dies.
- Files are replaced whole (`write_atomic`): a crash leaves the old file or
  the new one, never half of one.
- `--resume` continues the saved run's configuration (config.json: its
  steps and schedule too); a flag given on the command line overrides it.
  A flag that changes the model's shapes is refused, any other change is
  named in a warning.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable

from train.config import Config, flag

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints")
# What --overwrite deletes: what a run writes, nothing else in the folder.
WRITTEN = (*RUN_FILES, "checkpoints-skipped", "loss.png", "loss-telemetry.png")
# Fields that set the parameters' shapes: a checkpoint cannot load without them.
MODEL_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                "qk_norm", "tie_embeddings")
# Fields that change where or how a run executes, not what it computes.
NOT_COMPARED = ("out", "resume", "overwrite", "progress", "mesh", "coordinator",
                "num_processes", "process_id", "peak_tflops")


class RunError(Exception):
  """A problem the user can act on; the message is one line naming the flag,
  file or checkpoint concerned."""


def os_error(what: str, e: OSError) -> RunError:
  """`what` failed, in one line: the operating system's reason and the path."""
  where = f" ({e.filename})" if e.filename else ""
  return RunError(f"{what} failed: {e.strerror or e}{where}")


def write_atomic(path: str, text: str) -> None:
  """Replaces `path` with `text`: written beside it, synced, then renamed over it."""
  tmp = f"{path}.tmp"
  try:
    with open(tmp, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    raise os_error(f"writing {path}", e) from e


def holds_run(path: str) -> list[str]:
  """The run files in `path` (none: it holds no run)."""
  return [n for n in RUN_FILES if os.path.exists(os.path.join(path, n))]


def resolve(cfg: Config) -> str:
  """The folder this run writes: `--out`, else `runs/<name>[-N]` (see above)."""
  if cfg.out:
    return cfg.out
  base = os.path.join("runs", cfg.name)
  taken = [1] if holds_run(base) else []
  if os.path.isdir("runs"):
    pattern = re.compile(re.escape(cfg.name) + r"-(\d+)")
    taken += [int(m.group(1)) for n in os.listdir("runs")
              if (m := pattern.fullmatch(n)) and int(m.group(1)) >= 2
              and holds_run(os.path.join("runs", n))]
  if cfg.resume:
    if not taken:
      raise RunError(f"--resume: no run named {cfg.name!r} under runs/; name its folder "
                     f"with --out")
    n = max(taken)
  elif cfg.overwrite:
    n = 1
  else:
    n = max(taken, default=0) + 1
  return base if n == 1 else f"{base}-{n}"


def prepare(cfg: Config, run_dir: str, primary: bool,
            log: Callable[[str], None]) -> None:
  """Checks that the run may use `run_dir` and creates it (`primary`: the
  process that writes; the others only check)."""
  if os.path.exists(run_dir) and not os.path.isdir(run_dir):
    raise RunError(f"--out {run_dir} is a file, not a folder")
  found = holds_run(run_dir)
  if cfg.resume and not found:
    raise RunError(f"--resume: {run_dir} holds no run (no {', '.join(RUN_FILES)}); drop "
                   f"--resume to start one there")
  if found and not (cfg.resume or cfg.overwrite):
    raise RunError(f"{run_dir} already holds a run ({', '.join(found)}): continue it with "
                   f"--resume, or start it over with --overwrite (deletes its checkpoints "
                   f"and metrics)")
  if not primary:
    return
  try:
    os.makedirs(run_dir, exist_ok=True)
  except OSError as e:
    raise os_error(f"--out {run_dir}: creating the run folder", e) from e
  if cfg.overwrite and found:
    for name in WRITTEN:
      path = os.path.join(run_dir, name)
      try:
        if os.path.isdir(path):
          shutil.rmtree(path)
        elif os.path.exists(path):
          os.remove(path)
      except OSError as e:
        raise os_error(f"--overwrite: deleting {path}", e) from e
    log(f"--overwrite: deleted the run in {run_dir} ({', '.join(found)})")


def lock(run_dir: str) -> int:
  """Holds `<run_dir>/.lock` for this process's lifetime; RunError naming
  the holder if another process has it. Returns the lock's descriptor."""
  path = os.path.join(run_dir, ".lock")
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise os_error(f"--out {run_dir}: creating {path}", e) from e
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    os.close(fd)
    raise RunError(f"{run_dir} is in use by another training process (pid {holder}); "
                   f"wait for it, or give another --out") from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
  return fd


def config_path(run_dir: str) -> str:
  return os.path.join(run_dir, "config.json")


def save_config(cfg: Config) -> None:
  write_atomic(config_path(cfg.out), json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")


def saved_config(run_dir: str) -> dict | None:
  """The run's config.json as saved (None where there is none); RunError
  where it cannot be read or holds no JSON object."""
  path = config_path(run_dir)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise RunError(f"cannot read {path}: {e}") from e
  if not isinstance(saved, dict):
    raise RunError(f"{path} is not a JSON object")
  return saved


def resumed_config(cfg: Config, given) -> Config:
  """What `--resume` runs: the saved run's configuration (its config.json,
  its steps and schedule among it), with the fields of the flags given
  (`given`) and those that do not change what the run computes
  (NOT_COMPARED) from `cfg`. Without a config.json, `cfg` itself
  (`compare_with_saved` then warns). Fields the saved file lacks keep
  `cfg`'s values; names that are no field of Config are ignored."""
  run_dir = resolve(cfg)
  try:
    saved = saved_config(run_dir)
  except RunError as e:
    raise RunError(f"--resume: {e}; restore it, or start over with --overwrite") from e
  if saved is None:
    return cfg
  fields = {f.name for f in dataclasses.fields(Config)}
  kept = set(given) | set(NOT_COMPARED)
  return dataclasses.replace(cfg, **{n: v for n, v in saved.items()
                                     if n in fields and n not in kept})


def changed_fields(cfg: Config, saved: dict, *, unresolved_match: bool = False) -> list[str]:
  """The fields of `cfg` that `saved` (a config.json) holds with another
  value, NOT_COMPARED aside; `unresolved_match`: a field `cfg` leaves None
  (resolved when the run starts, as vocab_size) matches any."""
  now = dataclasses.asdict(cfg)
  return [n for n, value in now.items()
          if n in saved and n not in NOT_COMPARED and saved[n] != value
          and not (unresolved_match and value is None)]


def compare_with_saved(cfg: Config, log: Callable[[str], None]) -> None:
  """On resume: RunError if the flags change the saved model's shapes; a
  warning naming every other field that differs. `cfg.vocab_size` must be
  resolved (as it is saved)."""
  path = config_path(cfg.out)
  try:
    saved = saved_config(cfg.out)
  except RunError as e:
    raise RunError(f"--resume: {e}; restore it, or start over with --overwrite") from e
  if saved is None:
    log(f"warning: {path} is missing: the flags cannot be compared with the run's")
    return
  now = dataclasses.asdict(cfg)
  changed = changed_fields(cfg, saved)
  describe = lambda names: ", ".join(f"{flag(n)} {saved[n]} -> {now[n]}" for n in names)
  model = [n for n in changed if n in MODEL_FIELDS]
  if model:
    others = [n for n in changed if n not in MODEL_FIELDS]
    raise RunError(f"--resume: the flags change the model saved in {path}: {describe(model)}"
                   + (f" (and {describe(others)})" if others else "")
                   + "; resume with the saved values, or start a new run with another --out")
  if changed:
    log(f"warning: resuming with flags that differ from {path}: {describe(changed)}; the "
        f"run will not equal one never stopped")
