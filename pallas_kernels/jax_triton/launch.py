"""How the Triton kernels run: compiled on a GPU through `jax_triton.triton_call`,
or on the CPU through Triton's own interpreter, from the same kernel source.

The interpreter (`triton.runtime.interpreter`, what TRITON_INTERPRET=1 turns
on) executes a kernel's Python body program by program with numpy, reading
and writing memory through raw pointers. It is reached here through
`jax.pure_callback`: the host function wraps each numpy buffer in `_HostArray`
(the few methods of a torch tensor the interpreter calls), so no torch is
needed. Two adjustments keep its arithmetic the GPU's:
- numpy has no bfloat16, and the interpreter's `tl.dot` multiplies bfloat16
  operands as their raw bit patterns, so 16-bit float inputs travel to it as
  fp32 (exact) and 16-bit float outputs come back as fp32 and are rounded by
  XLA (to nearest even, as the kernel's own store would).
- it keeps its state in module globals, so launches are serialised by a lock
  (XLA may run independent callbacks on several threads).

`triton_call` has no batching rule, so every launch is wrapped in a
`custom_vmap` that folds a mapped axis into the batch axis, which leads every
argument and output of these kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

# Triton's names for the dtypes the kernels read and write.
_TRITON_DTYPES = {
    np.dtype(np.int8): "i8", np.dtype(np.int32): "i32", np.dtype(np.float32): "fp32",
}
_SIXTEEN_BIT_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_INTERPRETER_LOCK = threading.Lock()


class _InterpretedCall:
  """A jit function as an interpreted kernel calls it: its body as rewritten by
  the interpreter (InterpretedFunction's own call would patch
  triton.language again on every call, which the launch has already done)."""

  def __init__(self, fn: Callable):
    self.fn = fn

  @functools.cached_property
  def _body(self) -> Callable:
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(self.fn).rewrite()

  def __call__(self, *args, **kwargs):
    return self._body(*args, **kwargs)


class DeviceFunction(triton.JITFunction):
  """A `@triton.jit` helper that kernels call, compiled or interpreted.

  Compiled, Triton inlines it like any jit function. The interpreter instead
  calls the object, which a plain JITFunction refuses outside a kernel; this
  one runs its body through the interpreter.
  """

  @functools.cached_property
  def _interpreted(self) -> _InterpretedCall:
    return _InterpretedCall(self.fn)

  def __call__(self, *args, **kwargs):
    return self._interpreted(*args, **kwargs)


def device_function(fn: Callable) -> DeviceFunction:
  """Decorator for the helpers the kernels share (see DeviceFunction)."""
  return DeviceFunction(fn)


class _HostArray:
  """A numpy buffer as the interpreter sees a tensor: an address and a Triton
  dtype, and the storage methods it calls to stage tensors on the host (a
  no-op here: the buffer already is on the host)."""

  def __init__(self, array: np.ndarray):
    self.array = array
    self.dtype = _TRITON_DTYPES[array.dtype]

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  def untyped_storage(self) -> "_HostArray":
    return self

  def cpu(self) -> "_HostArray":
    return self

  def new_empty(self, *args, **kwargs) -> "_HostArray":
    del args, kwargs
    return self

  def set_(self, *args) -> "_HostArray":
    del args
    return self

  def storage_offset(self) -> int:
    return 0

  def size(self) -> tuple[int, ...]:
    return self.array.shape

  def stride(self) -> tuple[int, ...]:
    return tuple(s // self.array.itemsize for s in self.array.strides)

  def copy_(self, other) -> None:
    del other


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """How kernels are launched (does not change results). `interpret` runs them
  in Triton's interpreter on the CPU instead of compiling them for the GPU."""

  interpret: bool = False
  num_warps: int = 4
  num_stages: int = 2

  def call(self, kernel: triton.JITFunction, args: Sequence[jax.Array],
           out_shape: Sequence[jax.ShapeDtypeStruct], *, grid: tuple[int, ...], name: str,
           **constants) -> list[jax.Array]:
    """Launches `kernel` on `grid` with pointers to `args` then to fresh outputs
    of `out_shape`, and `constants` as its constexpr keyword arguments."""
    if not self.interpret:
      import jax_triton
      outs = jax_triton.triton_call(
          *args, kernel=kernel, out_shape=list(out_shape), grid=grid, name=name,
          num_warps=self.num_warps, num_stages=self.num_stages, **constants)
      return list(outs)
    widened = [jnp.float32 if s.dtype in _SIXTEEN_BIT_FLOATS else s.dtype for s in out_shape]
    host_shapes = [jax.ShapeDtypeStruct(s.shape, d) for s, d in zip(out_shape, widened)]
    args = [x.astype(jnp.float32) if x.dtype in _SIXTEEN_BIT_FLOATS else x for x in args]
    run = functools.partial(_interpret, kernel, grid, constants, host_shapes)
    outs = jax.pure_callback(run, host_shapes, *args)
    return [y.astype(s.dtype) for y, s in zip(outs, out_shape)]


