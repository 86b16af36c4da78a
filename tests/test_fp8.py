"""`quantization="int8_fp8"`: INT8 Q.K^T, FP8 E4M3 P.V, P^T.dO, dS.K
and dS^T.Q, every FP8 scale known before the loop that uses it.

The reference decides the mode's accuracy: against fp64 attention it must stay
within the mode's bars of the INT8 mode and beat per-tensor FP8 (cuDNN FP8's
numerics), its FP8 operands must be what the design says (numpy, with
ml_dtypes' E4M3 rounding), and a token a row cannot see must not move that
row's scales; the Hopper kernels (forward, dK/dV, dQ) must match it on the
GPU and lower for CUDA on the CPU; the Triton attention kernels must refuse the
mode so that the `implementation=` chain falls through (their quantization
pass takes it: tests/test_triton_kernels.py); the Flax modules and
`python -m train` must pass it on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

GPU = pytest.mark.gpu

from benchmarks.accuracy import (FP8_OVER_INT8, FP8_OVER_INT8_FROM_SIGMA_3, FP8_OVER_PER_TENSOR,
                                 per_tensor_fp8)
from conftest import (CPU, FP8_TUNINGS, MOSAIC_BACKWARD_CASES, MOSAIC_EXACT_CASES,
                      MOSAIC_FORWARD_CASES, MOSAIC_LAYOUTS, assert_lowers_to_mosaic_gpu,
                      channel_biased_qkv, gaussian_qkv, kernel_config, mosaic_config,
                      mosaic_exact_case, oracle64, rel_l2, sage)
from pallas_kernels.fp8_operands import fp8_operands
from pallas_kernels.layouts import REGISTER_B, TOKENS
from pallas_kernels.mosaic import forward as mosaic_forward
from pallas_kernels.mosaic import backend as mosaic_backend
from pallas_kernels.mosaic.backend import MosaicBackend
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic.backward_dkdv import backward_dkdv_mosaic
from pallas_kernels.mosaic.backward_dq import backward_dq_mosaic
from pallas_kernels.mosaic.backward_dq_product import backward_dq_product
from pallas_kernels.types import QUANTIZATIONS, Masks, Numerics
from sagebwd_jax import dot_product_attention, implementations
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean


def _e4m3(x: np.ndarray) -> np.ndarray:
  """float64 -> E4M3 (ml_dtypes: round to nearest even), saturated, as float64."""
  return np.clip(x, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(
      np.float64)


@pytest.mark.parametrize("sigma", [1, 3])
def test_errors_within_the_modes_bars(sigma):
  """Table 1's setting at T=512 (CI-sized; benchmarks.accuracy runs T=4096)."""
  q, k, v, do = gaussian_qkv(jax.random.key(sigma), 1, 512, 512, 1, 1, 128, sigma=sigma)
  exact = oracle64(q, k, v, do)
  fp8 = sage(q, k, v, do, implementation="reference", quantization="int8_fp8")
  int8 = sage(q, k, v, do, implementation="reference")
  cudnn_like = per_tensor_fp8(q, k, v, do)
  bar = FP8_OVER_INT8.get(sigma, FP8_OVER_INT8_FROM_SIGMA_3)
  for name, ours, base, other, truth in zip(
      ("O", "dQ", "dK", "dV"), (fp8[0], *fp8[1]), (int8[0], *int8[1]), cudnn_like,
      (exact[0], *exact[1])):
    ours, base, other = rel_l2(ours, truth), rel_l2(base, truth), rel_l2(other, truth)
    assert ours <= bar * base, (name, ours, base)
    assert ours <= FP8_OVER_PER_TENSOR * other, (name, ours, other)
  if sigma == 1:  # the baseline is cuDNN FP8's error (O .054-.059 on the H200)
    assert 0.045 <= rel_l2(cudnn_like[0], exact[0]) <= 0.065


