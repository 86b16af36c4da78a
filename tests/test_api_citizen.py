"""The op as a JAX citizen (issue 17): padded rows that cannot leak, every head
dim up to 256, implementation sequences, jax.nn's residual, traced and
negative scales, trivial masks and biases, odd lengths and empty batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gaussian_qkv, oracle64, rel_l2, value_and_grads
from sagebwd_jax import dot_product_attention, full_precision_attention

# The Triton kernels run in its interpreter on the CPU: tiny shapes keep it quick.
IMPLS = ["reference", "triton"]


def _outputs(q, k, v, do, **kwargs):
  fn = lambda q, k, v: dot_product_attention(q, k, v, **kwargs)
  o, grads = value_and_grads(fn, q, k, v, do)
  return (o, *grads)


def _run(q, k, v, do, **kwargs):
  """O, dQ, dK, dV as float64 numpy arrays."""
  return [np.asarray(x, np.float64) for x in _outputs(q, k, v, do, **kwargs)]


# ------------------------------------------------- padded rows cannot leak

@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("garbage", [np.nan, 1e3])
def test_padded_rows_change_no_valid_output_and_no_gradient(implementation, garbage):
  q, k, v, do = gaussian_qkv(jax.random.key(0), 2, 40, 48, 2, 1, 64, dtype=jnp.float32)
  q_lengths, kv_lengths = jnp.array([25, 40]), jnp.array([30, 17])
  q_pad = (jnp.arange(40)[None, :] >= q_lengths[:, None])[:, :, None, None]
  kv_pad = (jnp.arange(48)[None, :] >= kv_lengths[:, None])[:, :, None, None]
  clean = [jnp.where(pad, 0.0, x) for pad, x in ((q_pad, q), (kv_pad, k), (kv_pad, v),
                                                   (q_pad, do))]
  dirty = [jnp.where(pad, garbage, x) for pad, x in ((q_pad, q), (kv_pad, k), (kv_pad, v),
                                                       (q_pad, do))]
  kw = dict(query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, is_causal=True,
            implementation=implementation)
  want = _run(*clean, **kw)
  got = _run(*dirty, **kw)
  for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
    np.testing.assert_array_equal(a, b, err_msg=name)  # garbage changes nothing at all
  o, dq, dk, dv = got
  assert not np.any(o[np.asarray(q_pad[..., 0, 0])]) and not np.any(dq[np.asarray(q_pad[..., 0, 0])])
  assert not np.any(dk[np.asarray(kv_pad[..., 0, 0])])
  assert not np.any(dv[np.asarray(kv_pad[..., 0, 0])])
  # ... and what it computes is attention over the valid tokens.
  ref = oracle64(*clean, is_causal=True, query_seq_lengths=q_lengths,
                 key_value_seq_lengths=kv_lengths)
  for name, a, b in zip(("O", "dQ", "dK", "dV"), got, (ref[0], *ref[1])):
    assert rel_l2(a, b) < 0.05, name


# --------------------------------------------------------------- head dims

@pytest.mark.parametrize("implementation,head_dim", [
    ("reference", 16), ("reference", 32), ("reference", 80), ("reference", 96),
    ("reference", 256), ("triton", 16), ("triton", 80), ("triton", 256)])
def test_any_head_dim_matches_float64_attention(implementation, head_dim):
  q, k, v, do = gaussian_qkv(jax.random.key(head_dim), 2, 48, 48, 2, 2, head_dim)
  o, dq, dk, dv = _run(q, k, v, do, is_causal=True, implementation=implementation)
  assert o.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape
  want_o, (want_dq, want_dk, want_dv) = oracle64(q, k, v, do, is_causal=True)
  # Default scale: 1/sqrt of the caller's D, not of the padded one.
  for name, a, b in zip(("O", "dQ", "dK", "dV"), (o, dq, dk, dv),
                        (want_o, want_dq, want_dk, want_dv)):
    assert rel_l2(a, b) < 0.03, (name, rel_l2(a, b))


def test_padded_head_dim_is_the_zero_padded_call():
  # Zero channels change no score: D=80 equals D=128 with zeros and scale 1/sqrt(80).
  q, k, v, do = gaussian_qkv(jax.random.key(1), 1, 32, 32, 2, 2, 80)
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, 48)])
  o, *grads = _run(q, k, v, do, implementation="reference")
  o128, *grads128 = _run(pad(q), pad(k), pad(v), pad(do), scale=80**-0.5,
                         implementation="reference")
  np.testing.assert_array_equal(o, o128[..., :80])
  for g, g128 in zip(grads, grads128):
    np.testing.assert_array_equal(g, g128[..., :80])


# ------------------------------------------------------- implementations

def test_implementation_sequence_falls_through_not_implemented():
  q, k, v, do = gaussian_qkv(jax.random.key(2), 2, 32, 32, 2, 2, 64)
  # "mosaic" cannot run without a Hopper GPU: the next name runs.
  got = _run(q, k, v, do, is_causal=True, implementation=("mosaic", "reference"))
  want = _run(q, k, v, do, is_causal=True, implementation="reference")
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(NotImplementedError, match="'mosaic': implementation='mosaic' needs an "
                     "NVIDIA Hopper GPU.*'cudnn': cuDNN attention needs a GPU"):
    dot_product_attention(q, k, v, implementation=["mosaic", "cudnn"])


def test_full_precision_last_resort_is_jax_nn():
  q, k, v, do = gaussian_qkv(jax.random.key(3), 2, 32, 24, 4, 2, 64, dtype=jnp.float32)
  lengths = jnp.array([10, 24])
  got = _run(q, k, v, do, key_value_seq_lengths=lengths, implementation=("cudnn", "xla"))
  ref = oracle64(q, k, v, do, key_value_seq_lengths=lengths)
  for a, b in zip(got, (ref[0], *ref[1])):
    assert rel_l2(a, b) < 1e-5  # full precision, not int8
  seg = (jnp.array([[0] * 16 + [1] * 16] * 2), jnp.array([[0] * 8 + [1] * 16] * 2))
  got = dot_product_attention(q, k, v, segment_ids=seg, implementation="xla")
  want = full_precision_attention(q, k, v, segment_ids=seg)
  assert rel_l2(got, want) < 1e-5


# ------------------------------------------------------------- residual

@pytest.mark.parametrize("implementation", IMPLS)
def test_return_residual_is_jax_nn_lse(implementation):
  q, k, v, _ = gaussian_qkv(jax.random.key(4), 2, 40, 40, 4, 2, 64, dtype=jnp.float32)
  k = k + 1.0  # a channel bias that K-smoothing removes: the lse must put it back
  lengths = jnp.array([0, 33], jnp.int32)
  o, lse = dot_product_attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True,
                                 return_residual=True, implementation=implementation)
  want_o, want_lse = jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=lengths, is_causal=True, return_residual=True)
  assert lse.shape == want_lse.shape == (2, 40, 4) and lse.dtype == want_lse.dtype
  assert bool(jnp.all(lse[0] == -jnp.inf))  # rows that see no key
  np.testing.assert_allclose(lse[1], want_lse[1], atol=0.05)
  assert rel_l2(o[1], want_o[1]) < 0.03
  o1, lse1 = dot_product_attention(q[1], k[1], v[1], return_residual=True,
                                   implementation=implementation)
  assert lse1.shape == (40, 4) and o1.shape == q[1].shape


def _lse64(q, k, *, causal, lengths):
  """The exact natural log-sum-exp (B, Tq, H) in float64, GQA by repetition."""
  k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  pos_q, pos_k = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
  visible = (pos_k[None] < lengths[:, None, None]) & ((pos_q >= pos_k)[None] | (not causal))
  lse = jax.nn.logsumexp(jnp.where(visible[:, None], logits, -jnp.inf), axis=-1)
  return jnp.swapaxes(lse, 1, 2)


@pytest.mark.parametrize("implementation", IMPLS)
def test_residual_gradient_is_the_lse_gradient(implementation):
  """Unlike jax.nn's stopped one, the residual has SageBwd's gradient; with
  the output's, it adds up."""
  q, k, v, do = gaussian_qkv(jax.random.key(5), 2, 48, 40, 4, 2, 64, dtype=jnp.float32)
  k = k + 1.0  # K-smoothing's shift must not reach the gradient
  lengths = jnp.array([40, 21], jnp.int32)
  w = jax.random.normal(jax.random.key(6), (2, 48, 4))
  kw = dict(is_causal=True, key_value_seq_lengths=lengths, implementation=implementation,
            return_residual=True)

  def loss(q, k, v):
    o, lse = dot_product_attention(q, k, v, **kw)
    return jnp.sum(o * do) + jnp.sum(lse * w)

  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    q64, k64, v64, do64, w64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do, w))
    lse_grad = jax.grad(lambda q, k: jnp.sum(w64 * _lse64(q, k, causal=True, lengths=lengths)),
                        argnums=(0, 1))(q64, k64)
    out_grad = jax.grad(lambda q, k, v: jnp.sum(do64 * full_precision_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths)), argnums=(0, 1, 2))(
            q64, k64, v64)
  want = (lse_grad[0] + out_grad[0], lse_grad[1] + out_grad[1], out_grad[2])
  for name, a, b in zip(("dQ", "dK", "dV"), got, want):
    assert rel_l2(a, b) < 0.03, name
  # The residual's part alone, against its exact gradient.
  only_lse = jax.jit(jax.grad(lambda q, k: jnp.sum(dot_product_attention(q, k, v, **kw)[1] * w),
                              argnums=(0, 1)))(q, k)
  for name, a, b in zip(("dQ", "dK"), only_lse, lse_grad):
    assert rel_l2(a, b) < 0.03, name


