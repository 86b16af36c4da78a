"""Flax integration: attention_fn in Flax's modules, our Attention and Llama."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sagebwd_jax.flax import (Attention, Llama, LlamaConfig, attention_fn, count_params,
                              make_attention_fn)
from sagebwd_jax.flax.attention import RMSNorm
from sagebwd_jax.flax.llama import is_stacked, unscanned
from sagebwd_jax.metrics import cosine_similarity, relative_l2

B, T, HEADS, HEAD_DIM = 2, 64, 2, 64
FEATURES = HEADS * HEAD_DIM
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _x(seed=0, shape=(B, T, FEATURES)):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _assert_close(ours, ref):
  assert ours.shape == ref.shape and ours.dtype == ref.dtype
  assert bool(jnp.all(jnp.isfinite(ours)))
  assert float(cosine_similarity(ours, ref)) >= 0.999


def _assert_trees_close(ours, ref):
  leaves, ref_leaves = jax.tree.leaves(ours), jax.tree.leaves(ref)
  assert len(leaves) == len(ref_leaves) > 0
  for a, b in zip(leaves, ref_leaves):
    _assert_close(a, b)


def _assert_grads_close_but_key_bias(ours, ref):
  """The key bias shifts every score of a row equally, so its exact gradient
  is zero and a cosine against it is meaningless; SageBwd's int8 dS rows do
  not sum exactly to zero, so it must only stay small next to the kernel's."""
  def split(grads):
    flat = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    key_bias = [k for k in flat if "'key'" in k and "'bias'" in k]
    assert len(key_bias) == 1
    return flat.pop(key_bias[0]), flat

  key_bias, rest = split(ours)
  key_bias_ref, rest_ref = split(ref)
  assert rest.keys() == rest_ref.keys()
  _assert_trees_close(list(rest.values()), list(rest_ref.values()))
  key_kernel = next(g for k, g in rest.items() if "'key'" in k)
  assert float(jnp.linalg.norm(key_bias_ref)) < 1e-4
  assert float(jnp.linalg.norm(key_bias)) < 1e-2 * float(jnp.linalg.norm(key_kernel))


# Compiled: eager dispatch of the reference op's many small ops is slower.
_forward = nnx.jit(lambda module, x: module(x))


def _nnx_value_and_grads(module, x, **call_kwargs):
  def loss(module, x):
    y = module(x, **call_kwargs)
    return jnp.sum(y * jnp.cos(y)), y  # a non-linear loss: dO varies per element

  value_and_grad = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, y), (g_module, g_x) = value_and_grad(module, x)
  return y, nnx.state(g_module, nnx.Param), g_x


@pytest.mark.parametrize("is_causal", [False, True])
def test_nnx_multihead_attention_matches_flax_default(is_causal):
  ref = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                               rngs=nnx.Rngs(0))
  ours = nnx.clone(ref)
  ours.attention_fn = attention_fn
  x = _x()
  y_ref, g_ref, gx_ref = _nnx_value_and_grads(ref, x, is_causal=is_causal)
  y, g, gx = _nnx_value_and_grads(ours, x, is_causal=is_causal)
  _assert_close(y, y_ref)
  _assert_grads_close_but_key_bias(g, g_ref)
  _assert_close(gx, gx_ref)
  # The int8 path really ran: it is close to, not equal to, full precision.
  assert float(relative_l2(y, y_ref)) > 1e-5


def test_nnx_concrete_causal_mask_is_mapped_to_is_causal():
  ours = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                attention_fn=attention_fn, rngs=nnx.Rngs(0))
  x = _x()
  causal = ours(x, is_causal=True)
  np.testing.assert_array_equal(ours(x, mask=nnx.make_causal_mask(x[..., 0])), causal)
  all_true = jnp.ones((B, HEADS, T, T), bool)
  np.testing.assert_array_equal(ours(x, mask=all_true), ours(x))
  assert float(relative_l2(ours(x), causal)) > 1e-2


