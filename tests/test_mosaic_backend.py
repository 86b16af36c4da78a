"""The Hopper backend (`MosaicBackend`, implementation="mosaic") and its
dispatch: which kernels it runs for which case, and the op's results.

CI checks the wiring: the op on every kernel case with the three Mosaic entry
points swapped for their Triton twins (same contract but the layouts, which
the twins convert; Triton's interpreter), against the CPU reference with the
Triton kernels' P quantization, recording which entry points ran: those of
each direction whose layouts the backend asked the quantization pass for as
REGISTER_B, and which layouts it asks for. The Mosaic kernels
themselves are checked one by one (tests/test_mosaic.py, tests/test_mosaic_backward.py).
The op compiled on a Hopper GPU is checked by the behaviour suite
(tests/test_attention_gpu.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (KERNEL_CASES, MOSAIC_LAYOUTS, check_against_reference, gaussian_qkv,
                      mosaic_config)
from pallas_kernels.jax_triton.backend import TritonBackend
from pallas_kernels.jax_triton.backward_dkdv import backward_dkdv
from pallas_kernels.jax_triton.backward_dq import backward_dq
from pallas_kernels.jax_triton.forward import forward
from pallas_kernels.jax_triton.launch import LaunchConfig
from pallas_kernels.mosaic import backend as mosaic_backend
from pallas_kernels.mosaic.backend import (MOSAIC_NUMERICS, Launches, MosaicBackend,
                                           backward_takes)
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic import forward as mosaic_forward
from pallas_kernels.layouts import REGISTER_B, TOKENS, arrange, to_layout
from pallas_kernels.types import Layouts, Masks, QuantizedQKV
from sagebwd_jax import dot_product_attention, implementations
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import quantize

INTERPRET = LaunchConfig(interpret=True)


def _tuned(causal: bool, interpret: bool) -> MosaicBackend:
  return MosaicBackend(TritonBackend.tuned(causal=causal, interpret=interpret))


def _portable_forward(causal: bool, interpret: bool) -> MosaicBackend:
  """The tuned backend with the fallback's forward."""
  return dataclasses.replace(_tuned(causal, interpret), mosaic_forward=False)


# Every case through the tuned backend; a few through one that keeps the
# fallback's forward (taken, fallback for masks, GQA).
WIRING = ([(case, _tuned) for case in sorted(KERNEL_CASES)]
          + [(case, _portable_forward) for case in ("causal", "d128", "gqa_causal", "segments")])


@pytest.mark.parametrize("case,make_backend", WIRING,
                         ids=[f"{c}-{f.__name__}" for c, f in WIRING])
def test_op_wiring(case, make_backend, monkeypatch):
  # The op's stages are jits: a trace an earlier test cached for an equal
  # backend would run without calling the twins below.
  jax.clear_caches()
  calls = set()

  def twin(module, name, portable):
    def run(*args, fp8=None):
      assert fp8 is None  # the twins are INT8's; the FP8 backward's wiring: test_fp8.py
      calls.add(name)
      # The launch is the last argument; the twins read TOKENS (an XLA pass here).
      tokens = [arrange(x, Layouts()) if isinstance(x, QuantizedQKV) else
                to_layout(x, TOKENS) if getattr(x, "dtype", None) == jnp.int8 else x
                for x in args[:-1]]
      return portable(*tokens, INTERPRET)
    monkeypatch.setattr(module, name, run)

  # forward_mosaic also returns the row maxima: None in the INT8 mode.
  twin(mosaic_forward, "forward_mosaic", lambda *args: (*forward(*args), None))
  twin(mosaic_backend, "backward_dkdv_mosaic", backward_dkdv)
  twin(mosaic_backend, "backward_dq_mosaic", backward_dq)
  asked = set()  # the layouts the backend asks the quantization pass for
  layouts = MosaicBackend.layouts

  def recorded(self, *args):
    asked.add(layouts(self, *args))
    return layouts(self, *args)

  monkeypatch.setattr(MosaicBackend, "layouts", recorded)
  backend = make_backend(causal=KERNEL_CASES[case].get("is_causal", False), interpret=True)
  original = implementations.backend
  monkeypatch.setattr(implementations, "backend", lambda implementation, causal: (
      backend if implementation == "mosaic" else original(implementation, causal)))
  # The twins quantize P as the Triton kernels do: the fallback's numerics.
  check_against_reference(case, "mosaic", kernels=backend.fallback)
  (one_call,) = asked
  expected = ({"forward_mosaic"} if one_call.forward is REGISTER_B else set()) | (
      {"backward_dkdv_mosaic", "backward_dq_mosaic"} if one_call.backward is REGISTER_B
      else set())
  assert calls == expected


