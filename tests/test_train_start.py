"""How `python -m train` starts: its persistent compilation cache (a second
identical run loads the train step instead of compiling it) and the GPU
presets' refusal on a machine without a GPU (one line, at once, nothing
written)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import threading
import time

import jax
import pytest

import train.__main__ as cli
from train import compile_cache, flops
from train.cli import parse
from train.config import GPU_PRESETS, preset
from train.rundir import RunError

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A model that compiles in seconds, one step, the stdlib's json package as data.
TINY = ["--dim", "64", "--n-layers", "1", "--n-heads", "1", "--n-kv-heads", "1",
        "--ffn-dim", "128", "--seq-len", "64", "--batch-size", "2", "--steps", "1",
        "--eval-batches", "1", "--ckpt-every", "0", "--no-progress"]


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
  """The environment of a `python -m train` started by a test: no cache
  folder inherited, the default one under `tmp_path`."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
          "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def test_cache_folder_flag_and_default(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compile_cache.resolve(None) == str(tmp_path / "sagebwd-jax" / "jax-cache")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
  assert compile_cache.resolve(None) == "/somewhere"
  assert compile_cache.resolve("none") is None and compile_cache.resolve("d") == "d"
  _, _, options = parse(["--compile-cache", "none", "--allow-cpu"])
  assert options == dict(print_config=False, compile_cache="none", allow_cpu=True)


def test_cache_entries_appear_whole(tmp_path):
  """An entry is renamed into place complete: writers racing on one key
  leave one whole entry and no temporary file."""
  cache = compile_cache.AtomicFileCache(str(tmp_path / "c"))
  assert cache.get("k") is None
  values = [bytes([i]) * 200_000 for i in range(8)]
  threads = [threading.Thread(target=cache.put, args=("k", v)) for v in values]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert cache.get("k") in values and os.listdir(tmp_path / "c") == ["k-cache"]
  cache.put("k", b"other")  # an entry, once there, stays
  assert cache.get("k") in values and (cache.lookups, cache.hits) == (3, 2)


def test_a_second_identical_run_loads_the_train_step(tmp_path):
  """Two identical runs, each in a fresh process: the second loads what the
  first compiled and wrote to the default cache folder, and compiles faster."""
  env = {**_env(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  corpus = str(pathlib.Path(os.__file__).parent / "json")
  logs = []
  for run in ("a", "b"):
    proc = subprocess.run([sys.executable, "-m", "train", *TINY, "--data", corpus, "--out",
                           str(tmp_path / run)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs.append(proc.stdout + proc.stderr)
  folder = tmp_path / "xdg" / "sagebwd-jax" / "jax-cache"
  assert f"compile cache: {folder}" in logs[0]
  assert any(p.name.startswith("jit_train_step-") for p in folder.iterdir())
  cached = [re.search(r"compile cache: (\d+) programs loaded, (\d+) written", log).groups()
            for log in logs]
  assert cached[0][0] == "0" and int(cached[0][1]) > 0, cached
  assert int(cached[1][0]) > 0 and cached[1][1] == "0", cached
  seconds = [float(re.search(r"compiled the train step in ([\d.]+)s", log)[1]) for log in logs]
  assert seconds[1] < seconds[0], seconds


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is for machines "
                    "without a GPU")
@pytest.mark.parametrize("name", GPU_PRESETS,
                         ids=[f"{n}-preset" for n in GPU_PRESETS])  # not the `gpu` mark
def test_gpu_presets_refuse_on_a_cpu_in_one_line(name, tmp_path):
  """In a fresh process, at once: one line saying why (the step time its
  FLOPs take at the CPU's measured rate) and naming --allow-cpu; no run
  folder, no cache folder."""
  (tmp_path / "cwd").mkdir()
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "train", "--preset", name],
                        cwd=tmp_path / "cwd", env=_env(tmp_path), capture_output=True,
                        text=True, timeout=120)
  seconds = time.perf_counter() - t0
  assert proc.returncode == 1 and seconds < 30, (seconds, proc.stderr[-3000:])
  lines = proc.stderr.splitlines()
  assert len(lines) == 1, proc.stderr
  assert re.fullmatch(rf"error: --preset {name} is sized for GPUs and jax sees no GPU here: "
                      rf"one step \(.* FLOPs\) would take at least .* at this CPU's measured "
                      rf"\d+ GFLOP/s .*add --allow-cpu to start it anyway", lines[0]), lines[0]
  assert list(tmp_path.rglob("*")) == [tmp_path / "cwd"]  # nothing written, cache included


def test_allow_cpu_tiny_and_explicit_flags_start(monkeypatch):
  """--allow-cpu, the tiny preset and a model given by flags all reach the
  training loop (stopped there)."""
  def reached(cfg, dataset=None, stop=None):
    raise RunError(f"reached training with dim {cfg.dim}")
  monkeypatch.setattr("train.loop.train", reached)
  monkeypatch.setattr(cli, "_compile_cache", lambda flag, log: None)
  for flags, dim in ((["--preset", "small", "--allow-cpu"], 768), (["--preset", "tiny"], 128),
                     (["--dim", "768", "--n-heads", "12", "--n-kv-heads", "4"], 768)):
    with pytest.raises(SystemExit, match=f"error: reached training with dim {dim}"):
      cli.main(flags)


def test_the_refusal_counts_the_presets_flops():
  line = flops.cpu_refusal(preset("gpu"), "gpu", 100e9)
  assert "262,144 tokens through 309M parameters, 6.4e+14 FLOPs" in line
  assert "at least 1.8 hours at this CPU's measured 100 GFLOP/s" in line
  assert "the run's 20,000 steps 4.1 years" in line
  assert flops.duration(45) == "45 s" and flops.duration(90) == "1.5 minutes"
