"""NaN and infinity in, NaN out (issue 17): every output and gradient element
that jax.nn's attention makes non-finite is NaN here too, on the reference
and on the Triton kernels (interpreted; compiled on a GPU). int8 has no
NaN, so a non-finite value travels in its block's scale, and where block
skipping leaves no product to carry it, through `numerics.spread_nan`; the
spread beyond jax.nn's elements stays within the batch row and the key/value
head group (the op's docstring says how far)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gaussian_qkv, sage, value_and_grads

NAMES = ("O", "dQ", "dK", "dV")
IMPLS = ["reference", "triton"]
# Two batch rows, two key/value heads of two query heads; three 32-token
# blocks, so causal masking skips blocks.
B, T, H, HKV, D, BLOCK = 2, 96, 4, 2, 16, 32


MASKS = {"none": {}, "causal": dict(is_causal=True), "window": dict(local_window_size=(8, 4))}


@functools.partial(jax.jit, static_argnames=("is_causal", "local_window_size"))
def _jax_nn(q, k, v, do, is_causal=False, local_window_size=None):
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=is_causal,
                         local_window_size=local_window_size, implementation="xla")
  return value_and_grads(fn, q, k, v, do)


def _flat(out):
  return [np.asarray(x, np.float32) for x in (out[0], *out[1])]


def _check(implementation, where, index, value, kv_len=T, *, seq=T, head_dim=D, block=BLOCK,
           dtype=jnp.float32, quantization="int8", **kw):
  q, k, v, do = gaussian_qkv(jax.random.key(0), B, seq, kv_len, H, HKV, head_dim, dtype=dtype)
  arrays = dict(q=q, k=k, v=v, do=do)
  arrays[where] = arrays[where].at[index].set(value)
  q, k, v, do = arrays["q"], arrays["k"], arrays["v"], arrays["do"]
  want = _flat(_jax_nn(q, k, v, do, **kw))
  got = _flat(sage(q, k, v, do, implementation=implementation, block_q=block,
                   block_kv=block, quantization=quantization, **kw))
  group = index[2] // (H // HKV) if where in ("q", "do") else index[2]
  for name, a, b in zip(NAMES, got, want):
    missing = ~np.isfinite(b) & ~np.isnan(a)
    assert not missing.any(), (
        f"{name}: {missing.sum()} elements non-finite in jax.nn but not NaN here, "
        f"first at {np.argwhere(missing)[0]}")
    assert not np.isinf(a).any(), f"{name} has infinities"
    # The spread stays within the batch row and the key/value head group.
    heads = (slice(group, group + 1) if name in ("dK", "dV")
             else slice(group * (H // HKV), (group + 1) * (H // HKV)))
    outside = np.isnan(a)
    outside[0, :, heads] = False
    assert not outside.any(), f"{name}: NaN outside batch row 0, heads {heads}"


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("where,index", [
    ("q", (0, 40, 1, 3)), ("k", (0, 70, 0, 5)), ("v", (0, 70, 1, 2)), ("do", (0, 40, 2, 7)),
    ("q", (0, 10, 0, 0)), ("do", (0, 5, 3, 1))])
def test_nan_in_is_nan_out(implementation, mask, where, index):
  _check(implementation, where, index, np.nan, **MASKS[mask])


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("where,index", [
    ("q", (0, 40, 1, 3)), ("k", (0, 70, 0, 5)), ("v", (0, 70, 1, 2)), ("do", (0, 40, 2, 7))])
def test_fp8_nan_in_is_nan_out(mask, where, index):
  """quantization="int8_fp8" on the reference."""
  _check("reference", where, index, np.nan, quantization="int8_fp8", **MASKS[mask])


@pytest.mark.parametrize("where", ["q", "do"])
def test_fp8_nan_reaches_keys_no_query_sees(where):
  """As `test_nan_reaches_keys_no_query_sees`, with quantization="int8_fp8"."""
  _check("reference", where, (0, 20, 1, 3), np.nan, kv_len=T + 2 * BLOCK, is_causal=True,
         quantization="int8_fp8")


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("where,value", [("q", np.inf), ("k", -np.inf), ("v", np.inf)])
def test_infinity_in_is_nan_out(implementation, where, value):
  _check(implementation, where, (0, 50, 1, 4), value, is_causal=True)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("where", ["q", "do"])
def test_nan_reaches_keys_no_query_sees(implementation, where):
  """Causal with Tk > Tq: keys 96.. are seen by no query and no kernel program
  computes their gradients, yet jax.nn's 0 x NaN makes them NaN."""
  _check(implementation, where, (0, 20, 1, 3), np.nan, kv_len=T + 2 * BLOCK, is_causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["int8", "int8_fp8"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("where,index", [
    ("q", (0, 140, 1, 3)), ("k", (0, 70, 0, 5)), ("v", (0, 200, 1, 2)), ("do", (0, 40, 2, 7))])
def test_mosaic_nan_in_is_nan_out(quantization, mask, where, index):
  """The Hopper kernels (a shape and dtype they take: bf16, D=64, whole
  128-token tiles, 64-token blocks); with FP8 products the head groups' NaN
  rides on the gradients' factors (`sagebwd._nan_factors`)."""
  _check("mosaic", where, index, np.nan, kv_len=256, seq=256, head_dim=64, block=64,
         dtype=jnp.bfloat16, quantization=quantization, **MASKS[mask])


# --- finite inputs at saturating logits (docs/algorithm.md, "Saturating logits") ---

@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_queries_and_keys_at_sigma_200_give_finite_gradients(impl):
  """fp16 q, k at sigma 200 (logits near 5e4), B=2 T=128 H=4 D=64, causal:
  no Inf or NaN in O, dQ, dK, dV."""
  q, k, v, do = gaussian_qkv(jax.random.key(0), 2, 128, 128, 4, 4, 64, sigma=200.0,
                             dtype=jnp.float16)
  out = _flat(sage(q, k, v, do, is_causal=True, implementation=impl))
  for name, x in zip(NAMES, out):
    assert np.all(np.isfinite(x)), name


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_values_near_its_range_give_small_query_and_key_gradients(impl):
  """Issue 49: fp16 q, k at sigma 200, v a normal clipped to +-2 times 3e4 (up
  to 6e4), dO sigma 1; causal, B=2 T=128 H=4 D=64. float64's max |dQ|, |dK|
  are 1.2 and 1.4. Causal rows that see few keys are one-hot at base-2
  logits far below 2^15, where rowsum(dO * O) is off from sum_j P dP by
  dO . (V - V's int8 value), about 1e3 here: dQ and dK were Inf or near
  6.5e4 in 0.04% of their elements. fp16 rows from 2^6 take the backward's
  own Delta (numerics.SATURATED_LSE_FP16): every output finite, max |dQ|,
  |dK| <= 64."""
  keys = [jax.random.key(i) for i in range(4)]
  normal = lambda key: jax.random.normal(key, (2, 128, 4, 64), jnp.float32)
  q, k = ((200 * normal(key)).astype(jnp.float16) for key in keys[:2])
  v = (jnp.clip(normal(keys[2]), -2, 2) * 3e4).astype(jnp.float16)
  do = normal(keys[3]).astype(jnp.float16)
  out = sage(q, k, v, do, is_causal=True, implementation=impl)
  for name, x in zip(NAMES, _flat(out)):
    assert np.all(np.isfinite(x)), name
  _, (dq, dk, _) = out
  assert float(jnp.max(jnp.abs(dq.astype(jnp.float32)))) <= 64
  assert float(jnp.max(jnp.abs(dk.astype(jnp.float32)))) <= 64


# "triton-compiled": the GPU rounds the kernels' S * c - lse (an FMA) unlike
# the interpreter, and there P = 1 at a row's top key rests on log2_p's cap.
@pytest.mark.parametrize("impl", [*IMPLS, pytest.param("triton", marks=pytest.mark.gpu,
                                                       id="triton-compiled"),
                                  pytest.param("mosaic", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_one_hot_rows_give_near_zero_query_and_key_gradients(impl, dtype):
  """q, k, v of normal x 1e4 (logits near 1e8), causal: every row is
  one-hot, so the exact dQ and dK are 0 (and float64's are, to its
  rounding); the bar is max |dQ|, |dK| <= 1e3, every output finite (fp16
  too: no overflow). The rows' Delta is recomputed (sagebwd_jax/saturated_rows.py).
  The Hopper kernels take this shape (whole 128-token tiles, D=64)."""
  q, k, v, do = gaussian_qkv(jax.random.key(0), 2, 128, 128, 4, 4, 64)
  q, k, v = ((1e4 * x.astype(jnp.float32)).astype(dtype) for x in (q, k, v))
  out = sage(q, k, v, do.astype(dtype), is_causal=True, implementation=impl)
  for name, x in zip(NAMES, _flat(out)):
    assert np.all(np.isfinite(x)), name
  _, (dq, dk, _) = out
  assert float(jnp.max(jnp.abs(dq.astype(jnp.float32)))) <= 1e3
  assert float(jnp.max(jnp.abs(dk.astype(jnp.float32)))) <= 1e3


def test_fp8_factors_carry_the_head_groups_nan():
  """`sagebwd._nan_factors`: dQ's row factor k_top is NaN on every query head
  of a flagged key/value head's group, dK's and dV's on flagged groups;
  every other factor is unchanged, bit for bit."""
  from pallas_kernels.types import Fp8Operands
  from sagebwd_jax.sagebwd import _nan_factors
  batch, heads, kv_heads, t = 2, 4, 2, 8
  key = jax.random.key(3)
  k_top, dk_scale, dv_scale = (jax.random.uniform(k, shape) for k, shape in zip(
      jax.random.split(key, 3), [(batch, heads, t), (batch, kv_heads), (batch, kv_heads)]))
  fp8 = Fp8Operands(*(None,) * len(Fp8Operands._fields))._replace(
      k_top=k_top, dk_scale=dk_scale, dv_scale=dv_scale)
  nan_kv = jnp.zeros((batch, 1, kv_heads), bool).at[1, 0, 0].set(True)
  nan_q = nan_kv.at[0, 0, 1].set(True)
  got = _nan_factors(fp8, nan_kv, nan_q)
  want_k_top = np.zeros((batch, heads, t), bool)
  want_k_top[1, :2] = True  # query heads 0 and 1 share key/value head 0
  for name, x, want_nan in (("k_top", got.k_top, want_k_top),
                            ("dk_scale", got.dk_scale, np.asarray(nan_q[:, 0])),
                            ("dv_scale", got.dv_scale, np.asarray(nan_q[:, 0]))):
    x, before = np.asarray(x), np.asarray(getattr(fp8, name))
    np.testing.assert_array_equal(np.isnan(x), want_nan, err_msg=name)
    np.testing.assert_array_equal(x[~want_nan], before[~want_nan], err_msg=name)
