"""The Mosaic GPU kernels' PTX and ptxas report, compiled on a machine
without a GPU, for `benchmarks.sass` to read.

    pip download --no-deps jax-cuda13-pjrt==<jaxlib's version>   # then unzip it
    python -m benchmarks.mosaic_ptx --plugin .../xla_cuda13/xla_cuda_plugin.so \\
        --out dump [--variants mosaic_fp8,mosaic_fp8_overlap] [--forward] [--causal]
        [--causal-exact]
    python -m benchmarks.sass dump/*/*.ptx

jax lowers each kernel to a Mosaic GPU module here; the CUDA PJRT plugin's
`MosaicGpuCompile` then turns the module into PTX and runs ptxas, as on the
GPU machine (MOSAIC_GPU_DUMP_PTX and MOSAIC_GPU_DUMP_PTXAS write both to
--out/<variant>), asking the CUDA driver only for the device's compute
capability. Where no driver is installed, a stub (C, built with `cc`,
loaded before the plugin asks for libcuda.so.1) answers 9.0 (sm_90a), and
loading the compiled kernel is where the plugin stops, after both files are
written. ptxas comes from MOSAIC_GPU_CUDA_ROOT (default: the CUDA root
above the ptxas on PATH).
Variants are `benchmarks.mosaic_backward`'s (the FP8 ones: dK/dV and dQ) or,
with --forward, `benchmarks.mosaic_forward`'s (the FP8 ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ctypes
import functools
import io
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

import benchmarks

# The driver calls MosaicGpuCompile makes before it loads the kernel: the
# current device and its compute capability (attributes 75 and 76).
STUB_DRIVER = r"""
int cuCtxGetDevice(int *device) { *device = 0; return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
  *value = attribute == 75 ? 9 : 0;
  return 0;
}
int cuGetErrorString(int error, const char **text) { *text = "stub CUDA driver"; return 0; }
int cuGetErrorName(int error, const char **text) { *text = "STUB"; return 0; }
"""


def load_stub_driver(tmp: str) -> None:
  """Builds the stub driver and loads it under the soname libcuda.so.1, which
  the plugin's dlopen then finds already loaded; on a machine with a CUDA
  driver, nothing (the real one answers)."""
  try:
    ctypes.CDLL("libcuda.so.1")
    return
  except OSError:
    pass
  source, library = os.path.join(tmp, "cuda.c"), os.path.join(tmp, "libcuda.so.1")
  with open(source, "w") as f:
    f.write(STUB_DRIVER)
  compiler = shutil.which("cc") or shutil.which("gcc")
  if compiler is None:
    raise SystemExit("benchmarks.mosaic_ptx builds a stub CUDA driver: it needs cc or gcc")
  subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", library,
                  source], check=True)
  ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)


@contextlib.contextmanager
def compile_modules(plugin: str):
  """A context in which every Mosaic GPU module jax lowers is also compiled by
  `plugin`'s MosaicGpuCompile (its PTX and ptxas report dumped)."""
  import jax.experimental.mosaic.gpu.core as mosaic_core
  compile_module = ctypes.CDLL(plugin).MosaicGpuCompile
  compile_module.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_module.restype = ctypes.c_void_p
  serde = mosaic_core._run_serde_pass  # pylint: disable=protected-access

  def run_serde_pass(module, **kwargs):
    module = serde(module, **kwargs)
    if kwargs.get("serialize"):
      bytecode = io.BytesIO()
      module.operation.write_bytecode(bytecode)
      data = bytecode.getvalue()
      with quiet_stderr():  # the plugin's complaints about the missing runtime
        compile_module(data, len(data))  # fails at loading, once the files are written
    return module

  mosaic_core._run_serde_pass = run_serde_pass  # pylint: disable=protected-access
  try:
    yield
  finally:
    mosaic_core._run_serde_pass = serde  # pylint: disable=protected-access


@contextlib.contextmanager
def quiet_stderr():
  """Standard error (file descriptor 2, where C++ writes) to /dev/null."""
  sys.stderr.flush()
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def backward_kernels(name: str, shapes, causal: bool):
  """(function, abstract arguments) of a `benchmarks.mosaic_backward` FP8
  variant's dK/dV and dQ kernels on inputs of `shapes`."""
  from benchmarks import mosaic_backward
  config = fp8_config(shapes, causal)
  inputs, _, _ = jax.eval_shape(functools.partial(mosaic_backward.fp8_inputs, config=config),
                                *shapes)
  (dkdv, dq), (dkdv_args, dq_args) = (mosaic_backward.fp8_kernels(name, config),
                                      mosaic_backward.fp8_arguments(*inputs))
  dq_args = mosaic_backward.dq_arguments(dq_args, jax.eval_shape(dkdv, *dkdv_args))
  return [(dkdv, dkdv_args), (dq, dq_args)]


