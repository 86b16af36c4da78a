"""The Triton FP8 operand pass (pallas_kernels/jax_triton/fp8_operands.py,
its key side from the Triton quantization pass) against the XLA one
(`pallas_kernels.fp8_operands.fp8_operands`), in Triton's interpreter, on
the tensors the op hands it: the reference's quantization, forward and
pre-pass with quantization="int8_fp8".

b_i's fp32 sums run in another order (Triton's, not numerics.ordered_sum's),
so b_i may differ in the last bit, and an E4M3 value of Q' where that bit
moves its product across a rounding boundary: by one E4M3 step, in few
places. K' does not depend on b_i: equal. The scales amax / 448 differ by
an ulp where XLA, under jit, multiplies by 1 / 448 instead of dividing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import sass
from conftest import CPU, gaussian_qkv, mosaic_config
from pallas_kernels import fp8_operands as xla
from pallas_kernels.jax_triton import fp8_operands as triton_pass
from pallas_kernels.jax_triton.launch import LaunchConfig
from pallas_kernels.jax_triton.quantize import quantize_qkv
from pallas_kernels.layouts import REGISTER_B, TOKENS
from pallas_kernels.types import Layouts, Masks
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

INTERPRET = LaunchConfig(interpret=True)
# Measured: 3 to 5 of Q''s 131072 or 262144 values per case below (2e-5 of
# 2.6M over these and T=512), each one step.
DIFFERING_E4M3 = 1e-4


@functools.cache
def _case(batch, seq, heads, kv_heads, head_dim, causal, layout=TOKENS):
  """The pass's arguments as the op forms them (tests/test_fp8.py's
  `_fp8_backward_case`; the key side in `layout`), and the config."""
  q, k, v, do = gaussian_qkv(jax.random.key(3), batch, seq, seq, heads, kv_heads, head_dim,
                             sigma=2.0)
  config = mosaic_config(head_dim, causal, quantization="int8_fp8")
  reference = ReferenceBackend()

  @jax.jit
  def inputs(q, k, v, do):
    k_mean = key_mean(k, None)
    keys = quantize_qkv(q, k, v, k_mean, config, INTERPRET, True, Layouts(backward=layout))
    qkv = reference.quantize(q, k, v, k_mean, config)._replace(
        q16=q, k16=(k.astype(jnp.float32) - k_mean[:, None]).astype(k.dtype),
        fp8_keys=keys.fp8_keys)
    o, lse, row_max = reference.forward(qkv, Masks(), config, jnp.bfloat16)
    pre = reference.prepass(o, do, config)
    return qkv, v, pre, row_max, lse

  return inputs(q, k, v, do), config


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


def _e4m3_steps(got, want):
  """|got - want| in E4M3 steps, per element (the bit patterns of finite
  E4M3 values of one sign order as the values)."""
  signed = lambda x: np.where(x & 0x80, -(x & 0x7F).astype(np.int32), (x & 0x7F).astype(np.int32))
  return np.abs(signed(_bits(got)) - signed(_bits(want)))


@pytest.mark.parametrize("layout", [TOKENS, REGISTER_B], ids=lambda x: x.name)
@pytest.mark.parametrize("case", [(2, 256, 4, 2, 64, True), (2, 256, 4, 2, 128, False),
                                  (2, 256, 4, 1, 128, True), (2, 256, 4, 1, 64, False)],
                         ids=str)
def test_triton_fp8_operands_match_xla(case, layout):
  args, config = _case(*case, layout)
  # XLA's pass on the CPU: XLA:GPU's fp32 division is not correctly rounded,
  # which moves E4M3 values by a step (conftest's check_quantization_pass).
  with jax.default_device(CPU):
    want = jax.jit(lambda *a: xla.fp8_operands(*a, Masks(), config, layout))(
        *jax.device_put(args, CPU))
  got = jax.jit(lambda *a: triton_pass.fp8_operands(*a, Masks(), config, layout, INTERPRET))(
      *args)
  for name in want._fields:
    x, ref = getattr(got, name), getattr(want, name)
    assert x.shape == ref.shape and x.dtype == ref.dtype, name
  np.testing.assert_array_equal(_bits(got.k8_t), _bits(want.k8_t))
  steps = _e4m3_steps(got.q8_t, want.q8_t)
  assert steps.max() <= 1 and np.mean(steps > 0) <= DIFFERING_E4M3, (
      np.count_nonzero(steps), steps.size)
  for name in ("k_scale", "ds_bound", "q_fold", "dk_scale", "k_top", "p_factor", "dv_scale"):
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6, err_msg=name)


def test_triton_fp8_operands_refuse_masks():
  args, config = _case(2, 256, 4, 1, 64, False)
  ids = jnp.zeros((2, 256), jnp.int32)
  with pytest.raises(NotImplementedError, match="masks"):
    triton_pass.fp8_operands(*args, Masks(ids, ids), config, TOKENS, INTERPRET)


def test_triton_fp8_operands_refuse_a_missing_or_misplaced_key_side():
  """Without the quantization pass's key side, or with it in another layout
  than the call's, the pass says so (`TritonBackend.fp8_operands` sends the
  first case to XLA's pass)."""
  (qkv, *rest), config = _case(2, 256, 4, 1, 64, False, TOKENS)
  with pytest.raises(ValueError, match="fp8_keys"):
    triton_pass.fp8_operands(qkv._replace(fp8_keys=None), *rest, Masks(), config, TOKENS,
                             INTERPRET)
  with pytest.raises(ValueError, match="fp8_keys.k8_t is TOKENS"):
    triton_pass.fp8_operands(qkv, *rest, Masks(), config, REGISTER_B, INTERPRET)


