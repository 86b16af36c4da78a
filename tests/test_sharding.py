"""Multi-device training and the op under shard_map / pmap (issue 6).

The 8-device checks run in fresh processes with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag must precede
jax's start, and the rest of the suite shares these pytest processes with one
device): `tests/multidevice_checks.py` for the op and the model, and
`python -m train` itself for training. The rest runs here, on one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CPU_XLA_FLAGS
from sagebwd_jax import dot_product_attention
from sagebwd_jax.sharding import shard_attention, sharded_attention
from train import data, sharding
from train.__main__ import main
from train.config import Config, check
from train.metrics import read

ROOT = Path(__file__).resolve().parent.parent
EIGHT = "--xla_force_host_platform_device_count=8"


def _env(xla_flags: str | None, platforms: str = "cpu") -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                      "JAX_PROCESS_ID")}
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = platforms
  flags = [f for f in (CPU_XLA_FLAGS if platforms == "cpu" else "", xla_flags) if f]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  return env


def _spawn(args: list[str], xla_flags: str | None, platforms: str = "cpu") -> subprocess.Popen:
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(xla_flags, platforms),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, f"{proc.args} failed ({proc.returncode}):\n{out[-4000:]}"
  return out


def _checks(name: str) -> dict:
  out = _finish(_spawn(["tests/multidevice_checks.py", name], EIGHT))
  result = json.loads(out.strip().splitlines()[-1])
  assert result.get("devices", 8) == 8
  return result


# --- the op on 8 devices --------------------------------------------------------

def test_op_under_shard_map_equals_one_device():
  """Forward and dQ, dK, dV with batch on "data", heads on "model", or both, for
  the reference and the Triton kernels (its interpreter): the single-device values."""
  r = _checks("op")
  for impl in ("reference", "triton"):
    for split in ("data", "heads", "both"):
      assert r[f"{impl}/{split}"] <= 1e-5, (impl, split, r)
  assert r["reference/both/lengths"] <= 1e-5  # masks split with the batch, eager call
  assert r["jax.nn/both"] <= 1e-5             # any (q, k, v) op can be wrapped
  assert "key/value heads (2) must be divisible by the 4 devices" in r["gqa_error"]
  assert "batch size 6 is not divisible by the 8 devices" in r["batch_error"]
  assert r["reference/both/segments"] <= 1e-5  # segment ids split with the batch


def test_op_on_a_2x4_mesh_equals_one_device():
  """Issue 49: batch on "data" (2), heads on "model" (4), bf16, causal, B4
  T256 H8 D64. dQ and dK were off by relative L2 up to 2.9e-5 here on the
  reference (3.2e-3 and 3.9e-3 where the issue was found): XLA:CPU picked
  its reductions' order by the arrays' shape. The reference's sums now run
  in one fixed order (numerics.ordered_sum): bitwise equal. The Triton
  kernels (interpreted, T64) keep each program's arithmetic to its tile."""
  r = _checks("mesh_2x4")
  for impl in ("reference", "triton"):
    for name in ("o", "dq", "dk", "dv"):
      assert r[f"{impl}/{name}"] <= 1e-4, (impl, name, r)
  assert all(r[f"reference/{name}"] == 0.0 for name in ("o", "dq", "dk", "dv")), r


def test_op_under_pmap_equals_one_device():
  r = _checks("pmap")
  assert r["reference"] <= 1e-5, r
  assert r["triton"] <= 1e-5, r


def test_llama_with_mesh_equals_without():
  """Logits and every parameter gradient of an fp32 Llama, attention under
  shard_map on a 4 x 2 mesh. Full-precision attention agrees to rounding;
  SageBwd's int8 rounding may flip where the projections (batched
  differently per device) differ in the last bit, hence its looser bound."""
  r = _checks("model")
  assert r["llama/full"] <= 1e-5, r
  assert r["llama/sage"] <= 1e-3, r
  assert "key/value heads (2) must be divisible" in r["attention_gqa_error"]