def test_mosaic_without_hopper_is_refused():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="Hopper"):
    dot_product_attention(q, q, q, implementation="mosaic")


def test_backward_takes():
  config = mosaic_config(64, True)
  ids = jnp.zeros((1, 128), jnp.int32)
  takes = lambda config, seq=128, dtype=jnp.bfloat16, masks=Masks(), **kw: backward_takes(
      masks, config, seq, seq, 64, dtype, **kw)
  assert takes(config) and takes(config, dtype=jnp.float16)
  assert not takes(config, dtype=jnp.float32)  # dO.V^T wgmma takes 16-bit V
  assert not takes(config, masks=Masks(ids, ids))
  assert not takes(mosaic_config(64, True, smooth_q=True))
  assert not takes(mosaic_config(64, False, block_q=32, block_kv=32))
  plain = mosaic_config(64, False)
  assert not takes(plain, 192)  # not whole 128-token CTA tiles
  assert takes(plain, 192, tuning=BackwardTuning(compute_wgs=1, schedule_barrier=False))
  assert not takes(mosaic_config(64, True, window=(16, 0)))  # windows: the Triton kernels


def test_fp8_causal_exact_passes_run_where_they_are_formed():
  """FP8 products with causal_exact: the Hopper backend quantizes in its
  Triton fallback (V per 64-key block, in the Mosaic kernels' layouts), as
  the reference does, and the Triton backend forms the FP8 operands in
  XLA's pass (its Triton pass refuses the case: K' keeps K's mean and the
  bounds span the edge blocks)."""
  config = mosaic_config(64, True, quantization="int8_fp8", causal_exact=True)
  q, k, v, do = gaussian_qkv(jax.random.key(1), 1, 256, 256, 2, 1, 64)
  triton = TritonBackend.tuned(causal=True, interpret=True)
  hopper = MosaicBackend(triton, fp8_fallback=ReferenceBackend())
  layouts = hopper.layouts(q, k, Masks(), config)
  assert layouts == MOSAIC_LAYOUTS
  qkv = quantize(q, k, v, Masks(), config, hopper, True)
  want = quantize(q, k, v, Masks(), config, ReferenceBackend(), True)
  assert qkv.v_scale.shape == (1, 1, 256)  # per token: each 64-key block's
  for name, x, y in zip(qkv._fields, qkv, arrange(want, layouts)):
    assert (x is None) == (y is None), name
    if x is not None:  # 8-bit tensors bit for bit, scales to an ulp (tiles.quantize_e4m3)
      np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                 rtol=0 if x.dtype.itemsize == 1 else 1e-6, err_msg=name)
  reference = ReferenceBackend()
  o, lse, row_max = reference.forward(qkv, Masks(), config, q.dtype)
  pre = reference.prepass(o, do, config, REGISTER_B)
  got = triton.fp8_operands(qkv, v, pre, row_max, lse, Masks(), config)
  for name, x, y in zip(got._fields, got, reference.fp8_operands(qkv, v, pre, row_max, lse,
                                                                 Masks(), config)):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), name)


