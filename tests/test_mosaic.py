"""The Hopper forward kernel (Mosaic GPU) against the pure-JAX reference.

The kernel feeds P to wgmma from registers (`plgpu.inline_mgpu`), which Mosaic
GPU's interpret mode cannot run: on the CPU every variant is lowered for CUDA
(`lowering_platforms=("cuda",)`, which catches most errors) and the layout
helpers are checked against an independent construction; on a GPU
(`@pytest.mark.gpu`) the compiled kernel is compared with
`ReferenceBackend(MOSAIC_NUMERICS)`, the same algorithm in plain
JAX, fed the same quantized tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (CPU, MOSAIC_EXACT_CASES, MOSAIC_FORWARD_CASES, MOSAIC_LAYOUTS,
                      MOSAIC_PASSES, assert_lowers_to_mosaic_gpu, backend_tolerance,
                      channel_biased_qkv, gaussian_qkv, mosaic_config, mosaic_exact_case,
                      rel_l2, resampled)
from pallas_kernels import layouts, numerics as nm
from pallas_kernels.mosaic.forward import ForwardTuning, forward_mosaic, takes
from pallas_kernels.types import Layouts, Masks
from pallas_kernels.mosaic.backend import MOSAIC_NUMERICS
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean, quantize

# The reference with the Mosaic kernels' P and P^T quantization.
HOPPER = ReferenceBackend(MOSAIC_NUMERICS)

TUNINGS = {"default": ForwardTuning(),
           "one_warpgroup": ForwardTuning(compute_wgs=1, schedule_barrier=False),
           "three_stages": ForwardTuning(max_concurrent_steps=3)}


def _case(batch, q_len, kv_len, heads, kv_heads, head_dim, causal, *, seed=0, sigma=2.0,
          zero_v_block=False):
  """The reference's QuantizedQKV and its forward with the Hopper numerics (CPU)."""
  q, k, v, _ = gaussian_qkv(jax.random.key(seed), batch, q_len, kv_len, heads, kv_heads,
                            head_dim, sigma=sigma)
  if zero_v_block:  # V's second block all zero: scale 0, folded as its partner's
    v = v.at[:, 64:128].set(0)
  config = mosaic_config(head_dim, causal)
  with jax.default_device(CPU):
    q, k, v = (jax.device_put(x, CPU) for x in (q, k, v))
    qkv = HOPPER.quantize(q, k, v, key_mean(k, None), config, layouts=MOSAIC_LAYOUTS)
    o_ref, lse_ref, _ = HOPPER.forward(qkv, Masks(), config, jnp.bfloat16)
  return qkv, config, np.asarray(o_ref), np.asarray(lse_ref)


def _abstract_qkv(q_len, kv_len, head_dim, config, quantize_layouts=MOSAIC_LAYOUTS):
  args = gaussian_qkv(jax.random.key(0), 2, q_len, kv_len, 4, 2, head_dim)[:3]
  return jax.eval_shape(lambda: ReferenceBackend().quantize(*args, None, config,
                                                            layouts=quantize_layouts))


@pytest.mark.parametrize("quantization", ["int8", "int8_fp8"])
@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda(head_dim, causal, tuning, quantization):
  """Lowered, with no XLA layout pass around the kernel (V8^T arrives REGISTER_B)."""
  config = mosaic_config(head_dim, causal, quantization=quantization)
  fn = lambda qkv: forward_mosaic(qkv, Masks(), config, jnp.bfloat16, TUNINGS[tuning])
  assert_lowers_to_mosaic_gpu(fn, _abstract_qkv(512, 512, head_dim, config))


