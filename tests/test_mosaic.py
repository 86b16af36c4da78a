"""The Hopper forward kernel (Pallas Mosaic GPU) against the pure-JAX reference.

On the CPU: the kernel lowers for CUDA (`lowering_platforms=("cuda",)`) and
runs in Mosaic GPU interpret mode (`plgpu.force_gpu_interpret_mode`), fed the
reference's own `QuantizedQKV`. On a GPU (`@pytest.mark.gpu`): compiled.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CPU, assert_lowers_to_mosaic_gpu, gaussian_qkv, mosaic_config, rel_l2
from pallas_kernels.mosaic.common import supports
from pallas_kernels.mosaic.forward import MosaicLaunch, forward_mosaic
from pallas_kernels.types import Masks
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

REFERENCE = ReferenceBackend()


def _case(batch, seq, heads, kv_heads, head_dim, causal, seed=0, sigma=2.0):
  """The reference's QuantizedQKV and its forward (computed on the CPU)."""
  q, k, v, _ = gaussian_qkv(jax.random.key(seed), batch, seq, seq, heads, kv_heads, head_dim,
                            sigma=sigma)
  config = mosaic_config(head_dim, causal)
  with jax.default_device(CPU):
    q, k, v = (jax.device_put(x, CPU) for x in (q, k, v))
    qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
    o_ref, lse_ref = REFERENCE.forward(qkv, Masks(), config, jnp.bfloat16)
  return qkv, config, np.asarray(o_ref), np.asarray(lse_ref)


def _run(qkv, config, launch=MosaicLaunch()):
  return jax.jit(lambda qkv: forward_mosaic(qkv, Masks(), config, jnp.bfloat16, launch))(qkv)


def _check(o, lse, o_ref, lse_ref):
  o, lse = np.asarray(o), np.asarray(lse)
  assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
  assert lse.shape == lse_ref.shape and lse.dtype == np.float32
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
  assert rel_l2(o, o_ref) <= 1e-3
  assert rel_l2(lse, lse_ref) <= 1e-4


LAUNCHES = {
    "default": MosaicLaunch(),
    "bit_tricks": MosaicLaunch(bit_tricks=True),
    "no_schedule_barrier_3_stages": MosaicLaunch(use_schedule_barrier=False,
                                                 max_concurrent_steps=3),
    "overlap_qk": MosaicLaunch(overlap_qk=True),
    "overlap_qk_bit_tricks_no_schedule_barrier": MosaicLaunch(
        overlap_qk=True, bit_tricks=True, use_schedule_barrier=False),
}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda(head_dim, causal, launch):
  """Mosaic GPU lowering (to the CUDA custom call) without a GPU."""
  config = mosaic_config(head_dim, causal)
  qkv = jax.eval_shape(
      lambda: REFERENCE.quantize(*gaussian_qkv(jax.random.key(0), 2, 512, 512, 4, 2,
                                               head_dim)[:3], None, config))
  fn = lambda qkv: forward_mosaic(qkv, Masks(), config, jnp.bfloat16, LAUNCHES[launch])
  assert_lowers_to_mosaic_gpu(fn, qkv)


# (batch, seq, heads, kv_heads, head_dim, causal): GQA, MHA, an odd number of
# query blocks (padded to 128-row CTA tiles), one key block per pipeline slot.
INTERPRET_CASES = [
    (1, 256, 2, 1, 128, False),
    (1, 256, 2, 1, 128, True),
    (1, 256, 2, 2, 64, False),
    (1, 256, 2, 2, 64, True),
    (1, 192, 2, 1, 64, True),
    (1, 192, 2, 1, 128, False),
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=str)
def test_interpret_matches_reference(case):
  qkv, config, o_ref, lse_ref = _case(*case)
  with plgpu.force_gpu_interpret_mode():
    o, lse = _run(qkv, config)
  _check(o, lse, o_ref, lse_ref)


@pytest.mark.parametrize("launch", ["bit_tricks", "no_schedule_barrier_3_stages", "overlap_qk",
                                    "overlap_qk_bit_tricks_no_schedule_barrier"])
def test_interpret_launch_variants(launch):
  qkv, config, o_ref, lse_ref = _case(1, 256, 2, 1, 64, True, seed=1)
  with plgpu.force_gpu_interpret_mode():
    o, lse = _run(qkv, config, LAUNCHES[launch])
  _check(o, lse, o_ref, lse_ref)


@pytest.mark.parametrize("launch", ["default", "no_schedule_barrier_3_stages", "overlap_qk"])
def test_interpret_finds_no_races(launch):
  """The interpreter's race detector: every shared-memory access is ordered
  by the barriers (a missing wait is caught: checked by hand)."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  qkv, config, o_ref, lse_ref = _case(1, 384, 2, 2, 64, True, seed=2)
  params = plgpu.InterpretGPUParams(detect_races=True)
  with plgpu.force_gpu_interpret_mode(params):
    o, lse = jax.block_until_ready(_run(qkv, config, LAUNCHES[launch]))
  assert not gpu_callbacks.get_races().races_found
  _check(o, lse, o_ref, lse_ref)


def test_supports():
  base = mosaic_config(128, True)
  ids = jnp.zeros((1, 64), jnp.int32)
  assert supports(Masks(), base, 128)
  assert supports(Masks(), mosaic_config(64, False), 64)
  assert not supports(Masks(ids, ids), base, 128)
  assert not supports(Masks(), mosaic_config(128, True, smooth_q=True), 128)
  assert not supports(Masks(), mosaic_config(128, True, block_q=128), 128)
  assert not supports(Masks(), mosaic_config(128, True, block_kv=128), 128)
  for head_dim in (32, 80, 96, 256):
    assert not supports(Masks(), mosaic_config(head_dim, False), head_dim)
  with pytest.raises(NotImplementedError):
    forward_mosaic(_case(1, 64, 1, 1, 128, True)[0], Masks(ids, ids), base, jnp.bfloat16)


def test_lengths_not_whole_blocks_are_refused():
  qkv, config, _, _ = _case(1, 128, 1, 1, 64, False)
  keys = slice(0, 96)  # one and a half blocks
  short = qkv._replace(k8=qkv.k8[:, :, keys], k8_t=qkv.k8_t[..., keys],
                       k_scale=qkv.k_scale[..., keys], v8_t=qkv.v8_t[..., keys],
                       v_scale=qkv.v_scale[..., keys])
  with pytest.raises(ValueError, match="multiples of 64"):
    forward_mosaic(short, Masks(), config, jnp.bfloat16)


GPU_CASES = INTERPRET_CASES + [
    (2, 1024, 4, 2, 128, False),
    (2, 1024, 4, 2, 128, True),
    (2, 1024, 4, 1, 64, True),
    (1, 2048, 2, 2, 128, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_compiled_matches_reference(case):
  qkv, config, o_ref, lse_ref = _case(*case)
  o, lse = _run(jax.device_put(qkv, jax.devices("gpu")[0]), config)
  _check(o, lse, o_ref, lse_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", sorted(set(LAUNCHES) - {"default"}))
@pytest.mark.parametrize("case", [(2, 1024, 4, 2, 128, False), (2, 1024, 4, 1, 64, True)],
                         ids=str)
def test_gpu_launch_variants(case, launch):
  qkv, config, o_ref, lse_ref = _case(*case)
  o, lse = _run(jax.device_put(qkv, jax.devices("gpu")[0]), config, LAUNCHES[launch])
  _check(o, lse, o_ref, lse_ref)
