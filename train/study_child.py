"""One run of a study (train/study.py) in a fresh Python process.

Why a process per run: jax's persistent compilation cache keys a compile by
its HLO, and each lowering of a Mosaic GPU kernel embeds a counter that
counts up within a process (the kernel module's dump name, `..._0`, `_1`,
...). So the second run of one process lowers SageBwd's step to other HLO
than the first and compiles it again, while a fresh process lowers a run
exactly as the last fresh process did, and the cache hits: a cell's second
seed and a resumed study skip SageBwd's compiles. A run that crashes its
process (out of memory, a signal) also takes no other run with it.

The study's process imports no jax: on a GPU, a backend started there would
take memory the runs need.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from train.config import Config

# What the runs' stop lines say resumes them: the study's own command
# (train/study.py's main sets it; a run saves its step and the study resumes it).
resume_command = "python -m train.study"
# The signal a study passes to its runs when it is asked to stop: like their
# own first SIGINT, but never taken for a second (train/stop.py).
STOP_SIGNAL = signal.SIGUSR1
_children: set = set()  # the runs' processes alive now
_children_lock = threading.Lock()


class Diverged(Exception):
  """The run stopped at a non-finite loss, gradient or parameter (its message)."""


class Failed(Exception):
  """The run raised (the message: the exception's type and first line) or its
  process ended without an answer (how it ended)."""


class Interrupted(Exception):
  """The run stopped at a signal, its last completed step saved (its line)."""


def train(cfg: Config, compile_cache: str | None, share: bool = False) -> dict:
  """`train.loop.train(cfg)` in a fresh process, with jax's persistent
  compilation cache in `compile_cache` (None: none); returns its result.
  `share`: other processes use the accelerator too, so this one takes its
  memory as it needs it, not jax's 75% up front. Raises Diverged or Failed
  as the run ended, or Interrupted when it stopped at a signal."""
  status, value = in_child(_train, cfg, compile_cache, share, resume_command)
  if status == "diverged":
    raise Diverged(value)
  if status == "failed":
    raise Failed(value)
  if status == "interrupted":
    raise Interrupted(value)
  return value


def signal_runs(signum: int) -> None:
  """`signum` to every run's process alive now."""
  with _children_lock:
    pids = [p.pid for p in _children if p.pid is not None]
  for pid in pids:
    try:
      os.kill(pid, signum)
    except ProcessLookupError:
      pass


def in_child(fn: Callable[..., tuple[str, Any]], *args) -> tuple[str, Any]:
  """`fn(*args)` in a fresh ("spawn") process: what it returns, or ("failed",
  why) when it raises or its process ends without returning."""
  context = multiprocessing.get_context("spawn")
  receive, send = context.Pipe(duplex=False)
  process = context.Process(target=_serve, args=(send, fn, args))
  sys.stdout.flush()  # the run's own log lines come after the study's
  sys.stderr.flush()
  process.start()
  with _children_lock:
    _children.add(process)
  send.close()  # the child holds the other copy: its exit ends `recv` with EOFError
  try:
    try:
      answer = receive.recv()
    except EOFError:
      answer = None
    # The next run starts once this one's process is gone, with its device
    # memory; its exit runs the finalizers a SIGTERM would skip.
    process.join()
  finally:
    receive.close()
    if process.is_alive():  # the study was interrupted: so is the run
      process.terminate()
      process.join()
    with _children_lock:
      _children.discard(process)
  # An answer stands even if the exit after it failed: the run's metrics are written.
  return answer if answer is not None else ("failed", _ended(process.exitcode))


def _serve(send, fn: Callable[..., tuple[str, Any]], args: tuple) -> None:
  try:
    answer = fn(*args)
  except Exception as e:  # noqa: BLE001  (reported to the study, which goes on)
    answer = "failed", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
  send.send(answer)
  send.close()


def _ended(exitcode: int | None) -> str:
  if exitcode is not None and exitcode < 0:
    try:
      return f"its process was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
      return f"its process was killed by signal {-exitcode}"
  return f"its process exited with status {exitcode} before reporting"


def _train(cfg: Config, compile_cache: str | None, share: bool = False,
           command: str = resume_command) -> tuple[str, Any]:
  """In the child: ("done", result), ("diverged", message) or, stopped by a
  signal (its own, or the study's `STOP_SIGNAL`) with its step saved,
  ("interrupted", its line)."""
  from tqdm import tqdm

  from train import stop
  # tqdm's default lock is a multiprocessing one, whose semaphore a stop's
  # os._exit would leave behind (the resource tracker warns of it): one
  # process writes here, so a thread lock does.
  tqdm.set_lock(threading.RLock())
  with stop.handling(lambda run_dir: command, forwarded=(STOP_SIGNAL,)) as stopping:
    stopping.run_dir = cfg.out  # the study resumes the run there
    if share:  # read when jax starts its backend
      os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax
    if compile_cache is not None:  # before the first compile, which opens the cache
      jax.config.update("jax_compilation_cache_dir", compile_cache)
    from train import loop
    try:
      return "done", loop.train(cfg, stop=stopping)
    except loop.NonFiniteError as e:
      return "diverged", str(e)
    except stop.Interrupted as e:
      return "interrupted", e.line
