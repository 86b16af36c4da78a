"""Multi-device checks run by tests/test_sharding.py in a fresh process.

The host-device count must be set before jax starts, so the tests launch
`python tests/multidevice_checks.py CHECK` with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (`devices`: on every GPU
of a machine with two or more, JAX_PLATFORMS=cuda); the last line printed
is a JSON object of measured differences that the test asserts on.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from sagebwd_jax import dot_product_attention
from sagebwd_jax.sharding import shard_attention, sharded_attention

B, T, H, HKV, D = 8, 64, 4, 2, 64


def _mesh(data: int, model: int) -> Mesh:
  devices = np.asarray(jax.devices()[:data * model]).reshape(data, model)
  return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _qkv(batch=B, heads=H, kv_heads=HKV, seq=T, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (batch, seq, heads, D), dtype)
  k = jax.random.normal(ks[1], (batch, seq, kv_heads, D), dtype) + 0.5
  v = jax.random.normal(ks[2], (batch, seq, kv_heads, D), dtype)
  do = jax.random.normal(ks[3], (batch, seq, heads, D), dtype)
  return q, k, v, do


def _value_and_grads(fn, q, k, v, do):
  o, vjp = jax.vjp(fn, q, k, v)
  return (o, *vjp(do))


def _max_rel(a, b) -> float:
  """max |a - b| / max |b| over the output and the three gradients."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return max(float(jnp.max(jnp.abs(f32(x) - f32(y))) / jnp.max(jnp.abs(f32(y))))
             for x, y in zip(a, b))


def _logits_and_grads(model, tokens) -> list:
  """An nnx model's logits and every parameter's gradient of mean(logits^2)."""
  from flax import nnx
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(params):
    logits = nnx.merge(graphdef, params)(tokens)
    return jnp.mean(jnp.asarray(logits, jnp.float32) ** 2), logits

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return [logits, *jax.tree.leaves(grads)]


def op() -> dict:
  """Forward and backward under shard_map (data, heads, both) vs one device."""
  q, k, v, do = _qkv()
  seg = jnp.asarray(np.repeat(np.arange(2), T // 2)[None].repeat(B, 0))
  lengths = jnp.asarray([T, T - 5, 40, 64, 17, 33, 64, 60], jnp.int32)
  out = {"devices": jax.device_count()}
  for impl in ("reference", "triton"):
    kw = dict(is_causal=True, implementation=impl)
    single = jax.jit(lambda q, k, v, do: _value_and_grads(
        lambda q, k, v: dot_product_attention(q, k, v, **kw), q, k, v, do))(q, k, v, do)
    for name, (data, model) in {"data": (8, 1), "heads": (1, 2), "both": (4, 2)}.items():
      mesh = _mesh(data, model)
      sharded = jax.jit(lambda q, k, v, do: _value_and_grads(
          lambda q, k, v: sharded_attention(mesh, q, k, v, **kw), q, k, v, do))(q, k, v, do)
      assert all(x.shape == y.shape for x, y in zip(sharded, single))
      out[f"{impl}/{name}"] = _max_rel(sharded, single)
  # Lengths travel with the batch; eager calls work too.
  kw = dict(key_value_seq_lengths=lengths, query_seq_lengths=lengths,
            implementation="reference")
  single = _value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, **kw), q, k, v, do)
  sharded = _value_and_grads(lambda q, k, v: sharded_attention(_mesh(4, 2), q, k, v, **kw),
                             q, k, v, do)
  out["reference/both/lengths"] = _max_rel(sharded, single)
  kw = dict(segment_ids=seg, is_causal=True, implementation="reference")
  single = _value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, **kw), q, k, v, do)
  sharded = _value_and_grads(lambda q, k, v: sharded_attention(_mesh(4, 2), q, k, v, **kw),
                             q, k, v, do)
  out["reference/both/segments"] = _max_rel(sharded, single)
  # Any (q, k, v) -> o op can be wrapped: jax.nn's full-precision attention.
  wrapped = shard_attention(jax.nn.dot_product_attention, _mesh(4, 2))
  out["jax.nn/both"] = _max_rel(
      _value_and_grads(lambda q, k, v: wrapped(q, k, v, is_causal=True), q, k, v, do),
      _value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                       q, k, v, do))
  # GQA: kv heads not divisible by the head axis.
  try:
    sharded_attention(_mesh(2, 4), q, k, v)
    out["gqa_error"] = None
  except ValueError as e:
    out["gqa_error"] = str(e)
  try:
    sharded_attention(_mesh(8, 1), q[:6], k[:6], v[:6])
    out["batch_error"] = None
  except ValueError as e:
    out["batch_error"] = str(e)
  return out