# ------------------------------------------------------------------ scale

@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])
def test_any_finite_scale_matches_float64_attention(scale):
  q, k, v, do = gaussian_qkv(jax.random.key(6), 2, 32, 32, 2, 2, 64)
  want_o, want_grads = oracle64(q, k, v, do, scale=scale)
  traced = jax.jit(lambda q, k, v, do, s: _outputs(q, k, v, do, scale=s))
  for outputs in (_run(q, k, v, do, scale=scale), traced(q, k, v, do, scale)):
    o, dq, dk, dv = (np.asarray(x, np.float64) for x in outputs)
    assert rel_l2(o, want_o) < 0.03 and rel_l2(dv, want_grads[2]) < 0.03
    if scale:  # (with scale 0, dQ and dK are exactly 0)
      assert rel_l2(dq, want_grads[0]) < 0.05 and rel_l2(dk, want_grads[1]) < 0.05
    else:
      assert not np.any(dq) and not np.any(dk)


def test_gradient_with_respect_to_a_traced_scale():
  q, k, v, _ = gaussian_qkv(jax.random.key(7), 1, 32, 32, 2, 2, 64, dtype=jnp.float32)
  loss = lambda f: lambda s: jnp.sum(jnp.sin(f(q, k, v, scale=s)))
  ours = jax.grad(loss(lambda *a, **kw: dot_product_attention(*a, **kw,
                                                              implementation="reference")))
  exact = jax.grad(loss(full_precision_attention))
  assert float(ours(0.4)) == pytest.approx(float(exact(0.4)), rel=0.05)


