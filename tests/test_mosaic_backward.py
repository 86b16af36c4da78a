"""The Hopper backward kernels (Pallas Mosaic GPU) against the portable ones.

On the CPU: the kernels lower for CUDA (`lowering_platforms=("cuda",)`) and
run in Mosaic GPU interpret mode (`plgpu.force_gpu_interpret_mode`), compared
with `backward_dkdv` / `backward_dq` run in Pallas interpret mode on the same
inputs (the reference's `QuantizedQKV`, O and lse; the portable pre-pass).
On a GPU (`@pytest.mark.gpu`): compiled, against the compiled portable kernels.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CPU, assert_lowers_to_mosaic_gpu, gaussian_qkv, mosaic_config, rel_l2
from pallas_kernels.triton.backward_dkdv import backward_dkdv
from pallas_kernels.triton.backward_dq import backward_dq
from pallas_kernels.triton.backward_prepass import backward_prepass
from pallas_kernels.triton.common import LaunchConfig
from pallas_kernels.mosaic.backward_common import MosaicBackwardLaunch
from pallas_kernels.mosaic.backward_dkdv import backward_dkdv_mosaic
from pallas_kernels.mosaic.backward_dq import backward_dq_mosaic
from pallas_kernels.types import Masks
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

REFERENCE = ReferenceBackend()
INTERPRET = LaunchConfig(interpret=True)


def _inputs(batch, seq, heads, kv_heads, head_dim, causal, seed=0, sigma=2.0, device=CPU):
  """(qkv, v, lse, delta, do, do8_t, do_scale), config: the reference's
  quantization and forward, the portable pre-pass (Pallas interpret mode)."""
  q, k, v, do = gaussian_qkv(jax.random.key(seed), batch, seq, seq, heads, kv_heads,
                             head_dim, sigma=sigma)
  config = mosaic_config(head_dim, causal)
  with jax.default_device(CPU):
    q, k, v, do = (jax.device_put(x, CPU) for x in (q, k, v, do))
    qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
    o, lse = REFERENCE.forward(qkv, Masks(), config, jnp.bfloat16)
    delta, do8_t, do_scale = backward_prepass(o, do, block_q=config.block_q, launch=INTERPRET)
  args = (qkv, v, lse, delta, do, do8_t, do_scale)
  return jax.device_put(args, device), config


def _portable(args, config, launch):
  qkv, v, lse, delta, do, do8_t, do_scale = args
  dk, dv = jax.jit(lambda *a: backward_dkdv(*a, Masks(), config, launch))(
      qkv, v, lse, delta, do, do8_t, do_scale)
  dq = jax.jit(lambda *a: backward_dq(*a, Masks(), config, launch))(qkv, v, lse, delta, do)
  return dq, dk, dv


def _mosaic(args, config, launch=MosaicBackwardLaunch()):
  qkv, v, lse, delta, do, do8_t, do_scale = args
  dk, dv = jax.jit(lambda *a: backward_dkdv_mosaic(*a, Masks(), config, launch))(
      qkv, v, lse, delta, do, do8_t, do_scale)
  dq = jax.jit(lambda *a: backward_dq_mosaic(*a, Masks(), config, launch))(
      qkv, v, lse, delta, do)
  return dq, dk, dv


def _check(got, want, tol=5e-3):
  """bf16 outputs: 5e-3 relative L2 (a few roundings of int8 dS differ with
  the summation order of the bf16 dO.V^T)."""
  for name, x, ref in zip(("dQ", "dK", "dV"), got, want):
    x, ref = np.asarray(x), np.asarray(ref)
    assert x.shape == ref.shape and x.dtype == ref.dtype, name
    assert np.all(np.isfinite(x)), name
    assert rel_l2(x, ref) <= tol, (name, rel_l2(x, ref))


def _abstract_args(batch, seq, heads, kv_heads, head_dim, causal):
  config = mosaic_config(head_dim, causal)
  qkv = jax.eval_shape(
      lambda: REFERENCE.quantize(*gaussian_qkv(jax.random.key(0), batch, seq, seq, heads,
                                               kv_heads, head_dim)[:3], None, config))
  sds = jax.ShapeDtypeStruct
  rows = sds((batch, heads, seq), jnp.float32)
  return (qkv, sds((batch, seq, kv_heads, head_dim), jnp.bfloat16), rows, rows,
          sds((batch, seq, heads, head_dim), jnp.bfloat16),
          sds((batch, heads, head_dim, seq), jnp.int8), rows), config


LAUNCHES = {
    "default": MosaicBackwardLaunch(),
    "bit_tricks": MosaicBackwardLaunch(bit_tricks=True),
    "warp_specialized": MosaicBackwardLaunch(warp_specialized=True),
    "warp_specialized_3_steps_bit_tricks": MosaicBackwardLaunch(
        warp_specialized=True, max_concurrent_steps=3, bit_tricks=True),
}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_lowers_for_cuda(head_dim, causal, launch):
  """Mosaic GPU lowering (to the CUDA custom call) without a GPU. GQA at
  D = 128 (fp32 dK/dV partials) fits a ring of 2 only: MHA there."""
  kv_heads = 4 if head_dim == 128 and launch.endswith("3_steps_bit_tricks") else 2
  args, config = _abstract_args(2, 512, 4, kv_heads, head_dim, causal)
  launch = LAUNCHES[launch]
  dkdv = lambda *a: backward_dkdv_mosaic(*a, Masks(), config, launch)
  dq = lambda *a: backward_dq_mosaic(*a, Masks(), config, launch)
  assert_lowers_to_mosaic_gpu(dkdv, *args)
  assert_lowers_to_mosaic_gpu(dq, *args[:5])


# (batch, seq, heads, kv_heads, head_dim, causal): GQA and MHA, both head dims,
# an odd number of blocks.
INTERPRET_CASES = [
    (1, 256, 2, 1, 128, False),
    (1, 256, 2, 1, 64, True),
    (1, 192, 2, 2, 64, False),
    (1, 192, 2, 2, 128, True),
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=str)
def test_interpret_matches_portable(case):
  args, config = _inputs(*case)
  want = _portable(args, config, INTERPRET)
  with plgpu.force_gpu_interpret_mode():
    got = _mosaic(args, config)
  _check(got, want)


def test_interpret_bit_tricks():
  args, config = _inputs(1, 128, 2, 1, 64, True, seed=1)
  want = _portable(args, config, INTERPRET)
  with plgpu.force_gpu_interpret_mode():
    got = _mosaic(args, config, MosaicBackwardLaunch(bit_tricks=True, approx_math=False))
  _check(got, want)


# (case, launch): warp-specialized dK/dV and dQ, with causal CTAs whose
# warpgroups skip blocks the other one needs, and a ring deeper than some
# CTAs' range.
WS_CASES = [
    ((1, 256, 2, 1, 128, False), "warp_specialized"),
    ((1, 384, 2, 2, 64, True), "warp_specialized"),
    ((1, 256, 2, 1, 64, True), "warp_specialized_3_steps_bit_tricks"),
]


@pytest.mark.parametrize("case,launch", WS_CASES, ids=str)
def test_interpret_warp_specialized(case, launch):
  """Matches the portable kernels; no races (the interpreter's detector also
  fails a barrier phase nobody waited on)."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  args, config = _inputs(*case, seed=3)
  want = _portable(args, config, INTERPRET)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
    got = jax.block_until_ready(_mosaic(args, config, LAUNCHES[launch]))
  assert not gpu_callbacks.get_races().races_found
  _check(got, want)


