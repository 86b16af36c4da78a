"""`python -m train.study` (issues 19 and 35): the grids it names and its
scales (the second round's: head dim 128, 131K tokens per step, six seeds,
one token budget), its tables and plots from a tiny grid of two 3-step runs,
each in a process of its own, resuming without rerunning a finished run, the
compile cache reaching the runs, finished runs' checkpoints deleted, and each
gap's 95% interval over seeds, paired by seed, and its verdict."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from train import study, study_child, study_report
from train.config import check, params_besides_embeddings
from train.metrics import kind, read
from train.study_plan import (NEAR, SCALES, Cell, Gap, Grid, StudyError, grids, plan,
                              run_config, run_status)
from train.study_report import Result, compare, judge, paired_interval, t_quantile

CPU = SCALES["cpu"]
# Two cells of one seed at the larger CPU setting: two 3-step runs.
TINY = Grid("tiny", "a test", (Cell(attention="full"), Cell(attention="full", qk_norm=False)),
            (Gap(1, 0, "above"),))


def test_named_grids_and_h200_scale():
  h200 = SCALES["h200"]
  runs = plan(list(grids(h200).values()), h200, 2, "out", [])
  cfg = run_config(h200, Cell(), 0, "out", [])
  assert 20e6 <= params_besides_embeddings(cfg) <= 40e6 and 1024 <= cfg.seq_len <= 2048
  assert len(h200.grad_accums) >= 3  # the tokens grid's settings
  named = grids(h200)
  assert list(named) == ["tokens", "qknorm", "smoothing", "ds", "fp8"]
  for grid in named.values():
    for gap in grid.comparisons:
      assert grid.cells[gap.cell] != grid.cells[gap.baseline]
  # Same token budget at every setting; shared cells run once, two seeds each.
  assert {c.steps * c.tokens_per_step for c in (run_config(h200, Cell(setting=s), 0, "o", [])
                                                  for s in range(3))} == {200 * 32768}
  outs = [cfg.out for _, cfg in runs]
  assert len(outs) == len(set(outs)) == 30  # fp8 adds its own two cells only
  for _, cfg in runs:
    check(cfg)
    assert cfg.steps >= 200  # issue 19: a few hundred steps per cell


def _json_data() -> list[str]:
  return [str(__import__("train.data").data.stdlib_dir() / "json")]


def test_tiny_grid_tables_plots_and_resume(tmp_path, monkeypatch):
  """The study's own process, a fresh one here, runs the tiny grid without
  importing jax (on a GPU a backend there would take the runs' memory)."""
  out = str(tmp_path / "study")
  data = _json_data()
  code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
          f"from test_study import CPU, TINY; from train import study; "
          f"paths = study.run([TINY], CPU, 1, {out!r}, {data!r}, log=lambda *a: None); "
          f"print(*paths, sep=chr(10)); print('jax imported:', 'jax' in sys.modules)")
  # The runs on the CPU: on a GPU this test's process already holds the memory.
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  *paths, imported = proc.stdout.strip().splitlines()[-5:]
  assert imported == "jax imported: False"
  assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
      "gaps.csv", "summary.csv", "summary.md", "tiny-curves.png"]
  finals = {}
  for cell in TINY.cells:
    cfg = run_config(CPU, cell, 0, out, data)
    assert cfg.steps == 3
    rows = read(f"{cfg.out}/metrics.jsonl")
    finals[cell.name(CPU)] = [r["val_loss"] for r in rows if kind(r) == "eval"][-1]
    assert any(kind(r) == "telemetry" for r in rows)  # the largest setting records it
  summary = (tmp_path / "study" / "summary.md").read_text()
  for name, loss in finals.items():
    assert f"| {name} | 3 | {loss:.4f} |" in summary
  with open(tmp_path / "study" / "summary.csv") as f:
    table = list(csv.DictReader(f))
  assert {(r["cell"], float(r["final_val_loss"])) for r in table} == set(finals.items())
  with open(tmp_path / "study" / "gaps.csv") as f:
    (gap,) = csv.DictReader(f)
  names = [c.name(CPU) for c in TINY.cells]
  assert float(gap["mean_gap"]) == pytest.approx(finals[names[1]] - finals[names[0]])
  assert gap["verdict"] == "one seed: no interval"
  assert (tmp_path / "study" / "tiny-curves.png").read_bytes()[:4] == b"\x89PNG"

  # Resuming: finished runs are not run again; an unfinished one is, resumed
  # (it starts over: the study saves no checkpoints).
  trained = []
  monkeypatch.setattr(study_child, "train",
                      lambda cfg, cache, share: trained.append(cfg) or {"val_loss": 0.0})
  study.run([TINY], CPU, 1, out, data, log=lambda *a: None)
  assert trained == []
  unfinished = run_config(CPU, TINY.cells[1], 0, out, data)
  metrics = f"{unfinished.out}/metrics.jsonl"
  lines = open(metrics).read().splitlines()
  open(metrics, "w").write("\n".join(lines[:4]) + "\n")  # stopped after step 1
  study.run([TINY], CPU, 1, out, data, log=lambda *a: None)
  assert [(c.out, c.resume) for c in trained] == [(unfinished.out, True)]

  # A run that fails stops no other; the study then says which failed.
  first = run_config(CPU, TINY.cells[0], 0, out, data)
  open(f"{first.out}/metrics.jsonl", "w").write("\n".join(lines[:4]) + "\n")

  def fail_first(cfg, cache, share):
    if cfg.out == first.out:
      raise study_child.Failed("RuntimeError: RESOURCE_EXHAUSTED: out of memory")
    trained.append(cfg)
    return {"val_loss": 0.0}

  trained.clear()
  monkeypatch.setattr(study_child, "train", fail_first)
  logged = []
  with pytest.raises(StudyError, match=f"1 run\\(s\\) failed: {first.name} "):
    study.run([TINY], CPU, 1, out, data, log=logged.append)
  assert [c.out for c in trained] == [unfinished.out]
  assert any("FAILED: RuntimeError: RESOURCE_EXHAUSTED: out of memory (" in m for m in logged)