def test_linen_multihead_attention_matches_flax_default():
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                         attention_fn=make_attention_fn(is_causal=True))
  x = _x()
  params = ref.init(jax.random.key(0), x)
  mask = nn.make_causal_mask(x[..., 0])

  def value_and_grads(module, **kwargs):
    def loss(params, x):
      y = module.apply(params, x, **kwargs)
      return jnp.sum(y * jnp.cos(y)), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, grads

  y_ref, (g_ref, gx_ref) = value_and_grads(ref, mask=mask)
  y, (g, gx) = value_and_grads(ours)
  _assert_close(y, y_ref)
  _assert_grads_close_but_key_bias(g, g_ref)
  _assert_close(gx, gx_ref)
  assert float(relative_l2(y, y_ref)) > 1e-5


def test_linen_jit_bf16_output_dtype():
  module = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=jnp.bfloat16,
                                           attention_fn=attention_fn)
  x = _x().astype(jnp.bfloat16)
  params = module.init(jax.random.key(0), x)
  y = jax.jit(module.apply)(params, x)
  y_ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=jnp.bfloat16).apply(params, x)
  assert y.dtype == y_ref.dtype == jnp.bfloat16
  assert float(cosine_similarity(y, y_ref)) >= 0.995


def _qkv(shape=(B, T, HEADS, HEAD_DIM)):
  keys = jax.random.split(jax.random.key(1), 3)
  return [jax.random.normal(k, shape, jnp.float32) for k in keys]


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias=jnp.zeros((B, HEADS, T, T))), "bias is not supported"),
    (dict(dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0)),
     "dropout_rate=0.1"),
    (dict(mask=jax.random.bernoulli(jax.random.key(2), 0.5, (B, HEADS, T, T))),
     "mask: .*none of these"),
    (dict(mask=jnp.ones((B, HEADS, T, T - 1), bool)), "mask of shape"),
    (dict(module=object()), "sow_weights"),
    (dict(qk_attn_weights_einsum=jnp.einsum), "qk_attn_weights_einsum"),
    (dict(einsum_dot_general=jax.lax.dot_general), "einsum_dot_general"),
])
def test_attention_fn_refuses_what_it_cannot_honour(kwargs, match):
  with pytest.raises(ValueError, match=match):
    attention_fn(*_qkv(), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(quantization="int4"), r"quantization must be one of \('int8', 'int8_fp8'\); got 'int4'"),
    (dict(quantization=None), "quantization must be one of"),
    (dict(ds_precision="fp8"), "ds_precision must be one of"),
    (dict(block_q=48), "block_q must be a power of two >= 16; got 48"),
    (dict(block_kv=8), "block_kv must be a power of two"),
    (dict(implementation="pallas"), "implementation must be one of"),
])
def test_make_attention_fn_refuses_bad_options_when_called(kwargs, match):
  """Named where the mistake is made, not at the function's first call."""
  with pytest.raises(ValueError, match=match):
    make_attention_fn(**kwargs)


def test_attention_fn_refuses_traced_mask():
  q, k, v = _qkv()
  mask = jnp.tril(jnp.ones((T, T), bool))
  with pytest.raises(ValueError, match="mask: a traced .*is_causal=True"):
    jax.jit(lambda q, k, v, m: attention_fn(q, k, v, mask=m))(q, k, v, mask)


def test_attention_fn_takes_any_batch_rank():
  q, k, v = _qkv((2, B, T, HEADS, HEAD_DIM))
  flat = lambda x: x.reshape(2 * B, T, HEADS, HEAD_DIM)
  want = attention_fn(flat(q), flat(k), flat(v), is_causal=True)
  np.testing.assert_array_equal(attention_fn(q, k, v, is_causal=True),
                                want.reshape(q.shape))
  np.testing.assert_array_equal(attention_fn(q[0, 0], k[0, 0], v[0, 0], is_causal=True),
                                want[0])
  with pytest.raises(ValueError, match="share their batch dimensions"):
    attention_fn(q, k[0], v[0])


