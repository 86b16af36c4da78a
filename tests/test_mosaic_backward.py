"""The Hopper backward kernels (Pallas Mosaic GPU) against the pure-JAX reference.

The kernels feed P^T and dS to wgmma from registers (`plgpu.inline_mgpu`),
which Mosaic GPU's interpret mode cannot run: on the CPU every tuning is
lowered for CUDA (`lowering_platforms=("cuda",)`); on a GPU
(`@pytest.mark.gpu`) the compiled kernels are compared with
`ReferenceBackend(MOSAIC_NUMERICS).backward`, the same algorithm in plain JAX,
on the same quantized tensors, O and lse. With `Config.causal_exact`, in
both numerics modes, they are also held to dQ's prefix invariance.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (CPU, FP8_TUNINGS, MOSAIC_BACKWARD_CASES, MOSAIC_EXACT_CASES,
                      MOSAIC_LAYOUTS, MOSAIC_PASSES, assert_lowers_to_mosaic_gpu, backward_stage,
                      channel_biased_qkv, gaussian_qkv, mosaic_config, rel_l2, resampled)
from pallas_kernels.jax_triton.backward_prepass import backward_prepass
from pallas_kernels.jax_triton.launch import LaunchConfig
from pallas_kernels.mosaic import backward_common
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic.common import smem_transforms
from pallas_kernels.mosaic.backward_dkdv import backward_dkdv_mosaic
from pallas_kernels.mosaic.backward_dq import backward_dq_mosaic
from pallas_kernels.layouts import REGISTER_B
from pallas_kernels.types import Layouts, Masks
from pallas_kernels.mosaic.backend import MOSAIC_NUMERICS
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean, quantize

# The reference with the Mosaic kernels' P and P^T quantization.
HOPPER = ReferenceBackend(MOSAIC_NUMERICS)

TUNINGS = {"default": BackwardTuning(),
           "no_schedule_barrier": BackwardTuning(schedule_barrier=False),
           "one_warpgroup": BackwardTuning(compute_wgs=1, schedule_barrier=False),
           "three_steps": BackwardTuning(max_concurrent_steps=3)}


def _abstract_args(batch, seq, heads, kv_heads, head_dim, causal, layouts=MOSAIC_LAYOUTS):
  """The kernels' arguments, the transposed int8 ones in `layouts`."""
  config = mosaic_config(head_dim, causal)
  qkv = jax.eval_shape(
      lambda: HOPPER.quantize(*gaussian_qkv(jax.random.key(0), batch, seq, seq, heads,
                                            kv_heads, head_dim)[:3], None, config,
                              layouts=layouts))
  sds = jax.ShapeDtypeStruct
  rows = sds((batch, heads, seq), jnp.float32)
  do8_t = (sds((batch, heads, seq // 64, head_dim, 64), jnp.int8)
           if layouts.backward is REGISTER_B else sds((batch, heads, head_dim, seq), jnp.int8))
  return (qkv, sds((batch, seq, kv_heads, head_dim), jnp.bfloat16), rows, rows,
          sds((batch, seq, heads, head_dim), jnp.bfloat16), do8_t, rows), config


def _kernels(config, tuning):
  dkdv = lambda *a: backward_dkdv_mosaic(*a, Masks(), config, tuning)
  dq = lambda *a: backward_dq_mosaic(*a[:5], Masks(), config, tuning)
  return dkdv, dq


@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda(head_dim, causal, tuning):
  """Mosaic GPU lowering (to the CUDA custom call) without a GPU, with no XLA
  layout pass around the kernels (Q8^T, K8^T, dO8^T arrive REGISTER_B). GQA
  but with a ring of 3 at D = 128: fp32 dK/dV partials (GQA) fit a ring of 2
  there."""
  kv_heads = 4 if head_dim == 128 and tuning == "three_steps" else 2
  args, config = _abstract_args(2, 512, 4, kv_heads, head_dim, causal)
  for kernel in _kernels(config, TUNINGS[tuning]):
    assert_lowers_to_mosaic_gpu(kernel, *args)


@pytest.mark.parametrize("causal", [False, True])
def test_lowers_for_cuda_in_x64_mode(causal, x64):
  """With jax_enable_x64 a Python int in index arithmetic becomes int64, which
  Mosaic's int32 indices refuse (the GPU suite's x64 test found one in a
  kernel since replaced)."""
  del x64
  args, config = _abstract_args(1, 256, 2, 2, 64, causal)
  for kernel in _kernels(config, TUNINGS["default"]):
    assert_lowers_to_mosaic_gpu(kernel, *args)


@pytest.mark.parametrize("kwargs", [dict(compute_wgs=3), dict(max_concurrent_steps=1),
                                    dict(compute_wgs=1, schedule_barrier=True)])
def test_tuning_is_checked(kwargs):
  with pytest.raises(ValueError, match="compute_wgs|max_concurrent_steps|schedule_barrier"):
    BackwardTuning(**kwargs)


def test_unsupported_cases_are_refused():
  ids = jnp.zeros((1, 128), jnp.int32)
  args, config = _abstract_args(1, 128, 1, 1, 128, True)
  with pytest.raises(NotImplementedError):
    backward_dq_mosaic(*args[:5], Masks(ids, ids), config)
  with pytest.raises(NotImplementedError):
    backward_dkdv_mosaic(*args, Masks(), mosaic_config(128, True, smooth_q=True))
  args, config = _abstract_args(1, 192, 1, 1, 64, False)  # not whole 128-token CTA tiles
  with pytest.raises(ValueError, match="multiples of 128"):
    backward_dkdv_mosaic(*args, Masks(), config)
  args, config = _abstract_args(1, 128, 1, 1, 64, False, Layouts())
  dkdv, dq = _kernels(config, BackwardTuning())
  with pytest.raises(ValueError, match="q8_t is TOKENS"):
    dkdv(*args)
  with pytest.raises(ValueError, match="k8_t is TOKENS"):
    dq(*args)


def _gpu_case(batch, seq, heads, kv_heads, head_dim, causal, *, seed=0, sigma=2.0):
  """Inputs (quantized, forward and pre-pass on the GPU) and the reference's
  gradients from the same quantized tensors, O and lse (on the CPU)."""
  q, k, v, do = gaussian_qkv(jax.random.key(seed), batch, seq, seq, heads, kv_heads, head_dim,
                             sigma=sigma)
  config = mosaic_config(head_dim, causal)
  qkv = HOPPER.quantize(q, k, v, key_mean(k, None), config, layouts=MOSAIC_LAYOUTS)
  o, lse, _ = HOPPER.forward(qkv, Masks(), config, jnp.bfloat16)
  delta, do8_t, do_scale = backward_prepass(o, do, block_q=config.block_q,
                                            launch=LaunchConfig(), layout=REGISTER_B)[:3]
  with jax.default_device(CPU):
    cpu = jax.device_put((qkv, v, o, lse, do), CPU)
    want = jax.jit(lambda *a: backward_stage(HOPPER, *a, Masks(), config))(*cpu)
  return (qkv, v, lse, delta, do, do8_t, do_scale), config, want


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("case", MOSAIC_BACKWARD_CASES, ids=str)
def test_gpu_matches_reference(case, tuning):
  if case[4] == 128 and case[3] < case[2] and tuning == "three_steps":
    pytest.skip("a ring of 3 does not fit shared memory with fp32 GQA partials at D=128")
  args, config, want = _gpu_case(*case)
  dkdv, dq = (jax.jit(k) for k in _kernels(config, TUNINGS[tuning]))
  dk, dv = dkdv(*args)
  got = (dq(*args), dk, dv)
  for name, x, ref in zip(("dQ", "dK", "dV"), got, want):
    x, ref = np.asarray(x.astype(jnp.float32)), np.asarray(ref, np.float32)
    assert x.shape == ref.shape, name
    assert np.all(np.isfinite(x)), name
    # bf16 outputs; rare roundings of int8 P^T and dS differ with exp2.approx.
    assert rel_l2(x, ref) <= 5e-3, (name, rel_l2(x, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("sigma", [30.0, 300.0])
def test_gpu_large_logits(sigma):
  """Saturated softmax rows: P^T stays in 0..255 without a clip."""
  args, config, want = _gpu_case(1, 512, 2, 2, 64, True, seed=4, sigma=sigma)
  dkdv, dq = (jax.jit(k) for k in _kernels(config, BackwardTuning()))
  dk, dv = dkdv(*args)
  for name, x, ref in zip(("dQ", "dK", "dV"), (dq(*args), dk, dv), want):
    x, ref = np.asarray(x.astype(jnp.float32)), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(x)), name
    assert rel_l2(x, ref) <= 2e-2, (name, rel_l2(x, ref))


# Each mode's tunings, with the tolerance of its other GPU cases against the
# reference (above; tests/test_fp8.py); the ping-pong and the overlap refuse
# causal_exact (test_pingpong_refuses_causal_exact,
# test_fp8_backward_overlap_refuses_causal_exact).
EXACT_TUNINGS = [("int8", name) for name in sorted(TUNINGS)] + [
    ("int8_fp8", name) for name in sorted(FP8_TUNINGS)
    if name not in ("pingpong", "overlap", "overlap_turns")]
TOLERANCE = {"int8": 5e-3, "int8_fp8": 1e-2}


def _exact_tuning(quantization: str, name: str) -> BackwardTuning:
  return (TUNINGS if quantization == "int8" else FP8_TUNINGS)[name]


def _exact_inputs(config, smooth_k: bool = True):
  """(q, k, v, dO) -> the backward kernels' arguments (qkv, v, lse, the
  pre-pass with the FP8 operands, dO), formed by the reference's passes as
  the op's stages form them, `Config.causal_exact`'s operands included."""
  def inputs(q, k, v, do):
    qkv = quantize(q, k, v, Masks(), config, MOSAIC_PASSES, smooth_k, True)
    o, lse, row_max = HOPPER.forward(qkv, Masks(), config, jnp.bfloat16)
    pre = HOPPER.prepass(o, do, config, REGISTER_B)
    if config.fp8:
      pre = pre._replace(fp8=HOPPER.fp8_operands(qkv, v, pre, row_max, lse, Masks(), config))
    return qkv, v, lse, pre, do
  return inputs


def _exact_kernels(config, tuning, qkv, v, lse, pre, do):
  """dQ, dK, dV from the Hopper backward kernels."""
  fp8 = pre.fp8 if config.fp8 else None
  dk, dv = backward_dkdv_mosaic(qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale, Masks(),
                                config, tuning, fp8=fp8)
  dq = backward_dq_mosaic(qkv, v, lse, pre.delta, do, Masks(), config, tuning, fp8=fp8)
  return dq, dk, dv


def test_scores_read_both_accumulator_starts_exactly():
  """`backward_common.scores`: an int32 S accumulator that started at
  0x4B400000 (its bits 1.5 * 2**23 + S as fp32) and one that started from
  zero give the same fp32 S, exactly, over the range an int8 Q.K^T reaches
  at D=128 (|S| <= 128 * 127 * 128)."""
  s = jnp.array([0, 1, -1, 127 * 128, -127 * 128, 128 * 127 * 128, -128 * 127 * 128, 12345],
                jnp.int32)
  biased = s + np.int32(0x4B400000)
  expected = np.asarray(s, np.float64)
  np.testing.assert_array_equal(np.asarray(backward_common.scores(biased, biased=True)),
                                expected)
  np.testing.assert_array_equal(np.asarray(backward_common.scores(s, biased=False)), expected)
  assert backward_common.scores(s, biased=False).dtype == jnp.float32


@pytest.mark.parametrize("dtype,dtype16", [(jnp.int8, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
                                           (jnp.bfloat16, jnp.float16)])
def test_shared_tiles_give_each_warpgroup_the_same_bytes_in_both_views(dtype, dtype16):
  """A `sharing` union (Q8 and Q16 in dQ, the fp32 GQA partials' staging and
  Q16 in dK/dV): warpgroup w's tile starts at the same byte in both views,
  so one warpgroup's Q16 never overlaps the other's Q8 (with one
  (warpgroups, 64, D) array per view it did, and FP8 dQ with causal_exact
  went wrong on the GPU)."""
  tile = plgpu.SMEM((2, 64, 128), dtype, transforms=smem_transforms(128, dtype))
  union = backward_common.sharing(tile, dtype16)
  warpgroups = min(ref.shape[0] for ref in union.refs)
  assert warpgroups == 2
  per_warpgroup = {ref.shape[0] // warpgroups * int(np.prod(ref.shape[1:]))
                   * jnp.dtype(ref.dtype).itemsize for ref in union.refs}
  assert per_warpgroup == {64 * 128 * max(jnp.dtype(dtype).itemsize,
                                          jnp.dtype(dtype16).itemsize)}
  assert [ref.dtype for ref in union.refs] == [jnp.dtype(dtype), jnp.dtype(dtype16)]


@pytest.mark.parametrize("quantization,tuning", EXACT_TUNINGS, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda_with_causal_exact(head_dim, quantization, tuning):
  """causal_exact, causal, K-smoothing on: the mean term and the diagonal's
  16-bit step in every schedule; GQA but with a ring of 3 at D=128 (as
  without the option: fp32 dK/dV partials leave no room for it)."""
  kv_heads = 4 if head_dim == 128 and tuning == "three_steps" else 2
  config = mosaic_config(head_dim, True, quantization=quantization, causal_exact=True)
  args = jax.eval_shape(_exact_inputs(config),
                        *gaussian_qkv(jax.random.key(0), 2, 512, 512, 4, kv_heads, head_dim))
  assert_lowers_to_mosaic_gpu(
      functools.partial(_exact_kernels, config, _exact_tuning(quantization, tuning)), *args)


@pytest.mark.parametrize("quantization", ["int8", "int8_fp8"])
@pytest.mark.parametrize("causal,smooth_k", [(True, False), (False, True)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda_with_causal_exact_in_part(head_dim, causal, smooth_k, quantization):
  """The diagonal's step without K-smoothing (no m, no m'), and the mean
  term alone (not causal: no diagonal step)."""
  config = mosaic_config(head_dim, causal, quantization=quantization, causal_exact=True)
  args = jax.eval_shape(_exact_inputs(config, smooth_k),
                        *gaussian_qkv(jax.random.key(0), 2, 512, 512, 4, 2, head_dim))
  assert_lowers_to_mosaic_gpu(functools.partial(_exact_kernels, config, BackwardTuning()),
                              *args)


def test_pingpong_refuses_causal_exact():
  config = mosaic_config(64, True, quantization="int8_fp8", causal_exact=True)
  args = jax.eval_shape(_exact_inputs(config),
                        *gaussian_qkv(jax.random.key(0), 1, 128, 128, 1, 1, 64))
  with pytest.raises(ValueError, match="tuning=BackwardTuning.pipelined=True.*causal_exact"):
    _exact_kernels(config, FP8_TUNINGS["pingpong"], *args)


def test_causal_exact_refuses_missing_operands():
  config = mosaic_config(64, True, causal_exact=True)
  args = jax.eval_shape(_exact_inputs(config),
                        *gaussian_qkv(jax.random.key(0), 1, 128, 128, 1, 1, 64))
  qkv, *rest = args
  with pytest.raises(ValueError, match="k16"):
    _exact_kernels(config, BackwardTuning(), qkv._replace(k16=None), *rest)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization,tuning", EXACT_TUNINGS, ids=str)
@pytest.mark.parametrize("case", MOSAIC_EXACT_CASES, ids=str)
def test_gpu_causal_exact_matches_reference(case, quantization, tuning):
  """Both kernels with causal_exact against the reference in their numerics,
  on the same tensors, at each mode's tolerance of its other cases
  (`channel_biased_qkv`: the mean term, and m' in dQ's diagonal, carry
  weight)."""
  batch, seq, heads, kv_heads, head_dim, causal = case
  if head_dim == 128 and kv_heads < heads and tuning == "three_steps":
    pytest.skip("a ring of 3 does not fit shared memory with fp32 GQA partials at D=128")
  config = mosaic_config(head_dim, causal, quantization=quantization, causal_exact=True)
  key = jax.random.key(12)
  q, k, v = channel_biased_qkv(key, batch, seq, heads, kv_heads, head_dim)
  do = gaussian_qkv(key, batch, seq, seq, heads, kv_heads, head_dim)[3]
  with jax.default_device(CPU):
    args = jax.jit(_exact_inputs(config))(*jax.device_put((q, k, v, do), CPU))
    want = jax.jit(lambda qkv, v, lse, pre, do: HOPPER.backward(qkv, v, lse, do, pre, Masks(),
                                                                config))(*args)
  tuning = _exact_tuning(quantization, tuning)
  got = jax.jit(functools.partial(_exact_kernels, config, tuning))(
      *jax.device_put(args, jax.devices("gpu")[0]))
  for name, x, ref in zip(("dQ", "dK", "dV"), got, want):
    x, ref = np.asarray(x.astype(jnp.float32)), np.asarray(ref, np.float32)
    assert x.shape == ref.shape, name
    assert np.all(np.isfinite(x)), name
    assert rel_l2(x, ref) <= TOLERANCE[quantization], (name, rel_l2(x, ref))


PREFIX_TUNINGS = [("int8", "default"), ("int8_fp8", "default"), ("int8_fp8", "pipelined")]


@pytest.mark.gpu
@pytest.mark.parametrize("quantization,tuning", PREFIX_TUNINGS, ids=str)
@pytest.mark.parametrize("t", [768, 700, 1, 40, 63, 64, 100])
def test_gpu_causal_exact_dq_depends_on_no_later_token(quantization, tuning, t):
  """The bar case (B1 T1024 H2 D64, causal, bf16): with causal_exact, K, V
  and dO at positions >= t resampled leave the dQ kernel's dQ[:t] bitwise
  unchanged, at a block boundary (768), inside the diagonal block (700) and
  inside or at the end of key block 0, where m' and m part (1, 40, 63, 64,
  100); without it dQ[:t] moves (checked at 768 and 700). The inputs are
  the reference's passes on the CPU, themselves prefix invariant
  (tests/test_causal_exact.py)."""
  q, k, v, do = gaussian_qkv(jax.random.key(0), 1, 1024, 1024, 2, 2, 64)
  later = (resampled(k, t, 1), resampled(v, t, 2), resampled(do, t, 3))
  for exact in (True, False) if t >= 700 else (True,):
    config = mosaic_config(64, True, quantization=quantization, causal_exact=exact)
    dq = lambda qkv, v, lse, pre, do: backward_dq_mosaic(
        qkv, v, lse, pre.delta, do, Masks(), config, _exact_tuning(quantization, tuning),
        fp8=pre.fp8 if config.fp8 else None)
    runs = []
    for arrays in ((k, v, do), later):
      with jax.default_device(CPU):
        args = jax.jit(_exact_inputs(config))(*jax.device_put((q, *arrays), CPU))
      runs.append(np.asarray(jax.jit(dq)(*jax.device_put(args, jax.devices("gpu")[0])),
                             np.float32)[:, :t])
    if exact:
      np.testing.assert_array_equal(runs[1], runs[0])
    else:
      assert rel_l2(runs[1], runs[0]) > 1e-3