# -------------------------------------------------- trivial masks and biases

def test_all_true_mask_and_zero_bias_change_nothing():
  q, k, v, _ = gaussian_qkv(jax.random.key(8), 2, 32, 48, 2, 2, 64)
  want = dot_product_attention(q, k, v, implementation="reference")
  got = dot_product_attention(q, k, v, mask=jnp.ones((1, 1, 32, 48), bool),
                              bias=jnp.zeros((2, 2, 32, 48)), implementation="reference")
  np.testing.assert_array_equal(got, want)


# ------------------------------------------------------ lengths and batch

@pytest.mark.parametrize("implementation", IMPLS)
def test_uint32_max_length_means_all_tokens(implementation):
  q, k, v, _ = gaussian_qkv(jax.random.key(9), 2, 32, 32, 2, 2, 64)
  every = jnp.full((2,), 2**32 - 1, jnp.uint32)
  got = dot_product_attention(q, k, v, key_value_seq_lengths=every, query_seq_lengths=every,
                              implementation=implementation)
  want = dot_product_attention(q, k, v, implementation=implementation)
  np.testing.assert_array_equal(got, want)
  assert float(jnp.max(jnp.abs(got.astype(jnp.float32)))) > 0.1


@pytest.mark.parametrize("implementation", IMPLS)
def test_empty_batch(implementation):
  q, k, v, do = gaussian_qkv(jax.random.key(10), 0, 32, 16, 2, 1, 64)
  o, dq, dk, dv = _run(q, k, v, do, is_causal=True, implementation=implementation)
  assert o.shape == q.shape and dq.shape == q.shape and dk.shape == dv.shape == k.shape
  out, lse = dot_product_attention(q, k, v, return_residual=True,
                                   implementation=implementation)
  assert out.dtype == q.dtype and lse.shape == (0, 32, 2)


# ----------------------------------------------------- strict rank promotion

def test_op_wrapper_runs_under_strict_rank_promotion():
  """The Triton path exercises everything api.py adds around the kernels
  (lengths, padding, segments, residual) under rank promotion 'raise'."""
  q, k, v, do = gaussian_qkv(jax.random.key(11), 2, 40, 40, 2, 1, 80)
  kw = dict(query_seq_lengths=jnp.array([20, 40]), key_value_seq_lengths=jnp.array([30, 40]),
            segment_ids=jnp.zeros((2, 40), jnp.int32), is_causal=True, implementation="triton")
  with jax.numpy_rank_promotion("raise"):
    strict = _run(q, k, v, do, **kw)
    dot_product_attention(q, k, v, return_residual=True, **kw)
  for a, b in zip(strict, _run(q, k, v, do, **kw)):
    np.testing.assert_array_equal(a, b)


def test_constant_inputs_are_not_folded_at_compile_time():
  # A loss that closes over K and V (or a fixed dO) must compile to the same
  # program as one that takes them: XLA folding the quantization of constants
  # took seconds per reduction at compile time (sagebwd.opaque).
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 128, 2, 64), jnp.bfloat16)
             for i in range(3))
  loss = lambda q, k, v: dot_product_attention(q, k, v).astype(jnp.float32).sum()
  reductions = lambda f, *args: (
      jax.jit(f).lower(*args).compile().as_text().count("reduce-window"))
  assert reductions(lambda q: loss(q, k, v), q) == reductions(loss, q, k, v) > 0