def test_a_study_resumed_grid_by_grid_keeps_every_grid_in_its_summary(tmp_path, monkeypatch):
  """Running one grid into a study folder that holds another's runs rewrites
  the summary with both (it once kept only the grid just run)."""
  other = Grid("other", "another test", (Cell(attention="full", smooth_k=False),), ())
  monkeypatch.setattr(study, "grids", lambda scale: {"tiny": TINY, "other": other})
  data, out = _json_data(), str(tmp_path)
  for cell in TINY.cells:  # the tiny grid's runs, as a finished study leaves them
    cfg = run_config(CPU, cell, 0, out, data)
    os.makedirs(cfg.out)
    with open(f"{cfg.out}/metrics.jsonl", "w") as f:
      f.write(json.dumps({"step": cfg.steps, "tokens": 1, "val_loss": 1.5}) + "\n")
  monkeypatch.setattr(study_child, "train", lambda cfg, cache, share: {"val_loss": 1.0})
  monkeypatch.setattr(study_report, "plot_grid", lambda *a: [])
  study.run([other], CPU, 1, out, data, log=lambda *a: None)
  summary = (tmp_path / "summary.md").read_text()
  assert "## other: another test" in summary and "## tiny: a test" in summary
  assert summary.index("## other") < summary.index("## tiny")  # the chosen grids first
  study.run([other], CPU, 1, str(tmp_path / "fresh"), data, log=lambda *a: None)
  assert "## tiny" not in (tmp_path / "fresh" / "summary.md").read_text()