def mesh_2x4() -> dict:
  """Issue 49's case: the op (its VJP inside) under `jax.shard_map` over a
  data=2 x model=4 mesh, q's spec P("data", None, "model", None); bf16,
  causal, B4 T256 H8 D64 (T64 for the Triton kernels, interpreted: slow),
  against one device. Relative L2 of O, dQ, dK, dV (0.0: bitwise)."""
  spec = P("data", None, "model", None)
  out = {"devices": jax.device_count()}
  for impl, seq in (("reference", 256), ("triton", 64)):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (4, seq, 8, D), jnp.bfloat16) for key in keys)

    def vjp(q, k, v, do):
      return _value_and_grads(lambda q, k, v: dot_product_attention(
          q, k, v, is_causal=True, implementation=impl), q, k, v, do)

    single = jax.jit(vjp)(q, k, v, do)
    sharded = jax.jit(jax.shard_map(vjp, mesh=_mesh(2, 4), in_specs=(spec,) * 4,
                                    out_specs=(spec,) * 4, check_vma=False))(q, k, v, do)
    rel = lambda a, b: float(jnp.linalg.norm(jnp.asarray(a, jnp.float32) - jnp.asarray(
        b, jnp.float32)) / jnp.linalg.norm(jnp.asarray(b, jnp.float32)))
    for name, a, b in zip(("o", "dq", "dk", "dv"), sharded, single):
      out[f"{impl}/{name}"] = rel(a, b)
  return out


def pmap() -> dict:
  """The op inside jax.pmap over 8 devices (one batch row each) vs one device."""
  q, k, v, do = _qkv()
  out = {"devices": jax.device_count()}
  for impl in ("reference", "triton"):
    kw = dict(is_causal=True, implementation=impl)
    fn = lambda q, k, v: dot_product_attention(q, k, v, **kw)
    single = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, do)
    mapped = jax.pmap(lambda q, k, v, do: _value_and_grads(fn, q[None], k[None], v[None],
                                                           do[None]))(q, k, v, do)
    mapped = tuple(x[:, 0] for x in mapped)  # (8, 1, ...) -> (8, ...)
    assert len(mapped[0].sharding.device_set) == 8
    out[impl] = _max_rel(mapped, single)
  return out


def model() -> dict:
  """nnx Llama with a mesh (attention under shard_map) vs without: logits and grads."""
  from flax import nnx

  from sagebwd_jax.flax import Attention, Llama, LlamaConfig
  cfg = LlamaConfig(vocab_size=64, dim=128, n_layers=1, n_heads=2, n_kv_heads=2,
                    ffn_dim=128, max_seq_len=T, dtype=jnp.float32)
  tokens = jax.random.randint(jax.random.key(1), (8, T), 0, 64)

  out = {}
  for attention in ("sage", "full"):
    c = dataclasses.replace(cfg, attention=attention)
    plain = _logits_and_grads(Llama(c, rngs=nnx.Rngs(0)), tokens)
    sharded = _logits_and_grads(Llama(c, rngs=nnx.Rngs(0), mesh=_mesh(4, 2)), tokens)
    out[f"llama/{attention}"] = _max_rel(sharded, plain)
  try:
    Attention(256, 4, num_kv_heads=2, mesh=_mesh(2, 4), rngs=nnx.Rngs(0))
    out["attention_gqa_error"] = None
  except ValueError as e:
    out["attention_gqa_error"] = str(e)
  return out


def devices() -> dict:
  """The op with its default implementation (the Mosaic kernels on a Hopper
  GPU) and a bf16 Llama on the devices this process sees, at shapes the
  kernels take: batch on "data", heads on "model", vs one device. On GPUs
  this is the checks above on real devices; with host devices, their code."""
  n = jax.device_count()
  meshes = {"data": (n, 1), "heads": (1, 2), **({"both": (n // 2, 2)} if n >= 4 else {})}
  q, k, v, do = _qkv(batch=n, seq=256, dtype=jnp.bfloat16)
  fn = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True)
  single = jax.jit(lambda *a: _value_and_grads(fn, *a))(q, k, v, do)
  out = {"devices": n, "platform": jax.default_backend()}
  for name, (data, model) in meshes.items():
    mesh = _mesh(data, model)
    step = jax.jit(lambda q, k, v, do: _value_and_grads(
        lambda q, k, v: sharded_attention(mesh, q, k, v, is_causal=True), q, k, v, do))
    out[f"op/{name}/mosaic"] = "mosaic_gpu" in step.lower(q, k, v, do).as_text()
    out[f"op/{name}"] = _max_rel(step(q, k, v, do), single)

  from flax import nnx

  from sagebwd_jax.flax import Llama, LlamaConfig
  cfg = LlamaConfig(vocab_size=64, dim=128, n_layers=1, n_heads=2, n_kv_heads=2,
                    ffn_dim=128, max_seq_len=256, dtype=jnp.bfloat16, attention="sage")
  tokens = jax.random.randint(jax.random.key(1), (n, 256), 0, 64)
  plain = _logits_and_grads(Llama(cfg, rngs=nnx.Rngs(0)), tokens)
  for name, (data, model) in meshes.items():
    out[f"llama/{name}"] = _max_rel(
        _logits_and_grads(Llama(cfg, rngs=nnx.Rngs(0), mesh=_mesh(data, model)), tokens), plain)
  return out


if __name__ == "__main__":
  result = {"op": op, "mesh_2x4": mesh_2x4, "pmap": pmap, "model": model,
            "devices": devices}[sys.argv[1]]()
  print(json.dumps(result))
