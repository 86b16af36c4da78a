"""Delta where logits saturate (sagebwd_jax/delta.py): sum_j P dP against
float64 over the same int8 scores, and which rows take it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gaussian_qkv, kernel_config
from pallas_kernels import numerics as nm
from pallas_kernels.types import Masks
from sagebwd_jax import delta
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

B, T, H, HKV, D = 2, 128, 4, 2, 64


def _case(causal: bool, sigma: float = 1.0):
  q, k, v, do = gaussian_qkv(jax.random.key(3), B, T, T, H, HKV, D, sigma=sigma)
  config = kernel_config(causal=causal, scale=D**-0.5)
  qkv = ReferenceBackend().quantize(q, k, v, key_mean(k, None), config)
  return qkv, v, do, config


def _float64_weighted_dp(qkv, v, do, causal: bool) -> np.ndarray:
  """sum_j P_ij dP_ij (B, H, T) in float64: P the softmax of the base-2
  scores of the int8 Q and K with their scales, dP = dO . V^T."""
  f64 = lambda x: np.asarray(x, np.float64)
  group = H // HKV
  k8, k_scale = (np.repeat(f64(x), group, axis=1) for x in (qkv.k8, qkv.k_scale))
  s = np.einsum("bhqd,bhkd->bhqk", f64(qkv.q8), k8)
  s = s * f64(qkv.q_scale)[..., None] * k_scale[:, :, None, :]
  if causal:
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  p = np.exp2(s - s.max(axis=-1, keepdims=True))
  p = p / p.sum(axis=-1, keepdims=True)
  dp = np.einsum("bqhd,bkhd->bhqk", f64(do), np.repeat(f64(v), group, axis=2))
  return np.sum(p * dp, axis=-1)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_weighted_dp_is_float64s(causal):
  qkv, v, do, config = _case(causal)
  got = delta.softmax_weighted_dp(qkv, v, do, Masks(), config)
  want = _float64_weighted_dp(qkv, v, do, causal)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_rows_that_see_no_key_weigh_to_zero():
  qkv, v, do, config = _case(causal=False)
  ids = jnp.zeros((B, T), jnp.int32)
  masks = Masks(q_ids=ids.at[:, :5].set(nm.Q_INVALID_ID), kv_ids=ids)
  got = np.asarray(delta.softmax_weighted_dp(qkv, v, do, masks, config))
  assert np.all(got[:, :, :5] == 0) and np.all(np.isfinite(got))


def test_only_saturated_rows_are_replaced():
  """Rows with |lse| above numerics.SATURATED_LSE take sum_j P dP; the rest,
  and rows with an infinite or NaN lse, keep the pre-pass's Delta."""
  qkv, v, do, config = _case(causal=True)
  lse = jnp.zeros((B, H, T), jnp.float32)
  lse = lse.at[0, 1, 7].set(2 * nm.SATURATED_LSE).at[1, 3, 100].set(-2 * nm.SATURATED_LSE)
  lse = lse.at[0, 0, 0].set(jnp.inf).at[0, 0, 1].set(jnp.nan)
  lse = lse.at[0, 0, 2].set(nm.SATURATED_LSE)  # not above it
  prepass_delta = jax.random.normal(jax.random.key(0), (B, H, T))
  got = np.asarray(delta.where_saturated(prepass_delta, qkv, v, lse, do, Masks(), config))
  weighted = np.asarray(delta.softmax_weighted_dp(qkv, v, do, Masks(), config))
  replaced = np.zeros((B, H, T), bool)
  replaced[0, 1, 7] = replaced[1, 3, 100] = True
  np.testing.assert_array_equal(got[replaced], weighted[replaced])
  np.testing.assert_array_equal(got[~replaced], np.asarray(prepass_delta)[~replaced])
  # Nothing saturated: the pre-pass's Delta, bit for bit.
  same = delta.where_saturated(prepass_delta, qkv, v, jnp.zeros_like(lse), do, Masks(), config)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(prepass_delta))


def test_vmap_keeps_one_cond_over_the_whole_batch():
  """Under vmap the pass stays behind a cond (not a select that runs it for
  every call), and each example's Delta is its own."""
  qkv, v, do, config = _case(causal=True)
  lse = jnp.zeros((B, H, T), jnp.float32).at[1, 2, 50].set(2 * nm.SATURATED_LSE)
  prepass_delta = jax.random.normal(jax.random.key(1), (B, H, T))
  stack = lambda x: jnp.stack([x, x[::-1]])  # two examples: the batch rows swapped
  args = [jax.tree.map(stack, a) for a in (prepass_delta, qkv, v, lse, do)]
  fn = lambda d, qkv, v, lse, do: delta.where_saturated(d, qkv, v, lse, do, Masks(), config)
  got = jax.vmap(fn)(*args)
  for n in range(2):
    want = fn(*[jax.tree.map(lambda x: x[n], a) for a in args])
    np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want))
  jaxpr = str(jax.make_jaxpr(jax.vmap(fn))(*args))
  assert jaxpr.count("cond[") == 1 and "scan[" in jaxpr
