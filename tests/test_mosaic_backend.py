"""The Hopper backend (`MosaicBackend`, implementation="mosaic") and its
dispatch: which kernels it runs for which case, and the op's results.

CI checks the wiring: the op on every kernel case with the three Mosaic entry
points swapped for their Triton twins (same contract; Triton's interpreter),
against the CPU reference with the Triton kernels' P quantization, recording
which entry points ran. The Mosaic kernels
themselves are checked one by one (tests/test_mosaic.py, tests/test_mosaic_backward.py).
The op compiled on a Hopper GPU is checked by the behaviour suite
(tests/test_attention_gpu.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from conftest import (HOPPER_CASES, KERNEL_CASES, check_against_reference, gaussian_qkv,
                      mosaic_config, use_triton_numerics)
from pallas_kernels.jax_triton.backend import TritonBackend
from pallas_kernels.jax_triton.backward_dkdv import backward_dkdv
from pallas_kernels.jax_triton.backward_dq import backward_dq
from pallas_kernels.jax_triton.forward import forward
from pallas_kernels.jax_triton.launch import LaunchConfig
from pallas_kernels.mosaic import backend as mosaic_backend
from pallas_kernels.mosaic.backend import MosaicBackend, backward_takes
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic import forward as mosaic_forward
from pallas_kernels.types import Masks
from sagebwd_jax import api, dot_product_attention
from sagebwd_jax.reference import ReferenceBackend

INTERPRET = LaunchConfig(interpret=True)


def _tuned(causal: bool, interpret: bool) -> MosaicBackend:
  return MosaicBackend.tuned(TritonBackend.tuned(causal=causal, interpret=interpret))


def _portable_forward(causal: bool, interpret: bool) -> MosaicBackend:
  """The tuned backend with the fallback's forward."""
  return dataclasses.replace(_tuned(causal, interpret), forward_mosaic=None)


# Every case through the tuned backend; a few through one that keeps the
# fallback's forward (taken, fallback for masks, GQA).
WIRING = ([(case, _tuned) for case in sorted(KERNEL_CASES)]
          + [(case, _portable_forward) for case in ("causal", "d128", "gqa_causal", "segments")])


@pytest.mark.parametrize("case,make_backend", WIRING,
                         ids=[f"{c}-{f.__name__}" for c, f in WIRING])
def test_op_wiring(case, make_backend, monkeypatch):
  calls = set()

  def twin(module, name, portable):
    def run(*args):
      calls.add(name)
      return portable(*args[:-1], INTERPRET)  # the launch is the last argument
    monkeypatch.setattr(module, name, run)

  twin(mosaic_forward, "forward_mosaic", forward)
  twin(mosaic_backend, "backward_dkdv_mosaic", backward_dkdv)
  twin(mosaic_backend, "backward_dq_mosaic", backward_dq)
  backend = make_backend(causal=KERNEL_CASES[case].get("is_causal", False), interpret=True)
  original = api._backend
  monkeypatch.setattr(api, "_backend", lambda implementation, causal: (
      backend if implementation == "mosaic" else original(implementation, causal)))
  use_triton_numerics(monkeypatch)  # the twins quantize P as the Triton kernels do
  check_against_reference(case, "mosaic")
  expected = set()
  if case in HOPPER_CASES:
    expected = {"backward_dkdv_mosaic", "backward_dq_mosaic"} | (
        set() if backend.forward_mosaic is None else {"forward_mosaic"})
  assert calls == expected


def test_mosaic_without_hopper_is_refused():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="Hopper"):
    dot_product_attention(q, q, q, implementation="mosaic")


def _qkv(seq, head_dim, causal, **overrides):
  config = mosaic_config(head_dim, causal, **overrides)
  q, k, v, _ = gaussian_qkv(jax.random.key(0), 1, seq, seq, 2, 2, head_dim)
  return ReferenceBackend().quantize(q, k, v, None, config), config


def test_backward_takes():
  qkv, config = _qkv(128, 64, True)
  ids = jnp.zeros((1, 128), jnp.int32)
  assert backward_takes(qkv, Masks(), config, jnp.bfloat16)
  assert backward_takes(qkv, Masks(), config, jnp.float16)
  assert not backward_takes(qkv, Masks(), config, jnp.float32)  # dO.V^T wgmma takes 16-bit V
  assert not backward_takes(qkv, Masks(ids, ids), config, jnp.bfloat16)
  qkv_q, config_q = _qkv(128, 64, True, smooth_q=True)
  assert not backward_takes(qkv_q, Masks(), config_q, jnp.bfloat16)
  qkv_32, config_32 = _qkv(128, 64, False, block_q=32, block_kv=32)
  assert not backward_takes(qkv_32, Masks(), config_32, jnp.bfloat16)
  qkv_192, config_192 = _qkv(192, 64, False)  # not whole 128-token CTA tiles
  assert not backward_takes(qkv_192, Masks(), config_192, jnp.bfloat16)
  assert backward_takes(qkv_192, Masks(), config_192, jnp.bfloat16,
                        BackwardTuning(compute_wgs=1, schedule_barrier=False))
  qkv_w, config_w = _qkv(128, 64, True, window=(16, 0))  # windows: the Triton kernels
  assert not backward_takes(qkv_w, Masks(), config_w, jnp.bfloat16)


def test_tuned_launches():
  portable = TritonBackend.tuned(causal=True)
  causal, plain = _tuned(True, False), _tuned(False, False)
  assert causal.fallback == portable
  assert causal.forward_mosaic == plain.forward_mosaic == mosaic_forward.ForwardTuning()
  assert causal.dkdv_tuning == plain.dkdv_tuning == BackwardTuning()
  assert causal.dq_tuning == plain.dq_tuning == BackwardTuning(schedule_barrier=False)


def test_default_implementation_without_gpu_is_reference():
  assert api._implementations(None) == ("reference",)
  assert isinstance(api._backend("reference", causal=False), ReferenceBackend)


def test_default_implementation_on_gpus(monkeypatch):
  monkeypatch.setattr(api, "_platform", lambda: "gpu")
  monkeypatch.setattr(api, "_hopper", lambda: False)
  assert api._implementations(None) == ("triton",)
  monkeypatch.setattr(api, "_hopper", lambda: True)
  assert api._implementations(None) == ("mosaic", "triton")


@pytest.mark.gpu
def test_gpu_default_is_mosaic_on_hopper():
  hopper = jax.devices()[0].compute_capability == "9.0"
  backend = api._backend(api._implementations(None)[0], causal=True)
  assert isinstance(backend, MosaicBackend) == hopper
  if not hopper:
    with pytest.raises(NotImplementedError, match="Hopper"):
      api._backend("mosaic", causal=True)
