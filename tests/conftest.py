"""Shared fixtures and helpers for the SageBwd test suite.

The op's behaviour suite is `attention_suite.AttentionTestBase`, subclassed
once per backend in `test_attention_*.py`. `BACKENDS` lists the backends that
the property tests of test_api.py run on (those fast enough on the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
import shutil
import tempfile

# The suite runs under strict rank promotion (jax's own suite does; a common
# user setting): no implicit broadcasting of arrays of different rank. The
# variable reaches the training runs started as subprocesses too.
os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")
# Triton's interpreter (the Triton kernels' tests without a GPU) multiplies
# tiles with numpy, where OpenBLAS's threads, contending with XLA's on two
# cores, made each product many times slower (docs/performance-log.md). Read when numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# pytest-xdist workers share one GPU (`pytest -m gpu -n 4`: compiling, not the
# GPU, bounds the GPU suite): each takes memory as it needs it instead of
# XLA's default 75% of the device, which would leave the next worker none.
if "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _has_gpu_plugin() -> bool:
  return any((d.metadata["Name"] or "").replace("_", "-").startswith(("jax-cuda", "jax-rocm"))
             for d in importlib.metadata.distributions())


# Where jax has no GPU, compiling is most of the suite's time, and LLVM's
# optimization of the CPU code most of each compile. No test checks the
# speed of the CPU code, and XLA's own passes (fusion, layout) still run, so
# the suite compiles at LLVM -O0: a fifth less time (docs/performance-log.md).
# The variable reaches the subprocesses the tests start. With a GPU plugin
# the flag, which would also set the GPU's LLVM level, stays off; a level
# the caller set is left alone.
CPU_XLA_FLAGS = "" if _has_gpu_plugin() else "--xla_backend_optimization_level=0"
if CPU_XLA_FLAGS and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_XLA_FLAGS}".strip()

import jax  # noqa: E402  (after the variable, which jax reads at import)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels.mosaic.backend import MOSAIC_NUMERICS, MosaicBackend  # noqa: E402
from pallas_kernels.mosaic.backward_common import BackwardTuning  # noqa: E402
from pallas_kernels.types import Config, Layouts, Masks, TransposedLayout  # noqa: E402
from sagebwd_jax import (dot_product_attention, full_precision_attention,  # noqa: E402
                         implementations, metrics)
from sagebwd_jax.reference import ReferenceBackend  # noqa: E402
from sagebwd_jax.sagebwd import prepass, quantize  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", os.environ["JAX_NUMPY_RANK_PROMOTION"])

BACKENDS = ["reference"]


def pytest_configure(config):
  """One persistent compilation cache for the whole run, removed after it.

  Compiling, not running, takes most of the suite's time on the CPU, and the
  tests (and the training runs they start as subprocesses) compile many of
  the same programs. The process that runs pytest makes the cache; its xdist
  workers, started after this hook, and every subprocess inherit the
  variables. A cache the caller named is left alone.
  """
  if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  cache = tempfile.mkdtemp(prefix="sagebwd-jax-tests-")
  config.add_cleanup(functools.partial(shutil.rmtree, cache, ignore_errors=True))
  for name, value in (("JAX_COMPILATION_CACHE_DIR", cache),
                      ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.0),
                      ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", 0)):
    os.environ[name] = str(value)
    jax.config.update(name.lower(), value)  # this process has read the variables


def _cpu_converts_float16() -> bool:
  """Whether XLA's CPU code here converts float16. Under `XLA_FLAGS=
  --xla_cpu_max_isa=SSE4_2` (the instruction set a run can be limited to, to
  see which results depend on it) XLA calls compiler-rt's `__extendhfsf2`
  for the conversion and cannot link it, so nothing in float16 runs, nor
  the FP8 mode, whose E4M3 values pass through float16."""
  try:
    x = jax.device_put(np.ones(2, np.float16))
    jax.jit(lambda x: x.astype(jnp.float32))(x).block_until_ready()
  except jax.errors.JaxRuntimeError as e:
    if "Failed to materialize symbols" in str(e):
      return False
    raise
  return True


# The tests that need float16 conversions, by their names and parameters.
FLOAT16_TESTS = re.compile(r"float16|fp16|fp8")


def pytest_collection_modifyitems(config, items):
  """Tests marked `@pytest.mark.gpu` only run where JAX's default backend is a
  GPU; float16 and FP8 tests only where the CPU code can convert float16."""
  del config
  if jax.default_backend() == "gpu":
    return
  skip_gpu = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
  skip_float16 = None if _cpu_converts_float16() else pytest.mark.skip(
      reason="XLA's CPU code here cannot convert float16 (__extendhfsf2 not linked; "
             "XLA_FLAGS --xla_cpu_max_isa?)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
    elif skip_float16 is not None and FLOAT16_TESTS.search(item.nodeid):
      item.add_marker(skip_float16)


@pytest.fixture
def x64():
  """fp64 enabled for the duration of a test (restored afterwards)."""
  with jax.enable_x64(True):
    yield


def resampled(x, t, seed):
  """x (B, T, ...) with the tokens at positions >= t drawn again."""
  fresh = jax.random.normal(jax.random.key(seed), x.shape, jnp.float32).astype(x.dtype)
  return x.at[:, t:].set(fresh[:, t:])


def gaussian_qkv(key, B, Tq, Tk, H, Hkv, D, sigma=1.0, dtype=jnp.bfloat16):
  """q, k ~ N(0, sigma^2); v, do ~ N(0, 1). Shapes (B, T, H, D); `do` like q.

  With B=None the arrays are unbatched (T, H, D).
  """
  kq, kk, kv, kd = jax.random.split(key, 4)
  lead = () if B is None else (B,)
  q = sigma * jax.random.normal(kq, (*lead, Tq, H, D), jnp.float32)
  k = sigma * jax.random.normal(kk, (*lead, Tk, Hkv, D), jnp.float32)
  v = jax.random.normal(kv, (*lead, Tk, Hkv, D), jnp.float32)
  do = jax.random.normal(kd, (*lead, Tq, H, D), jnp.float32)
  return tuple(x.astype(dtype) for x in (q, k, v, do))


def value_and_grads(fn, q, k, v, do):
  """O = fn(q, k, v) and grads of sum(O * dO) w.r.t. q, k, v (via the VJP)."""
  o, vjp = jax.vjp(fn, q, k, v)
  return o, vjp(do.astype(o.dtype))


@functools.partial(jax.jit, static_argnames=("kwargs_items",))
def _sage_jit(q, k, v, do, arrays, kwargs_items):
  kwargs = dict(kwargs_items)
  fn = lambda q, k, v: dot_product_attention(q, k, v, **kwargs, **arrays)
  return value_and_grads(fn, q, k, v, do)


def _split_kwargs(kwargs):
  """Array-valued keyword arguments are traced; the rest (backend objects
too) are static."""
  arrays, static = {}, {}
  for name, value in kwargs.items():
    if value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, tuple) and all(isinstance(x, int) for x in value)) or (
        dataclasses.is_dataclass(value)):
      static[name] = value
    else:
      arrays[name] = value
  return arrays, tuple(sorted(static.items()))


def sage(q, k, v, do, **kwargs):
  """Jitted SageBwd: (O, (dQ, dK, dV)). kwargs go to `dot_product_attention`."""
  arrays, static = _split_kwargs(kwargs)
  return _sage_jit(q, k, v, do, arrays, static)


@functools.partial(jax.jit, static_argnames=("kwargs_items",))
def _oracle_jit(q, k, v, do, arrays, kwargs_items):
  kwargs = dict(kwargs_items)
  fn = lambda q, k, v: full_precision_attention(q, k, v, **kwargs, **arrays)
  return value_and_grads(fn, q, k, v, do)


def oracle(q, k, v, do, **kwargs):
  """Full-precision attention and its exact grads, computed in fp32 from the
  same (possibly bf16) input values. Use `oracle64` for the fp64 version."""
  arrays, static = _split_kwargs(kwargs)
  up = lambda x: x.astype(jnp.float32)
  return _oracle_jit(up(q), up(k), up(v), up(do), arrays, static)


def oracle64(q, k, v, do, **kwargs):
  """`oracle` in fp64 (enables x64 for the call only); returns numpy arrays."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  arrays, static = _split_kwargs(kwargs)
  with jax.enable_x64(True):
    arrays = {n: jnp.asarray(np.asarray(a)) for n, a in arrays.items()}
    o, grads = _oracle_jit(*(jnp.asarray(x) for x in (q, k, v, do)), arrays, static)
    assert o.dtype == jnp.float64
    return np.asarray(o), tuple(np.asarray(g) for g in grads)


# The transposed layouts the Mosaic kernels read, both directions (types.Layouts).
MOSAIC_LAYOUTS = Layouts(TransposedLayout.REGISTER_B, TransposedLayout.REGISTER_B)
# The Mosaic forward's GPU cases, either quantization: (batch, Tq, Tk, heads,
# kv_heads, head_dim, causal): GQA, MHA, MQA, one step per ring slot, more
# steps than slots, Tq not a whole CTA tile.
MOSAIC_FORWARD_CASES = [
    (1, 256, 256, 2, 1, 128, False),
    (1, 256, 256, 2, 1, 128, True),
    (1, 256, 256, 2, 2, 64, False),
    (1, 256, 256, 2, 2, 64, True),
    (2, 1024, 1024, 4, 2, 128, True),
    (2, 1024, 1024, 4, 1, 64, False),
    (2, 1024, 1024, 4, 1, 64, True),
    (2, 192, 512, 4, 2, 128, False),
    (1, 2048, 2048, 2, 2, 128, False),
]


# The Mosaic forward's causal_exact GPU cases, either quantization: (batch,
# seq, heads, kv_heads, head_dim, causal): GQA, MHA, MQA, one step per ring
# slot and more steps than slots, the mean term alone (not causal).
MOSAIC_EXACT_CASES = [
    (1, 256, 2, 1, 64, True),
    (1, 256, 2, 2, 128, True),
    (2, 1024, 4, 2, 128, True),
    (2, 1024, 4, 1, 64, True),
    (1, 512, 2, 2, 64, False),
]


# The Mosaic backward's GPU cases, either quantization: (batch, seq, heads,
# kv_heads, head_dim, causal): GQA, MQA and MHA, both head dims, causal CTAs
# whose warpgroups skip blocks the other one needs.
MOSAIC_BACKWARD_CASES = [
    (1, 256, 2, 1, 128, False),
    (1, 256, 2, 1, 64, True),
    (1, 384, 2, 2, 64, True),
    (2, 1024, 4, 2, 128, False),
    (2, 1024, 4, 2, 128, True),
    (2, 1024, 4, 1, 64, True),
    (1, 2048, 2, 2, 128, True),
]


# The Mosaic FP8 backward's schedules the tests run (tests/test_fp8.py,
# tests/test_mosaic_backward.py).
FP8_TUNINGS = {"default": BackwardTuning(),
               "no_schedule_barrier": BackwardTuning(schedule_barrier=False),
               "pipelined": BackwardTuning(pipelined=True, schedule_barrier=False),
               "pingpong": BackwardTuning(pipelined=True),
               "overlap": BackwardTuning(pipelined=True, overlap=True),
               "overlap_turns": BackwardTuning(pipelined=True, overlap=True,
                                               schedule_barrier=False, issue_turns=True)}


def mosaic_config(head_dim: int, causal: bool, **overrides) -> Config:
  """A kernel Config the Mosaic GPU kernels take (64 x 64 blocks, no Q-smoothing)."""
  return kernel_config(**{**dict(scale=head_dim**-0.5, causal=causal), **overrides})


def kernel_config(**overrides) -> Config:
  """A kernel Config: scale 1/8, not causal, no Q-smoothing, 64 x 64 blocks."""
  return Config(**{**dict(scale=0.125, causal=False, smooth_q=False, block_q=64,
                          block_kv=64), **overrides})


def backward_stage(backend, qkv, v, o, lse, do, masks, config):
  """One backend's pre-pass and backward, as the op wires them
  (`sagebwd.prepass`; without the op's saturated-rows Delta): dQ, dK, dV."""
  return backend.backward(qkv, v, lse, do, prepass(qkv, o, do, config, backend), masks, config)


def check_quantization_pass(backend, reference, head_dim: int, smooth_q: bool,
                            smooth_k: bool, *, sum_atol: float = 0.0,
                            ds_precision: str = "int8", layouts=None,
                            quantization: str = "int8", for_backward: bool = True,
                            shape: tuple[int, ...] = (2, 128, 192, 4, 2)):
  """`backend.quantize` forms `reference.quantize`'s tensors, each transposed
  one in its `layouts` (types.Layouts; default TOKENS): int8 (and E4M3)
  equal, scales and means to fp32 rounding (`sum_atol` times the largest:
  for kernels that add the Q-smoothing means in another order).
  `ds_precision="bf16"` quantizes Q per token. The reference runs on the
  CPU: XLA:GPU divides fp32 to within an ulp, not correctly rounded (127 /
  amax differs in many values on the H200: docs/performance-log.md), which
  moves int8 values by one. `shape`: (B, Tq, Tk, H, Hkv). Returns (ours,
  ref)."""
  from sagebwd_jax.sagebwd import key_mean
  layouts = Layouts() if layouts is None else layouts
  q, k, v, _ = gaussian_qkv(jax.random.key(0), *shape, head_dim, sigma=2.0)
  config = kernel_config(smooth_q=smooth_q, scale=head_dim**-0.5, ds_precision=ds_precision,
                         quantization=quantization)
  k_mean = key_mean(k, None) if smooth_k else None
  ours = backend.quantize(q, k, v, k_mean, config, for_backward=for_backward, layouts=layouts)
  ref = reference.quantize(*jax.device_put((q, k, v, k_mean), CPU), config,
                           for_backward=for_backward, layouts=layouts)
  # v_start, the portable forward's accumulator start, and fp8_keys, the FP8
  # backward's key side, are the Triton pass's own; with the key side it
  # writes no K8^T (the reference forms it: XLA drops it unread).
  if ours.fp8_keys is not None:
    ref = ref._replace(k8_t=None)
  for name, a, b in zip(ours._fields, ours._replace(v_start=None, fp8_keys=None), ref):
    assert (a is None) == (b is None), name
    if a is None:
      continue
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, name
    if a.dtype.itemsize == 1:  # int8 or E4M3: on the bits
      np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    else:
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=sum_atol * np.abs(b).max(),
                                 err_msg=name)
  return ours, ref


# XLA ops that move data into another layout; the quantization pass and the
# pre-pass write every layout the kernels read (types.Layouts).
LAYOUT_PASSES = frozenset({"transpose", "pad", "gather", "concatenate"})
_KERNELS = frozenset({"pallas_call", "mpmd_map"})  # primitives that hold a kernel's body


def layout_passes(jaxpr) -> set[str]:
  """The LAYOUT_PASSES in a jaxpr and the jaxprs it calls, kernels' bodies aside."""
  from jax.extend.core import Jaxpr
  found = set()

  def walk(value):
    if isinstance(value, (tuple, list)):
      for x in value:
        walk(x)
    elif isinstance(value, Jaxpr):
      for eqn in getattr(value, "jaxpr", value).eqns:
        found.update({eqn.primitive.name} & LAYOUT_PASSES)
        if eqn.primitive.name not in _KERNELS:
          walk(list(eqn.params.values()))

  walk(jaxpr)
  return found


def assert_lowers_to_mosaic_gpu(fn, *args):
  """`fn` lowers for CUDA without a GPU, to a Mosaic GPU custom call, with no
  XLA layout pass (LAYOUT_PASSES) before or after its kernels."""
  traced = jax.jit(fn).trace(*args)
  assert not layout_passes(traced.jaxpr)
  assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def rel_l2(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def cosine(x, ref) -> float:
  x, ref = np.asarray(x, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
  return float(np.dot(x, ref) / (np.linalg.norm(x) * np.linalg.norm(ref)))


CPU = jax.devices("cpu")[0]

# The reference's passes in the layouts the Mosaic kernels read: what the op's
# quantization stage hands the Mosaic forward, its `Config.causal_exact`
# operands (the first key block's mean m, 16-bit Q, K, V) included.
MOSAIC_PASSES = MosaicBackend(ReferenceBackend(), fp8_fallback=ReferenceBackend())


def channel_biased_qkv(key, batch, seq, heads, kv_heads, head_dim):
  """`gaussian_qkv`'s q, k, v (sigma 2) with K shifted by a channel bias of 3x
  its spread per key/value head, so the mean term carries weight."""
  q, k, v, _ = gaussian_qkv(key, batch, seq, seq, heads, kv_heads, head_dim, sigma=2.0)
  bias = 6.0 * jax.random.normal(jax.random.fold_in(key, 1), (1, 1, kv_heads, head_dim))
  return q, (k + bias).astype(k.dtype), v


def mosaic_exact_case(q, k, v, config: Config):
  """q, k, v quantized on the CPU as the op's quantization stage does with
  `Config.causal_exact` (K-smoothing on) for the Mosaic forward, and the
  reference's forward of them with the Mosaic numerics: (qkv, (O, lse, the
  FP8 mode's row maxima or None))."""
  with jax.default_device(CPU):
    q, k, v = jax.device_put((q, k, v), CPU)
    qkv = quantize(q, k, v, Masks(), config, MOSAIC_PASSES, True, False)
    return qkv, ReferenceBackend(MOSAIC_NUMERICS).forward(qkv, Masks(), config, jnp.bfloat16)


# Op-level cases every kernel backend is checked on against the CPU reference.
KERNEL_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "gqa_causal": dict(is_causal=True, heads=(4, 2)),
    "mqa": dict(heads=(4, 1)),
    "ragged": dict(is_causal=True, lengths=(100, 75)),
    "cross_ragged": dict(lengths=(70, 150)),
    "seq_lengths": dict(query_seq_lengths=(40, 128), key_value_seq_lengths=(10, 128)),
    "segments": dict(is_causal=True, segments=True),
    "smooth_q": dict(smooth_q=True, is_causal=True),
    "no_smooth_k": dict(smooth_k=False),
    "d128": dict(head_dim=128, is_causal=True),
    "window": dict(local_window_size=(50, 20)),
}


def run_case(case: str, implementation, *, dtype=jnp.bfloat16):
  opts = dict(KERNEL_CASES[case])
  heads, kv_heads = opts.pop("heads", (2, 2))
  q_len, kv_len = opts.pop("lengths", (128, 128))
  head_dim = opts.pop("head_dim", 64)
  q, k, v, do = gaussian_qkv(jax.random.key(7), 2, q_len, kv_len, heads, kv_heads, head_dim,
                             dtype=dtype)
  kwargs = dict(opts)
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in kwargs:
      kwargs[name] = jnp.array(kwargs[name])
  if kwargs.pop("segments", False):
    kwargs["segment_ids"] = jnp.stack([jnp.arange(q_len) // 48, jnp.arange(q_len) // 80])
  fn = lambda q, k, v: dot_product_attention(q, k, v, implementation=implementation,
                                             **kwargs)
  o, grads = jax.jit(functools.partial(value_and_grads, fn))(q, k, v, do)
  return (o, *grads)


def backend_tolerance(x) -> float:
  """Relative L2 allowed between two backends: rare int8 rounding flips from
  differently ordered fp32 sums, plus bf16's own rounding of the result."""
  return 1e-3 + 4e-3 * (x.dtype == jnp.bfloat16)


def check_against_reference(case: str, implementation: str, kernels=None):
  """The op with `implementation` on `case` against the CPU reference with
  the numerics that `kernels` (default: the backend the op runs for
  `implementation`) declares for each call (`Backend.reference_numerics`)."""
  ours = run_case(case, implementation)
  if kernels is None:
    kernels = implementations.backend(implementation, KERNEL_CASES[case].get("is_causal", False))
  with jax.default_device(CPU):  # the exact oracle is the CPU reference
    ref = run_case(case, ReferenceBackend(kernels))
  for name, a, b in zip(("O", "dQ", "dK", "dV"), ours, ref):
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name
    assert float(metrics.relative_l2(a, b)) <= backend_tolerance(a), name