def test_fp8_operands_are_the_designs():
  """Q8 and K8 as in the INT8 mode; V^T in E4M3 with one scale per 64-key
  block against the block's largest |V|, rounded to nearest even."""
  q, k, v, _ = gaussian_qkv(jax.random.key(5), 2, 128, 128, 2, 1, 64, sigma=2.0)
  config = kernel_config()
  int8 = ReferenceBackend().quantize(q, k, v, None, config)
  fp8 = ReferenceBackend().quantize(q, k, v, None, dataclasses.replace(
      config, quantization="int8_fp8"))
  np.testing.assert_array_equal(fp8.q8, int8.q8)
  np.testing.assert_array_equal(fp8.k8, int8.k8)
  assert fp8.q8_t is None and fp8.v8_t.dtype == jnp.float8_e4m3fn
  heads = np.swapaxes(np.asarray(v, np.float32), 1, 2)  # (B, Hkv, T, D)
  batch, kv_heads, seq, dim = heads.shape
  amax = np.abs(heads.reshape(batch, kv_heads, seq // 64, 64 * dim)).max(axis=-1)
  per_token = lambda x: np.repeat(x, 64, axis=-1)  # (B, Hkv, T / 64) -> (B, Hkv, T)
  np.testing.assert_allclose(fp8.v_scale, per_token(amax / 448), rtol=1e-6)
  # fp32 steps, as the op
  expected = _e4m3(heads * per_token(np.float32(448) / amax)[..., None])
  np.testing.assert_array_equal(np.swapaxes(np.asarray(fp8.v8_t, np.float64), -1, -2),
                                expected)


def test_forward_is_the_designs():
  """O against numpy's float64 run of the design from the same 8-bit Q, K
  and V: with sV_j the E4M3 scale of V's 64-key block j, P = E4M3(448
  exp2(S + log2 sV_j - m)) with m the running maximum of S + log2 sV_j over
  64-key steps, and O = sum P.V8 / sum P / sV_j. What is left is fp32
  rounding (and the E4M3 roundings it flips); a wrong scale, step or
  maximum moves O by far more than the mode's error against exact (~0.04)."""
  q, k, v, _ = gaussian_qkv(jax.random.key(6), 1, 256, 256, 1, 1, 128, sigma=2.0)
  config = kernel_config(scale=128**-0.5, quantization="int8_fp8")
  backend = ReferenceBackend()
  qkv = backend.quantize(q, k, v, None, config)
  o, lse, row_max = backend.forward(qkv, Masks(), config, jnp.float32)
  q8, k8 = (np.asarray(x, np.float64)[0, 0] for x in (qkv.q8, qkv.k8))
  s = (q8 @ k8.T) * np.asarray(qkv.q_scale, np.float64)[0, 0, :, None] * np.asarray(
      qkv.k_scale, np.float64)[0, 0, None, :]
  v8 = np.swapaxes(np.asarray(qkv.v8_t, np.float64)[0, 0], 0, 1)
  sv = np.asarray(qkv.v_scale, np.float64)[0, 0]
  m, l, acc = np.full(256, -np.inf), np.zeros(256), np.zeros((256, 128))
  for j in range(0, 256, 64):
    folded = s[:, j:j + 64] + np.log2(sv[j])
    m_new = np.maximum(m, folded.max(axis=1))
    p = 448 * np.exp2(folded - m_new[:, None])
    alpha = np.exp2(m - m_new)
    l = alpha * l + p.sum(axis=1) / sv[j]
    acc, m = alpha[:, None] * acc + _e4m3(p) @ v8[j:j + 64], m_new
  assert rel_l2(o[0, :, 0], acc / l[:, None]) < 1e-3
  np.testing.assert_allclose(row_max[0, 0], s.max(axis=1), rtol=1e-6)
  np.testing.assert_allclose(lse[0, 0], m + np.log2(l / 448), rtol=1e-5)


def test_ds_row_bound_bounds_every_score_gradient():
  """|dS_ij| <= b_i for every query row (fp64 dS from the reference's own P),
  causal, with GQA."""
  q, k, v, do = gaussian_qkv(jax.random.key(7), 1, 128, 128, 4, 2, 64, sigma=2.0)
  config = kernel_config(causal=True, quantization="int8_fp8")
  backend = ReferenceBackend()
  qkv = backend.quantize(q, k, v, None, config)
  o, lse, row_max = backend.forward(qkv, Masks(), config, q.dtype)
  pre = backend.prepass(o, do, config)
  delta = pre.delta
  bound = np.asarray(fp8_operands(qkv._replace(q16=q, k16=k), v, pre, row_max, lse, Masks(),
                                  config, TOKENS).ds_bound, np.float64)
  q8, k8 = (np.asarray(x, np.float64) for x in (qkv.q8, qkv.k8))
  k8 = np.repeat(k8, 2, axis=1)
  s = np.einsum("bhqd,bhkd->bhqk", q8, k8) * np.asarray(qkv.q_scale, np.float64)[
      ..., None] * np.repeat(np.asarray(qkv.k_scale, np.float64), 2, axis=1)[:, :, None]
  s = np.where(np.tril(np.ones((128, 128), bool)), s, -np.inf)
  p = np.exp2(np.minimum(s - np.asarray(lse, np.float64)[..., None], 0))
  dp = np.einsum("bqhd,bkhd->bhqk", np.asarray(do, np.float64),
                 np.repeat(np.asarray(v, np.float64), 2, axis=2))
  ds = p * (dp - np.asarray(delta, np.float64)[..., None])
  largest = np.abs(ds).max(axis=-1)
  assert np.all(largest <= bound * (1 + 1e-5))
  # b_i is m_i r_i: the row's largest P (what makes it tight: without it dQ's
  # and dK's error doubles at sigma 1) times ||dO_i|| max_j ||V_j|| + |Delta_i|,
  # the max over the key blocks of 64 that row i's block sees (causal: blocks
  # up to its own).
  v_norm = np.linalg.norm(np.asarray(v, np.float64), axis=-1)  # (B, Tk, Hkv)
  seen = np.maximum.accumulate(v_norm.reshape(1, 2, 64, 2).max(axis=2), axis=1)  # (B, blk, Hkv)
  v_seen = np.repeat(np.repeat(seen, 64, axis=1), 2, axis=2).transpose(0, 2, 1)  # (B, H, Tq)
  r = (np.linalg.norm(np.asarray(do, np.float64), axis=-1).transpose(0, 2, 1) * v_seen
       + np.abs(np.asarray(delta, np.float64)))
  np.testing.assert_allclose(bound, p.max(axis=-1) * r, rtol=1e-4)


def test_bf16_ds_composes():
  """With ds_precision="bf16", dS.K and dS^T.Q leave FP8: dQ and dK lose
  dS's FP8 error; O and dV keep the FP8 forward and dV."""
  q, k, v, do = gaussian_qkv(jax.random.key(8), 1, 256, 256, 2, 1, 128)
  exact = oracle64(q, k, v, do, is_causal=True)
  fp8 = sage(q, k, v, do, is_causal=True, implementation="reference", quantization="int8_fp8")
  both = sage(q, k, v, do, is_causal=True, implementation="reference",
              quantization="int8_fp8", ds_precision="bf16")
  for i in (0, 1):  # dQ, dK
    assert rel_l2(both[1][i], exact[1][i]) < 0.7 * rel_l2(fp8[1][i], exact[1][i])
  assert rel_l2(both[1][2], exact[1][2]) < 1.3 * rel_l2(fp8[1][2], exact[1][2])


def test_residual_and_its_gradient():
  """return_residual: jax.nn's log-sum-exp (within the mode's error), and a
  finite gradient through it."""
  q, k, v, _ = gaussian_qkv(jax.random.key(9), 1, 128, 128, 2, 2, 64)
  f = lambda q: dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                      implementation="reference", quantization="int8_fp8")
  _, lse = f(q)
  _, want = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
  assert rel_l2(lse, want) < 1e-2
  grad = jax.grad(lambda q: jnp.sum(f(q)[1].astype(jnp.float32)))(q)
  assert bool(jnp.all(jnp.isfinite(grad)))


def test_bad_mode_and_backends_without_it():
  q, k, v, _ = gaussian_qkv(jax.random.key(10), 1, 64, 64, 1, 1, 64)
  for bad in ("fp8", "INT8", None, 8):
    with pytest.raises(ValueError, match="quantization must be one of"):
      dot_product_attention(q, k, v, quantization=bad)
  # The Triton pass quantizes; the Triton forward then refuses the mode.
  with pytest.raises(NotImplementedError, match="int8_fp8"):
    dot_product_attention(q, k, v, implementation="triton", quantization="int8_fp8")
  chained = dot_product_attention(q, k, v, implementation=("triton", "reference"),
                                  quantization="int8_fp8")
  alone = dot_product_attention(q, k, v, implementation="reference", quantization="int8_fp8")
  np.testing.assert_array_equal(chained, alone)
  assert QUANTIZATIONS == ("int8", "int8_fp8")
  # Without a GPU the default is the reference for both modes; the Hopper
  # backend refuses the mode without a backend for what it has no kernel of.
  assert implementations.resolve(None, "int8_fp8") == ("reference",)
  with pytest.raises(NotImplementedError, match="fp8_fallback"):
    MosaicBackend(ReferenceBackend()).quantize(q, k, v, None, kernel_config(
        quantization="int8_fp8"))


def test_flax_and_train_pass_it_on(monkeypatch):
  """make_attention_fn, nnx Attention (through Llama) and `python -m train
  --quantization int8_fp8` hand the mode to the op."""
  from sagebwd_jax.flax import make_attention_fn
  from sagebwd_jax.flax import attention as attention_module
  from train.cli import from_args
  from train.step import build_model

  q, k, v, _ = gaussian_qkv(jax.random.key(11), 1, 64, 64, 2, 2, 64)
  fn = make_attention_fn(implementation="reference", quantization="int8_fp8")
  np.testing.assert_array_equal(
      fn(q, k, v), dot_product_attention(q, k, v, implementation="reference",
                                         quantization="int8_fp8"))

  cfg, _ = from_args(["--quantization", "int8_fp8", "--attention", "reference"])
  assert cfg.quantization == "int8_fp8"
  model = build_model(cfg, 256)
  seen = []
  real = attention_module.dot_product_attention
  monkeypatch.setattr(attention_module, "dot_product_attention",
                      lambda *a, **kw: seen.append(kw["quantization"]) or real(*a, **kw))
  model(jnp.zeros((1, 64), jnp.int32))
  assert seen and set(seen) == {"int8_fp8"}


FORWARD_TUNINGS = {"default": mosaic_forward.ForwardTuning(),
                   "pipelined": mosaic_forward.ForwardTuning(pipelined=True,
                                                             schedule_barrier=False),
                   "pingpong": mosaic_forward.ForwardTuning(pipelined=True),
                   "overlap": mosaic_forward.ForwardTuning(pipelined=True, overlap=True,
                                                           schedule_barrier=False),
                   "overlap_pingpong": mosaic_forward.ForwardTuning(pipelined=True,
                                                                    overlap=True),
                   "overlap_turns": mosaic_forward.ForwardTuning(pipelined=True, overlap=True,
                                                                 schedule_barrier=False,
                                                                 issue_turns=True)}


@pytest.mark.parametrize("tuning", ["pipelined", "pingpong", "overlap", "overlap_pingpong",
                                    "overlap_turns"])
@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True)])
def test_pipelined_forward_lowers_for_cuda(head_dim, causal, tuning):
  """The pipelined FP8 forward (P.V issued with the next step's S; with
  `overlap`, the next softmax under P.V), lowered with and without the
  ping-pong's schedule barrier, and with issue turns."""
  config = mosaic_config(head_dim, causal, quantization="int8_fp8")
  args = gaussian_qkv(jax.random.key(0), 2, 512, 512, 4, 2, head_dim)[:3]
  qkv = jax.eval_shape(lambda: ReferenceBackend().quantize(*args, None, config,
                                                           layouts=MOSAIC_LAYOUTS))
  assert_lowers_to_mosaic_gpu(lambda qkv: mosaic_forward.forward_mosaic(
      qkv, Masks(), config, jnp.bfloat16, FORWARD_TUNINGS[tuning]), qkv)


