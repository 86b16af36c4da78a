"""The Pallas kernels one by one against the pure-JAX reference backend: the
same int8 tensors, the same forward and backward results (CI: Pallas interpret
mode; GPU: compiled). The op through these kernels is checked by the behaviour
suite (tests/test_attention_pallas.py, tests/test_attention_gpu.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (CPU, backend_tolerance, check_quantization_pass, gaussian_qkv,
                      kernel_config, sage)
from pallas_kernels.triton.backend import PallasBackend
from pallas_kernels.triton.backward_prepass import backward_prepass
from pallas_kernels.types import Masks
from sagebwd_jax import dot_product_attention, metrics
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

ON_GPU = jax.default_backend() == "gpu"
PALLAS = PallasBackend.tuned(causal=False, interpret=not ON_GPU)
REFERENCE = ReferenceBackend()


def _check_quantize(head_dim, smooth_q, smooth_k, exact, ds_precision="int8"):
  check_quantization_pass(PALLAS, REFERENCE, head_dim, smooth_q, smooth_k, int8_exact=exact,
                          ds_precision=ds_precision)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("smooth_q,smooth_k", [(False, True), (True, False)])
def test_quantization_pass_forms_the_reference_int8_tensors(head_dim, smooth_q, smooth_k):
  _check_quantize(head_dim, smooth_q, smooth_k, exact=True)


@pytest.mark.parametrize("smooth_q", [False, True])
def test_quantization_pass_scales_q_per_token_with_bf16_ds(smooth_q):
  _check_quantize(64, smooth_q, smooth_k=True, exact=True, ds_precision="bf16")


def test_backward_prepass_matches_reference_rules():
  _, _, o, do = gaussian_qkv(jax.random.key(1), 2, 128, 128, 2, 2, 64)
  delta, do8_t, do_scale = backward_prepass(o, do, block_q=64, launch=PALLAS.backward_launch)
  expected_delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1)
  np.testing.assert_allclose(delta, jnp.swapaxes(expected_delta, 1, 2), rtol=1e-5,
                             atol=1e-5)
  for b in range(2):
    for h in range(2):
      for blk in range(2):
        tile = np.asarray(do[b, blk * 64:(blk + 1) * 64, h].astype(jnp.float32))
        amax = np.abs(tile).max()
        expected = np.rint(tile * (np.float32(127.0) / amax)).astype(np.int8)
        np.testing.assert_array_equal(do8_t[b, h, :, blk * 64:(blk + 1) * 64], expected.T)
        np.testing.assert_allclose(do_scale[b, h, blk * 64:(blk + 1) * 64], amax / 127,
                                   rtol=1e-7)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_lse_matches_reference(causal):
  q, k, v, _ = gaussian_qkv(jax.random.key(3), 1, 128, 128, 2, 1, 64)
  config = kernel_config(causal=causal)
  qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
  o, lse = PALLAS.forward(qkv, Masks(), config, jnp.float32)
  o_ref, lse_ref = REFERENCE.forward(qkv, Masks(), config, jnp.float32)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-4)
  assert float(metrics.relative_l2(o, o_ref)) <= 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_pallas_equals_reference_at_saturating_logits(causal):
  """At sigma up to 1e4 (base-2 logits near 1e8) the kernels' forward equals
  the reference's to fp32 rounding: both form each score's distance to its
  row max once (numerics.block_scores), so no P moves by a power of two. The
  gradients are compared at sigma 30 (causal) only: the backward's exp2(S - lse) takes
  two absolute fp32 numbers, whose rounding grows with the logits (near 1e8
  at sigma 1e4 it is 2**3; README, known limits), and the two backends
  contract it differently."""
  forward = lambda name: jax.jit(functools.partial(
      dot_product_attention, is_causal=causal, return_residual=True, implementation=name))
  # Compiled on a GPU, exp2 is the approximate instruction: int8 flips, not powers of two.
  tolerance = 1e-3 if ON_GPU else 1e-6
  for sigma in (30.0, 1e3, 1e4):
    q, k, v, do = gaussian_qkv(jax.random.key(5), 1, 128, 128, 2, 1, 64, sigma=sigma,
                               dtype=jnp.float32)
    o, lse = forward("pallas")(q, k, v)
    with jax.default_device(CPU):
      o_ref, lse_ref = forward("reference")(q, k, v)
      grads_ref = sage(q, k, v, do, is_causal=causal, implementation="reference")[1]
    assert float(metrics.relative_l2(o, o_ref)) <= tolerance, sigma
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=tolerance)
    if sigma == 30.0 and causal:
      for a, b in zip(sage(q, k, v, do, is_causal=causal, implementation="pallas")[1],
                      grads_ref):
        assert float(metrics.relative_l2(a, b)) <= backend_tolerance(a)


def test_backward_kernels_match_reference_fp32():
  q, k, v, do = gaussian_qkv(jax.random.key(4), 1, 128, 128, 2, 2, 64, dtype=jnp.float32)
  config = kernel_config(causal=True)
  qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
  o, lse = REFERENCE.forward(qkv, Masks(), config, jnp.float32)
  ours = PALLAS.backward(qkv, v, o, lse, do, Masks(), config)
  ref = REFERENCE.backward(qkv, v, o, lse, do, Masks(), config)
  for name, a, b in zip(("dQ", "dK", "dV"), ours, ref):
    assert float(metrics.relative_l2(a, b)) <= 1e-3, name


# Compiled on a GPU (run through the device tool).
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_quantization_pass(head_dim):
  _check_quantize(head_dim, smooth_q=True, smooth_k=False, exact=False)
  _check_quantize(head_dim, smooth_q=False, smooth_k=True, exact=False)
  _check_quantize(head_dim, smooth_q=False, smooth_k=True, exact=False, ds_precision="bf16")
