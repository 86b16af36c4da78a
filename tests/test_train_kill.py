"""kill -9 of real training processes, resumed each time (issue 18): once while
a metrics row is half written, once while a checkpoint is being saved; the
resumed run's metrics equal an uninterrupted run's, bit for bit (timings
aside). `python -m train.killtest` does the same with 10 random kills."""

from __future__ import annotations

from train import killtest


def test_kill_mid_write_and_mid_save_then_resume_is_exact(tmp_path):
  launches, diffs = killtest.run(tmp_path, ["write", "save"], seed=1)
  kills = [x for x in launches if x.killed]
  assert [x.kind for x in kills] == ["write", "save"], [x.log[-2000:] for x in launches]
  assert not launches[-1].killed and launches[-1].returncode == 0
  assert diffs == []
  # The launch after the write kill found the torn line and dropped it.
  assert "dropped a torn last line" in launches[1].log, launches[1].log[-2000:]
  assert kills[1].note.startswith("while writing ") and "orbax-checkpoint-tmp" in kills[1].note
  # Each launch after a kill continued the run rather than starting it over.
  assert all("Traceback" not in x.log for x in launches)
  assert all(("resumed from step" in x.log or "no checkpoint in" in x.log)
             for x in launches[1:])
