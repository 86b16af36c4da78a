"""Stopping a run on SIGINT or SIGTERM (Ctrl-C, a cluster's preemption).

The first signal asks the run to stop: the loop finishes the step in flight
(or abandons an evaluation), saves a checkpoint of the last completed step
(atomically, as every checkpoint), flushes the metrics and ends with one
line: the step, where it saved, and the command that resumes it. The
process then exits with status 128 + the signal's number (130 for SIGINT,
143 for SIGTERM), as a shell reports a process the signal ended.

A Python signal handler runs only between bytecodes of the main thread, and
the main thread spends long stretches inside XLA (compiling a step, waiting
for one). So the handler only records the request, and a watchdog thread,
woken by the signal itself (`signal.set_wakeup_fd`), ends the process where
waiting would not do:
- before the first step of this launch (imports, data, compilation, the
  first evaluation) there is nothing new to save: it exits at once;
- a step, evaluation batch or telemetry call still in flight after
  `grace_s()` is abandoned (its result was never saved);
- a second signal exits at once, whatever is in flight; a checkpoint being
  written then is left incomplete, which orbax never reads.
It exits with `os._exit`, which runs no interpreter teardown: ending the
interpreter normally while XLA's threads still run aborts in C++
("terminate called without an active exception").
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a step in flight may take to finish after the first signal (at
# least; `Stop.grace_s`) before the watchdog abandons it.
MIN_GRACE_S = 10.0


class Interrupted(Exception):
  """The run stopped at a signal. `line` is what to print, `signum` the signal."""

  def __init__(self, line: str, signum: int, step: int):
    super().__init__(line)
    self.line, self.signum, self.step = line, signum, step


def exit_status(signum: int) -> int:
  return 128 + signum


def say(line: str) -> None:
  """`line` on stderr, below any progress bar, flushed. The process's own
  stderr: the watchdog may say it while the main thread has `sys.stderr`
  redirected (train/checkpoint.py quiets orbax while it restores), where the
  line, the process's last, would be lost."""
  stderr = sys.__stderr__ or sys.stderr
  tqdm.write(line, file=stderr)
  sys.stdout.flush()
  stderr.flush()


class Stop:
  """The stop requests of one process (see the module docstring).

  `command(run_dir)`: the command that resumes the run in `run_dir` (None:
  the run folder is not made yet, so the command starts it again), for the
  final line. The loop keeps `run_dir`, `checkpoint` (the step and folder of
  the newest checkpoint, or None) and `phase` current: "starting" until the
  launch's first step is dispatched, then "training"; "saving" while it
  writes the checkpoint that a signal asked for (the watchdog waits for it).
  """

  def __init__(self, command: Callable[[str | None], str], forwarded: tuple[int, ...] = ()):
    self.command = command
    self.forwarded = forwarded
    self.run_dir: str | None = None
    self.signum: int | None = None
    self.phase = "starting"
    self.checkpoint: tuple[int, str] | None = None
    self.longest_step_s = 0.0
    self._lock = threading.Lock()
    self._exiting = False

  @property
  def requested(self) -> bool:
    return self.signum is not None

  def grace_s(self) -> float:
    """How long the watchdog waits for the step in flight: twice the longest
    step of this launch, at least `MIN_GRACE_S`."""
    return max(MIN_GRACE_S, 2 * self.longest_step_s)

  def where(self) -> str:
    if self.checkpoint is None:
      return "no checkpoint saved yet"
    step, folder = self.checkpoint
    return f"its newest checkpoint is step {step} in {folder}"

  def line(self, what: str) -> str:
    """The final line: the signal, what happened, and how to resume."""
    name = signal.Signals(self.signum).name if self.signum else "a signal"
    if self.signum in self.forwarded:
      name = f"its study ({name})"
    how = "resume with" if self.run_dir is not None else "no run folder yet; start again with"
    return f"stopped by {name} {what}; {how}: {self.command(self.run_dir)}"

  def claim_exit(self) -> bool:
    """True for the first caller: the main thread or the watchdog, whichever
    ends the process, prints the one final line."""
    with self._lock:
      if self._exiting:
        return False
      self._exiting = True
      return True

  def hard_exit(self, what: str, *, always_say: bool = False) -> None:
    """Print the final line (unless the main thread is printing its own;
    `always_say`: regardless) and end the process now, from any thread."""
    if self.claim_exit() or always_say:
      say(self.line(what))
    os._exit(exit_status(self.signum or signal.SIGTERM))

  def _handle(self, signum: int, frame) -> None:
    del frame
    if self.signum is None:
      self.signum = signum

  def _watch(self, read_fd: int) -> None:
    received, deadline = 0, None
    while True:
      timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
      ready, _, _ = select.select([read_fd], [], [], timeout)
      if ready:
        try:
          data = os.read(read_fd, 64)
        except OSError:
          return
        if not data:
          return  # uninstalled
        for signum in data:
          if signum not in SIGNALS + self.forwarded:
            continue
          if signum in self.forwarded and self.signum is not None:
            continue  # the signal the process had itself, passed on
          self.signum = self.signum or signum
          received += signum not in self.forwarded
          if received > 1:
            self.hard_exit(f"twice: exiting at once, {self.where()}", always_say=True)
          if self.phase == "starting":
            self.hard_exit(f"before this launch's first step: nothing new to save, "
                           f"{self.where()}")
          deadline = time.monotonic() + self.grace_s()
      elif deadline is not None and time.monotonic() >= deadline:
        if self.phase == "saving" or self._exiting:
          deadline = time.monotonic() + 1.0  # the checkpoint asked for is being written
          continue
        self.hard_exit(f"during a step or evaluation batch that did not finish within "
                       f"{self.grace_s():.0f}s: abandoned it, {self.where()}")


@contextlib.contextmanager
def handling(command: Callable[[str | None], str],
             forwarded: tuple[int, ...] = ()) -> Iterator[Stop | None]:
  """SIGINT and SIGTERM handled by a `Stop` within the block (None, and the
  signals left alone, outside the main thread, where Python cannot set
  handlers). `forwarded`: signals that a parent process passes on (a study's
  runs: train/study_child.py), which ask for a stop like the first SIGINT
  but never count as a second."""
  if threading.current_thread() is not threading.main_thread():
    yield None
    return
  stop = Stop(command, forwarded)
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  previous = {s: signal.signal(s, stop._handle) for s in SIGNALS + forwarded}
  previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  watchdog = threading.Thread(target=stop._watch, args=(read_fd,), name="sagebwd-stop",
                              daemon=True)
  watchdog.start()
  try:
    yield stop
  finally:
    signal.set_wakeup_fd(previous_fd)
    for s, handler in previous.items():
      signal.signal(s, handler)
    os.close(write_fd)  # the watchdog reads end-of-file and returns
    watchdog.join()
    os.close(read_fd)
