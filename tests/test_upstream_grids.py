"""jax's and Flax's own attention tests, their parameter grids re-run against
this op (issue 17): jax's `tests/nn_test.py` dot_product_attention cases and
Flax's linen and nnx attention tests. Each case either passes with INT8
tolerances (relative L2 and cosine against the full-precision result, where
upstream compares elementwise) or is refused with a clear error, never
silently wrong. Written from the upstream grids, not copied."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import cosine, rel_l2, value_and_grads
from sagebwd_jax import dot_product_attention
from sagebwd_jax.flax import attention_fn, make_attention_fn

# jax's shapes: batch, key length, query length, heads, head dim.
B, S, T, N, H = 2, 128, 128, 4, 32


def _int8_close(got, want, rel=0.04):
  for name, x, ref in zip(("O", "dQ", "dK", "dV"), got, want):
    assert x.shape == ref.shape, name
    assert rel_l2(x, ref) <= rel and cosine(x, ref) >= 0.999, (
        f"{name}: relative L2 {rel_l2(x, ref):.4f}, cosine {cosine(x, ref):.6f}")


def _normal(count, *shapes_and_dtype):
  *shapes, dtype = shapes_and_dtype
  keys = jax.random.split(jax.random.key(0), count)
  return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes)]


@functools.partial(jax.jit, static_argnames=("fn",))
def _flat_grads(fn, q, k, v, do):
  o, grads = value_and_grads(fn, q, k, v, do)
  return (o, *grads)


def _jax_nn_fp32(q, k, v, do, **kw):
  """jax.nn's XLA attention on the inputs upcast to fp32 (the oracle)."""
  up = (x.astype(jnp.float32) for x in (q, k, v, do))
  return _flat_grads(functools.partial(jax.nn.dot_product_attention, **kw), *up)


