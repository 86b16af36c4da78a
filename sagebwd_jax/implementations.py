"""Which implementation runs a call: the names `implementation=` takes, the
default for the device computations go to, and the backend object of each.

`api.dot_product_attention` resolves its `implementation` argument here and
tries the backends in order; what the op needs to know of the machine
(platform, Hopper or not, whether the Triton packages import) it asks here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax

from pallas_kernels.mosaic.backend import MosaicBackend
from pallas_kernels.types import Backend
from sagebwd_jax.reference import ReferenceBackend

Implementation = Literal["triton", "mosaic", "reference", "cudnn", "xla"]
SAGE = ("triton", "mosaic", "reference")
KERNELS = ("triton", "mosaic")
FULL_PRECISION = ("cudnn", "xla")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve(implementation, quantization: str = "int8",
            causal_exact: bool = False) -> tuple[str | Backend, ...]:
  """`implementation` as the names (or backend objects) to try, in order.

  The default with quantization="int8_fp8": the Hopper backend (its FP8
  forward) on an H100/H200, the reference elsewhere: no Triton kernel has
  FP8 products yet. With causal_exact: the reference, until the kernels'
  causal_exact (the Triton and the Hopper backends') is timed on a GPU."""
  if implementation is None:
    if not on_gpu() or causal_exact:
      return ("reference",)
    if quantization == "int8_fp8":
      return ("mosaic", "reference") if hopper() else ("reference",)
    return ("mosaic", "triton") if hopper() else ("triton",)
  names = ((implementation,) if isinstance(implementation, str) or is_backend(implementation)
           else tuple(implementation) if isinstance(implementation, Sequence) else None)
  known = SAGE + FULL_PRECISION
  if not names or any(not is_backend(name) and name not in known for name in names):
    # The same kernels were once lowered through Pallas' (deprecated) Triton backend.
    hint = "; 'pallas' is now 'triton'" if names and "pallas" in names else ""
    raise ValueError(f"implementation must be one of {known}, a backend object, a "
                     f"non-empty sequence of these, or None; got {implementation!r}{hint}")
  return names


def backend(implementation: str, causal: bool) -> Backend:
  """The SageBwd backend of one name; NotImplementedError where it cannot run
  here."""
  if implementation == "reference":
    return ReferenceBackend()
  if implementation == "triton":
    return _triton_backend(causal)
  if implementation == "mosaic":
    if not (on_gpu() and hopper()):
      device = _device()
      where = (f"{device.device_kind} has compute capability "
               f"{getattr(device, 'compute_capability', None)}" if on_gpu()
               else f"computations go to {platform()}")
      raise NotImplementedError(
          f"implementation='mosaic' needs an NVIDIA Hopper GPU (compute capability 9.0); "
          f"{where}. Use implementation='triton' (Triton's interpreter without a GPU).")
    # FP8 products: the Mosaic kernels with the Triton passes around them,
    # the reference where they do not run (no Triton attention kernel has them).
    return MosaicBackend(_triton_backend(causal), fp8_fallback=ReferenceBackend())
  raise ValueError(f"implementation must be one of {SAGE} or None; got {implementation!r}")


def _triton_backend(causal: bool) -> Backend:
  """The Triton kernels, compiled through jax_triton on a GPU, interpreted by
  Triton without one; NotImplementedError where the packages are missing
  (the Hopper backend's quantization pass and fallback are these too)."""
  gpu = on_gpu()
  try:
    from pallas_kernels.jax_triton.backend import TritonBackend
    if gpu:
      import jax_triton  # noqa: F401  (only whether it imports)
  except ImportError as e:
    needs = "triton and jax-triton (pip install 'sagebwd-jax[gpu]')" if gpu else "triton"
    raise NotImplementedError(f"the Triton kernels need the packages {needs}: {e}") from e
  return TritonBackend.tuned(causal=causal, interpret=not gpu)


def is_backend(x) -> bool:
  """Whether `x` is a backend object (`types.Backend`: its stages' methods)."""
  return not isinstance(x, (str, type)) and all(
      callable(getattr(x, method, None))
      for method in ("layouts", "reference_numerics", "quantize", "forward", "prepass",
                     "backward"))


def has_causal_exact(backend: Backend) -> bool:
  """Whether a backend computes `Config.causal_exact`'s statistics (the
  first key block's K mean, 16-bit edge tiles): the reference, the Triton
  kernels, and the Hopper (Mosaic) backend where its fallbacks do (they run
  what its kernels do not)."""
  if isinstance(backend, ReferenceBackend):
    return True
  if isinstance(backend, MosaicBackend):
    return all(has_causal_exact(fallback) for fallback in (backend.fallback,
                                                           backend.fp8_fallback)
               if fallback is not None)
  try:
    from pallas_kernels.jax_triton.backend import TritonBackend
  except ImportError:  # without triton no backend object is a TritonBackend
    return False
  return isinstance(backend, TritonBackend)


def runs_kernels(name: str | Backend) -> bool:
  """Whether an implementation (a name or a backend object) runs GPU kernels."""
  if isinstance(name, str):
    return name in KERNELS
  return not isinstance(name, ReferenceBackend)


def label(name: str | Backend) -> str:
  return name if isinstance(name, str) else type(name).__name__


def check_no_auto_sharding(names: tuple[str | Backend, ...], *arrays: jax.Array) -> None:
  """The kernels run only where every mesh axis is manual: inside
  `shard_map`. Refuses, with what to do, the cases visible at trace time:
  an explicit mesh in context, or concrete arrays spread over devices."""
  first = names[0]
  if not runs_kernels(first):
    return
  mesh = jax.sharding.get_abstract_mesh()
  automatic = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind != jax.sharding.AxisType.Manual and mesh.shape[name] > 1]
  spread = any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               and len(x.sharding.device_set) > 1 for x in arrays)
  if automatic or spread:
    kind = ({"triton": "Triton", "mosaic": "Mosaic GPU"}[first] if isinstance(first, str)
            else label(first))
    where = (f"mesh axes {tuple(automatic)} are not manual" if automatic
             else "the inputs are spread over several devices")
    raise ValueError(
        f"implementation={label(first)!r} runs {kind} kernels, which cannot be partitioned "
        f"automatically, and {where}. Run the op under jax.shard_map: "
        "sagebwd_jax.sharding.sharded_attention(mesh, q, k, v, ...) or "
        "shard_attention(dot_product_attention, mesh) does it for you.")


def platform() -> str:
  """Where computations go now: honours `jax.default_device(...)` contexts."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  return device if isinstance(device, str) else device.platform


def on_gpu() -> bool:
  return platform() in GPU_PLATFORMS


def hopper() -> bool:
  return getattr(_device(), "compute_capability", None) == "9.0"


def _device() -> jax.Device:
  device = jax.config.jax_default_device
  return device if isinstance(device, jax.Device) else jax.devices()[0]