@pytest.mark.gpu
def test_op_and_llama_on_every_gpu_equal_one_gpu():
  """The checks above on real GPUs (issue 36): the op with its default
  implementation and a bf16 Llama under shard_map on every GPU, batch on
  "data", heads on "model", against one GPU; on Hopper each lowers to the
  Mosaic kernels. A split that mixed batch rows or heads would be off by
  O(1); bf16 rounding and the order of the gradients' all-reduce account for
  a few percent of the largest value."""
  if jax.device_count() < 2:
    pytest.skip("needs two or more GPUs")
  r = json.loads(_finish(_spawn(["tests/multidevice_checks.py", "devices"], None, "cuda"))
                 .strip().splitlines()[-1])
  assert r["devices"] == jax.device_count() and r["platform"] == "gpu", r
  hopper = jax.devices()[0].compute_capability == "9.0"
  for split in ("data", "heads") + (("both",) if r["devices"] >= 4 else ()):
    assert r[f"op/{split}"] <= 2e-2, (split, r)
    assert r[f"llama/{split}"] <= 0.1, (split, r)
    assert r[f"op/{split}/mosaic"] == hopper, (split, r)


# --- training on 8 devices ------------------------------------------------------

def test_training_on_8_devices_matches_one_device(tmp_path):
  """Five steps of `python -m train`, SageBwd attention, fp32 compute, the
  same global batch of 8: one device, --mesh data=8 and --mesh data=4,model=2
  give the same losses, gradient norms and validation loss. (Full-precision
  attention agrees at any learning rate; SageBwd's int8 rounding can flip
  where parameters differ in the last bit, as the gradient all-reduce sums in
  another order, and --lr 1e-3 keeps their effect within the bars below:
  docs/performance-log.md.)"""
  corpus = str(data.stdlib_dir() / "json")
  flags = ["-m", "train", "--dim", "128", "--n-layers", "1", "--n-heads", "2",
           "--n-kv-heads", "2", "--ffn-dim", "128", "--seq-len", "32", "--batch-size", "8",
           "--steps", "5", "--warmup", "2", "--eval-every", "5", "--eval-batches", "2",
           "--lr", "1e-3", "--dtype", "float32", "--attention", "sage", "--no-progress",
           "--data", corpus]
  runs = {"one": (None, None), "data8": ("data=8", EIGHT), "data4model2": ("data=4,model=2", EIGHT)}
  procs = {name: _spawn(flags + ["--out", str(tmp_path / name)]
                        + (["--mesh", mesh] if mesh else []), xla)
           for name, (mesh, xla) in runs.items()}
  logs = {name: _finish(p) for name, p in procs.items()}
  assert "mesh data=1 x model=1 over 1 process(es), 1 cpu device(s)" in logs["one"]
  assert "mesh data=8 x model=1 over 1 process(es), 8 cpu device(s)" in logs["data8"]
  assert "mesh data=4 x model=2 over 1 process(es), 8 cpu device(s)" in logs["data4model2"]
  rows = {name: read(str(tmp_path / name / "metrics.jsonl")) for name in runs}
  train = {n: [r for r in rs if "loss" in r] for n, rs in rows.items()}
  val = {n: [r["val_loss"] for r in rs if "val_loss" in r] for n, rs in rows.items()}
  assert [r["step"] for r in train["one"]] == [1, 2, 3, 4, 5]
  for name in ("data8", "data4model2"):
    assert [r["step"] for r in train[name]] == [1, 2, 3, 4, 5]
    for a, b in zip(train[name], train["one"]):
      for key, rel in (("loss", 1e-5), ("param_norm", 1e-5), ("grad_norm", 1e-4)):
        assert a[key] == pytest.approx(b[key], rel=rel), (name, a["step"], key)
    np.testing.assert_allclose(val[name], val["one"], rtol=1e-5)
  assert train["one"][-1]["loss"] < train["one"][0]["loss"]


# --- one device: the mesh of 1, parsing, data slices ------------------------------