def test_pipelined_forward_refuses_causal_exact():
  config = mosaic_config(64, True, quantization="int8_fp8", causal_exact=True)
  with pytest.raises(ValueError, match="pipelined=True"):
    mosaic_forward.forward_mosaic(None, Masks(), config, jnp.bfloat16,
                                  FORWARD_TUNINGS["pingpong"])


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", sorted(FORWARD_TUNINGS))
@pytest.mark.parametrize("case", MOSAIC_FORWARD_CASES, ids=str)
def test_gpu_mosaic_forward_matches_reference(case, tuning):
  """The Hopper FP8 forward against the reference in its 128-key steps: the
  same E4M3 values but where the kernel's one-FMA exponent rounds a P across
  an E4M3 boundary (and fp32 sums in another order), bf16 O. Every
  schedule: the default, and P.V issued with the next step's S with and
  without the ping-pong."""
  batch, q_len, kv_len, heads, kv_heads, head_dim, causal = case
  q, k, v, _ = gaussian_qkv(jax.random.key(12), batch, q_len, kv_len, heads, kv_heads,
                            head_dim, sigma=2.0)
  config = mosaic_config(head_dim, causal, quantization="int8_fp8")
  reference = ReferenceBackend(Numerics(p_block=mosaic_forward.KV_STEP))
  with jax.default_device(CPU):
    q, k, v = (jax.device_put(x, CPU) for x in (q, k, v))
    qkv = reference.quantize(q, k, v, key_mean(k, None), config, layouts=MOSAIC_LAYOUTS)
    o_ref, lse_ref, m_ref = reference.forward(qkv, Masks(), config, jnp.bfloat16)
  run = jax.jit(lambda qkv: mosaic_forward.forward_mosaic(qkv, Masks(), config, jnp.bfloat16,
                                                         FORWARD_TUNINGS[tuning]))
  o, lse, m = run(jax.device_put(qkv, jax.devices("gpu")[0]))
  assert rel_l2(o, o_ref) < 1e-2
  assert rel_l2(lse, lse_ref) < 1e-4
  np.testing.assert_allclose(np.asarray(m), np.asarray(m_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_EXACT_CASES, ids=str)
def test_gpu_mosaic_forward_with_causal_exact_matches_reference(case):
  """The Hopper FP8 forward with causal_exact (V in E4M3 per block, folded
  into P; the mean term; the 16-bit edge step) against the reference in
  its 128-key steps, at the tolerances of the mode's other forward cases
  (`channel_biased_qkv`: the mean term carries weight)."""
  *shape, head_dim, causal = case
  config = mosaic_config(head_dim, causal, quantization="int8_fp8", causal_exact=True)
  qkv, (o_ref, lse_ref, m_ref) = mosaic_exact_case(
      *channel_biased_qkv(jax.random.key(12), *shape, head_dim), config)
  run = jax.jit(lambda qkv: mosaic_forward.forward_mosaic(qkv, Masks(), config, jnp.bfloat16))
  o, lse, m = run(jax.device_put(qkv, jax.devices("gpu")[0]))
  assert rel_l2(o, o_ref) < 1e-2
  assert rel_l2(lse, lse_ref) < 1e-4
  np.testing.assert_allclose(np.asarray(m), np.asarray(m_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("sigma", [1, 3, 5, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_op_error_within_the_references(causal, head_dim, sigma):
  """On the GPU the op (the Hopper FP8 kernels; the quantization pass and
  pre-pass the reference's) is within 1.1x of the reference's error against
  fp64 (the mode's bar)."""
  q, k, v, do = gaussian_qkv(jax.random.key(13), 1, 1024, 1024, 4, 2, head_dim, sigma=sigma)
  exact = oracle64(q, k, v, do, is_causal=causal)
  ours = sage(q, k, v, do, is_causal=causal, quantization="int8_fp8")
  reference = sage(q, k, v, do, is_causal=causal, quantization="int8_fp8",
                   implementation="reference")
  for name, got, want, truth in zip(("O", "dQ", "dK", "dV"), (ours[0], *ours[1]),
                                    (reference[0], *reference[1]), (exact[0], *exact[1])):
    assert rel_l2(got, truth) <= 1.1 * rel_l2(want, truth), name


@pytest.mark.parametrize("implementation", ["reference", pytest.param("mosaic", marks=GPU)])
def test_an_outlier_token_leaves_the_rows_that_cannot_see_it(implementation):
  """Causal, one token (the last) with K and V x100: the FP8 scales of rows
  that cannot attend to it (K''s largest block scale, the dS bound's largest
  ||V_j||) are taken over the key blocks those rows see, so their O and dQ
  errors against fp64 stay within 1.1x of the same inputs without it (over
  all keys they grew 6.6x: dQ .044 -> .288). On the GPU, through the Hopper
  kernels."""
  q, k, v, do = gaussian_qkv(jax.random.key(14), 1, 1024, 1024, 2, 2, 64)
  rows = slice(0, 768)
  errors = []
  for scale in (1, 100):
    k_, v_ = k.at[:, -1].multiply(scale), v.at[:, -1].multiply(scale)
    exact = oracle64(q, k_, v_, do, is_causal=True)
    ours = sage(q, k_, v_, do, is_causal=True, implementation=implementation,
                quantization="int8_fp8")
    errors.append([rel_l2(np.asarray(got, np.float64)[:, rows], want[:, rows])
                   for got, want in ((ours[0], exact[0]), (ours[1][0], exact[1][0]))])
  (o, dq), (o_outlier, dq_outlier) = errors
  assert o_outlier <= 1.1 * o and dq_outlier <= 1.1 * dq, errors


def _fp8_backward_case(batch, seq, heads, kv_heads, head_dim, causal, *, seed=0, sigma=2.0):
  """The FP8 backward kernels' arguments as the op forms them (the reference's
  quantization, forward, pre-pass and operands, the Mosaic layouts), the
  config, and the reference's dQ, dK, dV from the same tensors."""
  q, k, v, do = gaussian_qkv(jax.random.key(seed), batch, seq, seq, heads, kv_heads, head_dim,
                             sigma=sigma)
  config = mosaic_config(head_dim, causal, quantization="int8_fp8")
  reference = ReferenceBackend()

  def inputs(q, k, v, do):
    k_mean = key_mean(k, None)
    qkv = reference.quantize(q, k, v, k_mean, config, layouts=MOSAIC_LAYOUTS)._replace(
        q16=q, k16=(k.astype(jnp.float32) - k_mean[:, None]).astype(k.dtype))
    o, lse, row_max = reference.forward(qkv, Masks(), config, jnp.bfloat16)
    pre = reference.prepass(o, do, config, REGISTER_B)
    pre = pre._replace(fp8=fp8_operands(qkv, v, pre, row_max, lse, Masks(), config,
                                        REGISTER_B))
    return qkv, v, lse, pre, do

  return inputs, (q, k, v, do), config


def _fp8_kernels(config, tuning, qkv, v, lse, pre, do):
  """dQ, dK, dV from the Hopper FP8 backward kernels."""
  dk, dv = backward_dkdv_mosaic(qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale, Masks(),
                                config, tuning, fp8=pre.fp8)
  dq = backward_dq_mosaic(qkv, v, lse, pre.delta, do, Masks(), config, tuning, fp8=pre.fp8)
  return dq, dk, dv


# dQ as one product (`backend.Launches.ds_bytes`): dK/dV, with the op's
# overlap launch, writes dS'' and dQ is its product.
PRODUCT_TUNING = BackwardTuning(pipelined=True, overlap=True, schedule_barrier=False)


def _fp8_product(config, qkv, v, lse, pre, do):
  """dQ, dK, dV from the FP8 dK/dV kernel that writes dS'' and dQ's product."""
  dk, dv, ds8 = backward_dkdv_mosaic(qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale,
                                     Masks(), config, PRODUCT_TUNING, fp8=pre.fp8,
                                     write_ds=True)
  return backward_dq_product(ds8, pre.fp8, config, do.dtype), dk, dv


@pytest.mark.parametrize("case", [(1, 256, 2, 1, 64, True), (1, 256, 2, 2, 128, False)],
                         ids=str)
def test_fp8_backward_product_lowers_for_cuda(case):
  """dK/dV writing dS'' (transposed by stmatrix) and dQ's product lower for
  CUDA without a GPU, with no XLA layout pass between them."""
  inputs, arrays, config = _fp8_backward_case(*case)
  args = jax.eval_shape(inputs, *arrays)
  assert_lowers_to_mosaic_gpu(functools.partial(_fp8_product, config), *args)
  _, _, ds8 = jax.eval_shape(lambda qkv, v, lse, pre, do: backward_dkdv_mosaic(
      qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale, Masks(), config, PRODUCT_TUNING,
      fp8=pre.fp8, write_ds=True), *args)
  batch, seq, heads = case[:3]
  assert (ds8.shape, ds8.dtype) == ((batch, heads, seq // 64, seq, 64), jnp.float8_e4m3fn)


def test_fp8_backward_product_refuses_what_it_cannot_run():
  inputs, arrays, config = _fp8_backward_case(1, 128, 1, 1, 64, True)
  qkv, v, lse, pre, do = jax.eval_shape(inputs, *arrays)
  with pytest.raises(ValueError, match="write_ds"):
    backward_dkdv_mosaic(qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale, Masks(), config,
                         FP8_TUNINGS["pipelined"], fp8=pre.fp8, write_ds=True)
  ds8 = jax.ShapeDtypeStruct((1, 1, 2, 128, 64), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="causal_exact"):
    backward_dq_product(ds8, pre.fp8, dataclasses.replace(config, causal_exact=True),
                        jnp.bfloat16)
  with pytest.raises(ValueError, match="ds8"):
    backward_dq_product(jax.ShapeDtypeStruct((1, 1, 2, 128, 64), jnp.int8), pre.fp8, config,
                        jnp.bfloat16)


def test_a_block_of_zeros_in_q_folds_one_and_leaves_the_gradients():
  """`Fp8Operands.q_fold` is 1, not 0, for a block of zeros in Q (so dS'
  keeps what the Hopper dQ product forms dS'' from): the reference's
  gradients are those of a fold of 0, bit for bit (its Q' is zero)."""
  inputs, (q, k, v, do), config = _fp8_backward_case(1, 256, 2, 1, 64, False)
  qkv, v, lse, pre, do = jax.jit(inputs)(q.at[:, 64:128, 1].set(0), k, v, do)
  zero = np.zeros(pre.fp8.q_fold.shape, bool)
  zero[:, 1, 64:128] = True
  np.testing.assert_array_equal(np.asarray(pre.fp8.q_fold)[zero], 1.0)
  assert np.all(np.asarray(pre.fp8.q_fold)[~zero] < 1.0 + 1e-6)
  folded_zero = pre._replace(fp8=pre.fp8._replace(q_fold=jnp.where(zero, 0.0, pre.fp8.q_fold)))
  backward = jax.jit(lambda pre: ReferenceBackend().backward(qkv, v, lse, do, pre, Masks(),
                                                             config))
  for name, got, want in zip(("dQ", "dK", "dV"), backward(pre), backward(folded_zero)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                  err_msg=name)


def test_the_backend_takes_dq_as_a_product_when_launched_so():
  """`Launches.ds_bytes`: with FP8 products and the overlap (not
  causal_exact), dK/dV writes dS'' and dQ is its product for calls of up to
  that many bytes of dS'' (B * H * Tq * Tk); the default launch (0) keeps
  the dQ kernel."""
  inputs, arrays, config = _fp8_backward_case(1, 256, 2, 1, 64, True)
  default = mosaic_backend.launches(config)
  assert not default.dq_product(config, 1, 1, 128, 128)
  capped = dataclasses.replace(default, ds_bytes=16 * 16384 * 16384)
  assert capped.dq_product(config, 1, 16, 16384, 16384)
  assert not capped.dq_product(config, 2, 16, 16384, 16384)
  for other in (dataclasses.replace(config, causal_exact=True),
                dataclasses.replace(config, quantization="int8")):
    assert not capped.dq_product(other, 1, 1, 128, 128)
  qkv, v, lse, pre, do = jax.eval_shape(inputs, *arrays)

  def lowered(launch):
    backend = MosaicBackend(ReferenceBackend(), fp8_fallback=ReferenceBackend(), launches=launch)
    run = lambda qkv, v, lse, pre, do: backend.backward(qkv, v, lse, do, pre, Masks(), config)
    return jax.jit(run).trace(qkv, v, lse, pre, do).lower(lowering_platforms=("cuda",)).as_text()

  assert "dq_product" in lowered(capped) and "dq_product" not in lowered(default)


@pytest.mark.parametrize("tuning", sorted(FP8_TUNINGS))
@pytest.mark.parametrize("case", [(1, 256, 2, 1, 64, True), (1, 256, 2, 2, 128, False)],
                         ids=str)
def test_fp8_backward_kernels_lower_for_cuda(case, tuning):
  """The Hopper FP8 dK/dV and dQ kernels lower for CUDA without a GPU, with
  no XLA layout pass around them (Q'^T, K'^T, dO8^T arrive REGISTER_B)."""
  inputs, arrays, config = _fp8_backward_case(*case)
  args = jax.eval_shape(inputs, *arrays)
  tuning = FP8_TUNINGS[tuning]
  assert_lowers_to_mosaic_gpu(functools.partial(_fp8_kernels, config, tuning), *args)


def test_fp8_backward_overlap_refuses_causal_exact():
  inputs, arrays, config = _fp8_backward_case(1, 128, 1, 1, 64, True)
  qkv, v, lse, pre, do = jax.eval_shape(inputs, *arrays)
  exact, overlap = dataclasses.replace(config, causal_exact=True), FP8_TUNINGS["overlap"]
  with pytest.raises(ValueError, match="overlap=True"):
    backward_dkdv_mosaic(qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale, Masks(), exact,
                         overlap, fp8=pre.fp8)
  with pytest.raises(ValueError, match="overlap=True"):
    backward_dq_mosaic(qkv, v, lse, pre.delta, do, Masks(), exact, overlap, fp8=pre.fp8)


def test_fp8_backward_kernels_refuse_a_missing_or_stray_operand():
  inputs, arrays, config = _fp8_backward_case(1, 128, 1, 1, 64, False)
  qkv, v, lse, pre, do = jax.eval_shape(inputs, *arrays)
  with pytest.raises(ValueError, match="`fp8`"):
    backward_dq_mosaic(qkv, v, lse, pre.delta, do, Masks(), config)
  with pytest.raises(ValueError, match="`fp8`"):
    backward_dkdv_mosaic(qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale, Masks(),
                         dataclasses.replace(config, quantization="int8"), fp8=pre.fp8)



@pytest.mark.gpu
@pytest.mark.parametrize("tuning", sorted(FP8_TUNINGS))
@pytest.mark.parametrize("case", MOSAIC_BACKWARD_CASES, ids=str)
def test_gpu_fp8_backward_kernels_match_reference(case, tuning):
  """The kernels against the reference's FP8 backward on the same tensors: the
  same E4M3 operands but where the kernels' exponent rounds a P or dS across
  an E4M3 boundary, sums in another order, and the FP8 accumulator's own
  rounding (docs/algorithm.md)."""
  inputs, arrays, config = _fp8_backward_case(*case)
  args = jax.jit(inputs)(*arrays)
  got = jax.jit(functools.partial(_fp8_kernels, config, FP8_TUNINGS[tuning]))(*args)
  _check_against_reference(got, args, config)


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_BACKWARD_CASES, ids=str)
def test_gpu_fp8_backward_product_matches_reference(case):
  """dQ as the product of dK/dV's dS'' (and dK/dV writing it) against the
  reference's FP8 backward, as the kernels above."""
  inputs, arrays, config = _fp8_backward_case(*case)
  args = jax.jit(inputs)(*arrays)
  _check_against_reference(jax.jit(functools.partial(_fp8_product, config))(*args), args,
                           config)


def _check_against_reference(got, args, config):
  """The kernels' dQ, dK, dV within 1% of the reference's on the CPU."""
  with jax.default_device(CPU):
    cpu = jax.device_put(args, CPU)
    want = jax.jit(lambda qkv, v, lse, pre, do: ReferenceBackend().backward(
        qkv, v, lse, do, pre, Masks(), config))(*cpu)
  for name, x, ref in zip(("dQ", "dK", "dV"), got, want):
    x, ref = np.asarray(x.astype(jnp.float32)), np.asarray(ref, np.float32)
    assert x.shape == ref.shape, name
    assert np.all(np.isfinite(x)), name
    assert rel_l2(x, ref) <= 1e-2, (name, rel_l2(x, ref))
