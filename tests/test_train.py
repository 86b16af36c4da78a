"""Pre-training (train/): resume is exact, data is deterministic and checked,
the NaN guard stops a diverging run, flags are validated and explained, the
plot command draws a PNG and explains what it cannot read.

Run folders, metrics and checkpoints under crashes: test_train_runs.py; kill -9
of real processes: test_train_kill.py."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train import data, flops, optim
from train.__main__ import main
from train.checkpoint import Checkpoints
from train.cli import field_docs, from_args
from train.config import CHOICES, PRESETS, RANGES, Config, check, params_besides_embeddings, preset
from train.loop import NonFiniteError, train
from train.metrics import read
from train.plot import figure
from train.plot import main as plot_main
from train.step import build_model, count_params, make_steps

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
  assert Checkpoints(cfg.out, 2).latest_step() == 3
  assert max(_train_rows(cfg.out)) == 4
  monkeypatch.setattr(data, "train_batch", real_batch)
  resumed = train(_cfg(tmp_path, "resumed", corpus, resume=True, **kw))

  a, b = _train_rows(tmp_path / "straight"), _train_rows(cfg.out)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]  # step 4 logged once, not twice
  for step in a:
    for key in ("loss", "grad_norm", "param_norm", "lr"):
      assert a[step][key] == b[step][key], (step, key)
  assert straight["val_loss"] == resumed["val_loss"]
  assert a[6]["loss"] < a[1]["loss"]  # it learns
  run_cfg = Config(**{**SMALL, **kw})
  assert a[1]["lr"] == float(optim.schedule(run_cfg)(0)) > 0  # the first step learns too
  assert a[6]["lr"] == pytest.approx(run_cfg.lr * run_cfg.min_lr_ratio)


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path, corpus, capsys):
  run = str(tmp_path / "nan")
  flags = SMALL_FLAGS + ["--data", *corpus, "--out", run, "--ckpt-every", "1"]
  main(flags + ["--steps", "2"])
  assert "tokens per step: 64 = batch 2 x seq 32 x grad_accum 1" in capsys.readouterr().out
  assert open(os.path.join(run, "loss.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"

  # A learning rate of 1e30: step 3's update makes the parameter norm overflow.
  with pytest.raises(SystemExit, match="non-finite values at step 3"):
    main(flags + ["--steps", "4", "--resume", "--lr", "1e30"])
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
  with pytest.raises(NonFiniteError, match="at step 1.*No checkpoint was saved"):
    train(_cfg(tmp_path, "inf", corpus, steps=3, lr=1e30, warmup=0, ckpt_every=1))
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
  cfg, print_config = from_args(["--preset", "gpu", "--attention", "full", "--no-qk-norm",
                                 "--no-smooth-k", "--smooth-q", "--grad-accum", "2", "--lr",
                                 "1e-4", "--out", "x", "--name", "mine"])
  assert (cfg.attention, cfg.qk_norm, cfg.smooth_k, cfg.smooth_q) == ("full", False, False, True)
  assert cfg.tokens_per_step == 8 * 4096 * 2 and cfg.lr == 1e-4 and cfg.out == "x"
  assert (cfg.name, cfg.dim, print_config) == ("mine", 1024, False)
  assert from_args([])[0] == preset("tiny")
  with pytest.raises(ValueError, match="head_dim"):
    check(preset("tiny", dim=96))


def test_model_flags_are_llama_fields_with_its_choices():
  """Each model flag sets the LlamaConfig field of its name (build_model maps
  them by name), and the flags' choices are LlamaConfig's Literals."""
  from typing import get_args

  from pallas_kernels.types import DS_PRECISIONS, QUANTIZATIONS
  from sagebwd_jax.flax.attention import AttentionImpl
  from sagebwd_jax.flax.llama import LlamaConfig, Remat
  _, groups = field_docs()
  model = {name for name, group in groups.items() if group.startswith("model")}
  assert model <= {f.name for f in dataclasses.fields(LlamaConfig)}, model
  assert CHOICES["attention"] == get_args(AttentionImpl)
  assert CHOICES["ds_precision"] == DS_PRECISIONS
  assert CHOICES["quantization"] == QUANTIZATIONS
  assert CHOICES["remat"] == get_args(Remat)


def test_steps_alone_scales_the_presets_schedule(capsys):
  """`--steps 10` alone (issue 33: "--warmup must be in [0, 10], got 25"):
  the preset's warmup, evaluation and checkpoint intervals scale with it,
  and a line says so; flags given keep their values."""
  cfg, _ = from_args(["--steps", "10"])
  assert (cfg.warmup, cfg.eval_every, cfg.ckpt_every, cfg.telemetry_every) == (1, 2, 5, 0)
  err = capsys.readouterr().err
  assert "--warmup 1 (from 25)" in err and "--eval-every 2 (from 50)" in err
  cfg, _ = from_args(["--preset", "tiny", "--steps", "12", "--eval-every", "7"])
  assert (cfg.warmup, cfg.eval_every, cfg.ckpt_every) == (1, 7, 6)
  assert "--eval-every" not in capsys.readouterr().err
  cfg, _ = from_args(["--preset", "small", "--steps", "100000", "--warmup", "3"])
  assert (cfg.warmup, cfg.eval_every, cfg.ckpt_every) == (3, 5000, 10000)
  capsys.readouterr()
  assert from_args(["--steps", "250"])[0] == preset("tiny")
  assert capsys.readouterr().err == ""


def test_the_first_update_learns():
  """The first optimizer step's learning rate is lr / warmup, not 0."""
  cfg = preset("tiny", steps=10, warmup=4)
  lr = [float(optim.schedule(cfg)(i)) for i in range(10)]
  np.testing.assert_allclose(lr[:4], [cfg.lr / 4 * n for n in (1, 2, 3, 4)], rtol=1e-6)
  assert lr[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)
  assert float(optim.schedule(preset("tiny", warmup=0))(0)) == pytest.approx(cfg.lr, rel=1e-3)