@pytest.mark.parametrize("q_len,kv_len,causal,dtype,ids,mosaic_forward_on,expected", [
    (256, 256, True, jnp.bfloat16, False, True, (REGISTER_B, REGISTER_B)),
    (192, 256, False, jnp.bfloat16, False, True, (REGISTER_B, TOKENS)),  # bwd: CTA tiles
    (256, 256, False, jnp.bfloat16, False, False, (TOKENS, REGISTER_B)),
    (256, 256, False, jnp.bfloat16, True, True, (TOKENS, TOKENS)),  # masks
    (256, 256, False, jnp.float32, False, True, (TOKENS, TOKENS)),
])
def test_layouts_and_numerics_follow_the_kernels_that_run(q_len, kv_len, causal, dtype, ids,
                                                          mosaic_forward_on, expected):
  """REGISTER_B for each direction whose Mosaic kernels will run, by the rules
  by which the backend runs them; TOKENS for the fallback's. The declared
  numerics likewise: P per 128-key step where the Mosaic forward runs, per
  key block where the fallback's does."""
  backend = _tuned(causal, interpret=True)
  if not mosaic_forward_on:
    backend = dataclasses.replace(backend, mosaic_forward=False)
  q = jax.ShapeDtypeStruct((1, q_len, 2, 64), dtype)
  k = jax.ShapeDtypeStruct((1, kv_len, 2, 64), dtype)
  masks = Masks(jnp.zeros((1, q_len), jnp.int32), jnp.zeros((1, kv_len), jnp.int32)) if ids \
      else Masks()
  layouts = backend.layouts(q, k, masks, mosaic_config(64, causal))
  assert (layouts.forward, layouts.backward) == expected
  numerics = backend.reference_numerics(q, k, masks, mosaic_config(64, causal))
  forward_numerics = MOSAIC_NUMERICS if expected[0] is REGISTER_B else TritonBackend.NUMERICS
  assert (numerics.p_block, numerics.unsigned_p) == (forward_numerics.p_block,
                                                     forward_numerics.unsigned_p)
  assert numerics.unsigned_p_t  # the Mosaic backward's and the Triton kernels' alike


@pytest.mark.parametrize("causal", [False, True])
def test_launches_per_call(causal):
  """Each call's kernels get `launches(config)`: FP8 products the overlap
  without the schedule barrier; INT8 products,
  and FP8 with the diagonal in 16 bits (which the overlap does not take),
  the barrier. A backend's own `launches` are every call's."""
  int8 = mosaic_config(64, causal)
  fp8 = dataclasses.replace(int8, quantization="int8_fp8")
  barrier = Launches(mosaic_forward.ForwardTuning(), BackwardTuning(), BackwardTuning())
  overlap = dict(pipelined=True, overlap=True, schedule_barrier=False)
  backend = _tuned(causal, interpret=True)
  assert backend._launches(int8) == barrier
  assert backend._launches(fp8) == Launches(
      mosaic_forward.ForwardTuning(**overlap), BackwardTuning(**overlap),
      BackwardTuning(**overlap))
  exact = dataclasses.replace(fp8, causal_exact=True)
  assert (backend._launches(exact) == barrier) == causal
  pinned = dataclasses.replace(backend, launches=barrier)
  assert pinned._launches(fp8) == barrier


def test_default_implementation_without_gpu_is_reference():
  assert implementations.resolve(None) == ("reference",)
  assert isinstance(implementations.backend("reference", causal=False), ReferenceBackend)


def test_default_implementation_on_gpus(monkeypatch):
  monkeypatch.setattr(implementations, "platform", lambda: "gpu")
  monkeypatch.setattr(implementations, "hopper", lambda: False)
  assert implementations.resolve(None) == ("triton",)
  monkeypatch.setattr(implementations, "hopper", lambda: True)
  assert implementations.resolve(None) == ("mosaic", "triton")


@pytest.mark.gpu
def test_gpu_default_is_mosaic_on_hopper():
  hopper = jax.devices()[0].compute_capability == "9.0"
  backend = implementations.backend(implementations.resolve(None)[0], causal=True)
  assert isinstance(backend, MosaicBackend) == hopper
  if not hopper:
    with pytest.raises(NotImplementedError, match="Hopper"):
      implementations.backend("mosaic", causal=True)
