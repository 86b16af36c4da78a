"""Telemetry (issue 19, train/telemetry.py): every layer is recorded; with
full precision on both sides the errors vanish; the exact side agrees with
fp64 attention; the loop writes the rows and train.plot draws them."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import gaussian_qkv, rel_l2
from sagebwd_jax import full_precision_attention
from train import data
from train.config import Config
from train.loop import train
from train.metrics import TELEMETRY_VALUES as KEYS, kind, read
from train.plot import main as plot_main
from train.step import build_model
from train.telemetry import exact_attention, make_telemetry

TINY = dict(dim=128, n_heads=2, n_kv_heads=1, ffn_dim=128, seq_len=64, n_layers=3)


def _telemetry(attention: str, dtype: str, ds: str | None):
  cfg = Config(attention=attention, dtype=dtype, **TINY)
  model = build_model(cfg, 256)
  tokens = jax.random.randint(jax.random.key(1), (2, TINY["seq_len"] + 1), 0, 256)
  fn = make_telemetry(model, ds)
  return jax.device_get(fn(nnx.state(model, nnx.Param), tokens))


def test_full_precision_on_both_sides_has_no_error_and_every_layer():
  values = _telemetry("full", "float32", None)
  assert set(values) == set(KEYS) - {"ds_rel_l2"}
  for key, per_layer in values.items():
    assert per_layer.shape == (TINY["n_layers"],), key
    assert np.all(np.isfinite(per_layer)), key
  for key in ("o_rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2"):
    assert np.all(values[key] < 1e-5), (key, values[key])
  assert np.all(values["max_logit"] > 0) and np.all(values["max_abs_q"] > 0)


def test_sagebwd_errors_are_seen_and_bf16_ds_lowers_them():
  int8, bf16 = (_telemetry("reference", "bfloat16", ds) for ds in ("int8", "bf16"))
  for key in ("o_rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2", "ds_rel_l2"):
    assert np.all((int8[key] > 1e-3) & (int8[key] < 0.1)), (key, int8[key])
  # bf16 rounding of dS (~2^-9 relative) against per-row int8 (~1/127 of the row's max).
  assert np.all(bf16["ds_rel_l2"] < 0.5 * int8["ds_rel_l2"]) and np.all(bf16["ds_rel_l2"] > 0)
  np.testing.assert_array_equal(bf16["o_rel_l2"], int8["o_rel_l2"])


def test_exact_side_matches_fp64_attention(x64):
  q, k, v, do = gaussian_qkv(jax.random.key(2), 1, 80, 80, 4, 2, 64, sigma=2.0)
  o, grads, max_logit, _ = jax.jit(exact_attention)(q[0], k[0], v[0], do[0])
  wide = [jnp.asarray(x, jnp.float64) for x in (q, k, v, do)]
  o64, vjp = jax.vjp(lambda q, k, v: full_precision_attention(q, k, v, is_causal=True),
                     *wide[:3])
  for ours, ref in zip((o, *grads), (o64, *vjp(wide[3]))):
    assert rel_l2(ours, ref[0]) < 1e-5
  logits = np.einsum("qhd,khd->hqk", np.asarray(wide[0][0]),
                     np.repeat(np.asarray(wide[1][0]), 2, axis=1)) / 8.0
  expected = max(logits[:, i, :i + 1].max() for i in range(80))
  np.testing.assert_allclose(max_logit, expected, rtol=1e-5)


def test_loop_records_telemetry_rows_and_plot_draws_them(tmp_path, capsys):
  out = tmp_path / "run"
  cfg = Config(out=str(out), data=[str(data.stdlib_dir() / "json")], attention="full",
               dim=64, n_layers=2, n_heads=1, n_kv_heads=1, ffn_dim=128, seq_len=32,
               batch_size=2, warmup=1, steps=4, eval_every=2, eval_batches=1, ckpt_every=0,
               telemetry_every=3, progress=False)
  summary = train(cfg)
  rows = read(str(out / "metrics.jsonl"))
  telemetry = [r for r in rows if kind(r) == "telemetry"]
  assert [r["step"] for r in telemetry] == [0, 3, 4]  # the start, every 3, the end
  for r in telemetry:
    assert all(len(r[k]) == 2 for k in KEYS if k != "ds_rel_l2") and r["telemetry_s"] > 0
  assert summary["val_loss"] == [r for r in rows if kind(r) == "eval"][-1]["val_loss"]
  assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
  capsys.readouterr()
  plot_main([str(out), "--out", str(tmp_path / "p.png")])
  assert capsys.readouterr().out.split() == [str(tmp_path / "p.png"),
                                             str(tmp_path / "p-telemetry.png")]
  assert (tmp_path / "p-telemetry.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("row,message", [
    (dict(step=1, tokens=64, o_rel_l2=[0.1]), "a row without loss or val_loss"),
    (dict(tokens=64, max_logit=[1.0]), "a row without step"),
])
def test_malformed_telemetry_rows_are_named(tmp_path, row, message):
  path = tmp_path / "metrics.jsonl"
  path.write_text(json.dumps(row) + "\n" + json.dumps(dict(step=2, tokens=1, val_loss=1.0))
                  + "\n")
  with pytest.raises(ValueError, match=message):
    read(str(path))


def test_telemetry_cost_is_read_from_the_metrics(tmp_path, capsys):
  from benchmarks import telemetry_cost
  rows = [dict(step=s, tokens=s, loss=1.0, lr=0.1, step_time=0.2 if s > 1 else 9.0)
          for s in range(1, 11)]
  rows += [dict(step=s, tokens=s, telemetry_s=t, max_logit=[1.0]) for s, t in ((0, 0.3),
                                                                               (10, 0.5))]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  telemetry_cost.main([str(tmp_path), "--every", "10,100"])
  out = capsys.readouterr().out
  assert "median step 200.0 ms over 9 steps; telemetry call 400.0 ms (mean of 2) = 2.00 steps" in out
  assert "| 10 | 20.00% |" in out and "| 100 | 2.00% |" in out