def test_jobs_run_at_once_sharing_the_gpu_first_seeds_first(tmp_path, monkeypatch):
  """With --jobs 2 two runs train at once (each waits for the other at a
  barrier), sharing the GPU's memory, every first seed before any second
  (which then finds the compiles cached)."""
  barrier, started = threading.Barrier(2, timeout=30), []

  def train(cfg, cache, share):
    started.append((cfg.seed, share))
    barrier.wait()
    return {"val_loss": 1.0}

  monkeypatch.setattr(study_child, "train", train)
  monkeypatch.setattr(study_report, "write_tables", lambda *a: [])
  monkeypatch.setattr(study_report, "plot_grid", lambda *a: [])
  study.run([TINY], CPU, 2, str(tmp_path), _json_data(), log=lambda *a: None, jobs=2)
  assert started == [(0, True)] * 2 + [(1, True)] * 2


def _exit_slowly(path: str) -> tuple[str, None]:
  import atexit
  import time
  atexit.register(lambda: time.sleep(0.5) or open(path, "w").close())
  return "done", None


def test_a_run_ends_with_its_process(tmp_path):
  """The next run starts once the last one's process has exited (on a GPU,
  freeing its memory), its exit not cut short."""
  assert study_child.in_child(_exit_slowly, str(tmp_path / "exited")) == ("done", None)
  assert (tmp_path / "exited").exists()


def test_a_run_that_raises_or_dies_fails_and_one_that_diverges_is_told_apart(monkeypatch):
  assert study_child.in_child(int, "x") == (
      "failed", "ValueError: invalid literal for int() with base 10: 'x'")
  assert study_child.in_child(os._exit, 3) == (
      "failed", "its process exited with status 3 before reporting")
  assert study_child.in_child(signal.raise_signal, signal.SIGKILL) == (
      "failed", "its process was killed by SIGKILL")
  import train.loop

  def diverge(cfg, stop=None):
    raise train.loop.NonFiniteError("non-finite loss at step 2")

  monkeypatch.setattr(train.loop, "train", diverge)
  assert study_child._train(run_config(CPU, Cell(), 0, "o", []), None) == (
      "diverged", "non-finite loss at step 2")