def test_parse_mesh():
  assert sharding.parse_mesh(None, 8) == {"data": 8, "model": 1}
  assert sharding.parse_mesh("", 1) == {"data": 1, "model": 1}
  assert sharding.parse_mesh("data=4,model=2", 8) == {"data": 4, "model": 2}
  assert sharding.parse_mesh(" model = 2 ", 8) == {"data": 4, "model": 2}
  assert sharding.parse_mesh("data=2", 8) == {"data": 2, "model": 4}
  assert sharding.parse_mesh("data=2,model=2") == {"data": 2, "model": 2}  # form only
  bad = {"data=3,model=2": "must equal the number of devices, 8",
         "data=3": "must equal the number of devices, 8",
         "model=3": "must equal the number of devices, 8",
         "data=4,model=4": "must equal the number of devices, 8",
         "data": "expected AXIS=SIZE", "data=4;model=2": "must be an integer",
         "pipe=2": "unknown axis 'pipe'", "data=2,data=4": "given twice",
         "data=x": "must be an integer", "data=0,model=8": "must be >= 1",
         "data=4,": "expected AXIS=SIZE", "=4": "expected AXIS=SIZE"}
  for spec, message in bad.items():
    with pytest.raises(ValueError, match=message):
      sharding.parse_mesh(spec, 8)


def test_bad_mesh_flag_is_a_clear_cli_error(capsys):
  with pytest.raises(SystemExit, match="--mesh 'data=two': size of 'data' must be an integer"):
    main(["--mesh", "data=two"])
  with pytest.raises(ValueError, match="unknown axis"):
    check(Config(mesh="tensor=2"))
  n = jax.device_count()
  with pytest.raises(ValueError, match=f"must equal the number of devices, {n}"):
    sharding.make_mesh(f"data={n + 1}")


def test_mesh_of_one_and_config_checks():
  mesh = sharding.make_mesh(None)
  assert dict(mesh.shape) == {"data": jax.device_count(), "model": 1}
  sharding.check_config(Config(batch_size=8, n_heads=2, n_kv_heads=2), mesh)
  with pytest.raises(ValueError, match="key/value heads"):
    sharding.check_config(Config(n_heads=4, n_kv_heads=2), _abstract_mesh(1, 4))
  with pytest.raises(ValueError, match="batch size 6 is not divisible"):
    sharding.check_config(Config(batch_size=6), _abstract_mesh(4, 1))


def _abstract_mesh(data: int, model: int):
  return jax.sharding.AbstractMesh((data, model), ("data", "model"))


def test_shard_attention_on_one_device_is_the_op():
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (2, 64, 4, 64))
  k, v = (jax.random.normal(key, (2, 64, 2, 64)) for key in ks[1:])
  mesh = sharding.make_mesh("data=1,model=1", jax.devices()[:1])
  want = dot_product_attention(q, k, v, is_causal=True, implementation="reference")
  got = sharded_attention(mesh, q, k, v, is_causal=True, implementation="reference")
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  close(got, want)  # (eager op vs jitted shard_map: last-bit differences)
  seg = jnp.zeros((2, 64), jnp.int32).at[:, 32:].set(1)  # one device: segment ids work
  close(sharded_attention(mesh, q, k, v, segment_ids=seg),
        dot_product_attention(q, k, v, segment_ids=seg))
  close(shard_attention(mesh=mesh, batch_axis=None)(q[0], k[0], v[0]),
        dot_product_attention(q[0], k[0], v[0]))
  with pytest.raises(ValueError, match="mesh has no axis 'heads'"):
    shard_attention(mesh=mesh, head_axis="heads")


