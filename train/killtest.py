"""Kill -9 a tiny training run at random points, or stop it with SIGINT and
SIGTERM, resume it after each, and check that its metrics equal those of a
run never stopped.

    python -m train.killtest [--kills 10] [--seed 0] [--out runs/killtest]

Kill points, drawn at random (seeded), one kind per kill:
- time:  SIGKILL at a random moment of start-up (imports, data, compilation),
         or just after the launch logs its first step if that comes first;
- step:  SIGKILL a random fraction of a step after a random step is logged;
- save:  SIGKILL while a checkpoint is being written (its temporary folder
         exists);
- write: the process kills itself halfway through writing a metrics row
         (the torn last line a kill mid-write leaves);
- sigint, sigterm: the signal a random fraction of a step after a random
         step is logged; the run must save that step, print how to resume
         and exit 128 + the signal (train/stop.py);
- sigint-early: SIGINT at a random moment between the run folder's first
         log line and the first step: the run must exit at once, saving
         nothing.
After each kill the run is started again with --resume (without it when the
kill came before config.json was written). At the end every metrics row, all
but the timings, must equal the uninterrupted run's bit for bit. Each launch
is a fresh `python -m train` process; its output is in <out>/logs/.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from train.cli import ArgumentParser
from train.data import stdlib_dir
from train.metrics import read

KINDS = ("time", "step", "save", "write", "sigint", "sigterm", "sigint-early")
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigint-early": signal.SIGINT}
STEPS, CKPT_EVERY = 24, 3
# A model small enough that start-up (imports, compilation) is most of a launch.
FLAGS = ["--dim", "64", "--n-layers", "1", "--n-heads", "1", "--n-kv-heads", "1",
         "--ffn-dim", "128", "--seq-len", "32", "--batch-size", "2", "--steps", str(STEPS),
         "--warmup", "2", "--eval-every", "4", "--eval-batches", "2", "--ckpt-every",
         str(CKPT_EVERY), "--keep", "2", "--attention", "full", "--no-progress"]
TIMINGS = ("tokens_per_s", "step_time")  # differ from run to run by nature
ROOT = Path(__file__).resolve().parent.parent


def die_mid_write(row: int, argv: list[str]) -> None:
  """`python -m train argv`, killing itself (SIGKILL) halfway through writing
  its `row`-th metrics row."""
  from train import metrics
  from train.__main__ import main
  append, count = metrics._append, [0]

  def torn_append(fd: int, data: bytes) -> None:
    count[0] += 1
    if count[0] == row:
      append(fd, data[:len(data) // 2])
      os.kill(os.getpid(), signal.SIGKILL)
    append(fd, data)

  metrics._append = torn_append
  main(argv)


@dataclass
class Launch:
  kind: str | None  # the kill planned; None: run to the end
  returncode: int
  log: str
  note: str = ""

  @property
  def killed(self) -> bool:
    return self.returncode == -signal.SIGKILL

  @property
  def stopped(self) -> bool:
    """Ended by its own stop at SIGINT or SIGTERM (train/stop.py)."""
    return self.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM)

  @property
  def stopped_at(self) -> int | None:
    """The step its stop line says it saved, if it saved one."""
    m = re.search(r"at step (\d+): saved checkpoint", self.log)
    return None if m is None else int(m.group(1))

  @property
  def resumed_from(self) -> str:
    m = re.search(r"resumed from step (\d+)|(starting from step 0)", self.log)
    return "a fresh start" if m is None else f"step {m.group(1) or 0}"


# The set-up line a launch logs before it restores a checkpoint and compiles:
# the latest moment sigint-early signals. The uninterrupted run's start-up
# (`startup_s`) includes a first evaluation and maybe a cold compile that a
# resumed launch skips, so a deadline drawn from it alone could fall after
# that launch's first step.
LAST_SET_UP_LINE = "model FLOPs:"


def _log_of(proc: subprocess.Popen) -> str:
  with open(proc.log_file.name) as f:
    return f.read()


def _rows(run_dir: Path) -> list[dict]:
  path = run_dir / "metrics.jsonl"
  return read(str(path), warn=lambda m: None) if path.exists() else []


def _last_step(run_dir: Path) -> int:
  return max((r["step"] for r in _rows(run_dir)), default=0)


def _checkpoint_step(run_dir: Path) -> int:
  ckpts = run_dir / "checkpoints"
  steps = [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()] if ckpts.is_dir() else []
  return max(steps, default=0)


def _new_tmp_checkpoint(run_dir: Path, since_ns: int) -> str | None:
  """A checkpoint being written that this launch started (orbax's temporary
  folder; one left by an earlier kill is older)."""
  try:
    for p in (run_dir / "checkpoints").iterdir():
      if ".orbax-checkpoint-tmp" in p.name and p.stat().st_ctime_ns >= since_ns:
        return p.name
  except FileNotFoundError:
    pass
  return None


class KillTest:
  def __init__(self, out: Path, data: list[str], seed: int):
    self.out, self.data, self.rng = out, data, random.Random(seed)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    self.launches = 0
    self.startup_s, self.step_s = 30.0, 0.1  # measured on the uninterrupted run

  def _start(self, run_dir: Path, torn_row: int | None = None) -> subprocess.Popen:
    args = [*FLAGS, "--data", *self.data, "--out", str(run_dir)]
    if (run_dir / "config.json").exists():
      args.append("--resume")
    if torn_row is None:
      cmd = [sys.executable, "-m", "train", *args]
    else:
      cmd = [sys.executable, "-c", "import sys; from train.killtest import die_mid_write; "
             "die_mid_write(int(sys.argv[1]), sys.argv[2:])", str(torn_row), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    self.launches += 1
    log = open(self.out / "logs" / f"{self.launches:02d}-{run_dir.name}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_file = log
    return proc

  def _finish(self, proc: subprocess.Popen, kind: str | None, note: str = "") -> Launch:
    proc.wait()
    proc.log_file.seek(0)
    launch = Launch(kind, proc.returncode, proc.log_file.read(), note)
    proc.log_file.close()
    if not (launch.returncode in (0, -signal.SIGKILL) or launch.stopped):
      raise RuntimeError(f"launch {self.launches} failed ({launch.returncode}):\n"
                         f"{launch.log[-3000:]}")
    return launch

  def reference(self) -> Path:
    """The uninterrupted run; measures start-up and step time for the kills."""
    run_dir = self.out / "uninterrupted"
    t0 = time.monotonic()
    proc, first_row = self._start(run_dir), None
    while proc.poll() is None:
      if first_row is None and any("loss" in r for r in _rows(run_dir)):
        first_row = time.monotonic() - t0
      time.sleep(0.01)
    self._finish(proc, None)
    times = [r["step_time"] for r in _rows(run_dir) if "step_time" in r]
    self.startup_s = first_row or time.monotonic() - t0
    self.step_s = sum(times) / len(times)
    return run_dir

  def kill_once(self, run_dir: Path, kind: str) -> Launch:
    """One launch, killed the `kind` way (if it does not finish first)."""
    done = _checkpoint_step(run_dir)  # where it will resume, at most
    logged = _last_step(run_dir)  # rows past it are from this launch only
    if kind in ("step", "sigint", "sigterm") and logged + 1 >= STEPS:
      kind = "write"
    if kind == "write":
      row = self.rng.randint(1, STEPS - done)  # this launch writes at least as many
      return self._finish(self._start(run_dir, torn_row=row), kind,
                          f"mid-write of row {row} of the launch")
    launch_ns = time.time_ns()
    t0 = time.monotonic()
    proc = self._start(run_dir)
    deadline = t0 + self.rng.uniform(0, self.startup_s)
    after_step = kind in ("step", "sigint", "sigterm")
    target = self.rng.randint(logged + 1, STEPS - 1) if after_step else None
    note, folder_logged = "", None
    while proc.poll() is None:
      if kind == "sigint-early" and folder_logged is None and "run folder:" in _log_of(proc):
        folder_logged = time.monotonic()
        deadline = folder_logged + self.rng.uniform(0, max(0.0, t0 + self.startup_s
                                                           - folder_logged))
      if kind == "time" and (time.monotonic() >= deadline or _last_step(run_dir) > logged):
        note = f"{time.monotonic() - t0:.2f}s after launch"
      elif kind == "sigint-early" and folder_logged is not None and (
          time.monotonic() >= deadline or _last_step(run_dir) > logged
          or LAST_SET_UP_LINE in _log_of(proc)):
        note = f"{time.monotonic() - folder_logged:.2f}s after the run folder was logged"
      elif after_step and _last_step(run_dir) >= target:
        delay = self.rng.uniform(0, 1.5 * self.step_s)
        time.sleep(delay)
        note = f"{delay * 1e3:.0f} ms after step {target} was logged"
      elif kind == "save" and (tmp := _new_tmp_checkpoint(run_dir, launch_ns)):
        note = f"while writing {tmp}"
      else:
        time.sleep(0.001)
        continue
      proc.send_signal(SIGNALS.get(kind, signal.SIGKILL))
      break
    return self._finish(proc, kind, note)

  def killed_run(self, kinds: list[str], show: bool) -> tuple[Path, list[Launch]]:
    run_dir = self.out / "killed"
    launches: list[Launch] = []
    bar = tqdm(kinds, desc="kills", disable=not show)
    for kind in bar:
      launch = self.kill_once(run_dir, kind)
      launches.append(launch)
      if not (launch.killed or launch.stopped):
        break  # it finished first
      bar.set_postfix(kind=kind, refresh=False)
    bar.close()
    launches.append(self._finish(self._start(run_dir), None))
    return run_dir, launches


def stopped_cleanly(launch: Launch) -> bool:
  """A launch stopped by a signal printed one line saying how to resume, and
  no traceback or C++ abort."""
  return (launch.log.count("; resume with: ") == 1 and "Traceback" not in launch.log
          and "terminate called" not in launch.log)


def compare(a: list[dict], b: list[dict]) -> list[str]:
  """The differences between two runs' metrics (timings aside), as lines."""
  strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]
  a, b = strip(a), strip(b)
  diffs = [f"row {i}: {x} != {y}" for i, (x, y) in enumerate(zip(a, b)) if x != y]
  if len(a) != len(b):
    diffs.append(f"{len(a)} rows != {len(b)} rows")
  return diffs