def test_attention_fn_key_mask_is_exact_even_traced():
  """A mask over keys only (decode's cache mask, a padding mask) is honoured
  under jit, and masked keys cannot move the rest whatever they hold."""
  q, k, v = _qkv((B, 1, HEADS, HEAD_DIM))[0], *_qkv()[1:]
  keys = jnp.arange(T)[None, :] < jnp.array([[20], [T]])  # (B, T)
  mask = keys[:, None, None, :]
  attend = jax.jit(lambda q, k, v, m: attention_fn(q, k, v, mask=m))
  got = attend(q, k.at[0, 20:].set(1e3), v.at[0, 20:].set(jnp.nan), mask)
  want = nnx.dot_product_attention(q, k, v, mask=mask)
  assert bool(jnp.all(jnp.isfinite(got)))
  assert float(relative_l2(got, want)) < 0.02
  # The masked keys' contents do not matter at all.
  clean = attend(q, k.at[0, 20:].set(0.0), v.at[0, 20:].set(0.0), mask)
  np.testing.assert_array_equal(got, clean)


def test_attention_fn_accepts_nnx_keywords_and_refuses_sowing():
  module = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                  attention_fn=attention_fn, rngs=nnx.Rngs(0))
  x = _x()
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  np.testing.assert_array_equal(module(x, input_positions=positions), module(x))
  with pytest.raises(ValueError, match="sow_weights=True is not supported"):
    module(x, sow_weights=True)


def test_nnx_decode_generates_what_flax_default_attention_generates():
  """A seeded one-layer LM, greedy decoding of 8 tokens one at a time through
  nnx.MultiHeadAttention(decode=True): SageBwd attention over the cache picks
  the same tokens as Flax's default attention, with close logits."""
  vocab, features, prompt = 32, 64, 4

  class TinyLM(nnx.Module):
    def __init__(self, attention, rngs):
      self.embed = nnx.Embed(vocab, features, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=features, decode=True,
                                         attention_fn=attention, rngs=rngs)
      self.head = nnx.Linear(features, vocab, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens)
      return self.head(x + self.attn(x))

  def generate(attention):
    model = TinyLM(attention, nnx.Rngs(0))
    model.attn.init_cache((B, prompt + 8, features))
    step = nnx.jit(lambda model, token: model(token)[:, -1])
    tokens = jax.random.randint(jax.random.key(5), (B, prompt), 0, vocab)
    for i in range(prompt - 1):  # fill the cache with the prompt
      step(model, tokens[:, i:i + 1])
    logits, out = [], tokens[:, -1:]
    for _ in range(8):
      logits.append(step(model, out[:, -1:]))
      out = jnp.concatenate([out, jnp.argmax(logits[-1], -1)[:, None]], axis=1)
    return out[:, 1:], jnp.stack(logits)

  tokens, logits = generate(attention_fn)
  want_tokens, want_logits = generate(nnx.dot_product_attention)
  np.testing.assert_array_equal(tokens, want_tokens)
  assert float(cosine_similarity(logits, want_logits)) > 0.999
  assert float(relative_l2(logits, want_logits)) > 0  # the int8 path really ran


def test_nnx_dropout_refused_in_training_accepted_when_deterministic():
  module = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                  dropout_rate=0.1, attention_fn=attention_fn,
                                  rngs=nnx.Rngs(0))
  x = _x()
  with pytest.raises(ValueError, match="attention dropout"):
    module(x, deterministic=False)
  assert module(x, deterministic=True).shape == x.shape


def _attention_pair(**kwargs):
  ours = Attention(FEATURES * 2, 4, implementation="reference", dtype=jnp.float32,
                   rngs=nnx.Rngs(0), **kwargs)
  full = nnx.clone(ours)
  full.implementation = "full"
  return ours, full