def test_interpret_finds_no_races():
  """The interpreter's race detector: TMA prefetches into the other slot are
  ordered by the barriers against the wgmmas reading the current one."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  args, config = _inputs(1, 192, 2, 1, 64, True, seed=2)
  want = _portable(args, config, INTERPRET)
  with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
    got = jax.block_until_ready(_mosaic(args, config))
  assert not gpu_callbacks.get_races().races_found
  _check(got, want)


def test_unsupported_cases_are_refused():
  """The backward takes what `mosaic.common.supports` takes (tested in
  tests/test_mosaic.py) and refuses the rest."""
  base = mosaic_config(128, True)
  ids = jnp.zeros((1, 64), jnp.int32)
  args, _ = _abstract_args(1, 64, 1, 1, 128, True)
  with pytest.raises(NotImplementedError):
    backward_dq_mosaic(*args[:5], Masks(ids, ids), base)
  with pytest.raises(NotImplementedError):
    backward_dkdv_mosaic(*args, Masks(), mosaic_config(128, True, smooth_q=True))


GPU_CASES = INTERPRET_CASES + [
    (2, 1024, 4, 2, 128, False),
    (2, 1024, 4, 2, 128, True),
    (2, 1024, 4, 1, 64, True),
    (1, 2048, 2, 2, 128, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_compiled_matches_portable(case, launch):
  batch, seq, heads, kv_heads, head_dim, causal = case
  if head_dim == 128 and kv_heads < heads and launch.endswith("3_steps_bit_tricks"):
    pytest.skip("a ring of 3 does not fit shared memory with fp32 GQA partials at D=128")
  gpu = jax.devices("gpu")[0]
  args, config = _inputs(*case, device=gpu)
  want = _portable(args, config, LaunchConfig())
  got = _mosaic(args, config, LAUNCHES[launch])
  _check(got, want)
