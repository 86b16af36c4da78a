"""Running the Triton kernels in Triton's interpreter, on the CPU, from numpy
buffers: the same kernel source as on the GPU, no torch.

The interpreter (`triton.runtime.interpreter`, what TRITON_INTERPRET=1 turns
on) executes a kernel's Python body program by program with numpy, reading
and writing memory through raw pointers. Triton 3.6's needs a few things to
run these kernels in a process that imported triton without that variable,
all confined to `run` and `device_function`:
- the kernels' helpers are `DeviceFunction`s, which the interpreter can call;
- triton.language's own jit functions (tl.max, tl.sum) are swapped for their
  interpreted form during a launch, as the variable would have made them;
- its tensors' int() works under numpy versions that refuse int() of an
  array with a dimension (a scalar is a one-element array there), as in
  later Triton;
- its fp32 -> float8e4nv conversion truncates subnormals and rounds ties
  away from zero; a launch converts as the GPU's cvt.rn.satfinite does
  (to nearest even, saturated at +-448, NaN kept), which ml_dtypes' cast of
  the clamped value is;
- it keeps its state in module globals, so launches are serialised by a lock
  (XLA may run independent callbacks on several threads).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import ml_dtypes
import numpy as np
import triton
import triton.language as tl

from pallas_kernels import numerics as nm

# Triton's names for the dtypes the kernels read and write here (16-bit floats
# travel as fp32: launch.py says why).
_TRITON_DTYPES = {
    np.dtype(np.int8): "i8", np.dtype(np.int32): "i32", np.dtype(np.float32): "fp32",
    np.dtype(ml_dtypes.float8_e4m3fn): "fp8e4nv",
}
_LOCK = threading.Lock()


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


def run(kernel: triton.JITFunction, grid: tuple[int, ...], constants: dict,
        out_shapes, *args: np.ndarray) -> list[np.ndarray]:
  """Runs `kernel` on `grid` over numpy inputs `args` and fresh zeroed outputs
  of `out_shapes` (shapes and dtypes), which it returns."""
  from triton.runtime.interpreter import InterpretedFunction
  outs = [np.zeros(s.shape, s.dtype) for s in out_shapes]
  buffers = [_HostArray(np.ascontiguousarray(x)) for x in args] + [_HostArray(y) for y in outs]
  with _LOCK, _interpreter_fixes():
    InterpretedFunction(kernel.fn)[grid](*buffers, **constants)
  return outs


@contextlib.contextmanager
def _interpreter_fixes():
  """The module docstring's second to fourth points, for one launch."""
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
  fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

  def fp_to_fp_as_the_gpu(builder, src, dst_type, rounding_mode):
    if (dst_type.scalar != tl.float8e4nv or src.dtype.scalar != tl.float32
        or rounding_mode != interpreter._ir.ROUNDING_MODE.RTNE):
      return fp_to_fp(builder, src, dst_type, rounding_mode)
    e4m3 = np.clip(src.data, -nm.E4M3_MAX, nm.E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return interpreter.TensorHandle(e4m3.view(np.uint8), tl.float8e4nv)

  interpreter.InterpreterBuilder.create_fp_to_fp = fp_to_fp_as_the_gpu
  # A launch patches the language module its kernel names (`tl`); the
  # standard library's bodies name triton.language.core, patched here once.
  core_scope = interpreter._patch_lang(tl.standard.zeros.fn)
  try:
    yield
  finally:
    core_scope.restore()
    interpreter.InterpreterBuilder.create_fp_to_fp = fp_to_fp
    interpreter._patch_lang_tensor = patch_tensor
    for module, name, value in jitted:
      setattr(module, name, value)


_INTERPRETED: dict = {}