def test_rms_norm_rounds_once():
  """RMSNorm in bf16 compute is x / rms(x) * gain of fp64 on the bf16 inputs,
  rounded once to bf16: statistics and gain in fp32 (flax's `nnx.RMSNorm`
  rounds the gain to bf16 first, twice the error)."""
  x = (jax.random.normal(jax.random.key(0), (3, 1024))
       * jnp.geomspace(1e-2, 1e2, 1024)[None, :]).astype(jnp.bfloat16)
  norm = RMSNorm(1024, eps=1e-6, dtype=jnp.bfloat16)
  norm.weight[...] = jax.random.uniform(jax.random.key(1), (1024,), minval=0.5, maxval=2.0)
  got = norm(x)
  assert got.dtype == jnp.bfloat16
  x64 = np.asarray(x, np.float64)
  want = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6) * np.asarray(norm.weight)
  # A bf16 rounding (half an ulp: at most 2**-8 relative) plus fp32's few ulps.
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8 + 1e-6, atol=0)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_gqa_attention_module_matches_full_precision(qk_norm):
  ours, full = _attention_pair(num_kv_heads=2, qk_norm=qk_norm)
  assert ours.k_proj.kernel.shape == (FEATURES * 2, 2 * HEAD_DIM)
  assert ours.q_proj.kernel.shape == (FEATURES * 2, 4 * HEAD_DIM)
  if qk_norm:
    assert ours.q_norm.weight.shape == ours.k_norm.weight.shape == (HEAD_DIM,)
  x = _x(shape=(B, T, FEATURES * 2))
  y_ref, g_ref, gx_ref = _nnx_value_and_grads(full, x)
  y, g, gx = _nnx_value_and_grads(ours, x)
  _assert_close(y, y_ref)
  _assert_trees_close(g, g_ref)
  _assert_close(gx, gx_ref)