def run(out: Path, kinds: list[str], seed: int = 0, data: list[str] | None = None,
        show: bool = False) -> tuple[list[Launch], list[str]]:
  """(the launches of the killed run, the differences of its metrics from
  the uninterrupted run's: none when resuming is exact)."""
  test = KillTest(out, data or [str(stdlib_dir() / "json")], seed)
  reference = test.reference()
  killed, launches = test.killed_run(kinds, show)
  return launches, compare(_rows(reference), _rows(killed))


def kill_kinds(kills: int, rng: random.Random) -> list[str]:
  """`kills` kinds at random, each kind at least once when there are enough."""
  kinds = list(KINDS[:kills]) + [rng.choice(KINDS) for _ in range(kills - len(KINDS))]
  rng.shuffle(kinds)
  return kinds


def main(argv: list[str] | None = None) -> None:
  p = ArgumentParser(prog="python -m train.killtest",
                     description=__doc__.split("\n\n")[0])
  p.add_argument("--kills", type=int, default=10, help="kills (default 10)")
  p.add_argument("--seed", type=int, default=0, help="draws the kill points (default 0)")
  p.add_argument("--out", default="runs/killtest",
                 help="folder for the two runs and the logs; must not exist "
                      "(default runs/killtest)")
  args = p.parse_args(argv)
  if args.kills < 1:
    p.error(f"--kills must be >= 1, got {args.kills}")
  out = Path(args.out)
  if out.exists():
    p.error(f"--out {out} exists; remove it or give another")
  launches, diffs = run(out, kill_kinds(args.kills, random.Random(args.seed)), args.seed,
                        show=True)
  kills = [x for x in launches if x.killed or x.stopped]
  for i, (x, after) in enumerate(zip(kills, launches[1:]), 1):
    print(f"kill {i} ({x.kind}): {x.note or 'at exit'}; the next launch resumed from "
          f"{after.resumed_from}")
  bad = [x for x in kills if x.stopped and not stopped_cleanly(x)]
  if bad:
    raise SystemExit(f"FAIL: a stop at a signal ended unclean:\n{bad[0].log[-3000:]}")
  if len(kills) < args.kills:
    raise SystemExit(f"FAIL: the run finished after {len(kills)} of {args.kills} kills")
  if diffs:
    raise SystemExit("FAIL: the metrics differ from the uninterrupted run's:\n"
                     + "\n".join(diffs[:20]))
  print(f"OK: {len(kills)} kills, every metrics row equals the uninterrupted run's")


if __name__ == "__main__":
  main()