def _interpret(kernel: triton.JITFunction, grid: tuple[int, ...], constants: dict,
               out_shapes: Sequence[jax.ShapeDtypeStruct], *args: np.ndarray
               ) -> list[np.ndarray]:
  from triton.runtime.interpreter import InterpretedFunction
  outs = [np.zeros(s.shape, s.dtype) for s in out_shapes]
  buffers = [_HostArray(np.ascontiguousarray(x)) for x in args] + [_HostArray(y) for y in outs]
  with _INTERPRETER_LOCK, _interpreter_fixes():
    InterpretedFunction(kernel.fn)[grid](*buffers, **constants)
  return outs


@contextlib.contextmanager
def _interpreter_fixes():
  """What Triton 3.6's interpreter needs to run these kernels here, for the
  duration of a launch:
  - triton.language's own jit functions (tl.max, tl.sum, their combine
    functions) in the interpreter's form, which TRITON_INTERPRET=1 gives them
    only when set before triton is imported;
  - scalars (one-element arrays) usable as loop bounds under numpy >= 2.5,
    which refuses int() of an array with a dimension (as later Triton does).
  """
  # gluon, which the interpreter imports on first use, checks on import that
  # these functions are Triton's jit functions.
  import triton.experimental.gluon  # noqa: F401
  from triton.runtime import interpreter
  jitted = [(module, name, value) for module in (tl, tl.standard, tl.core, tl.math)
            for name, value in vars(module).items() if type(value) is triton.JITFunction]
  patch_tensor = interpreter._patch_lang_tensor

  def patch_tensor_with_scalar_index(tensor, scope):
    patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

  for module, name, value in jitted:
    setattr(module, name, _INTERPRETED.setdefault(value, _InterpretedCall(value.fn)))
  interpreter._patch_lang_tensor = patch_tensor_with_scalar_index
  # A launch patches the language module its kernel names (`tl`); the
  # standard library's bodies name triton.language.core, patched here once.
  core_scope = interpreter._patch_lang(tl.standard.zeros.fn)
  try:
    yield
  finally:
    core_scope.restore()
    interpreter._patch_lang_tensor = patch_tensor
    for module, name, value in jitted:
      setattr(module, name, value)


_INTERPRETED: dict = {}


def batch_folded(fn: Callable) -> Callable:
  """`fn` (arrays, or None, in; a tuple of arrays out; every array with the
  batch axis first) under `jax.vmap`: the mapped axis is folded into the batch
  axis and `fn` runs once on the merged batch."""
  folded = jax.custom_batching.custom_vmap(fn)

  @folded.def_vmap
  def _rule(axis_size: int, in_batched, *args):
    args = jax.tree.map(
        lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)),
        args, tuple(in_batched))
    outs = folded(*jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), args))
    outs = jax.tree.map(lambda y: y.reshape(axis_size, -1, *y.shape[1:]), outs)
    return outs, jax.tree.map(lambda _: True, outs)

  return folded


def placeholder(x: jax.Array | None, dtype) -> jax.Array:
  """`x`, or a one-element stand-in for an optional input the kernel does not
  read (it takes pointers to every argument)."""
  return jnp.zeros((1,), dtype) if x is None else x
