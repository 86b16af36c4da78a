"""Run folders, metrics and checkpoints when things go wrong (issue 18): a
folder holding a run is never replaced, a torn metrics line is dropped, a
corrupt checkpoint falls back to the previous one, changed flags are named,
a finished run resumes to a right summary, a full disk is one line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from train import data, flops, optim, rundir
from train.__main__ import main
from train.checkpoint import Checkpoints, flatten
from train.cli import from_args
from train.config import Config
from train.loop import train
from train.metrics import MetricsError, MetricsLog, read
from train.step import build_model, make_steps

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(dim=64, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=128, seq_len=32,
             batch_size=2, warmup=2, eval_every=2, eval_batches=2, steps=4, ckpt_every=2,
             keep=3, attention="full", progress=False)
FLAGS = ["--dim", "64", "--n-layers", "1", "--n-heads", "1", "--n-kv-heads", "1",
         "--ffn-dim", "128", "--seq-len", "32", "--batch-size", "2", "--warmup", "2",
         "--eval-every", "2", "--eval-batches", "2", "--steps", "4", "--ckpt-every", "2",
         "--keep", "3", "--attention", "full", "--no-progress"]
TIMINGS = ("tokens_per_s", "step_time", "mfu")


def _strip(rows):
  return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
  return [str(data.stdlib_dir() / "json")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
  """A 4-step run (checkpoints 2 and 4), its summary, and proof that its
  compile time stayed out of tokens/s: compiling moves a fake clock by 1000 s."""
  out = tmp_path_factory.mktemp("finished") / "run"
  compile_fn = jax.stages.Lowered.compile
  offset = [0.0]

  def slow_compile(self, *args, **kwargs):
    offset[0] += 1000.0
    return compile_fn(self, *args, **kwargs)

  real_clock = __import__("time").perf_counter
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(jax.stages.Lowered, "compile", slow_compile)
    mp.setattr("train.loop.time.perf_counter", lambda: real_clock() + offset[0])
    summary = train(Config(out=str(out), data=corpus, peak_tflops=0.5, **SMALL))
  return out, summary


def _copy(finished, tmp_path) -> Path:
  dest = tmp_path / "run"
  shutil.copytree(finished[0], dest)
  return dest


def _like(**overrides):
  cfg = Config(**{**SMALL, **overrides})
  return make_steps(build_model(cfg, 256), optim.optimizer(cfg))[0]


def _tree_equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in
             zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))))


def test_throughput_excludes_compilation_and_summary(finished):
  out, summary = finished
  rows = read(str(out / "metrics.jsonl"))
  train_rows = [r for r in rows if "loss" in r]
  assert summary["compile_s"] >= 1000  # the fake clock's compile
  assert all(r["step_time"] < 1000 for r in train_rows)  # ... counted in no step
  assert summary["tokens_per_s"] > 64 * 4 / 1000
  # MFU beside tokens/s: the model's FLOPs per second over --peak-tflops.
  per_token = flops.flops_per_token(Config(vocab_size=256, **SMALL))
  for r in train_rows:
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 0.5e12)
  assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * per_token / 0.5e12)
  assert (summary["step"], summary["loss"]) == (4, train_rows[-1]["loss"])
  assert summary["val_loss"] == [r for r in rows if "val_loss" in r][-1]["val_loss"]


# --- the run folder -------------------------------------------------------------

def test_a_folder_holding_a_run_is_never_replaced(finished, tmp_path, corpus, capsys):
  run = _copy(finished, tmp_path)
  before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
  with pytest.raises(SystemExit) as e:
    main(FLAGS + ["--data", *corpus, "--out", str(run)])
  assert "already holds a run" in str(e.value) and "--resume" in str(e.value)
  assert "--overwrite" in str(e.value) and "\n" not in str(e.value)
  assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_overwrite_deletes_only_what_a_run_writes(finished, tmp_path):
  run = _copy(finished, tmp_path)
  (run / "notes.txt").write_text("mine")
  logged = []
  rundir.prepare(Config(out=str(run), overwrite=True), str(run), True, logged.append)
  assert sorted(p.name for p in run.iterdir()) == [".lock", "notes.txt"]
  assert "deleted the run" in logged[0]


def test_without_out_a_fresh_run_gets_its_own_folder(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  resolve = lambda **kw: rundir.resolve(Config(name="tiny", **kw))
  assert resolve() == "runs/tiny"
  with pytest.raises(rundir.RunError, match="--resume: no run named 'tiny'"):
    resolve(resume=True)
  os.makedirs("runs/tiny")
  assert resolve() == "runs/tiny"  # an empty folder holds no run
  Path("runs/tiny/config.json").write_text("{}")
  assert (resolve(), resolve(resume=True), resolve(overwrite=True)) == (
      "runs/tiny-2", "runs/tiny", "runs/tiny")
  os.makedirs("runs/tiny-2/checkpoints")
  os.makedirs("runs/tiny-old/checkpoints")  # not one of the numbered folders
  assert (resolve(), resolve(resume=True)) == ("runs/tiny-3", "runs/tiny-2")
  assert resolve(out="elsewhere") == "elsewhere"


def test_bad_out_and_a_second_process(tmp_path, corpus):
  (tmp_path / "file").write_text("x")
  for out, message in ((tmp_path / "file", "is a file, not a folder"),
                       (tmp_path / "file" / "run", "creating the run folder failed: Not a "
                                                   "directory")):
    with pytest.raises(SystemExit, match=message):
      main(FLAGS + ["--data", *corpus, "--out", str(out)])
  fd = rundir.lock(str(tmp_path))
  try:
    with pytest.raises(rundir.RunError, match=f"in use by another training process "
                                              f"\\(pid {os.getpid()}\\)"):
      rundir.lock(str(tmp_path))
  finally:
    os.close(fd)
  os.close(rundir.lock(str(tmp_path)))  # released with its holder


def test_resume_names_every_changed_flag(finished, tmp_path, corpus):
  run = _copy(finished, tmp_path)
  with pytest.raises(SystemExit) as e:
    main(FLAGS + ["--data", *corpus, "--out", str(run), "--resume", "--dim", "128",
                  "--n-heads", "2", "--lr", "0.01"])
  message = str(e.value)
  assert "the flags change the model saved in" in message and "config.json" in message
  for change in ("--dim 64 -> 128", "--n-heads 1 -> 2", "--lr 0.003 -> 0.01"):
    assert change in message
  assert "\n" not in message
  saved = rundir.config_path(str(run))
  cfg = Config(**{**json.load(open(saved)), "out": str(run), "resume": True, "lr": 0.01,
                  "seed": 3})
  logged = []
  rundir.compare_with_saved(cfg, logged.append)
  assert logged == [f"warning: resuming with flags that differ from {saved}: --seed 0 -> 3, "
                    f"--lr 0.003 -> 0.01; the run will not equal one never stopped"]


def test_a_resume_continues_the_saved_run(finished, tmp_path, capsys):
  """`--resume` runs the saved config.json, its steps and schedule among
  them, whatever the preset says: a 4-step run resumed without --steps
  trains no further than step 4. A flag given that changes the run
  (`--steps 6`) is applied, and named in one line."""
  run = _copy(finished, tmp_path)
  saved = json.load(open(rundir.config_path(str(run))))
  before = read(str(run / "metrics.jsonl"))
  resume = ["--preset", "tiny", "--out", str(run), "--resume", "--no-progress"]
  cfg, _ = from_args(resume)
  assert {k: v for k, v in dataclasses.asdict(cfg).items() if k not in rundir.NOT_COMPARED} \
      == {k: v for k, v in saved.items() if k not in rundir.NOT_COMPARED}
  assert "--steps" not in capsys.readouterr().err  # no schedule scaled to the preset's steps

  main(resume)
  assert "nothing to train: the run is at step 4 and --steps is 4" in capsys.readouterr().out
  assert read(str(run / "metrics.jsonl")) == before

  main(resume + ["--steps", "6"])
  out = capsys.readouterr()
  named = [line for line in (out.out + out.err).splitlines() if "--steps" in line]
  assert len(named) == 1 and "--steps 4 -> 6" in named[0], named
  rows = {r["step"]: r for r in read(str(run / "metrics.jsonl")) if "loss" in r}
  assert sorted(rows) == [1, 2, 3, 4, 5, 6]
  assert _strip([rows[s] for s in (1, 2, 3, 4)]) == _strip([r for r in before if "loss" in r])
  schedule = optim.schedule(Config(**{**saved, "steps": 6}))
  for step in (5, 6):  # the saved warmup and learning rates on the 6-step cosine
    assert rows[step]["lr"] == pytest.approx(float(schedule(step - 1)), rel=1e-6)
  assert rows[6]["lr"] == pytest.approx(saved["lr"] * saved["min_lr_ratio"])
  assert json.load(open(rundir.config_path(str(run))))["steps"] == 6


def test_resuming_a_finished_run(finished, tmp_path, corpus, capsys):
  run = _copy(finished, tmp_path)
  main(FLAGS + ["--data", *corpus, "--out", str(run), "--resume"])
  err = capsys.readouterr()
  rows = read(str(run / "metrics.jsonl"))
  loss = [r for r in rows if "loss" in r][-1]["loss"]
  assert "nothing to train: the run is at step 4 and --steps is 4" in err.out
  assert f"step 4, loss {loss:.4f}" in err.err and "None" not in err.err
  assert _strip(rows) == _strip(read(str(finished[0] / "metrics.jsonl")))


# --- metrics --------------------------------------------------------------------

def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
  rows = [dict(step=s, tokens=s, loss=1.0 / s, lr=0.1) for s in range(1, 5)]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "tok')
  warnings = []
  assert read(str(path), warnings.append) == rows
  assert warnings == [f"{path} line 5: dropped a torn last line (what a crash during a write "
                      f"leaves): '{{\"step\": 5, \"tok'"]
  log = MetricsLog(str(tmp_path), 3, warn=warnings.append)  # resumed at step 3
  log.write(step=4, tokens=4, val_loss=2.0)
  log.close()
  assert read(str(path)) == rows[:3] + [dict(step=4, tokens=4, val_loss=2.0)]
  # Anywhere but at the end, a bad line is an error naming the file and line.
  path.write_text('{"step": 1, "tokens": 1, "loss": 1.0, "lr": 0.1}\n{"st\n'
                  '{"step": 3, "tokens": 3, "loss": 1.0, "lr": 0.1}\n')
  with pytest.raises(MetricsError, match=f"{path} line 2: not JSON"):
    MetricsLog(str(tmp_path), 3)
  assert path.read_text().count("\n") == 3  # left as it was


# --- checkpoints ----------------------------------------------------------------

def _largest_data_file(step_dir: Path) -> Path:
  return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)


def _flip(step_dir: Path) -> None:
  p = _largest_data_file(step_dir)
  b = bytearray(p.read_bytes())
  b[len(b) // 2] ^= 0xFF
  p.write_bytes(bytes(b))


def _truncate_data(step_dir: Path) -> None:
  p = _largest_data_file(step_dir)
  os.truncate(p, p.stat().st_size // 2)


def _truncate_metadata(step_dir: Path) -> None:
  os.truncate(step_dir / "state" / "_METADATA", 10)


# A flipped byte is caught by the checksum, or, where it lands in a compressed
# chunk's framing (the trained values, hence the bytes, vary with XLA's
# threading), by orbax failing to read the chunk: either way it is named.
CORRUPTIONS = {"flipped-bytes": (_flip, "(differs from its checksum|orbax cannot read it)"),
               "truncated-data": (_truncate_data, "orbax cannot read it"),
               "truncated-metadata": (_truncate_metadata, "orbax cannot read it")}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
# Orbax's background reads of the corrupted arrays fail in coroutines nobody
# awaits once the restore has failed: expected here, not a leak.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_checkpoint_falls_back_to_the_previous(finished, tmp_path, corruption):
  run = _copy(finished, tmp_path)
  corrupt, reason = CORRUPTIONS[corruption]
  intact = Checkpoints(str(finished[0]), 3).restore(_like(), 2)
  corrupt(run / "checkpoints" / "4")
  logged = []
  ckpts = Checkpoints(str(run), 3)
  state, step = ckpts.restore_newest(_like(), logged.append)
  assert step == 2 and _tree_equal(state, intact)
  assert logged[0].startswith(f"warning: skipping checkpoint 4 in {run / 'checkpoints'}: ")
  assert re.search(reason, logged[0]) and "\n" not in logged[0]
  assert ckpts.manager.all_steps() == [2]
  assert [p.name.split("-")[0] for p in (run / "checkpoints-skipped").iterdir()] == ["4"]
  # With none intact: one line naming each, nothing moved.
  corrupt(run / "checkpoints" / "2")
  with pytest.raises(rundir.RunError, match=f"no checkpoint in .* restores \\(step 2: .*{reason}"):
    Checkpoints(str(run), 3).restore_newest(_like(), logged.append)
  assert (run / "checkpoints" / "2").exists()


def test_a_non_finite_checkpoint_is_skipped(tmp_path):
  like = _like()
  ckpts = Checkpoints(str(tmp_path), 3)
  ckpts.save(1, like)
  bad = {**like, "params": jax.tree.map(lambda x: x * np.nan, like["params"])}
  ckpts.save(2, bad)
  logged = []
  state, step = ckpts.restore_newest(like, logged.append)
  assert step == 1 and "holds non-finite values" in logged[0]
  ckpts.close()


def test_resume_after_a_corrupt_checkpoint_equals_a_run_never_stopped(finished, tmp_path,
                                                                      corpus):
  run = _copy(finished, tmp_path)
  _flip(run / "checkpoints" / "4")
  summary = train(Config(out=str(run), data=corpus, resume=True, **SMALL))
  assert summary["step"] == 4 and summary["tokens_per_s"] is not None  # steps 3, 4 again
  assert _strip(read(str(run / "metrics.jsonl"))) == _strip(
      read(str(finished[0] / "metrics.jsonl")))


def test_checkpoints_are_the_same_with_scan_layers(tmp_path):
  """--scan-layers (issue 32) stacks the blocks' parameters; checkpoints keep
  one array per layer all the same: one saved without it (as every one
  before it) restores into a model with it, and the other way round."""
  plain, scanned = (_like(n_layers=2, scan_layers=scan) for scan in (False, True))
  assert flatten(plain).keys() == flatten(scanned).keys()
  ckpts = Checkpoints(str(tmp_path), 3)
  ckpts.save(1, plain)
  restored = ckpts.restore(scanned, 1)
  stacked = restored["params"]["blocks"]
  for layer in range(2):
    saved_layer = jax.tree.leaves(plain["params"]["blocks"][layer])
    for mine, saved in zip(jax.tree.leaves(stacked), saved_layer, strict=True):
      np.testing.assert_array_equal(mine[layer], saved)
  ckpts.save(2, restored)
  assert _tree_equal(ckpts.restore(plain, 2), plain)
  ckpts.close()


def test_a_full_disk_is_one_line(tmp_path, corpus):
  """A checkpoint that cannot be written (a file-size limit stands in for a full
  disk): one line naming the checkpoint and the reason, no traceback."""
  code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
          "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
          "import runpy; runpy.run_module('train', run_name='__main__')")
  # The limit is for the checkpoint: the suite's compilation cache may read
  # but not write (an entry past the limit would warn of its own error).
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1e9"}
  proc = subprocess.run([sys.executable, "-c", code, *FLAGS, "--data", *corpus, "--out",
                         str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith(f"error: saving checkpoint 2 to {tmp_path / 'run' / 'checkpoints'}"
                              f" failed: ") and "File too large" in errors[0]
  assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr


# --- generation from a run ----------------------------------------------------------

def test_sample_writes_text_from_the_newest_checkpoint_and_touches_nothing(finished,
                                                                          capsys):
  from train.sample import load_config, load_model, main as sample_main, parse_ids
  run = finished[0]
  before = sorted((str(p), p.stat().st_mtime_ns) for p in run.rglob("*"))
  sample_main([str(run), "--prompt", "def ", "--tokens", "6", "--temperature", "0"])
  out, err = capsys.readouterr()
  assert f"{run}: checkpoint of step 4, attention=full" in err
  assert out.startswith("def ") and out.endswith("\n")
  # Greedy: the first byte is the most likely after the prompt (a new
  # document: byte 0, then the prompt) by the restored model's plain forward.
  cfg = load_config(str(run))
  model, step = load_model(str(run), cfg)
  first = int(np.argmax(model(np.asarray([[0, *b"def "]], np.int32))[0, -1]))
  assert step == 4 and (first == 0 or out[4:].encode()[:1] == bytes([first]) or first > 127)
  assert sorted((str(p), p.stat().st_mtime_ns) for p in run.rglob("*")) == before
  assert parse_ids("464, 3290 7", 50304) == [464, 3290, 7]
  for bad, message in (("", "needs token ids"), ("a b", "token ids separated"),
                       ("1 99999", r"must be in \[0, 50304\)")):
    with pytest.raises(ValueError, match=message):
      parse_ids(bad, 50304)
  with pytest.raises(SystemExit, match="has no checkpoints/"):
    sample_main([str(_no_checkpoints(run))])


def _no_checkpoints(run: Path) -> Path:
  other = run.parent / "no-checkpoints"
  other.mkdir(exist_ok=True)
  shutil.copy(run / "config.json", other / "config.json")
  return other