@pytest.mark.parametrize("quantization", ["int8", "int8_fp8"])
@pytest.mark.parametrize("tuning", ["default", "one_warpgroup"])
@pytest.mark.parametrize("causal,smooth_k", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda_with_causal_exact(head_dim, causal, smooth_k, tuning, quantization):
  """causal_exact: the mean term (K-smoothing on), the 16-bit edge step
  (causal), both; the inputs as the op's quantization stage forms them."""
  config = mosaic_config(head_dim, causal, quantization=quantization, causal_exact=True)
  args = gaussian_qkv(jax.random.key(0), 2, 512, 512, 4, 2, head_dim)[:3]
  qkv = jax.eval_shape(lambda: quantize(*args, Masks(), config, MOSAIC_PASSES, smooth_k, False))
  fn = lambda qkv: forward_mosaic(qkv, Masks(), config, jnp.bfloat16, TUNINGS[tuning])
  assert_lowers_to_mosaic_gpu(fn, qkv)


def test_lowers_for_cuda_with_queries_not_in_whole_tiles():
  """Tq = 192, three 64-query blocks for CTAs of two: the last CTA's second
  warpgroup computes the last block again; Q is not padded (it was, by an
  XLA pass, with an XLA slice of O after)."""
  config = mosaic_config(64, False)
  fn = lambda qkv: forward_mosaic(qkv, Masks(), config, jnp.bfloat16)
  assert_lowers_to_mosaic_gpu(fn, _abstract_qkv(192, 256, 64, config))


def test_refuses_tokens_layout():
  config = mosaic_config(64, False)
  with pytest.raises(ValueError, match="v8_t is TOKENS"):
    forward_mosaic(_abstract_qkv(128, 128, 64, config, Layouts()), Masks(), config,
                   jnp.bfloat16)


def test_permute_keys_matches_the_register_layouts():
  """Position 4c + i of the 8-bit A operand (a thread's four consecutive
  columns) holds the accumulator column that thread holds i-th among
  {2c, 2c+1, 2c+8, 2c+9}, in every group of 16."""
  expected = []
  for group in range(4):
    for c in range(4):
      expected += [16 * group + col for col in (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)]
  keys = jnp.arange(64)
  np.testing.assert_array_equal(layouts.permute_keys(keys), expected)
  np.testing.assert_array_equal(layouts.permute_keys(keys[np.array(expected)], inverse=True),
                                keys)
  tile = jnp.arange(3 * 64).reshape(3, 64)  # along the last axis of a V^T tile
  np.testing.assert_array_equal(layouts.permute_keys(tile), tile[:, np.array(expected)])


def test_register_b_layout_holds_each_block_permuted():
  """REGISTER_B (B, H, T // 64, D, 64): tile n, channel d, position p holds
  token 64n + sigma16(p) of channel d; `to_layout` converts both ways."""
  tokens = jnp.arange(2 * 3 * 128, dtype=jnp.int32).reshape(1, 2, 3, 128)  # (B, H, D, T)
  blocked = layouts.to_layout(tokens, layouts.REGISTER_B)
  assert blocked.shape == (1, 2, 2, 3, 64) and layouts.layout_of(blocked) is layouts.REGISTER_B
  sigma = np.asarray(layouts.permute_keys(jnp.arange(64)))
  for n in range(2):
    np.testing.assert_array_equal(blocked[0, :, n], tokens[0][..., 64 * n + sigma])
  np.testing.assert_array_equal(layouts.to_layout(blocked, layouts.TOKENS), tokens)
  with pytest.raises(ValueError, match="rank 4"):
    layouts.layout_of(tokens[0])


def test_backward_layout_is_read_off_the_transposed_keys():
  """K8^T's layout, or where the FP8 key side replaced it, K'^T's; a forward
  alone's quantization has neither, and says so."""
  from pallas_kernels.types import Fp8Keys, QuantizedQKV
  tokens = jnp.zeros((1, 2, 64, 128), jnp.int8)
  blocked = layouts.to_layout(tokens, layouts.REGISTER_B)
  qkv = QuantizedQKV(*[None] * 9)
  assert layouts.backward_layout(qkv._replace(k8_t=blocked)) is layouts.REGISTER_B
  keys = Fp8Keys(k8_t=tokens, k_scale=None, v_norm=None)
  assert layouts.backward_layout(qkv._replace(fp8_keys=keys)) is layouts.TOKENS
  keys = keys._replace(k8_t=blocked)
  assert layouts.backward_layout(qkv._replace(fp8_keys=keys)) is layouts.REGISTER_B
  with pytest.raises(ValueError, match="for_backward=False"):
    layouts.backward_layout(qkv)


def test_takes():
  config = mosaic_config(128, True)
  ids = jnp.zeros((1, 128), jnp.int32)
  assert takes(Masks(), config, 256, 256, 128, jnp.bfloat16)
  assert takes(Masks(), mosaic_config(64, False), 192, 256, 64, jnp.float16)
  assert not takes(Masks(), config, 192, 192, 128, jnp.bfloat16)  # keys not whole steps
  assert not takes(Masks(), config, 128, 256, 128, jnp.bfloat16)  # causal Tq != Tk
  assert not takes(Masks(ids, ids), config, 128, 128, 128, jnp.bfloat16)
  assert not takes(Masks(), mosaic_config(128, True, smooth_q=True), 128, 128, 128,
                   jnp.bfloat16)
  assert not takes(Masks(), mosaic_config(128, True, block_kv=128), 128, 128, 128,
                   jnp.bfloat16)
  assert not takes(Masks(), config, 128, 128, 128, jnp.float32)
  assert not takes(Masks(), mosaic_config(128, False, window=(64, 64)), 128, 128, 128,
                   jnp.bfloat16)
  for head_dim in (32, 80, 96, 256):
    assert not takes(Masks(), mosaic_config(head_dim, False), 128, 128, head_dim,
                     jnp.bfloat16)


def test_refuses_what_it_does_not_take():
  qkv, config, _, _ = _case(1, 128, 128, 1, 1, 64, True)
  ids = jnp.zeros((1, 128), jnp.int32)
  with pytest.raises(NotImplementedError, match="no masks"):
    forward_mosaic(qkv, Masks(ids, ids), config, jnp.bfloat16)


@pytest.mark.parametrize("kwargs,match", [
    (dict(compute_wgs=3), "compute_wgs"), (dict(max_concurrent_steps=1), "max_concurrent"),
    (dict(compute_wgs=1), "schedule_barrier"), (dict(overlap=True), "pipelined=True"),
    (dict(issue_turns=True, pipelined=True), "issue_turns"),
    (dict(issue_turns=True, schedule_barrier=False), "issue_turns")])
def test_tuning_is_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ForwardTuning(**kwargs)


def _check(o, lse, o_ref, lse_ref, tolerance=backend_tolerance(jnp.zeros((), jnp.bfloat16))):
  o, lse = np.asarray(o), np.asarray(lse)
  assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
  assert lse.shape == lse_ref.shape and lse.dtype == np.float32
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
  assert rel_l2(o, o_ref) <= tolerance
  assert rel_l2(lse, lse_ref) <= 1e-4


def _run(qkv, config, tuning=ForwardTuning()):
  """O, lse and the FP8 mode's row maxima (else None) of the kernel on the GPU."""
  qkv = jax.device_put(qkv, jax.devices("gpu")[0])
  return jax.jit(lambda qkv: forward_mosaic(qkv, Masks(), config, jnp.bfloat16, tuning))(qkv)


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_FORWARD_CASES, ids=str)
def test_gpu_matches_reference(case):
  qkv, config, o_ref, lse_ref = _case(*case)
  _check(*_run(qkv, config)[:2], o_ref, lse_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", sorted(set(TUNINGS) - {"default"}))
@pytest.mark.parametrize("case", [(2, 1024, 1024, 4, 2, 128, False),
                                  (2, 1024, 1024, 4, 1, 64, True)], ids=str)
def test_gpu_tunings(case, tuning):
  qkv, config, o_ref, lse_ref = _case(*case)
  _check(*_run(qkv, config, TUNINGS[tuning])[:2], o_ref, lse_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("sigma", [10.0, 1e3])
def test_gpu_large_logits_keep_p_in_range(sigma):
  """Large Q.K scales make the fp32 rounding of the exp2 offset large; the
  clip keeps every P in 0..255 (a 256 would wrap to 0 in the packed byte)."""
  qkv, config, o_ref, lse_ref = _case(1, 256, 256, 2, 1, 128, False, sigma=sigma)
  _check(*_run(qkv, config)[:2], o_ref, lse_ref, tolerance=1e-2)


@pytest.mark.gpu
def test_gpu_all_zero_v_block():
  qkv, config, o_ref, lse_ref = _case(1, 256, 256, 2, 1, 64, True, zero_v_block=True)
  _check(*_run(qkv, config)[:2], o_ref, lse_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["int8", "int8_fp8"])
@pytest.mark.parametrize("t", [768, 700, 1, 40, 63, 64, 100])
def test_gpu_causal_exact_output_depends_on_no_later_key(quantization, t):
  """The bar case (B1 T1024 H2 D64, causal, bf16): with causal_exact, K and
  V at positions >= t resampled leave O[:t], lse[:t] and the FP8 mode's row
  maxima bitwise unchanged, at a block boundary (768), inside the diagonal
  block (700) and inside or at the end of key block 0, whose mean every
  8-bit half adds back (1, 40, 63, 64, 100); without it O[:t] moves (checked
  at 768 and 700)."""
  q, k, v, _ = gaussian_qkv(jax.random.key(0), 1, 1024, 1024, 2, 2, 64)
  later = (resampled(k, t, 1), resampled(v, t, 2))
  for exact in (True, False) if t >= 700 else (True,):
    config = mosaic_config(64, True, quantization=quantization, causal_exact=exact)
    (o, *rows), (o_after, *rows_after) = (
        _run(mosaic_exact_case(q, k_, v_, config)[0], config) for k_, v_ in ((k, v), later))
    o, o_after = np.asarray(o, np.float32)[:, :t], np.asarray(o_after, np.float32)[:, :t]
    if not exact:
      assert rel_l2(o_after, o) > 1e-3
      continue
    np.testing.assert_array_equal(o_after, o)
    for x, x_after in zip(rows, rows_after):
      if x is not None:
        np.testing.assert_array_equal(np.asarray(x_after)[..., :t], np.asarray(x)[..., :t])


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", ["default", "one_warpgroup"])
@pytest.mark.parametrize("case", MOSAIC_EXACT_CASES, ids=str)
def test_gpu_causal_exact_matches_reference(case, tuning):
  """INT8 mode, causal_exact: the reference in the kernel's numerics, at the
  other cases' tolerance (`channel_biased_qkv`: the mean term carries
  weight)."""
  *shape, head_dim, causal = case
  config = mosaic_config(head_dim, causal, causal_exact=True)
  qkv, (o_ref, lse_ref, _) = mosaic_exact_case(
      *channel_biased_qkv(jax.random.key(12), *shape, head_dim), config)
  _check(*_run(qkv, config, TUNINGS[tuning])[:2], np.asarray(o_ref), np.asarray(lse_ref))


def test_positive_scale_floors_and_keeps_nan():
  """The score scale's floor keeps masked scores -inf (no 0 scale) and a NaN
  scale NaN (a max would drop it)."""
  from pallas_kernels.mosaic.common import positive_scale
  got = np.asarray(positive_scale(jnp.array([0.0, 2.0**-120, 0.5, jnp.nan], jnp.float32)))
  np.testing.assert_array_equal(got[:3], [nm.SCALE_FLOOR, nm.SCALE_FLOOR, 0.5])
  assert np.isnan(got[3])