def forward_kernels(name: str, shapes, causal: bool, causal_exact: bool = False):
  """(function, abstract arguments) of a `benchmarks.mosaic_forward` FP8
  variant's kernel on inputs of `shapes` (with `causal_exact`, its
  operands: the 16-bit diagonal step)."""
  from benchmarks import mosaic_forward
  from pallas_kernels.mosaic.forward import forward_mosaic
  from pallas_kernels.types import Masks
  config = dataclasses.replace(fp8_config(shapes, causal), causal_exact=causal_exact)
  quantize = mosaic_forward.exact_inputs if causal_exact else mosaic_forward.quantize_fp8
  qkv = jax.eval_shape(functools.partial(quantize, config=config), *shapes[:3])
  tuning = mosaic_forward.VARIANTS[name]
  return [(lambda qkv: forward_mosaic(qkv, Masks(), config, jnp.bfloat16, tuning), (qkv,))]


def fp8_config(shapes, causal: bool):
  """The benchmarks' kernel Config, quantization="int8_fp8"."""
  from pallas_kernels.types import Config
  d = shapes[0].shape[-1]
  return Config(scale=d**-0.5, causal=causal, smooth_q=False, block_q=64, block_kv=64,
                quantization="int8_fp8")


def main(argv: list[str] | None = None) -> None:
  parser = benchmarks.parser(__doc__, "benchmarks.mosaic_ptx")
  parser.add_argument("--plugin", required=True,
                      help="xla_cuda_plugin.so of jax-cuda13-pjrt (jaxlib's version)")
  parser.add_argument("--out", required=True, help="folder for <variant>/*.ptx, *.ptxas")
  parser.add_argument("--variants", default="mosaic_fp8", help="comma-separated FP8 variants")
  parser.add_argument("--forward", action="store_true",
                      help="benchmarks.mosaic_forward's variants (default: the backward's)")
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--causal-exact", action="store_true",
                      help="with --forward --causal: causal_exact=True (its 16-bit diagonal)")
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--head-dim", type=int, default=128)
  args = parser.parse_args(argv)
  if not os.path.isfile(args.plugin):
    raise SystemExit(f"--plugin: no file {args.plugin}")
  if args.causal_exact and not (args.forward and args.causal):
    parser.error("--causal-exact takes --forward and --causal")
  from benchmarks import mosaic_backward, mosaic_forward
  known = mosaic_forward.VARIANTS if args.forward else mosaic_backward.VARIANTS
  names = args.variants.split(",")
  for name in names:
    if name not in known or "fp8" not in name:
      raise SystemExit(f"--variants: {name!r} is not one of the FP8 variants "
                       f"{sorted(n for n in known if 'fp8' in n)}")
  ptxas = shutil.which("ptxas")
  os.environ.setdefault("MOSAIC_GPU_CUDA_ROOT",
                        os.path.dirname(os.path.dirname(ptxas)) if ptxas else "/usr/local/cuda")
  shapes = [jax.ShapeDtypeStruct((1, args.seq, 2, args.head_dim), jnp.bfloat16)] * 4
  kernels = (functools.partial(forward_kernels, causal_exact=args.causal_exact) if args.forward
             else backward_kernels)
  with tempfile.TemporaryDirectory() as tmp:
    load_stub_driver(tmp)
    with compile_modules(args.plugin):
      for name in names:
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1",
                          MOSAIC_GPU_DUMP_TO=out)
        for fn, operands in kernels(name, shapes, args.causal):
          jax.jit(fn).trace(*operands).lower(lowering_platforms=("cuda",))
        for f in os.listdir(out):  # jax's and the plugin's other dumps
          if not f.endswith((".ptx", ".ptxas")):
            os.remove(os.path.join(out, f))
        written = sorted(f for f in os.listdir(out) if f.endswith(".ptx"))
        print(f"{name}: {', '.join(written) or 'no PTX written'}", file=sys.stderr)


if __name__ == "__main__":
  main()
