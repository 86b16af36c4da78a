"""SageBwd (every backend in BACKENDS) against full-precision attention, and
the reference backend's int8 tensors against an independent re-derivation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cosine, gaussian_qkv, oracle, oracle64, rel_l2, sage
from pallas_kernels import numerics as nm
from pallas_kernels.types import Config
from sagebwd_jax import dot_product_attention, full_precision_attention
from sagebwd_jax.reference import ReferenceBackend

NAMES = ("O", "dQ", "dK", "dV")

# The paper's Table 1 (relative L2 vs full precision; docs/algorithm.md); the
# bar is 1.25x these.
TABLE1_REL_L2 = {
    1.0: (0.0160, 0.0184, 0.0220, 0.0159),
    3.0: (0.0389, 0.0758, 0.0777, 0.0387),
    5.0: (0.0603, 0.2014, 0.2007, 0.0605),
}


def _flat(out):
  o, grads = out
  return (o, *grads)


def assert_close_to_oracle(got, want, min_cos=0.999, names=NAMES):
  for name, x, ref in zip(names, _flat(got), _flat(want)):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x)), f"{name} has non-finite values"
    c = cosine(x, ref)
    assert c >= min_cos, f"{name}: cosine {c:.6f} < {min_cos}"


# ---------------------------------------------------------------- Table 1

@pytest.mark.parametrize("sigma", sorted(TABLE1_REL_L2))
def test_table1_accuracy(implementation, sigma):
  q, k, v, do = gaussian_qkv(jax.random.key(int(sigma)), 1, 4096, 4096, 1, 1, 128, sigma)
  got = sage(q, k, v, do, implementation=implementation)
  want = oracle64(q, k, v, do)
  errors = {n: rel_l2(x, ref) for n, x, ref in zip(NAMES, _flat(got), _flat(want))}
  bars = dict(zip(NAMES, (1.25 * e for e in TABLE1_REL_L2[sigma])))
  bad = {n: (round(errors[n], 4), round(bars[n], 4)) for n in NAMES if not errors[n] <= bars[n]}
  assert not bad, f"sigma={sigma}: relative L2 (got, bar) {bad}; all: {errors}"


def test_oracle64_is_really_fp64_and_matches_fp32(x64):
  del x64
  q, k, v, do = gaussian_qkv(jax.random.key(0), 1, 64, 64, 2, 1, 64)
  o64, g64 = oracle64(q, k, v, do)
  o32, g32 = oracle(q, k, v, do)
  assert o64.dtype == np.float64
  for a, b in zip((o64, *g64), (o32, *g32)):
    assert rel_l2(b, a) < 1e-5


# ---------------------------------------------------------------- masks, shapes

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tq,tk", [(100, 75), (75, 100), (17, 200)])
def test_against_full_precision(implementation, causal, tq, tk):
  q, k, v, do = gaussian_qkv(jax.random.key(tq + tk), 2, tq, tk, 2, 2, 64)
  got = sage(q, k, v, do, is_causal=causal, implementation=implementation)
  want = oracle(q, k, v, do, is_causal=causal)
  assert got[0].shape == q.shape and got[0].dtype == q.dtype
  assert_close_to_oracle(got, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_gqa_mqa(implementation, heads, kv_heads, causal):
  q, k, v, do = gaussian_qkv(jax.random.key(heads * 10 + kv_heads), 1, 256, 256, heads,
                             kv_heads, 64)
  got = sage(q, k, v, do, is_causal=causal, implementation=implementation)
  want = oracle(q, k, v, do, is_causal=causal)
  assert got[1][1].shape == k.shape and got[1][2].shape == v.shape
  assert_close_to_oracle(got, want)


def test_gqa_equals_repeated_kv_heads(implementation):
  # dK/dV of a kv head are the sum over its group of query heads.
  q, k, v, do = gaussian_qkv(jax.random.key(7), 1, 128, 128, 4, 2, 64)
  o, (dq, dk, dv) = sage(q, k, v, do, implementation=implementation)
  kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
  o_r, (dq_r, dk_r, dv_r) = sage(q, kr, vr, do, implementation=implementation)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_r, np.float32), atol=1e-6)
  np.testing.assert_allclose(np.asarray(dq, np.float32), np.asarray(dq_r, np.float32),
                             atol=1e-6)
  summed = lambda g: np.asarray(g, np.float32).reshape(1, 128, 2, 2, 64).sum(3)
  np.testing.assert_allclose(np.asarray(dk, np.float32), summed(dk_r), rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(dv, np.float32), summed(dv_r), rtol=2e-2, atol=2e-2)


def _check_masked(got, want, dead_rows):
  """Rows of `dead_rows` (B, Tq, bool) see no key: O and dQ exactly 0 there."""
  o, (dq, dk, dv) = got
  for name, x in zip(NAMES, (o, dq, dk, dv)):
    assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name} not finite"
  o, dq = np.asarray(o, np.float32), np.asarray(dq, np.float32)
  assert np.all(o[dead_rows] == 0), "fully masked rows must output exactly 0"
  assert np.all(dq[dead_rows] == 0), "fully masked rows must get zero dQ"
  assert_close_to_oracle(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_sequence_lengths(implementation, causal):
  tq, tk = 100, 75
  q, k, v, do = gaussian_qkv(jax.random.key(11), 3, tq, tk, 2, 1, 64)
  q_len = jnp.asarray([100, 37, 60], jnp.int32)
  kv_len = jnp.asarray([75, 20, 0], jnp.int32)  # batch 2: no key at all
  kw = dict(is_causal=causal, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  got = sage(q, k, v, do, implementation=implementation, **kw)
  want = oracle(q, k, v, do, **kw)
  dead = np.arange(tq)[None, :] >= np.asarray(q_len)[:, None]
  dead[2] = True
  _check_masked(got, want, dead)
  # Keys past the length get exactly zero dK, dV.
  for g in got[1][1:]:
    g = np.asarray(g, np.float32)
    assert np.all(g[1, 20:] == 0) and np.all(g[2] == 0)


def test_segment_ids_self_attention(implementation):
  t = 160
  q, k, v, do = gaussian_qkv(jax.random.key(12), 2, t, t, 2, 2, 64)
  ids = np.zeros((2, t), np.int32)
  ids[0, 50:], ids[0, 120:] = 1, 2
  ids[1, 7:] = 5
  for causal in (False, True):
    kw = dict(segment_ids=jnp.asarray(ids), is_causal=causal)
    got = sage(q, k, v, do, implementation=implementation, **kw)
    want = oracle(q, k, v, do, **kw)
    _check_masked(got, want, np.zeros((2, t), bool))


def test_segment_ids_pair_with_unmatched_queries(implementation):
  tq, tk = 90, 130
  q, k, v, do = gaussian_qkv(jax.random.key(13), 2, tq, tk, 4, 2, 64)
  rng = np.random.default_rng(0)
  q_ids = rng.integers(0, 4, (2, tq)).astype(np.int32)  # id 3 never appears in kv
  kv_ids = rng.integers(0, 3, (2, tk)).astype(np.int32)
  kw = dict(segment_ids=(jnp.asarray(q_ids), jnp.asarray(kv_ids)),
            key_value_seq_lengths=jnp.asarray([130, 100], jnp.int32))
  got = sage(q, k, v, do, implementation=implementation, **kw)
  want = oracle(q, k, v, do, **kw)
  _check_masked(got, want, q_ids == 3)


def test_lengths_do_not_leak_padding_into_mean(implementation):
  # Tokens past the length hold garbage with a huge bias. They fill whole key
  # blocks here (block_kv=32, length 96), so they share no quantization scale
  # with valid keys; they must change nothing, in particular not K's mean.
  q, k, v, do = gaussian_qkv(jax.random.key(14), 1, 128, 128, 2, 2, 64)
  kv_len = jnp.asarray([96], jnp.int32)
  k_bad = k.at[:, 96:].set(jnp.asarray(1e3, k.dtype))
  v_bad = v.at[:, 96:].set(jnp.asarray(-1e3, v.dtype))
  kw = dict(key_value_seq_lengths=kv_len, block_kv=32, implementation=implementation)
  a = sage(q, k, v, do, **kw)
  b = sage(q, k_bad, v_bad, do, **kw)
  for name, x, y in zip(NAMES, _flat(a), _flat(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if name in ("dK", "dV"):
      assert np.all(x[:, 96:] == 0) and np.all(y[:, 96:] == 0), name
    np.testing.assert_array_equal(x, y, err_msg=name)
  want = oracle(q, k, v, do, key_value_seq_lengths=kv_len)
  assert_close_to_oracle(a, want)


# ---------------------------------------------------------------- smoothing

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


def _biased_k(seed, bias_scale):
  q, k, v, do = gaussian_qkv(jax.random.key(seed), 1, 256, 256, 2, 2, 64, dtype=jnp.float32)
  bias = bias_scale * jax.random.normal(jax.random.key(seed + 1), (1, 1, 2, 64))
  return tuple(x.astype(jnp.bfloat16) for x in (q, k + bias, v, do))


@pytest.mark.parametrize("smooth_k", [True, False])
def test_smoothing_on_and_off_match_full_precision(implementation, smooth_k):
  q, k, v, do = gaussian_qkv(jax.random.key(22), 1, 256, 256, 2, 2, 64)
  got = sage(q, k, v, do, smooth_k=smooth_k, implementation=implementation)
  assert_close_to_oracle(got, oracle(q, k, v, do))


def test_k_smoothing_wins_with_channel_bias(implementation):
  q, k, v, do = _biased_k(23, 8.0)
  want = oracle(q, k, v, do)
  on = sage(q, k, v, do, smooth_k=True, implementation=implementation)
  off = sage(q, k, v, do, smooth_k=False, implementation=implementation)
  err_on = [rel_l2(x, r) for x, r in zip(_flat(on), _flat(want))]
  err_off = [rel_l2(x, r) for x, r in zip(_flat(off), _flat(want))]
  assert_close_to_oracle(on, want)
  for name, e_on, e_off in zip(NAMES, err_on, err_off):
    assert e_on < 0.5 * e_off, f"{name}: smoothing on {e_on:.4f} vs off {e_off:.4f}"


def test_smooth_q(implementation):
  q, k, v, do = gaussian_qkv(jax.random.key(24), 1, 256, 256, 2, 2, 64)
  for causal in (False, True):
    got = sage(q, k, v, do, smooth_q=True, is_causal=causal, implementation=implementation)
    assert_close_to_oracle(got, oracle(q, k, v, do, is_causal=causal))


def test_smooth_q_with_query_channel_bias(implementation):
  # A per-channel bias on Q (3x its spread): Q-smoothing quantizes Q - mean
  # and adds the bias back in fp32; the bias dominates Q, so a wrong or
  # missing dK correction term (colsum(dS) q_mean) would wreck dK. (A larger
  # bias makes softmax nearly one-hot, where dQ's relative error is large
  # with or without smoothing; see Table 1 at sigma 5+.)
  q, k, v, do = gaussian_qkv(jax.random.key(25), 1, 256, 200, 2, 1, 64, dtype=jnp.float32)
  q = (q + 3.0 * jax.random.normal(jax.random.key(26), (1, 1, 2, 64))).astype(jnp.bfloat16)
  k, v, do = (x.astype(jnp.bfloat16) for x in (k, v, do))
  want = oracle(q, k, v, do)
  got = sage(q, k, v, do, smooth_q=True, implementation=implementation)
  assert_close_to_oracle(got, want, min_cos=0.998)
  plain = sage(q, k, v, do, smooth_q=False, implementation=implementation)
  # Smoothing Q is no less accurate than not (same blocks, same K).
  for name, x, y, r in zip(NAMES, _flat(got), _flat(plain), _flat(want)):
    assert rel_l2(x, r) <= 1.1 * rel_l2(y, r) + 1e-3, name


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


# ---------------------------------------------------------------- transforms

def _loss_fn(implementation, **kw):
  def loss(q, k, v, do):
    o = dot_product_attention(q, k, v, implementation=implementation, **kw)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
  return loss


def _assert_trees_close(a, b):
  """Same shapes and dtypes, and the same values up to a rare last-bit flip
  (XLA fuses differently under jit/vmap, which can move a bf16 rounding)."""
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    assert x.shape == y.shape and x.dtype == y.dtype
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.mean(x == y) >= 0.99, f"only {np.mean(x == y):.4f} of elements equal"
    assert rel_l2(x, y) < 1e-3


def test_jit_grad_checkpoint_agree_with_eager(implementation):
  q, k, v, do = gaussian_qkv(jax.random.key(30), 1, 96, 80, 2, 1, 64)
  loss = _loss_fn(implementation, is_causal=True)
  eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, do)
  jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, do)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v, do)
  _assert_trees_close(eager, jitted)
  _assert_trees_close(eager, remat)
  fwd_eager = dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  fwd_jit = jax.jit(lambda q, k, v: dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation))(q, k, v)
  _assert_trees_close(fwd_eager, fwd_jit)
  # And the grads are SageBwd's, i.e. close to the exact ones.
  want = oracle(q, k, v, do, is_causal=True)[1]
  for name, x, r in zip(NAMES[1:], eager, want):
    assert cosine(x, r) >= 0.999, name


def test_vmap_over_leading_axis(implementation):
  q, k, v, do = gaussian_qkv(jax.random.key(31), 3, 70, 70, 2, 2, 64)
  # A leading axis of 3 over batched (B=1) inputs.
  q, k, v, do = (x[:, None] for x in (q, k, v, do))
  loss = _loss_fn(implementation, is_causal=True)
  fwd = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True,
                                              implementation=implementation)
  out = jax.jit(jax.vmap(fwd))(q, k, v)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, do)
  for i in range(3):
    _assert_trees_close(out[i], fwd(q[i], k[i], v[i]))
    _assert_trees_close(tuple(g[i] for g in grads),
                        jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i], do[i]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_dtypes(implementation, dtype):
  q, k, v, do = gaussian_qkv(jax.random.key(32), 1, 128, 128, 2, 2, 64, dtype=dtype)
  got = sage(q, k, v, do, implementation=implementation)
  o, grads = got
  assert o.dtype == dtype
  assert all(g.dtype == dtype for g in grads)
  assert_close_to_oracle(got, oracle(q, k, v, do))


def test_unbatched_rank3(implementation):
  q, k, v, do = gaussian_qkv(jax.random.key(33), 1, 50, 90, 4, 2, 64)
  batched = sage(q, k, v, do, implementation=implementation)
  unbatched = sage(q[0], k[0], v[0], do[0], implementation=implementation)
  assert unbatched[0].shape == q.shape[1:]
  _assert_trees_close(unbatched, jax.tree.map(lambda x: x[0], batched))


def test_block_sizes_all_accurate(implementation):
  q, k, v, do = gaussian_qkv(jax.random.key(34), 1, 200, 200, 2, 2, 128)
  want = oracle(q, k, v, do, is_causal=True)
  for bq, bkv in ((16, 16), (32, 128), (128, 64)):
    got = sage(q, k, v, do, is_causal=True, block_q=bq, block_kv=bkv,
               implementation=implementation)
    assert_close_to_oracle(got, want)


def test_explicit_scale(implementation):
  q, k, v, do = gaussian_qkv(jax.random.key(35), 1, 128, 128, 2, 2, 64)
  got = sage(q, k, v, do, scale=0.05, implementation=implementation)
  assert_close_to_oracle(got, oracle(q, k, v, do, scale=0.05))
  default = sage(q, k, v, do, implementation=implementation)
  assert rel_l2(got[0], default[0]) > 0.05  # the scale is honoured