# ------------------------------------------------- jax: testDotProductAttention

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_jax_dot_product_attention(dtype, group_num, use_vmap):
  """GQA groups, vmapped over the batch (rank-3 calls), jax.nn's signature."""
  q, k, v, do = _normal(4, (B, T, N, H), (B, S, N // group_num, H),
                        (B, S, N // group_num, H), (B, T, N, H), dtype)
  ours = dot_product_attention
  if use_vmap:
    ours = jax.vmap(ours, in_axes=(0, 0, 0, None, None))
  got = _flat_grads(lambda q, k, v: ours(q, k, v, None, None), q, k, v, do)
  repeat = lambda x: jnp.repeat(x, group_num, axis=2)
  want = list(_jax_nn_fp32(q, repeat(k), repeat(v), do))
  for i in (2, 3):  # a key/value head's gradient sums its group's
    want[i] = want[i].reshape(B, S, N // group_num, group_num, H).sum(axis=3)
  assert all(x.dtype == dtype for x in got)
  _int8_close(got, want)


# --------------------------------------------- jax: testDotProductAttentionMask

MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"),
              ("custom", "padding"), ("bias", "causal"), ("causal", "sliding_window")]


@pytest.mark.parametrize("mask_mode", MASK_MODES, ids=str)
def test_jax_dot_product_attention_mask(mask_mode):
  """Causality, padding and windows pass; a random bias (traced, as upstream
  passes it through jax.vjp) and a dense mask are refused."""
  modes = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
  q, k, v, do, bias = _normal(5, (B, T, N, H), (B, S, N, H), (B, S, N, H), (B, T, N, H),
                              (1, N, T, S), jnp.bfloat16)
  causal = "causal" in modes
  kw = dict(is_causal=causal)
  if "padding" in modes:
    kw.update(query_seq_lengths=jnp.array([T // 2, T // 4], jnp.int32),
              key_value_seq_lengths=jnp.array([S // 4, S // 2], jnp.int32))
  if "sliding_window" in modes:
    kw.update(local_window_size=(3, 2) if causal else (3, 0))
  bias = bias if "bias" in modes else None
  mask = jnp.tril(jnp.ones((T, S), bool))[None, None] if "custom" in modes else None
  fn = lambda q, k, v, b, m: dot_product_attention(q, k, v, b, m, **kw)
  if bias is not None or mask is not None:
    with pytest.raises(ValueError, match="a traced bias cannot|mask is not supported"):
      jax.vjp(fn, q, k, v, bias, mask)
    return
  o, vjp = jax.vjp(fn, q, k, v, None, None)
  got = (o, *vjp(do)[:3])
  want = _jax_nn_fp32(q, k, v, do, **kw)
  _int8_close(got, want)


# -------------------------------------- jax: testDotProductAttentionBiasGradient

@pytest.mark.parametrize("batch_size", [1, 16])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_jax_bias_is_refused(batch_size, use_vmap):
  """(A concrete all-zero bias is accepted: tests/test_api_citizen.py.)"""
  x, bias = _normal(2, (batch_size, S, N, H), (batch_size, N, S, S), jnp.bfloat16)
  mask = jnp.ones((1, 1, S), bool)  # all True: accepted
  fn = lambda x, bias, mask: dot_product_attention(x, x, x, bias, mask)
  if use_vmap:
    fn = jax.vmap(fn, in_axes=(0, 0, None))
  with pytest.raises(ValueError, match="a traced bias cannot be checked"):
    jax.jit(fn)(x, bias, mask)


# ----------------------------------------------------------------- Flax linen

def _linen(**kw):
  return nn.MultiHeadDotProductAttention(
      num_heads=8, qkv_features=16, kernel_init=jax.nn.initializers.normal(0.5),
      bias_init=jax.nn.initializers.zeros, **kw)


@pytest.mark.parametrize("shape", [(4, 6, 5), (4, 2, 3, 5), (3, 5)],
                         ids=["self", "encoder_decoder", "unbatched"])
def test_linen_multihead_attention(shape):
  """8 heads over 16 features (D = 2), any batch rank, against Flax's own."""
  x = jax.random.normal(jax.random.key(1), shape)
  variables = _linen(deterministic=True).init(jax.random.key(0), x)
  want = _linen(deterministic=True).apply(variables, x)
  got = _linen(deterministic=True, attention_fn=attention_fn).apply(variables, x)
  assert got.shape == x.shape and got.dtype == jnp.float32
  assert rel_l2(got, want) < 0.03


@pytest.mark.parametrize("kw,error,match", [
    (dict(dropout_rate=0.1, deterministic=False), ValueError, "dropout"),
    (dict(deterministic=True, dtype=jnp.complex64), TypeError, "complex64"),
])
def test_linen_refusals(kw, error, match):
  module = _linen(attention_fn=attention_fn, **kw)
  with pytest.raises(error, match=match):
    module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                jnp.ones((4, 6, 5), kw.get("dtype", jnp.float32)))


def test_linen_sow_weights_and_float64_are_refused():
  x = jnp.ones((4, 6, 5))
  module = _linen(deterministic=True, attention_fn=attention_fn)
  variables = module.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="sow_weights"):
    module.apply(variables, x, sow_weights=True, mutable=["intermediates"])
  with jax.enable_x64(True):
    module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, decode=True,
                                             attention_fn=attention_fn)
    x64 = jnp.ones((1, 4, 4), jnp.float64)
    with pytest.raises(TypeError, match="float64"):
      module.init(jax.random.key(0), x64)


def test_linen_dropout_disabled_does_not_depend_on_the_rng():
  x = jnp.ones((4, 2, 3, 5))
  module = _linen(dropout_rate=0.5, attention_fn=attention_fn)
  variables = module.init(jax.random.key(0), x, deterministic=True)
  a = module.apply(variables, x, deterministic=True, rngs={"dropout": jax.random.key(1)})
  b = module.apply(variables, x, deterministic=True, rngs={"dropout": jax.random.key(2)})
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spatial_shape,attn_axis", [((5,), 1), ((6, 5), 2)])
def test_linen_decoding(spatial_shape, attn_axis):
  """Token by token through the cache (a key-only mask, honoured exactly)
  against the whole sequence with causal attention."""
  bs, heads, features = 2, 3, 4
  x = jax.random.normal(jax.random.key(1), (bs, *spatial_shape, heads * features))
  kw = dict(num_heads=heads, qkv_features=heads * features, deterministic=True)
  whole = nn.MultiHeadDotProductAttention(attention_fn=make_attention_fn(is_causal=True), **kw)
  decoder = nn.MultiHeadDotProductAttention(decode=True, attention_fn=attention_fn, **kw)
  variables = decoder.init(jax.random.key(0), x)
  want = whole.apply({"params": variables["params"]}, x)

  def step(cache, token):
    y, updated = decoder.apply({"params": variables["params"], **cache}, token,
                               mutable=["cache"])
    return updated, y

  tokens = jnp.moveaxis(x, attn_axis, 0)[:, ..., None, :]
  tokens = jnp.expand_dims(jnp.moveaxis(x, attn_axis, 0), attn_axis + 1)
  _, ys = jax.lax.scan(step, {"cache": variables["cache"]}, tokens)
  got = jnp.moveaxis(jnp.squeeze(ys, attn_axis + 1), 0, attn_axis)
  assert rel_l2(got, want) < 0.03


def test_linen_autoregressive_receptive_field():
  """Output i depends on inputs 0..i only: exact zeros in the gradient."""
  length = 10
  x = jax.random.normal(jax.random.key(2), (1, length, 1))
  module = nn.MultiHeadDotProductAttention(num_heads=1, kernel_init=jax.nn.initializers.ones,
                                           deterministic=True, attention_fn=attention_fn)
  variables = module.init(jax.random.key(1), x)
  causal = nn.make_causal_mask(jnp.ones((1, length)))
  grad = jax.jit(jax.grad(lambda x, i: module.apply(variables, x, mask=causal)[0, i].sum()))
  for i in range(length):
    seen = np.abs(np.asarray(grad(x, i))[0, :, 0]) > 1e-5
    assert seen[:i].all() and not seen[i + 1:].any(), i


# ------------------------------------------------------------------ Flax nnx

def test_nnx_basic_against_flax_default():
  kw = dict(num_heads=2, in_features=3, qkv_features=6, out_features=6, decode=False)
  x = jax.random.normal(jax.random.key(3), (1, 7, 3))
  ours = nnx.MultiHeadAttention(attention_fn=attention_fn, rngs=nnx.Rngs(0), **kw)
  default = nnx.MultiHeadAttention(rngs=nnx.Rngs(0), **kw)
  assert ours(x).shape == (1, 7, 6)
  assert rel_l2(ours(x), default(x)) < 0.03


def test_nnx_sow_weights_and_float64_are_refused():
  module = nnx.MultiHeadAttention(num_heads=8, in_features=8, decode=False,
                                  attention_fn=attention_fn, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="sow_weights"):
    module(jnp.ones((4, 6, 8)), sow_weights=True)
  with jax.enable_x64(True):
    module = nnx.MultiHeadAttention(in_features=4, num_heads=2, qkv_features=4, decode=True,
                                    attention_fn=attention_fn, rngs=nnx.Rngs(0))
    module.init_cache((1, 4, 4), dtype=jnp.float64)
    with pytest.raises(TypeError, match="float64"):
      module(jnp.ones((1, 1, 4), jnp.float64))


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("dtype,param_dtype,precision", [
    (jnp.float32, jnp.float32, jax.lax.Precision.DEFAULT),
    (jnp.float16, jnp.float32, jax.lax.Precision.HIGH),
    (jnp.float16, jnp.float16, jax.lax.Precision.HIGHEST)])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("normalize_qk", [True, False])
def test_nnx_linen_consistency(use_bias, dtype, param_dtype, precision, decode, normalize_qk):
  """nnx and linen with this attention_fn and the same parameters give the
  same output. Flax's grid, with its parameter dtype and precision axes
  sampled rather than crossed: the op sees only q, k, v in `dtype`, and
  `precision` has no effect on its int8 products."""
  kw = dict(num_heads=2, qkv_features=6, out_features=6, use_bias=use_bias, dtype=dtype,
            param_dtype=param_dtype, precision=precision, decode=decode,
            normalize_qk=normalize_qk, attention_fn=attention_fn)
  x = jnp.ones((1, 3))
  linen = nn.MultiHeadDotProductAttention(**kw)
  variables = linen.init(jax.random.key(42), x)
  module = nnx.MultiHeadAttention(in_features=3, rngs=nnx.Rngs(42), **kw)
  for name in ("query", "key", "value", "out"):
    getattr(module, name).kernel[...] = variables["params"][name]["kernel"]
    if use_bias:
      getattr(module, name).bias[...] = variables["params"][name]["bias"]
  if decode:
    module.init_cache(x.shape, dtype=dtype)
  out, _ = linen.apply(variables, x, mutable=["cache"])
  np.testing.assert_array_equal(out, module(x))


def test_nnx_gqa_shapes_heads_and_parity():
  """Flax's GQA tests of nnx.dot_product_attention, through attention_fn."""
  q, k, v = _normal(3, (2, 4, 6, 8), (2, 5, 3, 8), (2, 5, 3, 8), jnp.float32)
  assert attention_fn(q, k, v).shape == (2, 4, 6, 8)
  with pytest.raises(ValueError, match="must be a multiple"):
    attention_fn(jnp.ones((1, 4, 5, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)))
  q, k, v = _normal(3, (2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16), jnp.float32)
  want = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
  assert rel_l2(attention_fn(q, k, v), want) < 0.03
  with pytest.raises(ValueError, match="sow_weights"):  # a module is passed to sow into
    attention_fn(q, k, v, module=object())
