"""The reference backend's int8 tensors against an independent numpy
re-derivation, and the oracles the behaviour suite (tests/attention_suite.py)
measures every backend against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import backward_stage, gaussian_qkv, oracle, oracle64, rel_l2
from pallas_kernels import numerics as nm
from pallas_kernels.types import Config, Masks, Numerics
from sagebwd_jax import full_precision_attention
from sagebwd_jax.reference import ReferenceBackend


# ---------------------------------------------------------------- oracles

def test_oracle64_is_really_fp64_and_matches_fp32(x64):
  del x64
  q, k, v, do = gaussian_qkv(jax.random.key(0), 1, 64, 64, 2, 1, 64)
  o64, g64 = oracle64(q, k, v, do)
  o32, g32 = oracle(q, k, v, do)
  assert o64.dtype == np.float64
  for a, b in zip((o64, *g64), (o32, *g32)):
    assert rel_l2(b, a) < 1e-5


def test_k_smoothing_leaves_softmax_unchanged():
  q, k, v, _ = gaussian_qkv(jax.random.key(20), 2, 64, 96, 2, 2, 64, dtype=jnp.float32)
  k = k + 3.0 * jax.random.normal(jax.random.key(21), (1, 1, 2, 64))
  for causal in (False, True):
    a = full_precision_attention(q, k, v, is_causal=causal)
    b = full_precision_attention(q, k - jnp.mean(k, axis=1, keepdims=True), v, is_causal=causal)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
  # Sanity: a shift that is not per-row constant does change the output.
  c = full_precision_attention(q, k - jnp.mean(k, axis=2, keepdims=True), v)
  assert rel_l2(c, a) > 1e-2


# ---------------------------------------------------------------- quantize exactly

def _np_psi_blocks(x, block):
  """Independent psi per (block, D) tile of x (..., T, D) fp32: int8, scale,
  and the pre-rounding values x * 127 / amax."""
  *lead, t, d = x.shape
  xb = x.reshape(*lead, t // block, block, d)
  amax = np.max(np.abs(xb), axis=(-1, -2), keepdims=True)
  with np.errstate(divide="ignore"):
    inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
  scaled = (xb * inv).reshape(x.shape)
  x8 = np.clip(np.rint(scaled), -127, 127).astype(np.int8)
  return x8, (amax[..., 0, 0] / np.float32(127)).astype(np.float32), scaled


def _check_scale(got, want_blocks, block, maxulp=1):
  """Scales may be stored per block (..., n) or per token (..., n * block)."""
  got = np.asarray(got)
  if got.shape[-1] == want_blocks.shape[-1] * block and block > 1:
    want_blocks = np.repeat(want_blocks, block, axis=-1)
  assert got.shape == want_blocks.shape
  np.testing.assert_array_max_ulp(got, want_blocks.astype(np.float32), maxulp=maxulp)


@pytest.mark.parametrize("smooth_q", [False, True])
@pytest.mark.parametrize("block_q,block_kv", [(64, 64), (32, 128), (16, 16)])
def test_reference_quantize_is_numerics_rules(smooth_q, block_q, block_kv):
  """int8 Q, K, V re-derived in numpy, block by block: scale = amax/127,
  int8 = round-half-even(x * (127/amax)); Q's softmax multiplier
  scale*log2(e) lives in its scale, not in its int8 values."""
  rng = np.random.default_rng(block_q + block_kv + smooth_q)
  b, tq, tk, h, hkv, d = 2, 256, 128, 4, 2, 64
  heads = lambda x: np.swapaxes(x, 1, 2)  # (B, T, H, D) -> (B, H, T, D)
  q = jnp.asarray(rng.standard_normal((b, tq, h, d)) * 2 + 0.5, jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((b, tk, hkv, d)) + 3, jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((b, tk, hkv, d)), jnp.bfloat16)
  q = q.at[0, :block_q, 0].set(0)  # an all-zero Q tile: scale 0, zeros
  k_mean = np.mean(np.asarray(k, np.float32), axis=1).astype(np.float32)  # (B, Hkv, D)
  config = Config(scale=0.125, causal=False, smooth_q=smooth_q, block_q=block_q,
                  block_kv=block_kv)
  qkv = ReferenceBackend().quantize(q, k, v, jnp.asarray(k_mean), config)
  multiplier = 0.125 * nm.LOG2_E

  q32 = heads(np.asarray(q, np.float32))
  if smooth_q:
    qb = q32.reshape(b, h, tq // block_q, block_q, d)
    mean = qb.mean(axis=-2, dtype=np.float64)
    np.testing.assert_allclose(np.asarray(qkv.q_mean), mean * multiplier, rtol=1e-5, atol=1e-6)
    q32 = (qb - mean.astype(np.float32)[..., None, :]).reshape(q32.shape)
  else:
    assert qkv.q_mean is None
  q8, q_scale, q_pre = _np_psi_blocks(q32.astype(np.float32), block_q)
  k8, k_scale, _ = _np_psi_blocks(heads(np.asarray(k, np.float32)) - k_mean[:, :, None, :],
                                  block_kv)
  v8, v_scale, _ = _np_psi_blocks(heads(np.asarray(v, np.float32)), block_kv)

  got_q8 = np.asarray(qkv.q8)
  assert got_q8.dtype == np.int8
  if smooth_q:
    # The block mean is a float reduction whose order is the backend's: only
    # values within float noise of a rounding tie may round the other way.
    diff = got_q8.astype(np.int32) - q8
    assert np.all(np.abs(diff) <= 1)
    near_tie = np.abs(np.abs(q_pre - np.trunc(q_pre)) - 0.5) < 1e-3
    assert np.all(near_tie[diff != 0]), "int8 Q differs away from a rounding tie"
    assert np.mean(diff == 0) > 0.999
  else:
    np.testing.assert_array_equal(got_q8, q8, err_msg="q8")
  np.testing.assert_array_equal(np.asarray(qkv.k8), k8, err_msg="k8")
  np.testing.assert_array_equal(np.asarray(qkv.q8_t), np.swapaxes(got_q8, -1, -2))
  np.testing.assert_array_equal(np.asarray(qkv.k8_t), np.swapaxes(k8, -1, -2))
  np.testing.assert_array_equal(np.asarray(qkv.v8_t), np.swapaxes(v8, -1, -2))
  assert np.all(got_q8[0, 0, :block_q] == 0)
  _check_scale(qkv.q_scale, q_scale * np.float64(multiplier), block_q,
               maxulp=8 if smooth_q else 2)
  _check_scale(qkv.k_scale, k_scale, block_kv)
  _check_scale(qkv.v_scale, v_scale, block_kv)
  assert q_scale[0, 0, 0] == 0


@pytest.mark.parametrize("causal", [False, True])
def test_unsigned_p_t_backward_against_fp64(causal):
  """The Hopper backward's rule (P^T per key row to 0..255): dQ and dK within
  the INT8 design's error of fp64 attention, and dV at least as close as with
  P^T to 0..127 (twice the levels)."""
  q, k, v, do = gaussian_qkv(jax.random.key(5), 1, 256, 256, 2, 2, 64, dtype=jnp.float32)
  config = Config(scale=64**-0.5, causal=causal, smooth_q=False, block_q=64, block_kv=64)
  _, want = oracle64(q, k, v, do, is_causal=causal)

  def grads(backend):
    qkv = backend.quantize(q, k, v, None, config)
    o, lse, _ = backend.forward(qkv, Masks(), config, jnp.float32)
    return backward_stage(backend, qkv, v, o, lse, do, Masks(), config)

  unsigned = grads(ReferenceBackend(Numerics(unsigned_p_t=True)))
  signed = grads(ReferenceBackend())
  for name, got, ref in zip(("dQ", "dK"), unsigned[:2], want[:2]):
    assert rel_l2(got, ref) < 0.03, name
  assert rel_l2(unsigned[2], want[2]) <= rel_l2(signed[2], want[2])
