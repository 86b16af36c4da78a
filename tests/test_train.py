"""Pre-training (train/): resume is exact, data is deterministic and checked,
the NaN guard stops a diverging run, the plot command draws a PNG."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest

from train import data, optim
from train.__main__ import main
from train.checkpoint import Checkpoints
from train.config import PRESETS, Config, check, from_args, preset
from train.loop import NonFiniteError, train
from train.metrics import read
from train.plot import main as plot_main
from train.step import build_model, make_steps

# A one-layer, one-head model on a few stdlib folders: seconds per run on a CPU.
SMALL = dict(dim=64, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=128, seq_len=32,
             batch_size=2, warmup=2, eval_every=3, eval_batches=2, progress=False)
SMALL_FLAGS = ["--dim", "64", "--n-layers", "1", "--n-heads", "1", "--n-kv-heads", "1",
               "--ffn-dim", "128", "--seq-len", "32", "--batch-size", "2", "--warmup", "2",
               "--eval-batches", "2", "--attention", "full", "--no-progress"]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
  root = data.stdlib_dir()
  return [str(root / "json"), str(root / "email" / "mime")]


def _cfg(tmp_path, name, corpus, **kw) -> Config:
  return Config(name=name, out=str(tmp_path / name), data=corpus, **{**SMALL, **kw})


def _train_rows(run_dir):
  return {r["step"]: r for r in read(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r}


def test_resume_is_exact(tmp_path, corpus, monkeypatch):
  """6 steps straight == 3 steps, a crash, resume from the step-3 checkpoint, 3 steps."""
  kw = dict(steps=6, grad_accum=2, ckpt_every=3, attention="sage")
  straight = train(_cfg(tmp_path, "straight", corpus, **kw))

  real_batch = data.train_batch

  def crash_at_step_5(ds, seed, step, *args):
    if step == 4:  # steps 4 and 5 are done; the checkpoint holds step 3
      raise KeyboardInterrupt("simulated crash")
    return real_batch(ds, seed, step, *args)

  monkeypatch.setattr(data, "train_batch", crash_at_step_5)
  cfg = _cfg(tmp_path, "resumed", corpus, **kw)
  with pytest.raises(KeyboardInterrupt):
    train(cfg)
  assert Checkpoints(cfg.run_dir, 2).latest_step() == 3
  assert max(_train_rows(cfg.run_dir)) == 4
  monkeypatch.setattr(data, "train_batch", real_batch)
  resumed = train(_cfg(tmp_path, "resumed", corpus, resume=True, **kw))

  a, b = _train_rows(tmp_path / "straight"), _train_rows(cfg.run_dir)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]  # step 4 logged once, not twice
  for step in a:
    for key in ("loss", "grad_norm", "param_norm", "lr"):
      assert a[step][key] == b[step][key], (step, key)
  assert straight["val_loss"] == resumed["val_loss"]
  assert a[6]["loss"] < a[1]["loss"]  # it learns


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path, corpus, capsys):
  run = str(tmp_path / "nan")
  flags = SMALL_FLAGS + ["--data", *corpus, "--out", run, "--ckpt-every", "1"]
  main(flags + ["--steps", "2"])
  assert "tokens per step: 64 = batch 2 x seq 32 x grad_accum 1" in capsys.readouterr().out
  assert open(os.path.join(run, "loss.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"

  # An infinite learning rate: step 3's update makes the parameters non-finite.
  with pytest.raises(SystemExit, match="non-finite values at step 3"):
    main(flags + ["--steps", "4", "--resume", "--lr", "inf"])
  ckpts = Checkpoints(run, 2)
  assert ckpts.latest_step() == 2
  cfg = Config(**{**SMALL, "attention": "full"})
  like, _, _ = make_steps(build_model(cfg, 256), optim.optimizer(cfg))
  state = ckpts.restore(like)
  assert int(state["step"]) == 2
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state)))
  rows = read(os.path.join(run, "metrics.jsonl"))
  assert math.isnan(rows[-1]["param_norm"]) or math.isinf(rows[-1]["param_norm"])


def test_nan_guard_in_the_loop(tmp_path, corpus):
  with pytest.raises(NonFiniteError, match="at step 1"):
    train(_cfg(tmp_path, "inf", corpus, steps=3, lr=math.inf, ckpt_every=1))
  assert Checkpoints(str(tmp_path / "inf"), 2).latest_step() is None  # nothing saved


def test_default_corpus_offline_and_split_deterministic():
  files = data.stdlib_files()
  assert len(files) > 100 and files == sorted(files, key=lambda p: p.as_posix())
  assert all("site-packages" not in p.parts for p in files)
  a, b = data.load([], 0.05, 128), data.load([], 0.05, 128)
  assert a.vocab_size == 256
  np.testing.assert_array_equal(a.train, b.train)
  np.testing.assert_array_equal(a.val, b.val)
  frac = len(a.val) / (len(a.train) + len(a.val))
  assert 0.01 < frac < 0.15, frac
  # The split is by document: the first validation document opens the val stream.
  root = data.stdlib_dir()
  first_val = next(f for f in files if data._in_val(f.relative_to(root).as_posix(), 0.05))
  head = np.frombuffer(first_val.read_bytes()[:1000], np.uint8)
  np.testing.assert_array_equal(a.val[:len(head)], head)
  # Batches are a function of (seed, step) only.
  x = data.train_batch(a, 0, 7, 2, 4, 128)
  assert x.shape == (2, 4, 129) and x.dtype == np.int32
  np.testing.assert_array_equal(x, data.train_batch(b, 0, 7, 2, 4, 128))
  assert not np.array_equal(x, data.train_batch(a, 0, 8, 2, 4, 128))
  np.testing.assert_array_equal(data.val_batch(a, 0, 1, 4, 128), data.val_batch(b, 0, 1, 4, 128))


def test_bad_data_paths_get_clear_errors(tmp_path):
  missing = str(tmp_path / "nope.txt")
  with pytest.raises(ValueError, match="nope.txt.*does not exist"):
    data.load([missing], 0.05, 32)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(ValueError, match="empty.txt.*is empty"):
    data.load([str(empty)], 0.05, 32)
  folder = tmp_path / "folder"
  folder.mkdir()
  (folder / "blank.txt").write_text("")
  with pytest.raises(ValueError, match="folder.*no non-empty text file"):
    data.load([str(folder)], 0.05, 32)
  with pytest.raises(ValueError, match="empty.bin.*is empty"):
    (tmp_path / "empty.bin").write_bytes(b"")
    data.load([str(tmp_path / "empty.bin")], 0.05, 32)
  short = tmp_path / "short.txt"
  short.write_text("hello")
  with pytest.raises(ValueError, match="fewer than seq_len"):
    data.load([str(short)], 0.05, 32)
  # From the command line: an error message, not a traceback.
  with pytest.raises(SystemExit, match="nope.txt"):
    main(SMALL_FLAGS + ["--data", missing, "--out", str(tmp_path / "run")])


def test_bin_tokens(tmp_path):
  tokens = (np.arange(10_000) % 1000).astype(np.uint16)
  path = tmp_path / "tokens.bin"
  tokens.tofile(path)
  ds = data.load([str(path)], 0.1, 64)
  assert ds.vocab_size == 1024  # 1000 rounded up to a multiple of 64
  assert len(ds.train) == 9000 and len(ds.val) == 1000
  np.testing.assert_array_equal(ds.val, tokens[9000:])
  (tmp_path / "odd.bin").write_bytes(b"abc")
  with pytest.raises(ValueError, match="odd.bin"):
    data.load([str(tmp_path / "odd.bin")], 0.1, 64)


def test_presets_and_flags():
  for name in PRESETS:
    check(preset(name))
  cfg = from_args(["--preset", "gpu", "--attention", "full", "--no-qk-norm", "--no-smooth-k",
                   "--smooth-q", "--grad-accum", "2", "--lr", "1e-4", "--out", "x"])
  assert (cfg.attention, cfg.qk_norm, cfg.smooth_k, cfg.smooth_q) == ("full", False, False, True)
  assert cfg.tokens_per_step == 8 * 4096 * 2 and cfg.lr == 1e-4 and cfg.run_dir == "x"
  assert from_args([]).run_dir == "runs/tiny"
  with pytest.raises(ValueError, match="head_dim"):
    check(preset("tiny", dim=96))


def test_plot_writes_png(tmp_path):
  for i, name in enumerate(["a", "b"]):
    run = tmp_path / name
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
      for s in range(1, 21):
        f.write(json.dumps(dict(step=s, tokens=64 * s, loss=5.0 - 0.1 * s - i)) + "\n")
        if s % 5 == 0:
          f.write(json.dumps(dict(step=s, tokens=64 * s, val_loss=5.1 - 0.1 * s - i)) + "\n")
  out = tmp_path / "plots" / "loss.png"
  plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--x", "tokens"])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
  with pytest.raises(SystemExit, match="no metrics.jsonl"):
    plot_main([str(tmp_path), "--out", str(out)])


def test_weight_decay_mask():
  cfg = Config(**SMALL)
  state, _, _ = make_steps(build_model(cfg, 256), optim.optimizer(cfg))
  flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
  mask = jax.tree.leaves(optim.decay_mask(state["params"]))
  decayed = {optim._path_str(p) for (p, _), d in zip(flat, mask) if d}
  kept = {optim._path_str(p) for (p, _), d in zip(flat, mask) if not d}
  assert any("q_proj/kernel" in p for p in decayed) and any("mlp/up" in p for p in decayed)
  assert any("embed" in p for p in kept) and any("q_norm" in p for p in kept)
  assert all("norm" not in p.replace("_proj", "") for p in decayed)
