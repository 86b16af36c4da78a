"""kill -9 of real training processes, resumed each time (issue 18): once while
a metrics row is half written, once while a checkpoint is being saved; and
stops at SIGINT and SIGTERM (issue 49): after a step, and during start-up
(a checkpoint's restore included). The resumed run's metrics equal an uninterrupted
run's, bit for bit (timings aside). `python -m train.killtest` does the same
with 10 random kills."""

from __future__ import annotations

import contextlib
import io
import signal

from train import killtest
from train.stop import say


def test_kills_and_signals_then_resume_is_exact(tmp_path):
  kinds = ["write", "save", "sigint", "sigterm", "sigint-early"]
  launches, diffs = killtest.run(tmp_path, kinds, seed=1)
  kills = [x for x in launches if x.killed or x.stopped]
  assert [x.kind for x in kills] == kinds, [x.log[-2000:] for x in launches]
  assert not launches[-1].killed and launches[-1].returncode == 0
  assert diffs == []
  # The launch after the write kill found the torn line and dropped it.
  assert "dropped a torn last line" in launches[1].log, launches[1].log[-2000:]
  assert kills[1].note.startswith("while writing ") and "orbax-checkpoint-tmp" in kills[1].note
  # Each launch after a kill continued the run rather than starting it over
  # (the one stopped during start-up may stop before it logs where it resumes).
  assert all("Traceback" not in x.log for x in launches)
  assert all(("resumed from step" in x.log or "no checkpoint in" in x.log)
             for x in launches[1:] if x.kind != "sigint-early")
  # A signal after a step: that step saved, one line saying how to resume
  # (no traceback, no C++ abort), exit 128 + the signal, and the next launch
  # that got as far as restoring resumed from that step (the one stopped
  # during start-up may not: it saves nothing, so the launch after it does).
  for i, (x, signum) in enumerate(zip(kills[2:4], (signal.SIGINT, signal.SIGTERM)), 3):
    assert x.returncode == 128 + signum and killtest.stopped_cleanly(x), x.log[-2000:]
    assert f"stopped by {signum.name} at step {x.stopped_at}: saved checkpoint" in x.log
    assert x.log.rstrip().endswith("--resume"), x.log[-500:]
    nxt = next(y for y in launches[i:]
               if "resumed from step" in y.log or "no checkpoint in" in y.log)
    assert nxt.resumed_from == f"step {x.stopped_at}", nxt.log[-2000:]
  # During start-up: at once, with nothing to save.
  early = kills[4]
  assert early.returncode == 128 + signal.SIGINT and killtest.stopped_cleanly(early)
  assert "before this launch's first step: nothing new to save" in early.log, early.log[-2000:]


def test_the_stop_line_reaches_stderr_while_it_is_redirected(capfd):
  """The watchdog says the last line while the main thread may have
  sys.stderr redirected (train/checkpoint.py quiets orbax while restoring)."""
  with contextlib.redirect_stderr(io.StringIO()) as caught:
    say("stopped by SIGINT before this launch's first step")
  assert caught.getvalue() == ""
  assert "stopped by SIGINT before this launch's first step" in capfd.readouterr().err