def test_bad_data_leaves_no_run_folder(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit, match="--data: '/nonexistent' does not exist"):
    main(["--data", "/nonexistent", "--no-progress"])
  assert list(tmp_path.iterdir()) == []


# Every flag the issue found accepted or crashing, and what the error must name.
BAD_FLAGS = [
    (["--lr", "-3e-3"], "--lr must be > 0, got -0.003"),
    (["--lr=-3e-3"], "--lr must be > 0"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--grad-clip", "-1"], "--grad-clip must be > 0"),
    (["--grad-clip", "0"], "--grad-clip must be > 0"),
    (["--beta1", "2"], r"--beta1 must be in \[0, 1\), got 2.0"),
    (["--beta2", "1"], r"--beta2 must be in \[0, 1\)"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["--warmup", "500", "--steps", "1"], r"--warmup must be in \[0, --steps\] = \[0, 1\]"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--ffn-dim", "0"], "--ffn-dim must be >= 1"),
    (["--min-lr-ratio", "1.5"], r"--min-lr-ratio must be in \[0, 1\]"),
    (["--val-fraction", "1"], r"--val-fraction must be in \(0, 1\)"),
    (["--seed", "-1"], "--seed must be in"),
    (["--keep", "0"], "--keep must be >= 1"),
    (["--name", "../x"], "--name must be"),
    (["--resume", "--overwrite"], "--resume and --overwrite"),
    (["--n-kv-heads", "3"], "--n-kv-heads must divide --n-heads"),
    (["--mesh", "data"], "--mesh 'data'"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_get_one_line_naming_the_flag(flags, message, capsys):
  with pytest.raises(SystemExit) as e:
    main(flags)
  assert str(e.value).startswith("error: ") and "\n" not in str(e.value)
  assert re.search(message, str(e.value)), e.value
  assert "Traceback" not in capsys.readouterr().err


# Mistakes argparse itself catches (a choice, a type, a missing value, an
# unknown flag), in each command-line tool of train/ and benchmarks/.
PARSER_ERRORS = [
    ("train", ["--quantization", "fp8"], r"argument --quantization: invalid choice: 'fp8'"),
    ("train", ["--steps", "ten"], r"argument --steps: invalid int value: 'ten'"),
    ("train", ["--lr"], r"argument --lr: expected one argument"),
    ("train", ["--lr-peak", "3"], r"unrecognized arguments: --lr-peak 3"),
    ("train.plot", [], r"the following arguments are required: runs"),
    ("train.sample", ["run", "--tokens", "many"], r"argument --tokens: invalid int value"),
    ("train.study", ["--scale", "huge"], r"argument --scale: invalid choice: 'huge'"),
    ("train.killtest", ["--kills", "x"], r"argument --kills: invalid int value"),
    ("benchmarks.accuracy", ["--sigmas"], r"argument --sigmas: expected one argument"),
]


@pytest.mark.parametrize("module,argv,message", PARSER_ERRORS,
                         ids=[" ".join([m, *a]) for m, a, _ in PARSER_ERRORS])
def test_flag_errors_name_the_flag_without_the_usage(module, argv, message, capsys,
                                                    monkeypatch):
  """The line naming the mistake, then where the flags are listed; not
  argparse's usage first (28 lines for python -m train)."""
  import importlib
  script = importlib.import_module(module if module != "train" else "train.__main__")
  monkeypatch.setattr("sys.argv", [module, *argv])  # the benchmarks' main reads it
  with pytest.raises(SystemExit) as e:
    script.main()
  assert e.value.code == 2
  err = capsys.readouterr().err.splitlines()
  assert err == [err[0], f"python -m {module} --help lists every flag and the values it takes"]
  assert re.fullmatch(rf"python -m {re.escape(module)}: error: {message}.*", err[0]), err[0]


def test_help_is_grouped_with_defaults_and_presets(capsys):
  with pytest.raises(SystemExit):
    main(["--help"])
  out = capsys.readouterr().out
  titles = ["run:", "model:", "data:", "optimisation:", "evaluation and checkpoints:",
            "devices:", "presets:"]
  positions = [out.index("\n" + t) for t in titles]
  assert positions == sorted(positions), "groups missing or out of order"
  group_of = lambda option: titles[sum(p < out.index("\n  " + option) for p in positions) - 1]
  assert group_of("--lr LR") == "optimisation:" and group_of("--dim DIM") == "model:"
  assert group_of("--keep KEEP") == "evaluation and checkpoints:"
  assert group_of("--mesh MESH") == "devices:" and group_of("--seq-len") == "data:"
  flat = " ".join(out.split())  # argparse wraps to the terminal's width
  assert "--lr LR Peak learning rate (> 0; default 0.003, small 0.0006, gpu 0.0003)" in flat
  assert "--beta1 BETA1 Adam's first-moment decay (in [0, 1); default 0.9)" in flat
  helps, groups = field_docs()
  for f in Config.__dataclass_fields__:
    assert helps.get(f) and groups.get(f), f"{f} has no help line or group"
    assert "--" + f.replace("_", "-") in out
  for name in PRESETS:
    c = preset(name)
    assert re.search(rf"{name}: dim {c.dim}, {c.n_layers} layers.*"
                     rf"{params_besides_embeddings(c) / 1e6:.1f}M parameters.*"
                     rf"{c.tokens_per_step:,} tokens/step", flat), name


def test_parameter_count_in_help_matches_the_model():
  for kw in ({}, dict(n_kv_heads=1, qk_norm=False), dict(tie_embeddings=True)):
    cfg = Config(**{**SMALL, **kw})
    state, _, _ = make_steps(build_model(cfg, 256), optim.optimizer(cfg))
    embeddings = 256 * cfg.dim * (1 if cfg.tie_embeddings else 2)
    assert count_params(state["params"]) == params_besides_embeddings(cfg) + embeddings, kw


def test_model_flops_count_every_weight_and_causal_attention():
  """MFU's FLOPs per token: 6 per weight that multiplies (every parameter but
  the embedding table's lookup; a tied table multiplies as the output layer)
  plus 6 x seq_len x dim per layer, against the built model's parameters."""
  for kw in ({}, dict(tie_embeddings=True)):
    cfg = Config(**{**SMALL, **kw, "vocab_size": 256})
    params = count_params(build_model(cfg, 256))
    lookup = 0 if cfg.tie_embeddings else 256 * cfg.dim
    want = 6 * (params - lookup) + 6 * cfg.n_layers * cfg.seq_len * cfg.dim
    assert flops.flops_per_token(cfg) == want, kw
  assert flops.device_peak_tflops("NVIDIA H200") == 989.0
  assert flops.device_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
  assert flops.device_peak_tflops("NVIDIA L40S") == 362.0
  assert flops.device_peak_tflops("cpu") is None
  assert flops.peak_flops(jax.devices()) is None  # this machine's CPU
  assert flops.peak_flops(jax.devices(), 2.0) == 2e12 * jax.device_count()


def test_every_range_is_enforced_on_the_config_too():
  """`check` guards Config built in code as well as from flags."""
  for name, allowed in RANGES.items():
    bad = (allowed.lo - 1) if not allowed.lo_open else allowed.lo
    with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be"):
      check(Config(**{name: bad}))
  with pytest.raises(ValueError, match="--dim must be an integer"):
    check(Config(dim=128.0))
  with pytest.raises(ValueError, match="--attention must be one of sage, full, reference"):
    check(Config(attention="flash"))


def test_print_config(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  main(["--preset", "small", "--lr", "1e-4", "--print-config"])
  shown = json.loads(capsys.readouterr().out)
  assert shown["lr"] == 1e-4 and shown["dim"] == 768 and shown["out"] == "runs/small"
  assert set(shown) == set(Config.__dataclass_fields__)
  assert not (tmp_path / "runs").exists()  # it only prints


def _write_metrics(run, lines, config=None):
  run.mkdir(parents=True, exist_ok=True)
  (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
  if config is not None:
    (run / "config.json").write_text(json.dumps(config))


def _rows(n, offset=0.0):
  out = []
  for s in range(1, n + 1):
    out.append(json.dumps(dict(step=s, tokens=64 * s, loss=5.0 - 0.1 * s - offset,
                               lr=1e-3 * min(1, s / 5))))
    if s % 5 == 0:
      out.append(json.dumps(dict(step=s, tokens=64 * s, val_loss=5.1 - 0.1 * s - offset)))
  return out


def test_plot_writes_png(tmp_path, capsys):
  for i, name in enumerate(["a", "b"]):
    _write_metrics(tmp_path / name, _rows(20, i))
  out = tmp_path / "plots" / "loss.png"
  plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--x", "tokens"])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
  assert capsys.readouterr().out.strip() == str(out)
  # Without an extension the file written is FILE.png, and that is what is printed.
  plot_main([str(tmp_path / "a"), "--out", str(tmp_path / "x")])
  assert capsys.readouterr().out.strip() == str(tmp_path / "x.png")
  assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "x").exists()


def test_plot_without_out_writes_beside_the_runs(tmp_path, monkeypatch, capsys):
  for i, name in enumerate(["a", "b"]):
    _write_metrics(tmp_path / "runs" / name, _rows(5, i))
  monkeypatch.chdir(tmp_path)
  plot_main(["runs/a"])
  assert capsys.readouterr().out.strip() == os.path.join("runs", "a", "loss.png")
  plot_main(["runs/a", "runs/b/"])
  assert capsys.readouterr().out.strip() == os.path.join("runs", "loss-a-vs-b.png")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing in the cwd
  assert (tmp_path / "runs" / "a" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_has_title_lr_panel_and_uniform_line(tmp_path):
  config = dict(attention="sage", batch_size=2, seq_len=32, grad_accum=2, vocab_size=256)
  _write_metrics(tmp_path / "mine", _rows(10), config)
  fig = figure([str(tmp_path / "mine")])
  loss_ax, lr_ax = fig.axes
  assert loss_ax.get_title() == "mine (sage, 128 tokens/step)"
  assert lr_ax.get_ylabel() == "learning rate"
  np.testing.assert_allclose(lr_ax.lines[0].get_ydata(), [1e-3 * min(1, s / 5)
                                                          for s in range(1, 11)])
  uniform = [ln for ln in loss_ax.lines if "uniform" in str(ln.get_label())]
  assert len(uniform) == 1 and "ln 256 = 5.545" in uniform[0].get_label()
  np.testing.assert_allclose(uniform[0].get_ydata(), math.log(256))
  assert loss_ax.get_ylim()[1] > math.log(256)  # visible, not on the frame


@pytest.mark.parametrize("lines,message", [
    ([], "metrics.jsonl has no rows"),
    (['{"step": 1, "tokens": 64, "loss": 5.0, "lr": 0.1}', '{"step": 2, "tok',
      '{"step": 3, "tokens": 192, "loss": 4.0, "lr": 0.1}'], r"metrics.jsonl line 2: not JSON"),
    (['{"tokens": 64, "loss": 5.0, "lr": 0.1}'], "metrics.jsonl line 1: a row without step"),
    (['{"step": 1, "tokens": 64, "loss": 5.0}'], "metrics.jsonl line 1: a row without lr"),
    (['{"step": 1, "tokens": 64}'], "line 1: a row without loss or val_loss"),
    (['[1, 2]'], "metrics.jsonl line 1: not a JSON object"),
], ids=["empty", "malformed", "no-step", "no-lr", "no-loss", "not-object"])
def test_plot_errors_name_file_and_line(tmp_path, lines, message, capsys):
  _write_metrics(tmp_path / "run", lines)
  with pytest.raises(SystemExit, match=message) as e:
    plot_main([str(tmp_path / "run"), "--out", str(tmp_path / "p.png")])
  assert str(tmp_path / "run" / "metrics.jsonl") in str(e.value)
  assert not (tmp_path / "p.png").exists()


def test_plot_other_errors(tmp_path, capsys):
  with pytest.raises(SystemExit, match="no metrics.jsonl"):
    plot_main([str(tmp_path), "--out", str(tmp_path / "p.png")])
  (tmp_path / "dir" / "metrics.jsonl").mkdir(parents=True)
  with pytest.raises(SystemExit, match="metrics.jsonl is a folder"):
    plot_main([str(tmp_path / "dir"), "--out", str(tmp_path / "p.png")])
  _write_metrics(tmp_path / "ok", _rows(3))
  with pytest.raises(SystemExit, match="--out .*p.xyz.*not supported"):
    plot_main([str(tmp_path / "ok"), "--out", str(tmp_path / "p.xyz")])
  # A torn last line (a run being written) is dropped with a warning, not an error.
  with open(tmp_path / "ok" / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "tok')
  plot_main([str(tmp_path / "ok"), "--out", str(tmp_path / "p.png")])
  assert "metrics.jsonl line 4: dropped a torn last line" in capsys.readouterr().err


def _by_path(tree) -> dict[str, jax.Array]:
  return {"/".join(optim._keys(p)): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unstacked(tree) -> dict[str, jax.Array]:
  """A scanned model's pytree (parameters, gradients, optimizer state) by the
  paths of the unscanned model's: layer i of each stacked array under
  blocks/i."""
  out = {}
  for path, x in _by_path(tree).items():
    keys = path.split("/")
    if "blocks" not in keys:
      out[path] = x
      continue
    at = keys.index("blocks") + 1
    out.update({"/".join(keys[:at] + [str(i)] + keys[at:]): x[i] for i in range(x.shape[0])})
  return out


def _stacked_like(tree, scanned):
  """The unscanned model's pytree `tree` in the structure of the scanned
  model's `scanned` (copies: the train step donates its state)."""
  flat = _by_path(tree)

  def leaf(path, x):
    keys = optim._keys(path)
    if "blocks" not in keys:
      return jnp.copy(flat["/".join(keys)])
    at = keys.index("blocks") + 1
    return jnp.stack([flat["/".join(keys[:at] + [str(i)] + keys[at:])]
                      for i in range(x.shape[0])])
  return jax.tree_util.tree_map_with_path(leaf, scanned)


def _relative_l2(a, b) -> float:
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_scan_layers_trains_as_without():
  """--scan-layers (issue 32) computes the unscanned model's function: same
  initial values and, from the same parameters, the same loss and gradients
  to float32 accuracy, at the start and after 20 steps of training, whatever
  each block keeps for the backward (the unscanned model under one remat
  policy, the scanned under another). From the same train state the step
  gives the same loss and gradient norm.

  The two 20-step trajectories are not compared: the clip's global norm sums
  a stacked array in another order than its layers one by one, a last-bit
  difference that Adam amplifies step by step into a drift that depends on
  the CPU's instruction set (1.3e-3 in the loss after 20 steps with AVX-512
  or AVX2, 2.0e-3 with SSE4.2), not on the code. In float32: bfloat16's
  rounding would swamp the comparison."""
  batches = jax.random.randint(jax.random.key(0), (20, 1, 2, SMALL["seq_len"] + 1), 0, 256)
  steps = {}
  for scan_layers, remat in ((False, "dots"), (True, "full")):
    cfg = Config(**{**SMALL, "n_layers": 2, "dtype": "float32", "scan_layers": scan_layers,
                    "remat": remat})
    steps[scan_layers] = make_steps(build_model(cfg, 256), optim.optimizer(cfg))
  (state, train_step, eval_step), (scanned, scanned_step, scanned_eval) = steps[False], steps[True]
  initial, scanned_initial = _by_path(state["params"]), _unstacked(scanned["params"])
  assert scanned_initial.keys() == initial.keys()
  for path, x in initial.items():
    np.testing.assert_array_equal(scanned_initial[path], x, err_msg=path)

  grads, scanned_grads = (jax.jit(jax.value_and_grad(f)) for f in (eval_step, scanned_eval))
  for n, batch in enumerate(batches):
    if n in (0, len(batches) - 1):  # the initial parameters, and trained ones
      for tokens in batch:
        loss, g = grads(state["params"], tokens)
        scanned_loss, scanned_g = scanned_grads(
            _stacked_like(state["params"], scanned["params"]), tokens)
        assert float(scanned_loss) == pytest.approx(float(loss), rel=1e-6), n
        g, scanned_g = _by_path(g), _unstacked(scanned_g)
        assert scanned_g.keys() == g.keys()
        for path in g:
          assert _relative_l2(scanned_g[path], g[path]) < 1e-5, (n, path)
      _, scanned_metrics = scanned_step(_stacked_like(state, scanned), batch)
    state, metrics = train_step(state, batch)
    if n in (0, len(batches) - 1):
      for key in ("loss", "grad_norm"):
        assert float(scanned_metrics[key]) == pytest.approx(float(metrics[key]), rel=1e-6), \
            (n, key)
  assert int(state["step"]) == len(batches)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_weight_decay_mask(scan_layers):
  # With --scan-layers the norms' gains are (n_layers, dim): still not decayed.
  params = nnx.state(build_model(Config(**SMALL, scan_layers=scan_layers), 256), nnx.Param)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  mask = jax.tree.leaves(optim.decay_mask(params))
  decayed = {optim._path_str(p) for (p, _), d in zip(flat, mask) if d}
  kept = {optim._path_str(p) for (p, _), d in zip(flat, mask) if not d}
  assert any("q_proj/kernel" in p for p in decayed) and any("mlp/up" in p for p in decayed)
  assert any("embed" in p for p in kept) and any("q_norm" in p for p in kept)
  assert all("norm" not in p.replace("_proj", "") for p in decayed)
