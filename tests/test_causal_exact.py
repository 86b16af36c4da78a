"""`causal_exact=True`: no output row, nor its dQ, depends on a key or value
after the last key the row sees (docs/algorithm.md, "Statistics over what
each row sees"), in both numerics modes, and the statistics that make it so
keep the op exact up to quantization.

The prefix tests compare the op against itself on the same machine (bitwise
equality holds on any ISA: the same arithmetic runs on the same prefix); the
accuracy tests measure it against fp64 attention. The Triton kernels (INT8
mode) run in Triton's interpreter here.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import backend_tolerance, gaussian_qkv, oracle64, rel_l2, resampled, sage
from pallas_kernels import fp8_operands
from pallas_kernels.layouts import TOKENS
from pallas_kernels.mosaic.backend import MosaicBackend
from pallas_kernels.types import Config, Masks
from sagebwd_jax import dot_product_attention, implementations
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import first_block_mean, key_means_seen, quantize

MODES = ("int8", "int8_fp8")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the Triton kernels need the package triton")


def _prefix_moves(q, k, v, do, t, *, implementation, **kwargs):
  """(O[:t], dQ[:t]) before and after resampling K and V at positions >= t."""
  runs = [sage(q, k_, v_, do, is_causal=True, implementation=implementation, **kwargs)
          for k_, v_ in ((k, v), (resampled(k, t, 1), resampled(v, t, 2)))]
  return [(np.asarray(o, np.float32)[:, :t], np.asarray(dq, np.float32)[:, :t])
          for o, (dq, _, _) in runs]


IMPLEMENTATIONS = [(mode, "reference") for mode in MODES] + [
    pytest.param("int8", "triton", marks=needs_triton)]


# The Hopper backend (its kernels in either mode, the Triton passes around
# them; the reference's where they lack the case).
@pytest.mark.parametrize("quantization,implementation", IMPLEMENTATIONS + [
    pytest.param(mode, "mosaic", marks=pytest.mark.gpu) for mode in MODES])
@pytest.mark.parametrize("t", [768, 700])
def test_no_output_depends_on_a_later_key_or_value(quantization, implementation, t):
  """The bar case (B1 T1024 H2 D64, causal, bf16): K and V at positions >= t
  resampled leave O[:t] and dQ[:t] bitwise unchanged, at a block boundary
  (768) and inside a block (700, where the diagonal block holds keys after
  some of its rows). Without the option they move (K-smoothing's mean over
  every key): 1.4e-2 (INT8) and 2.5e-2 (FP8) relative in O (the Triton
  kernels: 1.2e-2)."""
  q, k, v, do = gaussian_qkv(jax.random.key(0), 1, 1024, 1024, 2, 2, 64)
  case = dict(implementation=implementation, quantization=quantization)
  (o, dq), (o_after, dq_after) = _prefix_moves(q, k, v, do, t, causal_exact=True, **case)
  np.testing.assert_array_equal(o_after, o)
  np.testing.assert_array_equal(dq_after, dq)
  (o, dq), (o_after, dq_after) = _prefix_moves(q, k, v, do, t, **case)
  assert rel_l2(o_after, o) > 1e-3 and rel_l2(dq_after, dq) > 1e-3


@pytest.mark.parametrize("quantization,implementation", IMPLEMENTATIONS)
def test_no_output_depends_on_a_later_token_with_gqa_segments_and_mixed_blocks(
    quantization, implementation):
  """GQA, packed segments, 32-row query blocks against 64-key blocks (two
  query blocks per edge block) and a window: still bitwise."""
  q, k, v, do = gaussian_qkv(jax.random.key(3), 2, 256, 256, 4, 2, 64)
  position = np.arange(256)
  segments = jnp.asarray(np.broadcast_to((position >= 90) + (position >= 200), (2, 256)),
                         jnp.int32)
  case = dict(implementation=implementation, quantization=quantization, segment_ids=segments,
              block_q=32, block_kv=64, local_window_size=(100, 0))
  (o, dq), (o_after, dq_after) = _prefix_moves(q, k, v, do, 150, causal_exact=True, **case)
  np.testing.assert_array_equal(o_after, o)
  np.testing.assert_array_equal(dq_after, dq)
  (o, dq), (o_after, dq_after) = _prefix_moves(q, k, v, do, 150, **case)
  assert rel_l2(o_after, o) > 1e-3 and rel_l2(dq_after, dq) > 1e-3


@pytest.mark.parametrize("options", [
    dict(), dict(smooth_q=True, ds_precision="bf16"), dict(smooth_k=False),
    dict(local_window_size=(100, 0), block_q=32, segments=True)], ids=str)
@needs_triton
def test_triton_kernels_match_the_reference(options):
  """The op on the Triton kernels against the reference with their numerics
  (`Backend.reference_numerics`), causal_exact on: O, dQ, dK, dV within the
  suite's tolerance between backends (GQA, a channel bias on K of 3x its
  spread, so the mean term matters)."""
  options = dict(options)
  q, k, v, do = gaussian_qkv(jax.random.key(12), 2, 256, 256, 4, 2, 64)
  k = (k.astype(jnp.float32) + 3.0 * jax.random.normal(jax.random.key(13), (1, 1, 2, 64))
       ).astype(k.dtype)
  if options.pop("segments", False):
    options["segment_ids"] = jnp.stack([jnp.arange(256) // 48, jnp.arange(256) // 80])
  triton = implementations.backend("triton", True)
  ours = sage(q, k, v, do, is_causal=True, implementation="triton", causal_exact=True,
              **options)
  ref = sage(q, k, v, do, is_causal=True, implementation=ReferenceBackend(triton),
             causal_exact=True, **options)
  for name, a, b in zip(("O", "dQ", "dK", "dV"), jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name
    assert rel_l2(a, b) <= backend_tolerance(a), name


@needs_triton
def test_triton_saturated_rows_take_the_same_scores():
  """The saturated-rows kernel recomputes Delta and lse from the forward's
  scores with causal_exact (the mean term, 16-bit edge tiles): the
  reference's rows to fp32 rounding, every row saturated (logits near
  1e5)."""
  triton = implementations.backend("triton", True)
  q, k, v, do = gaussian_qkv(jax.random.key(14), 1, 128, 128, 2, 1, 64, sigma=300.0,
                             dtype=jnp.float32)
  config = Config(scale=1.0, causal=True, smooth_q=False, block_q=64, block_kv=64,
                  causal_exact=True)
  reference = ReferenceBackend(triton)
  qkv = quantize(q, k, v, Masks(), config, reference, True)
  _, lse, _ = reference.forward(qkv, Masks(), config, q.dtype)
  assert bool(jnp.all(jnp.abs(lse) > 2**15))
  delta = jnp.zeros_like(lse)
  for ours, ref in zip(triton.saturated_rows(qkv, v, lse, do, delta, Masks(), config),
                       reference.saturated_rows(qkv, v, lse, do, delta, Masks(), config)):
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


def _errors(q, k, v, do, causal, **kwargs):
  exact = oracle64(q, k, v, do, is_causal=causal)
  ours = sage(q, k, v, do, is_causal=causal, implementation="reference", **kwargs)
  return np.array([rel_l2(a, b) for a, b in zip((ours[0], *ours[1]), (exact[0], *exact[1]))])


@pytest.mark.parametrize("quantization", MODES)
def test_a_constant_key_offset_is_restored_exactly(quantization):
  """K plus a constant per channel of 10x its spread: m, the first key
  block's mean, takes it in, and each row's q . m comes back exactly, so O,
  dQ, dK and dV stay within 1.1x of their errors against fp64 without the
  offset. (An offset that drifts along the sequence stays partly in K - m:
  docs/algorithm.md measures that trade.)"""
  q, k, v, do = gaussian_qkv(jax.random.key(4), 1, 512, 512, 2, 2, 64)
  offset = 10.0 * jax.random.normal(jax.random.key(5), (1, 1, 2, 64))
  shifted = (k.astype(jnp.float32) + offset).astype(k.dtype)
  plain = _errors(q, k, v, do, True, quantization=quantization, causal_exact=True)
  ours = _errors(q, shifted, v, do, True, quantization=quantization, causal_exact=True)
  assert np.all(ours <= 1.1 * plain), (ours, plain)


@pytest.mark.parametrize("quantization,implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("block_q", [64, 32])
def test_no_output_depends_on_a_later_key_of_the_first_block(quantization, implementation,
                                                            block_q):
  """K and V resampled from t = 1, 40, 63 (inside key block 0, whose mean m
  is every 8-bit tile's), 64 and 100: O[:t] and dQ[:t] bitwise unchanged.
  Rows before 63 have edge tiles only; a row that meets m sees all of key
  block 0."""
  q, k, v, do = gaussian_qkv(jax.random.key(15), 1, 256, 256, 2, 2, 64)
  case = dict(implementation=implementation, quantization=quantization, block_q=block_q,
              causal_exact=True)
  for t in (1, 40, 63, 64, 100):
    (o, dq), (o_after, dq_after) = _prefix_moves(q, k, v, do, t, **case)
    np.testing.assert_array_equal(o_after, o, err_msg=f"t={t}")
    np.testing.assert_array_equal(dq_after, dq, err_msg=f"t={t}")


@pytest.mark.parametrize("quantization", MODES)
def test_rows_of_the_first_query_block_never_meet_the_mean(quantization):
  """Causal, 64-row query blocks: the first block's rows see key block 0
  only, an edge tile, so their O is bitwise the same with K-smoothing off
  (no m at all)."""
  q, k, v, do = gaussian_qkv(jax.random.key(16), 1, 256, 256, 2, 2, 64)
  k = (k.astype(jnp.float32) + 5.0).astype(k.dtype)
  outs = [sage(q, k, v, do, is_causal=True, implementation="reference", causal_exact=True,
               quantization=quantization, smooth_k=smooth_k)[0] for smooth_k in (True, False)]
  np.testing.assert_array_equal(np.asarray(outs[0])[:, :64], np.asarray(outs[1])[:, :64])
  assert rel_l2(outs[0][:, 64:], outs[1][:, 64:]) > 0


def test_without_causality_it_changes_nothing():
  """Every row sees every key: the head-wide statistics stay (Table 1, not
  causal, measured them as accurate as per-block ones or more), bitwise."""
  q, k, v, do = gaussian_qkv(jax.random.key(11), 1, 128, 128, 2, 2, 64)
  for quantization in MODES:
    ours = sage(q, k, v, do, implementation="reference", quantization=quantization,
                causal_exact=True)
    today = sage(q, k, v, do, implementation="reference", quantization=quantization)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(today)):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("options", [
    dict(), dict(quantization="int8_fp8"), dict(ds_precision="bf16"),
    dict(smooth_q=True), dict(quantization="int8_fp8", ds_precision="bf16"),
    dict(smooth_k=False)], ids=str)
def test_every_path_within_its_error_without_the_option(options):
  """Against fp64 (causal, T=256, GQA, a channel bias on K of 3x its
  spread), every option that reaches the changed stages keeps each error
  within 1.1x of the same call without causal_exact (its 16-bit edge tiles
  make most of them smaller)."""
  q, k, v, do = gaussian_qkv(jax.random.key(6), 1, 256, 256, 4, 2, 64)
  bias = 3.0 * jax.random.normal(jax.random.key(7), (1, 1, 2, 64))
  k = (k.astype(jnp.float32) + bias).astype(k.dtype)
  ours = _errors(q, k, v, do, True, causal_exact=True, **options)
  today = _errors(q, k, v, do, True, **options)
  assert np.all(ours <= 1.1 * today), (ours, today)


def test_key_means_leave_padding_out():
  """m (the first key block's mean) and dQ's per-query-block means against
  numpy, over the valid tokens only: lengths 40 (key block 0 partly valid)
  and 150; a batch row whose block 0 is all padding gets m = 0. With
  32-row query blocks, blocks 0 and 1 (first rows 0 and 32) take the mean of
  the keys up to their first row, every later one m itself."""
  _, k, _, _ = gaussian_qkv(jax.random.key(8), 3, 256, 256, 2, 2, 64)
  k = k + 2.0
  lengths = np.array([40, 150, 0])
  valid = np.arange(256)[None] < lengths[:, None]
  ids = jnp.asarray(np.where(valid, 0, -(2**31) + 1), jnp.int32)
  keys = np.asarray(k, np.float64).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)

  def mean_upto(b, last):
    upto = valid[b] & (np.arange(256) <= last)
    return keys[b][:, upto].mean(axis=1) if upto.any() else np.zeros((2, 64))

  m = first_block_mean(k, ids, 64)
  np.testing.assert_allclose(m, np.stack([mean_upto(b, 63) for b in range(3)]), rtol=1e-5,
                             atol=1e-5)
  config = Config(scale=0.125, causal=True, smooth_q=False, block_q=32, block_kv=64,
                  causal_exact=True)
  seen = key_means_seen(k, ids, config, 256)
  for b in range(3):
    for i in range(2):
      np.testing.assert_allclose(seen[b, :, i], mean_upto(b, 32 * i), rtol=1e-5, atol=1e-5)
  later = seen[:, :, 2:]
  np.testing.assert_array_equal(later, jnp.broadcast_to(m[:, :, None], later.shape))


def test_fp8_ds_bound_bounds_every_score_gradient_with_edges():
  """|dS_ij| <= b_i for every row and key it sees, its edge block's keys
  included (each row's own largest ||V_j|| up to its position there), with
  GQA and 32-row query blocks."""
  q, k, v, do = gaussian_qkv(jax.random.key(9), 1, 128, 128, 4, 2, 64, sigma=2.0)
  v = v.at[:, 100].multiply(30)  # a large value after most rows of its block
  config = Config(scale=0.125, causal=True, smooth_q=False, block_q=32, block_kv=64,
                  quantization="int8_fp8", causal_exact=True)
  backend = ReferenceBackend()
  qkv = quantize(q, k, v, Masks(), config, backend, True)
  o, lse, row_max = backend.forward(qkv, Masks(), config, q.dtype)
  pre = backend.prepass(o, do, config)
  bound = np.asarray(fp8_operands.fp8_operands(qkv, v, pre, row_max, lse, Masks(), config,
                                               TOKENS).ds_bound, np.float64)[0]  # (H, T)
  qf, kf, vf, dof = (np.asarray(x, np.float64)[0].transpose(1, 0, 2) for x in (q, k, v, do))
  kf, vf = np.repeat(kf, 2, axis=0), np.repeat(vf, 2, axis=0)
  s = np.einsum("hqd,hkd->hqk", qf, kf) * 0.125 * np.log2(np.e)
  s = np.where(np.tril(np.ones((128, 128), bool)), s, -np.inf)
  p = np.exp2(np.minimum(s - np.asarray(lse, np.float64)[0][..., None], 0))
  ds = p * (np.einsum("hqd,hkd->hqk", dof, vf) - np.asarray(pre.delta, np.float64)[0][..., None])
  assert np.all(np.abs(ds).max(axis=-1) <= bound * (1 + 1e-3))
  # Rows before the large value do not see it: their bound stays small.
  assert bound[:, :100].max() < 0.1 * bound[:, 100:].max()


class _Stages:
  """A backend object of no class the op knows (`implementations.is_backend`),
  the reference's stages behind it."""

  def __init__(self, inner):
    self._inner = inner

  def __getattr__(self, name):
    return getattr(self._inner, name)


def test_backends_that_lack_it_are_refused_and_the_default_is_the_reference():
  """The Hopper backend takes it where its fallbacks compute it (here, T=64,
  they run every stage); a backend not known to compute it is refused, with
  or inside the Hopper backend, and the next one in the chain runs."""
  q, k, v, _ = gaussian_qkv(jax.random.key(10), 1, 64, 64, 1, 1, 64)
  attend = lambda implementation: dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation, causal_exact=True)
  alone = attend("reference")
  np.testing.assert_array_equal(attend(MosaicBackend(ReferenceBackend(),
                                                    fp8_fallback=ReferenceBackend())),
                                alone)
  for lacking in (_Stages(ReferenceBackend()), MosaicBackend(_Stages(ReferenceBackend()))):
    with pytest.raises(NotImplementedError, match="causal_exact"):
      attend(lacking)
    np.testing.assert_array_equal(attend((lacking, "reference")), alone)
  assert implementations.resolve(None, "int8", causal_exact=True) == ("reference",)
  for bad in ("yes", 1, None):
    with pytest.raises(TypeError, match="causal_exact"):
      dot_product_attention(q, k, v, causal_exact=bad)
