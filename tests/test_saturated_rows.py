"""The rows whose logits saturate (sagebwd_jax/saturated_rows.py): their
recomputed Delta (sum_j P dP) and lse against float64 over the same int8
scores, which rows take them, in the reference and the Triton kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gaussian_qkv, kernel_config
from pallas_kernels import numerics as nm
from pallas_kernels.jax_triton.backend import TritonBackend
from pallas_kernels.types import Masks
from sagebwd_jax import saturated_rows
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

B, T, H, HKV, D = 2, 128, 4, 2, 64


def _case(causal: bool, sigma: float = 1.0, dtype=jnp.bfloat16):
  q, k, v, do = gaussian_qkv(jax.random.key(3), B, T, T, H, HKV, D, sigma=sigma, dtype=dtype)
  config = kernel_config(causal=causal, scale=D**-0.5)
  qkv = ReferenceBackend().quantize(q, k, v, key_mean(k, None), config)
  return qkv, v, do, config


BACKENDS = {"reference": ReferenceBackend(),
            "triton": TritonBackend.tuned(causal=False,
                                          interpret=jax.default_backend() != "gpu")}


def _float64_rows(qkv, v, do, causal: bool) -> tuple[np.ndarray, np.ndarray]:
  """sum_j P_ij dP_ij and the base-2 lse (B, H, T) in float64: P the softmax
  of the base-2 scores of the int8 Q and K with their scales, dP = dO . V^T."""
  f64 = lambda x: np.asarray(x, np.float64)
  group = H // HKV
  k8, k_scale = (np.repeat(f64(x), group, axis=1) for x in (qkv.k8, qkv.k_scale))
  s = np.einsum("bhqd,bhkd->bhqk", f64(qkv.q8), k8)
  s = s * f64(qkv.q_scale)[..., None] * k_scale[:, :, None, :]
  if causal:
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  top = s.max(axis=-1, keepdims=True)
  p = np.exp2(s - top)
  lse = top[..., 0] + np.log2(p.sum(axis=-1))
  p = p / p.sum(axis=-1, keepdims=True)
  dp = np.einsum("bqhd,bkhd->bhqk", f64(do), np.repeat(f64(v), group, axis=2))
  return np.sum(p * dp, axis=-1), lse


@pytest.mark.parametrize("causal", [False, True])
def test_recomputed_rows_are_float64s(causal):
  qkv, v, do, config = _case(causal)
  got = saturated_rows.recomputed_rows(qkv, v, do, Masks(), config)
  for x, want in zip(got, _float64_rows(qkv, v, do, causal)):
    np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5, atol=1e-5)


def test_rows_that_see_no_key_get_zero_delta_and_infinite_lse():
  qkv, v, do, config = _case(causal=False)
  ids = jnp.zeros((B, T), jnp.int32)
  masks = Masks(q_ids=ids.at[:, :5].set(nm.Q_INVALID_ID), kv_ids=ids)
  got_delta, got_lse = map(np.asarray, saturated_rows.recomputed_rows(qkv, v, do, masks, config))
  assert np.all(got_delta[:, :, :5] == 0) and np.all(np.isfinite(got_delta))
  assert np.all(got_lse[:, :, :5] == np.inf) and np.all(np.isfinite(got_lse[:, :, 5:]))


def _marked_lse() -> tuple[jax.Array, np.ndarray]:
  """An lse with two saturated rows (one in each batch row, one negative)
  and, not saturated, an infinite, a NaN and one exactly at the threshold;
  and where the two are."""
  lse = jnp.zeros((B, H, T), jnp.float32)
  lse = lse.at[0, 1, 7].set(2 * nm.SATURATED_LSE).at[1, 3, 100].set(-2 * nm.SATURATED_LSE)
  lse = lse.at[0, 0, 0].set(jnp.inf).at[0, 0, 1].set(jnp.nan)
  lse = lse.at[0, 0, 2].set(nm.SATURATED_LSE)  # not above it
  replaced = np.zeros((B, H, T), bool)
  replaced[0, 1, 7] = replaced[1, 3, 100] = True
  return lse, replaced


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_only_saturated_rows_are_replaced(backend, causal):
  """Rows with |lse| above numerics.SATURATED_LSE take the recomputed Delta
  and lse (the reference's within fp32 summation order, for the kernel); the
  rest, and rows with an infinite or NaN lse, keep theirs bit for bit."""
  qkv, v, do, config = _case(causal=causal)
  lse, replaced = _marked_lse()
  prepass_delta = jax.random.normal(jax.random.key(0), (B, H, T))
  got = BACKENDS[backend].saturated_rows(qkv, v, lse, do, prepass_delta, Masks(), config)
  want = saturated_rows.recomputed_rows(qkv, v, do, Masks(), config)
  for x, given, recomputed in zip(got, (prepass_delta, lse), want):
    x, given, recomputed = np.asarray(x), np.asarray(given), np.asarray(recomputed)
    np.testing.assert_allclose(x[replaced], recomputed[replaced], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x[~replaced], given[~replaced])
  # Nothing saturated: the pre-pass's Delta and the forward's lse, bit for bit.
  zeros = jnp.zeros_like(lse)
  same = BACKENDS[backend].saturated_rows(qkv, v, zeros, do, prepass_delta, Masks(), config)
  for x, given in zip(same, (prepass_delta, zeros)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(given))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fp16_rows_take_the_pass_from_a_lower_lse(backend):
  """fp16 inputs take the recomputed Delta and lse above
  numerics.SATURATED_LSE_FP16 (issue 49); bf16 ones only above
  SATURATED_LSE, as before."""
  lse = jnp.zeros((B, H, T), jnp.float32).at[0, 1, 7].set(2 * nm.SATURATED_LSE_FP16)
  lse = lse.at[1, 0, 3].set(nm.SATURATED_LSE_FP16)  # not above it
  prepass_delta = jax.random.normal(jax.random.key(0), (B, H, T))
  for dtype, replaced in ((jnp.float16, True), (jnp.bfloat16, False)):
    qkv, v, do, config = _case(causal=True, dtype=dtype)
    got_delta, got_lse = map(np.asarray, BACKENDS[backend].saturated_rows(
        qkv, v, lse, do, prepass_delta, Masks(), config))
    want_delta, want_lse = map(np.asarray, saturated_rows.recomputed_rows(
        qkv, v, do, Masks(), config))
    at = (0, 1, 7)
    if replaced:
      np.testing.assert_allclose(got_delta[at], want_delta[at], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(got_lse[at], want_lse[at], rtol=1e-5, atol=1e-5)
    else:
      assert got_delta[at] == prepass_delta[at] and got_lse[at] == lse[at], dtype
    assert got_delta[1, 0, 3] == prepass_delta[1, 0, 3] and got_lse[1, 0, 3] == lse[1, 0, 3]


def test_vmap_keeps_one_cond_over_the_whole_batch():
  """Under vmap the pass stays behind a cond (not a select that runs it for
  every call), and each example's Delta and lse are its own."""
  qkv, v, do, config = _case(causal=True)
  lse = jnp.zeros((B, H, T), jnp.float32).at[1, 2, 50].set(2 * nm.SATURATED_LSE)
  prepass_delta = jax.random.normal(jax.random.key(1), (B, H, T))
  stack = lambda x: jnp.stack([x, x[::-1]])  # two examples: the batch rows swapped
  args = [jax.tree.map(stack, a) for a in (qkv, v, lse, do, prepass_delta)]
  fn = lambda *a: saturated_rows.where_saturated(*a, Masks(), config)
  got = jax.vmap(fn)(*args)
  for n in range(2):
    want = fn(*[jax.tree.map(lambda x: x[n], a) for a in args])
    for x, y in zip(got, want):
      np.testing.assert_array_equal(np.asarray(x[n]), np.asarray(y))
  jaxpr = str(jax.make_jaxpr(jax.vmap(fn))(*args))
  assert jaxpr.count("cond[") == 1 and "scan[" in jaxpr


@pytest.mark.parametrize("q_len, block_q, rows", [(4096, 64, 1024), (128, 64, 128),
                                                  (192, 64, 64), (384, 64, 128),
                                                  (3072, 128, 1024), (64, 64, 64)])
def test_a_program_checks_whole_query_blocks(q_len, block_q, rows):
  """Each Triton program takes a power-of-two count of whole query blocks,
  up to CHECK_ROWS rows, that divides the queries."""
  from pallas_kernels.jax_triton.saturated_rows import rows_per_program
  assert rows_per_program(q_len, block_q) == rows
