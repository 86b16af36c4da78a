"""The shared int8 rules (pallas_kernels.numerics), exactly, against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import numerics as nm


def _round_grid() -> np.ndarray:
  """Every multiple of 1/8 in [-130, 130] (all .5 ties, the +-127.5 limits
  and beyond), values just beside the ties, random and huge fp32 values."""
  grid = np.arange(-130 * 8, 130 * 8 + 1, dtype=np.float64) / 8
  ties = (np.arange(-128, 128, dtype=np.float64) + 0.5).astype(np.float32)
  near = np.concatenate([np.nextafter(ties, np.float32(np.inf)),
                         np.nextafter(ties, np.float32(-np.inf))])
  rand = np.random.default_rng(0).uniform(-127.5, 127.5, 20000)
  values = np.concatenate([grid, near, rand, [0.0, -0.0, 1e9, -1e9, 3e38, -3e38]])
  return values.astype(np.float32)


def test_round_to_int8_is_clipped_round_half_even():
  x = _round_grid()
  got = np.asarray(jax.jit(nm.round_to_int8)(jnp.asarray(x)))
  assert got.dtype == np.int8
  want = np.clip(np.rint(x.astype(np.float64)), -127, 127).astype(np.int64)
  np.testing.assert_array_equal(got.astype(np.int64), want)


def test_round_to_int8_ties_go_to_even():
  x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 125.5, -0.0], np.float32)
  got = np.asarray(nm.round_to_int8(jnp.asarray(x)))
  np.testing.assert_array_equal(got, [0, 2, 2, 0, -2, -2, 126, -126, 126, 0])


def test_round_to_int8_limits():
  # The int8 range is symmetric: -128 never appears, and +-127.5 (a tie that
  # half-to-even would send to +-128) clips to +-127.
  x = np.array([127.0, -127.0, 127.5, -127.5, 128.0, -128.0, 1e6, -1e6,
                np.nextafter(np.float32(127.5), np.float32(0)),
                np.nextafter(np.float32(-127.5), np.float32(0))], np.float32)
  got = np.asarray(nm.round_to_int8(jnp.asarray(x)))
  np.testing.assert_array_equal(got, [127, -127, 127, -127, 127, -127, 127, -127, 127, -127])


def test_round_to_int8_nonnegative():
  x = np.array([0.0, 0.5, 1.5, 63.5, 126.5, 127.0, 127.5, 1e6], np.float32)
  got = np.asarray(nm.round_to_int8(jnp.asarray(x), nonnegative=True))
  np.testing.assert_array_equal(got, [0, 0, 2, 64, 126, 127, 127, 127])


def test_magic_constants_round_and_convert_exactly():
  """The kernels' bit tricks, in numpy fp32: x + 1.5 * 2**23 keeps
  round-half-even(x) in its low byte for |x| <= 127.5, and an int32 |n| < 2**22
  added to 0x4B400000 reads as the fp32 1.5 * 2**23 + n."""
  x = np.clip(_round_grid(), -127.4, 127.4).astype(np.float32)
  biased = (x + np.float32(nm.ROUND_MAGIC_F32)).view(np.int32)
  np.testing.assert_array_equal(biased.astype(np.int8), np.rint(x).astype(np.int8))
  assert np.float32(nm.ROUND_MAGIC_F32).view(np.int32) == nm.ROUND_MAGIC_I32
  rng = np.random.default_rng(1)
  lim = 2 ** 22 - 1
  n = np.concatenate([rng.integers(-lim, lim + 1, 50000), np.arange(-1000, 1001),
                      [lim, -lim, 2 ** 21, -2 ** 21, 127 * 127 * 256]]).astype(np.int32)
  read = (n + np.int32(nm.ROUND_MAGIC_I32)).view(np.float32) - np.float32(nm.ROUND_MAGIC_F32)
  np.testing.assert_array_equal(read.astype(np.float64), n.astype(np.float64))


def test_inverse_scale():
  amax = jnp.asarray([0.0, 1.0, 127.0, 0.5], jnp.float32)
  np.testing.assert_array_equal(np.asarray(nm.inverse_scale(amax)),
                                np.float32([0.0, 127.0, 1.0, 254.0]))


def _np_quantize(x: np.ndarray, axis=None):
  """Independent psi: scale = amax/127, round-half-even(x * (127/amax))."""
  x = x.astype(np.float32)
  amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None)
  with np.errstate(divide="ignore"):
    inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
  x8 = np.clip(np.rint(x * inv), -127, 127).astype(np.int8)
  scale = (amax / np.float32(127)).astype(np.float32)
  return x8, (scale if axis is None else scale.squeeze(axis))


@pytest.mark.parametrize("shape,sigma", [((64, 128), 1.0), ((128, 64), 30.0), ((16, 64), 1e-3)])
def test_quantize_tile(shape, sigma):
  x = (sigma * np.random.default_rng(2).standard_normal(shape)).astype(np.float32)
  x8, scale = jax.jit(nm.quantize_tile)(jnp.asarray(x))
  x8, scale = np.asarray(x8), np.asarray(scale)
  assert x8.dtype == np.int8 and scale.shape == () and scale.dtype == np.float32
  assert np.max(np.abs(x8.astype(np.int32))) == 127
  np.testing.assert_allclose(scale, np.max(np.abs(x)) / 127, rtol=1e-6)
  err = np.abs(x8.astype(np.float64) * scale - x)
  assert np.all(err <= scale / 2 * (1 + 1e-5))
  ref8, ref_scale = _np_quantize(x)
  np.testing.assert_array_equal(x8, ref8)
  # The scale amax/127 may be formed as amax * (1/127): allow one ulp.
  np.testing.assert_array_max_ulp(scale, ref_scale, maxulp=1)


def test_quantize_tile_zero_tile():
  x8, scale = nm.quantize_tile(jnp.zeros((64, 64), jnp.float32))
  assert float(scale) == 0.0
  np.testing.assert_array_equal(np.asarray(x8), np.zeros((64, 64), np.int8))


def test_quantize_tile_sign_and_extremes():
  x = np.zeros((16, 64), np.float32)
  x[3, 5], x[7, 9], x[0, 0] = -2.0, 1.0, 0.999
  x8, scale = nm.quantize_tile(jnp.asarray(x))
  x8 = np.asarray(x8)
  assert float(scale) == pytest.approx(2.0 / 127)
  assert x8[3, 5] == -127 and x8[7, 9] == 64 and x8[0, 0] == 63  # 63.5 -> 64, 63.44 -> 63
  assert np.count_nonzero(x8) == 3


def test_quantize_rows():
  rng = np.random.default_rng(3)
  # Rows with very different magnitudes, one all-zero row, one negative-only row.
  x = rng.standard_normal((64, 128)).astype(np.float32) * np.logspace(-4, 3, 64)[:, None]
  x[10] = 0.0
  x[20] = -np.abs(x[20])
  x = x.astype(np.float32)
  x8, scale = jax.jit(nm.quantize_rows)(jnp.asarray(x))
  x8, scale = np.asarray(x8), np.asarray(scale)
  assert x8.dtype == np.int8 and scale.shape == (64,)
  amax8 = np.max(np.abs(x8.astype(np.int32)), axis=1)
  assert amax8[10] == 0 and scale[10] == 0
  assert np.all(np.delete(amax8, 10) == 127)
  err = np.abs(x8.astype(np.float64) * scale[:, None] - x)
  assert np.all(err <= scale[:, None] / 2 * (1 + 1e-5))
  ref8, ref_scale = _np_quantize(x, axis=1)
  np.testing.assert_array_equal(x8, ref8)
  # The scale amax/127 may be formed as amax * (1/127): allow one ulp.
  np.testing.assert_array_max_ulp(scale, ref_scale, maxulp=1)



def test_dequantize():
  acc = jnp.asarray([[100, -3], [0, 16129]], jnp.int32)
  got = nm.dequantize(acc, jnp.float32(0.5), jnp.float32(0.25))
  np.testing.assert_array_equal(np.asarray(got), np.float32([[12.5, -0.375], [0, 2016.125]]))


def _pos(bq, bk, q0=0, k0=0):
  return jnp.arange(q0, q0 + bq)[:, None], jnp.arange(k0, k0 + bk)[None, :]


def test_tile_mask_none_when_no_rule():
  q_pos, kv_pos = _pos(4, 4)
  assert nm.tile_mask(q_pos, kv_pos, causal=False) is None


@pytest.mark.parametrize("q0,k0", [(0, 0), (16, 0), (0, 16), (32, 16)])
def test_tile_mask_causal(q0, k0):
  q_pos, kv_pos = _pos(16, 16, q0, k0)
  got = np.asarray(nm.tile_mask(q_pos, kv_pos, causal=True))
  qi = np.arange(q0, q0 + 16)[:, None]
  kj = np.arange(k0, k0 + 16)[None, :]
  np.testing.assert_array_equal(got, np.broadcast_to(qi >= kj, (16, 16)))


@pytest.mark.parametrize("causal", [False, True])
def test_tile_mask_ids(causal):
  rng = np.random.default_rng(5)
  q_pos, kv_pos = _pos(16, 32, 16, 0)
  q_ids = rng.integers(0, 3, (16, 1)).astype(np.int32)
  kv_ids = rng.integers(0, 3, (1, 32)).astype(np.int32)
  # Tokens past a length carry the sentinels, which match nothing, not even
  # each other.
  q_ids[12:] = nm.Q_INVALID_ID
  kv_ids[:, 25:] = nm.KV_INVALID_ID
  got = np.asarray(nm.tile_mask(q_pos, kv_pos, causal=causal, q_ids=jnp.asarray(q_ids),
                                kv_ids=jnp.asarray(kv_ids)))
  qi = np.arange(16, 32)[:, None]
  kj = np.arange(32)[None, :]
  want = (q_ids == kv_ids) & ((qi >= kj) if causal else True)
  np.testing.assert_array_equal(got, want)
  assert not got[12:].any() and not got[:, 25:].any()
  assert nm.Q_INVALID_ID != nm.KV_INVALID_ID


def test_q_smoothing_bias():
  rng = np.random.default_rng(6)
  k8 = rng.integers(-127, 128, (32, 64)).astype(np.int8)
  q_mean = rng.standard_normal(64).astype(np.float32)
  got = nm.q_smoothing_bias(jnp.asarray(k8), jnp.float32(0.01), jnp.asarray(q_mean))
  want = (k8.astype(np.float64) * 0.01) @ q_mean.astype(np.float64)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_safe_row_max():
  m = jnp.asarray([-jnp.inf, 3.0, -2.0], jnp.float32)
  np.testing.assert_array_equal(np.asarray(nm.safe_row_max(m)), [0.0, 3.0, -2.0])
  # exp2(S - m) for a fully masked row gives 0, not NaN.
  s = jnp.full((3,), -jnp.inf)
  assert np.all(np.asarray(jnp.exp2(s - nm.safe_row_max(m)[0])) == 0)


def _folded_steps(s, v_block_scale, block, blocks_per_step, levels):
  """Runs numerics.folded_softmax_step over the keys of `s` (rows, keys);
  returns per step (P, alpha, e) and the final l, as numpy."""
  log2_sv, inv_sv = nm.folded_v_scales(jnp.asarray(v_block_scale), blocks_per_step)
  log2_sv, inv_sv = np.asarray(log2_sv), np.asarray(inv_sv)
  rows, step = s.shape[0], block * blocks_per_step
  m = jnp.full((rows,), nm.NOTHING_SEEN, jnp.float32)
  e = jnp.full((rows,), -jnp.inf, jnp.float32)
  l = jnp.zeros((rows,), jnp.float32)
  steps = []
  for j in range(0, s.shape[1], step):
    blocks, log2_step, inv_step = [], [], []
    for b in range(j // block, j // block + blocks_per_step):
      tile = s[:, b * block:(b + 1) * block]
      top = np.max(tile, axis=1)
      blocks.append((jnp.asarray(top), jnp.asarray(tile - np.where(
          np.isfinite(top), top, 0)[:, None])))
      log2_step.append(jnp.asarray(log2_sv[b]))
      inv_step.append(jnp.asarray(inv_sv[b]))
    p, alpha, m, e, l = nm.folded_softmax_step(blocks, log2_step, inv_step, m, e, l,
                                               levels=levels)
    p = np.round(np.minimum(np.asarray(p, np.float64), levels))
    steps.append((p, *(np.asarray(x, np.float64) for x in (alpha, e))))
  return steps, np.asarray(l, np.float64)


@pytest.mark.parametrize("levels", [127.0, 255.0])
def test_folded_softmax_step_is_softmax(levels):
  """Each P is round(levels * exp2(s + log2 sV - E)) with E the step's largest
  folded score; l is the unquantized softmax denominator in units of
  exp2(E) / levels; and acc * alpha + P.V8 gives softmax(S).V up to P's
  rounding (at most half a step of P per key)."""
  rng = np.random.default_rng(0)
  block, per_step, rows, keys = 16, 2, 8, 128
  s = rng.normal(0, 3, (rows, keys)).astype(np.float32)
  s[:, 40:50] = -np.inf  # masked keys
  s[3] = -np.inf  # a row that sees nothing
  v_scale = rng.uniform(0.5, 2.0, keys // block).astype(np.float32)
  v_scale[5] = 0.0  # an all-zero V block: folded as its step partner's scale
  v8 = rng.integers(-127, 128, (keys, 4)).astype(np.float64)
  v8[5 * block:6 * block] = 0
  steps, l = _folded_steps(s, v_scale, block, per_step, levels)

  sv = np.repeat(np.where(v_scale > 0, v_scale, v_scale[4]), block).astype(np.float64)
  seen = np.isfinite(np.max(s, axis=1))
  acc, bound = np.zeros((rows, 4)), np.zeros(rows)
  for (p, alpha, e), j in zip(steps, range(0, keys, block * per_step)):
    keys_j = slice(j, j + block * per_step)
    folded = s[seen, keys_j].astype(np.float64) + np.log2(sv[keys_j])
    top = np.max(folded, axis=1)
    np.testing.assert_allclose(e[seen], top, rtol=0, atol=1e-5)
    want = np.round(levels * np.exp2(folded - top[:, None]))
    assert np.all(p <= levels) and np.all(p[~seen] == 0)
    # fp32 rounding of the exponent may move a P by one step at a .5 tie.
    assert np.max(np.abs(p[seen] - want)) <= 1
    assert np.mean(p[seen] != want) < 0.01
    acc = acc * alpha[:, None] + p @ v8[keys_j]
    unit = np.exp2(np.where(seen, e, 0)) / levels  # of P, in exp2 of the scores
    bound += 0.5 * unit * np.abs(v8[keys_j] * sv[keys_j, None]).sum(0).max()
  e_final = steps[-1][2]

  exact_p = np.exp2(s[seen].astype(np.float64))
  denominator = exact_p.sum(1)
  np.testing.assert_allclose(l[seen] * np.exp2(e_final[seen]) / levels, denominator, rtol=1e-5)
  assert l[3] == 0
  o = acc[seen] / l[seen, None]
  exact = exact_p @ (v8 * sv[:, None]) / denominator[:, None]
  # P.V in the true scale: acc carries V8 units and P units of exp2(E) / levels.
  assert np.all(np.abs(o - exact) <= bound[seen, None] / denominator[:, None] * 1.001 + 1e-9)


def test_folded_softmax_step_floors_e_below_the_running_max():
  """A step far below the running max is quantized against max - 60, so the
  factor that rescales the accumulators stays finite (here 2**60)."""
  s = np.array([[0.0] * 16 + [-200.0] * 16], np.float32)  # step 2 is 200 below
  steps, _ = _folded_steps(s, np.ones(2, np.float32), 16, 1, 255.0)
  (_, _, e1), (p2, alpha2, e2) = steps
  assert e1[0] == 0 and e2[0] == -nm.E_FLOOR_BELOW_MAX
  assert np.isclose(alpha2[0], 2.0**nm.E_FLOOR_BELOW_MAX, rtol=1e-5)
  assert np.all(p2 == 0)


@pytest.mark.parametrize("masked", [False, True])
def test_block_scores_largest_score_gives_exactly_zero(masked):
  """At logits near 1e8 (sigma 1e4) S - max(S) must still be exactly 0 at each
  row's largest score under jit, where XLA:CPU may contract S's multiply into
  the subtraction; the other entries are S - max(S) to one rounding."""
  rng = np.random.default_rng(5)
  product = rng.integers(-4_000_000, 4_000_000, (64, 64)).astype(np.int32)
  scale = np.float32(37.25)
  mask = np.tril(np.ones((64, 64), bool)) if masked else None
  top, from_top = jax.jit(lambda p: nm.block_scores(
      p, jnp.float32(scale), mask=None if mask is None else jnp.asarray(mask)))(
          jnp.asarray(product))
  top, from_top = np.asarray(top), np.asarray(from_top)
  visible = np.ones((64, 64), bool) if mask is None else mask
  s = np.where(visible, product.astype(np.float64) * scale, -np.inf)
  np.testing.assert_array_equal(np.max(from_top, axis=1), 0.0)
  np.testing.assert_allclose(top, np.max(s, axis=1), rtol=1e-7)
  want = s - np.max(s, axis=1, keepdims=True)
  np.testing.assert_array_equal(np.isinf(from_top), ~visible)
  np.testing.assert_allclose(from_top[visible], want[visible], rtol=1e-7)


def test_block_scores_with_a_bias_and_a_row_that_sees_nothing():
  product = jnp.asarray([[3, -1, 2], [5, 0, 1]], jnp.int32)
  bias = jnp.asarray([[0.5, 4.0, -1.0]], jnp.float32)
  mask = jnp.asarray([[True, True, False], [False, False, False]])
  top, from_top = nm.block_scores(product, jnp.float32(2.0), mask=mask, bias=bias)
  np.testing.assert_array_equal(np.asarray(top), [6.5, -np.inf])
  np.testing.assert_array_equal(np.asarray(from_top), [[0.0, -4.5, -np.inf], [-np.inf] * 3])


@pytest.mark.parametrize("x", [
    np.float32(np.nan), np.float32(np.inf), np.float32(-np.inf), -np.float32(np.nan)])
def test_non_finite_group_gets_a_nan_scale(x):
  """A NaN or an infinity anywhere in a group makes its scale NaN, whatever
  the position (XLA:CPU's vectorized max skips NaN) and the NaN's sign."""
  tile = np.random.default_rng(6).standard_normal((64, 64)).astype(np.float32)
  tile[37, 11] = x
  _, scale = jax.jit(nm.quantize_tile)(jnp.asarray(tile))
  assert np.isnan(scale)
  _, row_scales = jax.jit(nm.quantize_rows)(jnp.asarray(tile))
  assert np.isnan(row_scales[37]) and np.all(np.isfinite(np.delete(row_scales, 37)))
  _, row_scales = nm.quantize_rows(jnp.abs(jnp.asarray(tile)), nonnegative=True)
  assert np.isnan(row_scales[37]) and np.all(np.isfinite(np.delete(row_scales, 37)))


def test_spread_nan():
  x = jnp.asarray([[1.0, np.nan, 2.0], [1.0, np.inf, 3.0]], jnp.float32)
  got = np.asarray(nm.spread_nan(x))
  assert np.all(np.isnan(got[0]))
  np.testing.assert_array_equal(got[1], [1.0, np.inf, 3.0])  # +inf is a lse's "no key"


def test_unsigned_rows():
  """pq = 255 * exp2(a - rowmax a): the row's largest rounds to 255, every value
  lies in [0, 255], pq * exp2(scale) is exp2(a), and a fully masked row is 0."""
  a = jax.random.normal(jax.random.key(3), (4, 64)) * 5.0 - 20.0
  a = a.at[2].set(-jnp.inf)
  pq, log2_scale = nm.unsigned_rows(a)
  pq, log2_scale = np.asarray(pq), np.asarray(log2_scale)
  assert np.all((pq >= 0) & (np.round(pq) <= 255))
  np.testing.assert_array_equal(np.round(pq[[0, 1, 3]]).max(axis=1), 255.0)
  np.testing.assert_array_equal(pq[2], 0.0)
  live = [0, 1, 3]
  np.testing.assert_allclose(pq[live] * np.exp2(log2_scale[live])[:, None],
                             np.exp2(np.asarray(a, np.float64)[live]), rtol=1e-5)


def test_log2_p_caps_at_zero_and_keeps_nan():
  a = jnp.array([-jnp.inf, -3.0, 0.0, 2.5, jnp.nan, jnp.inf], jnp.float32)
  np.testing.assert_array_equal(nm.log2_p(a), [-np.inf, -3.0, 0.0, 0.0, np.nan, 0.0])


@pytest.mark.parametrize("m", [2.0**15 + 1.0, 1.37e6, -2.5e8, 3e9])
def test_saturated_lse_margin(m):
  """A one-hot row (l = 1): the lse lies below its top score by more than
  the 2 ulp that the kernels' roundings of S * c - lse reach, and, with
  those 2 ulp, by less than one step of the int8 scores at D=64
  (|S| / (127**2 * 64)), so a key one step below stays below the cap."""
  m = np.float32(m)
  lse = np.float32(nm.saturated_lse(jnp.float32(m), jnp.float32(1.0)))
  gap = np.float64(m) - np.float64(lse)
  assert gap > 2 * np.spacing(np.abs(m))
  assert gap + 2 * np.spacing(np.abs(m)) < abs(np.float64(m)) / (127**2 * 64)


def test_mean_scores_are_each_rows_product_with_its_kv_heads_mean():
  """q_i . m times the multiplier, per (batch, query head, row), m the mean
  of the query head's kv head (GQA: heads 0-2 read kv head 0, 3-5 kv head 1),
  against float64."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 16, 6, 8)).astype(np.float32)
  m = rng.standard_normal((2, 2, 8)).astype(np.float32)
  got = np.asarray(nm.mean_scores(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32),
                                  jnp.asarray(m), 0.5))
  q64 = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32), np.float64)
  want = np.einsum("bthd,bhd->bht", q64, np.repeat(m.astype(np.float64), 3, axis=1)) * 0.5
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_token_norms_are_float64_norms_per_token_and_head():
  """(B, T, H, D) -> (B, H, T): each token's Euclidean norm over channels,
  per head, to fp32 rounding of float64's; a NaN channel makes its token's
  norm NaN."""
  x = jax.random.normal(jax.random.key(3), (2, 48, 3, 64), jnp.bfloat16) * 5
  x = x.at[1, 7, 2, 11].set(jnp.nan)
  want = np.sqrt(np.sum(np.square(np.asarray(x, np.float64)), axis=-1)).transpose(0, 2, 1)
  got = np.asarray(nm.token_norms(x))
  assert got.shape == (2, 3, 48) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert np.isnan(got[1, 2, 7]) and np.isnan(want[1, 2, 7])