def test_fp8_operands_refuse_a_prepass_without_norms():
  """Both passes take ||dO_i|| from the pre-pass; one run without FP8
  products (no `Prepass.do_norm`) is refused by name, not traced into a
  None operand."""
  (qkv, v, pre, *rest), config = _case(2, 256, 4, 1, 64, False, TOKENS)
  args = (qkv, v, pre._replace(do_norm=None), *rest, Masks(), config, TOKENS)
  with pytest.raises(ValueError, match="prepass.do_norm"):
    xla.fp8_operands(*args)
  with pytest.raises(ValueError, match="prepass.do_norm"):
    triton_pass.fp8_operands(*args, INTERPRET)


@pytest.mark.parametrize("layout", [TOKENS, REGISTER_B], ids=lambda x: x.name)
def test_triton_fp8_operands_compile_for_hopper(layout):
  """Triton compiles the launch for sm_90, as jax_triton would on a GPU
  (the compiled path's only check here), converting to E4M3 with the
  instruction whose rounding the interpreter's conversion follows."""
  args, config = _case(2, 256, 4, 2, 128, True, layout)
  launches = sass.triton_launches(
      lambda *a: triton_pass.fp8_operands(*a, Masks(), config, layout, LaunchConfig()), *args)
  assert [launch.name for launch in launches] == ["sagebwd_triton_fp8_queries"]
  for launch in launches:
    assert "cvt.rn.satfinite.e4m3x2.f32" in launch.compiled(90).asm["ptx"], launch.name


@pytest.mark.parametrize("layout", [TOKENS, REGISTER_B], ids=lambda x: x.name)
def test_fp8_prepass_is_the_references(layout):
  """The Triton pre-pass with FP8 products (the Hopper FP8 backward's):
  Delta, dO in E4M3 per block, transposed in `layout`, and its scales, as the
  reference's pre-pass forms them, and ||dO_i|| (Delta's and the norms'
  sums in another order: fp32 rounding; the E4M3 values equal)."""
  from pallas_kernels.jax_triton.backward_prepass import backward_prepass
  o, do = gaussian_qkv(jax.random.key(4), 2, 256, 256, 2, 2, 128)[::3]
  config = mosaic_config(128, False, quantization="int8_fp8")
  want = ReferenceBackend().prepass(o, do, config, layout)
  got = backward_prepass(o, do, block_q=64, launch=INTERPRET, layout=layout, fp8=True)
  assert got.do8_t.dtype == jnp.float8_e4m3fn and got.do_start is None
  np.testing.assert_array_equal(np.asarray(got.do8_t, np.float32),
                                np.asarray(want.do8_t, np.float32))
  np.testing.assert_allclose(got.do_scale, want.do_scale, rtol=1e-6)
  np.testing.assert_allclose(got.delta, want.delta, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got.do_norm, want.do_norm, rtol=1e-6)