def test_process_rows_and_batches_are_slices_of_the_global_batch():
  """One process owns every row; the rows argument selects rows of the very
  batch the global draw gives, whatever the split."""
  mesh = sharding.make_mesh(None)
  sh = sharding.batch_sharding(mesh, 3, 1)
  assert sharding.local_rows(sh, (2, 8, 33), 1) == slice(0, 8)
  ds = data.Dataset(np.arange(10_000, dtype=np.uint16), np.arange(500, dtype=np.uint16),
                    256, "test")
  full = data.train_batch(ds, 0, 3, 2, 8, 32)
  np.testing.assert_array_equal(data.train_batch(ds, 0, 3, 2, 8, 32, slice(2, 6)),
                                full[:, 2:6])
  np.testing.assert_array_equal(data.val_batch(ds, 0, 1, 8, 32, slice(4, 8)),
                                data.val_batch(ds, 0, 1, 8, 32)[4:])
  batch = sharding.global_batch(full, sh, full.shape)
  assert batch.sharding == sh
  np.testing.assert_array_equal(np.asarray(batch), full)


def test_distributed_initialize_only_when_asked(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  assert not sharding.initialize_distributed(environ={})
  assert calls == []
  assert sharding.initialize_distributed("10.0.0.1:1234", 2, 1, environ={})
  assert calls[-1] == dict(coordinator_address="10.0.0.1:1234", num_processes=2,
                           process_id=1)
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "3"}
  assert sharding.initialize_distributed(environ=env)  # JAX reads the address itself
  assert calls[-1] == dict(coordinator_address=None, num_processes=4, process_id=3)
  assert sharding.initialize_distributed("auto", environ={})  # JAX's cluster detection
  assert calls[-1] == dict(coordinator_address=None, num_processes=None, process_id=None)
  with pytest.raises(ValueError, match=r"--process-id must be in \[0, 2\)"):
    sharding.initialize_distributed("h:1", 2, 2, environ={})
  assert len(calls) == 3


def test_shard_attention_takes_tuple_batch_axes_and_a_partition_spec():
  ks = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (2, 32, 2, 64)) for key in ks)
  devices = np.asarray(jax.devices()[:1]).reshape(1, 1, 1)
  mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor"))
  want = dot_product_attention(q, k, v, is_causal=True)
  spec = jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
  for attend in (shard_attention(mesh=mesh, batch_axis=("data", "fsdp"), head_axis="tensor"),
                 shard_attention(mesh=mesh, spec=spec)):
    np.testing.assert_allclose(np.asarray(attend(q, k, v, is_causal=True)), np.asarray(want),
                               atol=1e-6)
  with pytest.raises(ValueError, match="mesh has no axis 'fsdpp'"):
    shard_attention(mesh=mesh, batch_axis=("data", "fsdpp"))
  with pytest.raises(ValueError, match=r"splits only B and H"):
    shard_attention(mesh=mesh, spec=jax.sharding.PartitionSpec("data", "tensor"))
  with pytest.raises(TypeError, match="batch_axis must be a mesh axis name"):
    shard_attention(mesh=mesh, batch_axis=3)


_SHARDED_INPUTS = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from sagebwd_jax import dot_product_attention
mesh = jax.make_mesh((2,), ("data",))
q = jax.device_put(jnp.ones((2, 32, 2, 64)), NamedSharding(mesh, P("data")))
attend = lambda q: dot_product_attention(q, q, q, implementation="triton")
def explicit():
  with jax.set_mesh(mesh):
    return jax.jit(attend)(q)
for name, run in (("eager", lambda: attend(q)), ("explicit", explicit)):
  try:
    run()
    print(name, "ran")
  except ValueError as e:
    print(name, e)
print("reference", dot_product_attention(q, q, q, implementation="reference").shape)
"""


def test_kernels_on_sharded_inputs_outside_shard_map_say_what_to_do():
  out = _finish(_spawn(["-c", _SHARDED_INPUTS], "--xla_force_host_platform_device_count=2"))
  assert "eager implementation='triton' runs Triton kernels" in out, out
  assert "the inputs are spread over several devices" in out, out
  assert "explicit implementation='triton'" in out and "mesh axes ('data',)" in out, out
  assert out.count("sharded_attention(mesh, q, k, v, ...)") == 2, out
  assert "reference (2, 32, 2, 64)" in out  # the reference partitions automatically