def test_attention_module_is_causal_by_default():
  ours, full = _attention_pair(num_kv_heads=1)
  bidirectional = Attention(FEATURES * 2, 4, causal=False, implementation="reference",
                            dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = _x(shape=(B, T, FEATURES * 2))
  future_changed = x.at[:, T // 2:].set(_x(7, (B, T - T // 2, FEATURES * 2)))
  past_change = lambda m: float(relative_l2(_forward(m, future_changed)[:, :T // 2],
                                             _forward(m, x)[:, :T // 2]))

  assert past_change(full) == 0.0
  # A K block's int8 scale and the K-smoothing mean are taken over all of its
  # tokens, future ones included, so the past moves by quantization noise only.
  assert past_change(ours) < 0.05
  assert past_change(bidirectional) > 0.5


@pytest.mark.parametrize("kwargs, match", [
    (dict(implementation="flash"), "implementation must be one of"),
    (dict(num_kv_heads=3), "num_heads \\(4\\) must be a positive multiple of num_kv_heads"),
    (dict(head_dim=512), "head_dim=512 is not supported"),
])
def test_attention_module_refuses_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Attention(FEATURES * 2, 4, rngs=nnx.Rngs(0), **kwargs)


TINY = dict(vocab_size=64, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256,
            max_seq_len=64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=1024), "head_dim = dim // n_heads = 512"),
    (dict(n_kv_heads=3), "n_heads \\(2\\) must be a multiple of n_kv_heads \\(3\\)"),
    (dict(attention="flash"), "LlamaConfig.attention must be one of"),
    (dict(remat="all"), "LlamaConfig.remat must be one of"),
    (dict(quantization="int4"), "LlamaConfig.quantization must be one of .*got 'int4'"),
    (dict(ds_precision="fp8"), "LlamaConfig.ds_precision must be one of .*got 'fp8'"),
    (dict(n_heads=3), "dim \\(128\\) must be divisible by n_heads \\(3\\)"),
])
def test_llama_config_refuses_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LlamaConfig(**{**TINY, **kwargs})


def test_llama_tied_embeddings_share_the_output_matrix():
  untied = count_params(Llama(LlamaConfig(**TINY), rngs=nnx.Rngs(0)))
  tied = count_params(Llama(LlamaConfig(**TINY, tie_embeddings=True), rngs=nnx.Rngs(0)))
  assert untied - tied == TINY["vocab_size"] * TINY["dim"]


def test_llama_sage_logits_match_full_precision():
  tokens = jax.random.randint(jax.random.key(3), (B, 32), 0, TINY["vocab_size"])
  sage = Llama(LlamaConfig(**TINY, dtype=jnp.float32), rngs=nnx.Rngs(0))
  full = Llama(LlamaConfig(**TINY, dtype=jnp.float32, attention="full"), rngs=nnx.Rngs(0))
  logits = _forward(sage, tokens)
  assert logits.shape == (B, 32, TINY["vocab_size"]) and logits.dtype == jnp.float32
  _assert_close(logits, _forward(full, tokens))
  with pytest.raises(ValueError, match="tokens must be an integer array"):
    sage(tokens.astype(jnp.float32))


def test_llama_decode_with_the_cache_gives_the_full_forwards_logits():
  """Generation's path: prefill a prompt, then one token at a time through
  each layer's key/value cache (the op on the cache with its length as
  key_value_seq_lengths): the logits of the whole sequence in one forward, up
  to SageBwd's int8 blocks, which span the tokens seen so far (the bar's
  margin, and what a position off by one gives: docs/performance-log.md)."""
  model = Llama(LlamaConfig(**TINY, dtype=jnp.float32), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(5), (B, 24), 0, TINY["vocab_size"])
  want = model(tokens)
  logits, caches = model.prefill(tokens[:, :8])
  assert caches[0].k.shape == (B, TINY["max_seq_len"], 1, 64)
  got = [logits]
  decode = nnx.jit(lambda model, token, caches, position: model.decode(token, caches, position))
  for i in range(8, 24):
    logits, caches = decode(model, tokens[:, i:i + 1], caches, jnp.int32(i))
    got.append(logits)
  got = jnp.concatenate(got, axis=1)
  assert float(relative_l2(got, want)) < 0.02
  with pytest.raises(ValueError, match="decode takes one token"):
    model.decode(tokens[:, :2], caches, jnp.int32(3))


def test_llama_scan_layers_is_the_same_model():
  """Stacked blocks: an unscanned model's initial values (each layer's the
  slice of the stacked ones) and logits, and the layers one by one again
  through `unscanned`. (tests/test_train.py trains the two, remat on.)"""
  tokens = jax.random.randint(jax.random.key(5), (B, 32), 0, TINY["vocab_size"])
  cfg = dict(TINY, dtype=jnp.float32, attention="full")
  plain = Llama(LlamaConfig(**cfg), rngs=nnx.Rngs(0))
  scanned = Llama(LlamaConfig(**cfg, scan_layers=True), rngs=nnx.Rngs(0))
  for layer in range(TINY["n_layers"]):
    stacked, ref = nnx.state(scanned.blocks), nnx.state(plain.blocks[layer])
    for mine, theirs in zip(jax.tree.leaves(stacked), jax.tree.leaves(ref), strict=True):
      np.testing.assert_array_equal(mine[layer], theirs)
  logits = _forward(plain, tokens)
  np.testing.assert_allclose(_forward(scanned, tokens), logits, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_forward(unscanned(scanned), tokens), logits, rtol=1e-5, atol=1e-6)


def test_llama_loss_decreases_with_adamw():
  model = Llama(LlamaConfig(**TINY), rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
  tokens = jax.random.randint(jax.random.key(4), (4, 33), 0, TINY["vocab_size"])

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, tokens)) for _ in range(12)]
  assert all(np.isfinite(losses))
  assert losses[-1] < losses[0] - 0.5


def _readme_snippets():
  text = README.read_text()
  section = text.split("## Flax: one-argument swap", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_readme_snippets_run():
  snippets = _readme_snippets()
  assert len(snippets) == 2
  for snippet in snippets:
    assert "attention_fn" in snippet
    namespace = {}
    exec(compile(snippet, str(README), "exec"), namespace)
    y = namespace["y"]
    assert y.shape == (2, 128, 256) and y.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(y)))


def test_is_stacked_tells_the_scanned_blocks_variables():
  assert is_stacked(("blocks", "attention", "wq", "kernel"))
  assert is_stacked(("opt_state", 0, "mu", "blocks", "norm", "scale"))
  assert not is_stacked(("blocks", 3, "attention", "wq", "kernel"))
  assert not is_stacked(("embed", "embedding"))
  assert not is_stacked(("blocks",))
