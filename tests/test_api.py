"""`dot_product_attention`: argument validation and property tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BACKENDS, cosine, gaussian_qkv, oracle, sage
from pallas_kernels.types import Numerics
from sagebwd_jax import dot_product_attention
from sagebwd_jax.reference import ReferenceBackend


def _qkv(b=2, tq=32, tk=48, h=4, hkv=2, d=64, dtype=jnp.bfloat16):
  q = jnp.zeros((b, tq, h, d), dtype)
  k = jnp.zeros((b, tk, hkv, d), dtype)
  return q, k, jnp.zeros_like(k)


def _call(q=None, k=None, v=None, **kw):
  dq, dk, dv = _qkv()
  q = dq if q is None else q
  k = dk if k is None else k
  v = dv if v is None else v
  kw.setdefault("implementation", "reference")
  return dot_product_attention(q, k, v, **kw)


Q, K, V = _qkv()
B, TQ, TK = 2, 32, 48


BAD_QKV = [
    # (q, k, v, error type, message regex)
    (Q[0, 0], K, V, ValueError, "query must have rank 4"),
    (Q[None], K, V, ValueError, "query must have rank 4"),
    (Q, K[0, 0], V, ValueError, "key must have rank 4"),
    (Q, K, V[None], ValueError, "value must have rank 4"),
    (Q[0], K, V, ValueError, "same rank"),
    (Q, K[:1], V[:1], ValueError, "same batch size"),
    (Q, K, V[:, :40], ValueError, "key and value must have the same shape"),
    (Q, K, V[..., :1, :], ValueError, "key and value must have the same shape"),
    (Q[..., :32], K[..., :32], V, ValueError, "key and value must have the same shape"),
    (Q, K[..., :32], V[..., :32], ValueError, "same head dim"),
    (Q[..., :1, :], K, V, ValueError, r"query heads \(1\) must be a multiple of key/value heads \(2\)"),
    (jnp.zeros((2, 32, 3, 64)), jnp.zeros((2, 48, 2, 64)), jnp.zeros((2, 48, 2, 64)),
     ValueError, "multiple of key/value heads"),
    (Q.astype(jnp.int32), K.astype(jnp.int32), V.astype(jnp.int32), TypeError,
     "query must be bfloat16, float16 or float32"),
    (Q, K, V.astype(jnp.int32), TypeError, "value must be bfloat16, float16 or float32"),
    (np.zeros(Q.shape, np.float64), np.zeros(K.shape, np.float64),
     np.zeros(V.shape, np.float64), TypeError, "bfloat16, float16 or float32; got float64"),
    # zeros: converting K to float16 is code some CPUs' XLA cannot link (conftest.py)
    (Q, jnp.zeros(K.shape, jnp.float16), V, TypeError, "share one dtype"),
    (Q.astype(jnp.float32), K, V, TypeError, "share one dtype"),
    (jnp.zeros((1, 8, 1, 257)), jnp.zeros((1, 8, 1, 257)), jnp.zeros((1, 8, 1, 257)),
     ValueError, "head dim D=257 is not supported; SageBwd takes 1 <= D <= 256"),
    (Q[..., :0], K[..., :0], V[..., :0], ValueError, "head dim D=0 is not supported"),
    (Q[:, :0], K, V, ValueError, "at least one token"),
    (Q, K[:, :0], V[:, :0], ValueError, "at least one token"),
    (Q.tolist(), K, V, TypeError, "query must be an array"),
]


@pytest.mark.parametrize("q,k,v,exc,match", BAD_QKV)
def test_bad_qkv(q, k, v, exc, match):
  with pytest.raises(exc, match=match):
    dot_product_attention(q, k, v, implementation="reference")


BAD_KWARGS = [
    (dict(bias=jnp.ones((B, 4, TQ, TK))), ValueError, "bias is not supported .* all zeros"),
    (dict(mask=jnp.ones((B, 4, TQ, TK), bool).at[0, 0, 0, 0].set(False)), ValueError,
     "mask is not supported .* all True"),
    (dict(block_q=48), ValueError, "block_q must be a power of two >= 16"),
    (dict(block_q=8), ValueError, "block_q must be a power of two >= 16"),
    (dict(block_kv=0), ValueError, "block_kv must be a power of two >= 16"),
    (dict(block_kv=-32), ValueError, "block_kv must be a power of two >= 16"),
    (dict(block_kv=32.0), ValueError, "block_kv must be a power of two >= 16"),
    (dict(block_kv=True), ValueError, "block_kv must be a power of two >= 16"),
    (dict(implementation="cuda"), ValueError,
     r"implementation must be one of "
     r"\('triton', 'mosaic', 'reference', 'cudnn', 'xla'\)"),
    (dict(implementation="Reference"), ValueError, "implementation must be"),
    (dict(implementation="pallas"), ValueError, "'pallas' is now 'triton'"),
    (dict(implementation=()), ValueError, "a non-empty sequence"),
    (dict(implementation=("reference", "flash")), ValueError, "implementation must be"),
    (dict(implementation=3), ValueError, "implementation must be"),
    (dict(local_window_size=(3, -1)), ValueError, r"local_window_size must be None, an int"),
    (dict(local_window_size=(3,)), ValueError, r"local_window_size must be None, an int"),
    (dict(local_window_size=2.0), ValueError, r"local_window_size must be None, an int"),
    (dict(local_window_size=(True, 1)), ValueError, r"local_window_size must be None"),
    (dict(query_seq_lengths=jnp.asarray([1, 2, 3])), ValueError,
     r"query_seq_lengths must have shape \(batch,\)"),
    (dict(query_seq_lengths=jnp.asarray(3)), ValueError,
     r"query_seq_lengths must have shape \(batch,\)"),
    (dict(key_value_seq_lengths=jnp.ones((B, 1), jnp.int32)), ValueError,
     r"key_value_seq_lengths must have shape \(batch,\)"),
    (dict(key_value_seq_lengths=jnp.asarray([1.0, 2.0])), TypeError,
     "key_value_seq_lengths must be an integer array"),
    (dict(segment_ids=jnp.zeros((B, TQ), jnp.int32)), ValueError, "needs Tq == Tk"),
    (dict(segment_ids=(jnp.zeros((B, TQ), jnp.int32), jnp.zeros((B, TQ), jnp.int32))),
     ValueError, r"key/value segment_ids must have shape \(2, 48\)"),
    (dict(segment_ids=(jnp.zeros((B + 1, TQ), jnp.int32), jnp.zeros((B, TK), jnp.int32))),
     ValueError, r"query segment_ids must have shape \(2, 32\)"),
    (dict(segment_ids=(jnp.zeros((B, TQ)), jnp.zeros((B, TK)))), TypeError,
     "segment_ids must be integer arrays"),
    (dict(segment_ids=(jnp.zeros((B, TQ), jnp.int32),) * 3), ValueError,
     r"segment_ids must be an array or a pair"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(scale=float("inf")), ValueError, "scale must be finite"),
    (dict(scale=[0.1, 0.2]), TypeError, "scale must be a float scalar"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_KWARGS)
def test_bad_kwargs(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    _call(**kwargs)


def test_implementation_takes_a_backend_object():
  """A backend object runs as its name does; `ReferenceBackend(numerics)` with
  other numerics gives other int8 values (unsigned P: twice the levels)."""
  q, k, v, _ = gaussian_qkv(jax.random.key(2), 1, 64, 64, 2, 2, 64, dtype=jnp.float32)
  named = dot_product_attention(q, k, v, implementation="reference")
  np.testing.assert_array_equal(
      dot_product_attention(q, k, v, implementation=ReferenceBackend()), named)
  unsigned = dot_product_attention(q, k, v,
                                   implementation=ReferenceBackend(Numerics(unsigned_p=True)))
  assert not np.array_equal(unsigned, named)


def test_segment_ids_single_array_shape():
  q, k, v = _qkv(tq=32, tk=32)
  with pytest.raises(ValueError, match=r"query segment_ids must have shape \(2, 32\)"):
    dot_product_attention(q, k, v, segment_ids=jnp.zeros((2, 31), jnp.int32),
                          implementation="reference")


def test_traced_masks_and_scales_are_refused_clearly():
  with pytest.raises(TypeError, match="scale must be a float scalar; got a traced int32"):
    jax.jit(lambda s: _call(scale=s))(jnp.int32(1))
  with pytest.raises(ValueError, match="a traced mask cannot be checked"):
    jax.jit(lambda m: _call(mask=m))(jnp.ones((B, 4, TQ, TK), bool))


def test_valid_edge_arguments_accepted():
  # The boundaries of what is accepted: numpy ints for blocks, numpy lengths,
  # segment_ids as a list pair, default implementation, D=128, MQA.
  q, k, v = _qkv(b=1, tq=20, tk=20, h=2, hkv=1, d=128)
  out = dot_product_attention(q, k, v, block_q=np.int64(16), block_kv=16,
                              query_seq_lengths=np.asarray([20]),
                              segment_ids=[np.zeros((1, 20), np.int32)] * 2)
  assert out.shape == q.shape and out.dtype == q.dtype


# ---------------------------------------------------------------- properties

HEADS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 1), (3, 1)]


@st.composite
def attention_case(draw):
  b = draw(st.integers(1, 2))
  tq = draw(st.integers(1, 150))
  tk = draw(st.integers(1, 150))
  h, hkv = draw(st.sampled_from(HEADS))
  causal = draw(st.booleans())
  masks = draw(st.sampled_from(["none", "lengths", "segments"]))
  kw = dict(is_causal=causal, smooth_k=draw(st.booleans()), smooth_q=draw(st.booleans()))
  if masks == "lengths":
    kw["query_seq_lengths"] = jnp.asarray(draw(st.lists(st.integers(0, tq), min_size=b,
                                                        max_size=b)), jnp.int32)
    kw["key_value_seq_lengths"] = jnp.asarray(draw(st.lists(st.integers(0, tk), min_size=b,
                                                            max_size=b)), jnp.int32)
  elif masks == "segments":
    n = draw(st.integers(1, 3))
    ids = lambda t: jnp.sort(jnp.asarray(np.random.default_rng(t).integers(0, n, (b, t)),
                                         jnp.int32), axis=1)
    kw["segment_ids"] = (ids(tq), ids(tk))
  seed = draw(st.integers(0, 2**16))
  return b, tq, tk, h, hkv, kw, seed


@pytest.mark.parametrize("implementation", BACKENDS)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=attention_case())
def test_properties(implementation, case):
  b, tq, tk, h, hkv, kw, seed = case
  q, k, v, do = gaussian_qkv(jax.random.key(seed), b, tq, tk, h, hkv, 64)
  o, grads = sage(q, k, v, do, implementation=implementation, **kw)
  oracle_kw = {n: x for n, x in kw.items() if n not in ("smooth_k", "smooth_q")}
  want_o, want_grads = oracle(q, k, v, do, **oracle_kw)

  assert o.shape == q.shape and o.dtype == q.dtype
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype
  for name, x, ref in zip(("O", "dQ", "dK", "dV"), (o, *grads), (want_o, *want_grads)):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x)), f"{name} not finite"
    # Where the exact answer is exactly 0 (rows or keys that see nothing),
    # SageBwd gives exactly 0 too.
    dead = np.all(ref == 0, axis=(-1, -2)) if name in ("O", "dV") else None
    if dead is not None:
      assert np.all(x[dead] == 0), f"{name}: masked tokens must be exactly 0"
  # O and dV are accurate in cosine whenever they are not all zero.
  for name, x, ref in (("O", o, want_o), ("dV", grads[2], want_grads[2])):
    if np.any(np.asarray(ref) != 0):
      assert cosine(x, ref) >= 0.99, f"{name}: cosine {cosine(x, ref):.5f}"
  # dQ and dK vanish exactly for one visible key and are tiny for nearly
  # one-hot softmax, where the quantized forward's O (hence Delta) leaves an
  # error of a share of dO.V (docs/performance-log.md); bound the error on the
  # natural gradient scale |dV|, and require cosine where the exact gradient
  # is of that scale.
  scale = np.linalg.norm(np.asarray(want_grads[2], np.float64))
  for name, x, ref in (("dQ", grads[0], want_grads[0]), ("dK", grads[1], want_grads[1])):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    err = np.linalg.norm(x - ref)
    assert err <= 0.05 * scale + 1e-6, f"{name}: |err| {err:.4g} vs |dV| {scale:.4g}"
    if np.linalg.norm(ref) >= 0.2 * scale > 0:
      assert cosine(x, ref) >= 0.99, f"{name}: cosine {cosine(x, ref):.5f}"
