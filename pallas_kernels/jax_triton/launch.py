"""How the Triton kernels are launched: compiled on a GPU through
`jax_triton.triton_call`, or on the CPU in Triton's interpreter
(interpreter.py) through `jax.pure_callback`, from the same kernel source.

numpy has no bfloat16, and the interpreter's `tl.dot` multiplies bfloat16
operands as their raw bit patterns, so 16-bit float inputs travel to it as
fp32 (exact) and 16-bit float outputs come back as fp32 and are rounded by
XLA (to nearest even, as the kernel's own store would).

`triton_call` has no batching rule, so every launch is wrapped in
`batching.batch_folded`: the batch axis leads every argument and output of
these kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import triton

from pallas_kernels.jax_triton import interpreter

_SIXTEEN_BIT_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# A program's shared memory (CUDA's opt-in limit per block) by compute
# capability, as CUDA's programming guide lists it (the H200 names its 232448
# when a launch asks for more).
SHARED_MEMORY = {"7.0": 98304, "7.5": 65536, "8.0": 166912, "8.6": 101376, "8.7": 166912,
                 "8.9": 101376, "9.0": 232448, "10.0": 232448, "12.0": 101376}
HOPPER_SHARED_MEMORY = SHARED_MEMORY["9.0"]
# Beyond the pipelined tiles, Triton's own scratch (layout conversions,
# reductions): within 1 KB of the tiles' bytes in every kernel here.
SHARED_MEMORY_SLACK = 4096


@functools.cache
def shared_memory_limit() -> int:
  """Bytes of shared memory a program may take on device 0; Hopper's without
  a GPU (the CPU's compile checks, tests and benchmarks.sass, target it); the
  smallest listed for a GPU not listed."""
  if jax.default_backend() != "gpu":
    return HOPPER_SHARED_MEMORY
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return SHARED_MEMORY.get(capability, min(SHARED_MEMORY.values()))


@functools.cache
def _specializer_without_torch() -> None:
  """Initializes Triton's native argument specializer with torch hidden.

  jax_triton specializes every kernel's arguments at lowering with Triton's
  `native_specialize_impl`, whose first call in a process imports torch
  where it is installed, only to give torch.Tensor a fast path (a tensor
  still specializes through its `data_ptr` without it). A JAX program passes
  no torch tensors, and that import was most of the op's first Triton
  lowering on the H200 (docs/performance-log.md, 2026-12-02, one-hot rows:
  "Compile time (issue 32): where the op's fixed cost goes now"). Where
  torch is already imported, nothing changes.
  """
  if "torch" in sys.modules:
    return
  try:
    from triton._C.libtriton import native_specialize_impl
  except ImportError:  # a Triton that specializes otherwise: nothing to prepare
    return
  sys.modules["torch"] = None  # `import torch` fails; the specializer goes on without
  try:
    native_specialize_impl(None, 1, False, False, False)  # an int needs no backend
  finally:
    del sys.modules["torch"]


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """How kernels are launched (does not change results). `interpret` runs them
  in Triton's interpreter on the CPU instead of compiling them for the GPU.
  `tile_rows`: output rows per program (queries, or dK/dV's keys) where the
  kernel's tile may differ from the quantization block (`tile_rows_for`);
  None keeps the config's block. `convert`: products that can start from
  zero reach fp32 by a conversion instruction, else from a biased start by
  a subtraction (tiles.py says which costs what)."""

  interpret: bool = False
  num_warps: int = 4
  num_stages: int = 2
  tile_rows: int | None = None
  convert: bool = True

  def __post_init__(self):
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps must be a power of two up to 16; got {self.num_warps}")
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be at least 1; got {self.num_stages}")
    if self.tile_rows is not None and (self.tile_rows < 16 or self.tile_rows > 256
                                        or self.tile_rows & (self.tile_rows - 1)):
      raise ValueError(f"tile_rows must be a power of two in 16..256 or None; got "
                       f"{self.tile_rows}")

  def tile_rows_for(self, length: int, block: int, *, free: bool = True) -> int:
    """`tile_rows` where it tiles `length` and the kernel's tile is `free` of
    the quantization block, else `block`. Results do not depend on it: the
    kernels read scales per token."""
    rows = self.tile_rows or block
    return rows if free and length % rows == 0 else block

  def fitted(self, *, fixed_bytes: int, stage_bytes: int) -> "LaunchConfig":
    """This launch with as many of its pipeline stages (at least one) as fit
    in a program's shared memory, for a kernel that keeps `fixed_bytes` there
    and `stage_bytes` per stage (its tiles loaded for one loop step)."""
    if stage_bytes < 1 or fixed_bytes < 0:
      raise ValueError(f"stage_bytes must be positive and fixed_bytes not negative; got "
                       f"{stage_bytes} and {fixed_bytes}")
    room = shared_memory_limit() - SHARED_MEMORY_SLACK - fixed_bytes
    stages = max(1, min(self.num_stages, room // stage_bytes))
    return self if stages == self.num_stages else dataclasses.replace(self, num_stages=stages)

  def call(self, kernel: triton.JITFunction, args: Sequence[jax.Array],
           out_shape: Sequence[jax.ShapeDtypeStruct], *, grid: tuple[int, ...], name: str,
           **constants) -> list[jax.Array]:
    """Launches `kernel` on `grid` with pointers to `args` then to fresh outputs
    of `out_shape`, and `constants` as its constexpr keyword arguments."""
    if not self.interpret:
      import jax_triton
      _specializer_without_torch()
      outs = jax_triton.triton_call(
          *args, kernel=kernel, out_shape=list(out_shape), grid=grid, name=name,
          num_warps=self.num_warps, num_stages=self.num_stages, **constants)
      return list(outs)
    widened = [jnp.float32 if s.dtype in _SIXTEEN_BIT_FLOATS else s.dtype for s in out_shape]
    host_shapes = [jax.ShapeDtypeStruct(s.shape, d) for s, d in zip(out_shape, widened)]
    args = [x.astype(jnp.float32) if x.dtype in _SIXTEEN_BIT_FLOATS else x for x in args]
    run = functools.partial(interpreter.run, kernel, grid, constants, host_shapes)
    outs = jax.pure_callback(run, host_shapes, *args)
    return [y.astype(s.dtype) for y, s in zip(outs, out_shape)]


def placeholder(x: jax.Array | None, dtype) -> jax.Array:
  """`x`, or a one-element stand-in for an optional input the kernel does not
  read (it takes pointers to every argument)."""
  return jnp.zeros((1,), dtype) if x is None else x