def test_the_second_seed_compiles_its_train_step_from_the_cache(tmp_path, monkeypatch):
  """Each run's process gets --compile-cache before its first compile, and a
  cell's second seed, in a fresh process (a resumed study), adds no train step
  to the cache: it hit. On the CPU the runs take the reference backend,
  without the Mosaic kernels whose per-process counter made a second run in
  one process miss (train/study_child.py), so this tests the plumbing only."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # a toy compiles fast
  scale = dataclasses.replace(CPU, steps_at_largest=1)  # 2 steps, no telemetry, at setting 0
  grid = Grid("one", "a test", (Cell(setting=0),), ())
  out, cache = str(tmp_path / "study"), tmp_path / "cache"
  steps = lambda: sorted(p.name for p in cache.iterdir() if "train_step" in p.name)
  study.run([grid], scale, 1, out, _json_data(), log=lambda *a: None, compile_cache=str(cache))
  assert len(steps()) == 1
  first = steps()
  study.run([grid], scale, 2, out, _json_data(), log=lambda *a: None, compile_cache=str(cache))
  assert run_status(run_config(scale, grid.cells[0], 1, out, _json_data())) == "done"
  assert steps() == first


def test_jobs_below_one_are_refused(tmp_path, capsys):
  with pytest.raises(SystemExit, match="--jobs must be at least 1, got 0"):
    study.main(["--scale", "cpu", "--out", str(tmp_path), "--jobs", "0"])
  assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_folder_of_another_study_is_refused(tmp_path):
  cfg = run_config(CPU, Cell(), 0, str(tmp_path), [])
  (tmp_path / cfg.name).mkdir()
  (tmp_path / cfg.name / "config.json").write_text(json.dumps({"dim": 999, "steps": 3}))
  with pytest.raises(StudyError, match=r"holds a run with other settings \(dim\)"):
    study.run([Grid("g", "", (Cell(),), ())], CPU, 1, str(tmp_path), [])


def test_a_diverged_run_is_finished(tmp_path):
  cfg = run_config(CPU, Cell(), 0, str(tmp_path), [])
  (tmp_path / cfg.name).mkdir()
  (tmp_path / cfg.name / "metrics.jsonl").write_text(
      json.dumps(dict(step=0, tokens=0, val_loss=5.5)) + "\n"
      + json.dumps(dict(step=1, tokens=128, loss=math.nan, lr=1e-3, grad_norm=math.nan,
                        param_norm=1.0)) + "\n")
  assert run_status(cfg) == "diverged"
  assert study_report.result(cfg, 0).diverged_at == 1


def _results(losses, status="done"):
  return [Result("r", s, status, val_loss=x if status == "done" else None)
          for s, x in enumerate(losses)]


@pytest.mark.parametrize("p,dof,t", [(0.975, 1, 12.7062), (0.975, 2, 4.3027),
                                     (0.975, 5, 2.5706), (0.975, 10, 2.2281),
                                     (0.975, 30, 2.0423), (0.95, 5, 2.0150), (0.995, 7, 3.4995)])
def test_t_quantile_against_the_table(p, dof, t):
  assert t_quantile(p, dof) == pytest.approx(t, abs=5e-5)


def test_paired_interval_by_hand():
  """Six seeds: gaps .01 .03 .02 .05 .00 .03, mean .023333, standard
  deviation .0175119, standard error .0071492, times t(0.975, 5) = 2.5706."""
  cell = [2.01, 2.13, 1.92, 2.05, 2.00, 1.93]
  baseline = [2.00, 2.10, 1.90, 2.00, 2.00, 1.90]
  c = compare(_results(cell), _results(baseline), Gap(0, 1, "above"))
  assert c["gaps"] == pytest.approx([0.01, 0.03, 0.02, 0.05, 0.00, 0.03])
  assert c["mean"] == pytest.approx(0.0233333, abs=1e-6)
  assert c["interval"] == pytest.approx((0.0049557, 0.0417109), abs=1e-6)
  assert c["verdict"] == "supports"
  # Paired: the cells' own spread over seeds (0.21) does not widen the interval.
  assert c["interval"][1] - c["interval"][0] < 0.04
  assert paired_interval([0.1, 0.3]) == pytest.approx((0.2 - 1.27062, 0.2 + 1.27062), abs=1e-5)
  assert paired_interval([0.1]) is None
  # A weighted gap: the cell's error against half the baseline's.
  errors = compare(_results([0.010, 0.012]), _results([0.030, 0.028]), Gap(0, 1, "below",
                                                                           weight=0.5))
  assert errors["gaps"] == pytest.approx([-0.005, -0.002])


@pytest.mark.parametrize("interval,expect,verdict", [
    ((0.001, 0.05), "above", "supports"),
    ((0.0, 0.05), "above", "cannot tell"),  # open at 0
    ((-0.05, 0.0), "above", "contradicts"),
    ((-0.05, 0.001), "above", "cannot tell"),
    ((-0.05, -0.001), "below", "supports"),
    ((0.0, 0.05), "below", "contradicts"),
    ((-NEAR, NEAR), "near", "supports"),  # closed at +-NEAR
    ((-NEAR - 1e-9, 0.0), "near", "cannot tell"),
    ((NEAR, 0.1), "near", "cannot tell"),
    ((NEAR + 1e-9, 0.1), "near", "contradicts"),
    ((-0.1, -NEAR - 1e-9), "near", "contradicts"),
])
def test_verdict_rule_at_its_edges(interval, expect, verdict):
  assert judge(interval, expect) == verdict


def test_divergence_and_unfinished_runs_in_the_verdict():
  gap = Gap(0, 1, "near")
  diverged = [Result("r", 0, "diverged", diverged_at=7), Result("r", 1, "done", val_loss=2.0)]
  assert compare(diverged, _results([2.0, 2.1]), gap)["verdict"] == "cell diverged (1/2 seeds)"
  partial = [Result("r", 0, "partial"), Result("r", 1, "done", val_loss=2.0)]
  assert compare(_results([2.0, 2.1]), partial, gap)["verdict"] == "unfinished"
  three = _results([2.00, 2.01, 2.02]) + [Result("r", 3, "partial")]
  assert compare(three, _results([2.00, 2.00, 2.01, 2.0]), gap)["verdict"] == (
      "unfinished (3/4 seeds), so far: cannot tell")
  assert compare(_results([2.0]), _results([1.9]), gap)["verdict"] == "one seed: no interval"


def test_second_round_scale_lists_d128_131k_six_seeds_one_budget(tmp_path, capsys):
  """Issue 35's bars on `--list`: head dim 128, >= 131K tokens per step,
  six seeds per cell by default, the same tokens in every run."""
  study.main(["tokens", "smoothing", "ds", "--scale", "h200-d128", "--list",
              "--out", str(tmp_path)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("scale h200-d128: dim 512, 8 layers, 4 heads of 128, context 1024;"
                             " tokens per step 16,384, 32,768, 65,536, 131,072 ")
  assert lines[0].endswith("; 6 seeds per cell")
  runs = lines[1:-1]
  assert lines[-1] == "66 runs of 11 cells, 865.1M tokens; 66 runs, 865.1M tokens left"
  assert {line.split(" = ")[1].split(",")[0] for line in runs} == {"13.1M"}
  for cell in ("sage-tps131072", "full-tps131072", "sage-tps131072-dsbf16",
               "sage-tps131072-nosmoothk", "sage-tps16384"):
    assert sum(line.split(":")[0].rsplit("-s", 1)[0] == cell for line in runs) == 6
  scale = SCALES["h200-d128"]
  for gap in grids(scale)["ds"].comparisons:  # (ii) at the largest setting, with telemetry
    for i in (gap.cell, gap.baseline):
      cfg = run_config(scale, grids(scale)["ds"].cells[i], 0, "o", [])
      assert cfg.tokens_per_step == 131072 and cfg.telemetry_every > 0
      assert cfg.dim // cfg.n_heads == 128
      check(cfg)


def test_cli_help_list_and_errors(tmp_path, capsys):
  with pytest.raises(SystemExit):
    study.main(["--help"])
  text = capsys.readouterr().out
  for grid, finding in (("tokens", "(iii)"), ("qknorm", "(i)"), ("smoothing", "(iv)"),
                        ("ds", "(ii)"), ("fp8", "int8_fp8")):
    assert f"- {grid}:" in text and finding in text
  study.main(["--scale", "cpu", "--list", "--out", str(tmp_path)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[-1] == "24 runs of 12 cells, 0.0M tokens; 24 runs, 0.0M tokens left"
  assert lines[1] == ("sage-tps64-s0: 6 steps x 64 tokens = 0.0M, lr 0.003, telemetry every -, "
                      "checkpoint every -: absent")
  with pytest.raises(SystemExit):
    study.main(["speed", "--scale", "cpu"])
  assert "unknown grid(s) speed" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    study.main(["--scale", "cpu", "--start-within", "0"])
  assert "--start-within must be a positive number of minutes, got 0.0" in (
      capsys.readouterr().err)


def test_finished_runs_lose_their_checkpoints_and_start_within_stops_new_runs(tmp_path,
                                                                              monkeypatch):
  """A scale that checkpoints (so a stopped run resumes mid-way) keeps no
  checkpoint of a finished run; past --start-within no run starts."""
  scale = dataclasses.replace(CPU, checkpoints=3)
  assert run_config(scale, Cell(), 0, "o", []).ckpt_every == 1  # 3 steps, 3 checkpoints
  clock = iter([0.0] + [0.0] * 2 + [600.0] * 10)  # the study's start, then two runs in time
  monkeypatch.setattr(study.time, "monotonic", lambda: next(clock))
  trained = []

  def train(cfg, cache, share):
    os.makedirs(f"{cfg.out}/checkpoints/3")
    with open(f"{cfg.out}/metrics.jsonl", "w") as f:
      f.write(json.dumps({"step": cfg.steps, "tokens": 1, "val_loss": 1.0}) + "\n")
    trained.append(cfg.out)
    return {"val_loss": 1.0}

  monkeypatch.setattr(study_child, "train", train)
  monkeypatch.setattr(study_report, "plot_grid", lambda *a: [])
  logged = []
  study.run([TINY], scale, 2, str(tmp_path), _json_data(), log=logged.append, start_within=5)
  assert len(trained) == 2 and not any(
      os.path.exists(f"{out}/checkpoints") for out in trained)
  assert logged[-1] == ("2 run(s) not started: --start-within 5 minutes had passed; the same "
                        "command runs them")
  assert trained == [run_config(scale, TINY.cells[0], s, str(tmp_path), []).out for s in (0, 1)]
  left = run_config(scale, TINY.cells[1], 0, str(tmp_path), []).out
  os.makedirs(f"{left}/checkpoints/3")  # finished, stopped before its clean-up
  with open(f"{left}/metrics.jsonl", "w") as f:
    f.write(json.dumps({"step": 3, "tokens": 1, "val_loss": 1.0}) + "\n")
  study.run([TINY], scale, 2, str(tmp_path), _json_data(), log=lambda *a: None)
  assert not os.path.exists(f"{left}/checkpoints")
  assert trained[2:] == [run_config(scale, TINY.cells[1], 1, str(tmp_path), []).out]


def test_the_ds_grid_reports_its_telemetry_layer_by_layer(tmp_path):
  grid = grids(CPU)["ds"]
  for i, cell in enumerate(grid.cells):
    cfg = run_config(CPU, cell, 0, str(tmp_path), [])
    os.makedirs(cfg.out)
    errors = {k: [0.01 * (i + 1), 0.02 * (i + 1)] for k in ("ds_rel_l2", "dq_rel_l2")}
    with open(f"{cfg.out}/metrics.jsonl", "w") as f:
      f.write(json.dumps({"step": 3, "tokens": 1, "max_logit": [5.0, 6.0], **errors}) + "\n")
      f.write(json.dumps({"step": 3, "tokens": 1, "val_loss": 1.5}) + "\n")
  study_report.write_tables([grid], CPU, 1, str(tmp_path), [])
  summary = (tmp_path / "summary.md").read_text()
  assert "| cell, error | layer 0 | layer 1 |" in summary
  assert "| sage-tps128-dsbf16 dq_rel_l2 | 0.0200 | 0.0400 |" in summary
  assert "| dq_rel_l2: sage-tps128-dsbf16 - 0.5 x sage-tps128 | < 0 | +0.0300 | +0.0300 | - |" \
      " one seed: no interval |" in summary


def test_a_signal_stops_the_runs_under_way_with_their_steps_saved(tmp_path):
  """Issue 49: SIGINT to the study passes on to its run (study_child.STOP_SIGNAL),
  which saves its last completed step and ends; the study then ends with
  one line saying how to resume (exit 130), starting no other run, and
  without a traceback. The same command resumes the run from that step
  (the resume itself: test_tiny_grid_tables_plots_and_resume)."""
  out = tmp_path / "study"
  args = ["tokens", "--scale", "cpu", "--seeds", "1", "--steps", "200", "--out", str(out),
          "--data", *_json_data()]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
  proc = subprocess.Popen([sys.executable, "-m", "train.study", *args], env=env,
                          cwd=os.path.dirname(os.path.dirname(__file__)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  first = run_config(CPU, Cell(setting=0), 0, str(out), _json_data()).out
  metrics = f"{first}/metrics.jsonl"
  deadline = time.monotonic() + 120
  while proc.poll() is None and time.monotonic() < deadline and not (
      os.path.exists(metrics) and sum('"loss"' in line for line in open(metrics)) >= 2):
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  log, _ = proc.communicate(timeout=60)
  assert proc.returncode == 130, log[-3000:]
  assert "Traceback" not in log and "terminate called" not in log, log[-3000:]
  saved = re.search(r"interrupted: stopped by its study \(SIGUSR1\) at step (\d+): "
                    r"saved checkpoint \1 in (\S+)", log)
  assert saved and os.path.isdir(os.path.join(saved.group(2), saved.group(1))), log[-3000:]
  assert log.rstrip().endswith(f"resume with: python -m train.study {shlex.join(args)}")
  assert "[2/" not in log  # no other run started
