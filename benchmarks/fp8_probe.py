"""The two numbers the FP8 products' design hinges on, measured on the GPU.

    python -m benchmarks.fp8_probe [--part accumulation|rates|both]

`accumulation`: how precisely a Hopper FP8 wgmma (E4M3 x E4M3 -> fp32, both
operands in shared memory, as a Mosaic GPU kernel issues it) accumulates
across steps. One warpgroup sums A_j.B_j over `steps` tiles of 64 keys, A
probability-like (448 * exp of normal logits, E4M3), B ~ N(0, 1) * 112 clipped
to +-448 (E4M3): either in one accumulator that every wgmma adds into (the design's
P.V, dV, dK, dQ: no promotion), or each step into a fresh accumulator added
to an fp32 sum in registers (promotion every step, SageAttention2's
two-level accumulation). Prints each one's relative L2 against float64 of
the same E4M3 values, for 64 to 65536 keys.

`rates`: cycles per instruction of the conversions and packs the loops
use, issued by every warp of a full GPU on independent registers (Triton
inline PTX through jax_triton): cvt.rn.satfinite.e4m3x2.f32 (two fp32 to
an E4M3 pair), cvt.rn.f32.s32 (I2F), prmt.b32 (a byte permute), and FFMA
and MUFU.EX2 for scale. Prints each chain's warp instructions per cycle and
SM (4 is one per scheduler and cycle, the issue limit) at the clock it
reads from nvidia-smi.
"""

from __future__ import annotations

import functools
import subprocess

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

import benchmarks
from benchmarks.attention import time_call

_ROWS, _KEYS, _COLS = 64, 64, 128  # A tile (rows x keys), B tile (keys x cols)
_F8 = jnp.float8_e4m3fn


def _transforms(minor: int, dtype) -> tuple:
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames="promote")
def fp8_sum(a: jax.Array, b_t: jax.Array, *, promote: bool) -> jax.Array:
  """sum_j a[j] . b_t[j]^T, fp32 (64, 128): a (steps, 64, 64), b_t (steps,
  128, 64), E4M3, by FP8 wgmmas in one warpgroup."""
  steps = a.shape[0]

  def body(a_ref, b_ref, o_ref, a_smem, b_smem, o_smem, a_bar, b_bar):
    def load(j):
      plgpu.copy_gmem_to_smem(a_ref.at[j], a_smem, a_bar)
      plgpu.copy_gmem_to_smem(b_ref.at[j], b_smem, b_bar)
      plgpu.barrier_wait(a_bar)
      plgpu.barrier_wait(b_bar)

    def product(acc):
      def issue(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.T)
      return pl.run_state(issue)(acc)

    zeros = lambda: plgpu.layout_cast(jnp.zeros((_ROWS, _COLS), jnp.float32),
                                      plgpu.Layout.WGMMA)

    def step(j, total):
      load(j)
      if promote:  # a fresh accumulator, added in fp32 registers
        return total + product(plgpu.ACC.init(zeros()))
      return product(plgpu.ACC.init(total))  # the tensor cores add into it

    zero = zeros()
    total = jax.lax.fori_loop(0, steps, step, zero)
    o_smem[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  def entry(a_ref, b_ref, o_ref):
    pl.run_scoped(
        lambda *scoped: body(a_ref, b_ref, o_ref, *scoped),
        plgpu.SMEM((_ROWS, _KEYS), _F8, transforms=_transforms(_KEYS, _F8)),
        plgpu.SMEM((_COLS, _KEYS), _F8, transforms=_transforms(_KEYS, _F8)),
        plgpu.SMEM((_ROWS, _COLS), jnp.float32),
        plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=1))

  return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((_ROWS, _COLS), jnp.float32),
                      kernel_name="fp8_accumulation_probe")(a, b_t)


def accumulation() -> None:
  print("| keys | steps of 64 | rel. L2, one accumulator | rel. L2, promoted every step |")
  print("|---|---|---|---|")
  for steps in (1, 4, 16, 64, 256, 1024):
    rng = np.random.default_rng(steps)
    a = 448.0 * np.exp(2.0 * rng.standard_normal((steps, _ROWS, _KEYS)) - 4.0)
    a = jnp.asarray(np.minimum(a, 448.0), jnp.float32).astype(_F8)
    b_t = np.clip(112.0 * rng.standard_normal((steps, _COLS, _KEYS)), -448.0, 448.0)
    b_t = jnp.asarray(b_t, jnp.float32).astype(_F8)  # a cast past 448 would be NaN
    exact = np.einsum("jrk,jck->rc", np.asarray(a.astype(jnp.float32), np.float64),
                      np.asarray(b_t.astype(jnp.float32), np.float64))
    rel = lambda got: np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact)
    print(f"| {steps * _KEYS} | {steps} | {rel(fp8_sum(a, b_t, promote=False)):.2e} | "
          f"{rel(fp8_sum(a, b_t, promote=True)):.2e} |", flush=True)


# Each chain: PTX that maps a 32-bit register to one of the same width, and
# the instructions it issues. Independent chains per thread keep the
# schedulers busy; every thread runs `_ITERS` links of its chains.
_CHAINS = {
    "ffma": ("fma.rn.f32 $0, $1, $1, $1;", "=f,f", "FFMA"),
    "ex2": ("ex2.approx.ftz.f32 $0, $1;", "=f,f", "MUFU.EX2"),
    "i2f": ("{ .reg .f32 t; cvt.rn.f32.s32 t, $1; mov.b32 $0, t; }", "=r,r", "I2F"),
    "prmt": ("prmt.b32 $0, $1, $1, 0x0040;", "=r,r", "PRMT"),
    "e4m3x2": ("{ .reg .b16 h; .reg .f32 f; mov.b32 f, $1; "
               "cvt.rn.satfinite.e4m3x2.f32 h, f, f; cvt.u32.u16 $0, h; }", "=r,r",
               "F2FP (+ a zero-extension)"),
    "e4m3x2_pair": ("{ .reg .b16 h0, h1; .reg .f32 f; mov.b32 f, $1; "
                    "cvt.rn.satfinite.e4m3x2.f32 h0, f, f; "
                    "cvt.rn.satfinite.e4m3x2.f32 h1, f, f; mov.b32 $0, {h0, h1}; }", "=r,r",
                    "2 F2FP + the pair's pack"),
}
_ITERS, _ELEMS, _WARPS = 2048, 1024, 4


def _chain_kernel(x_ptr, o_ptr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr,
                  ITERS: tl.constexpr, ELEMS: tl.constexpr, FLOAT: tl.constexpr):
  offs = tl.program_id(0) * ELEMS + tl.arange(0, ELEMS)
  x = tl.load(x_ptr + offs)
  if FLOAT:
    x = x.to(tl.float32, bitcast=True)
  for _ in range(ITERS):
    x = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [x], dtype=x.dtype, is_pure=True, pack=1)
  tl.store(o_ptr + offs, x.to(tl.int32, bitcast=True))


def _sm_clock_hz() -> float:
  out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, check=True).stdout
  return float(out.split()[0]) * 1e6


def rates() -> None:
  import jax_triton
  kernel = triton.jit(_chain_kernel)
  device = jax.devices()[0]
  sms = device.core_count
  programs = sms * 16
  x = jnp.arange(programs * _ELEMS, dtype=jnp.int32) | jnp.int32(0x3F800000)
  print(f"{device.device_kind}: {sms} SMs, SM clock {_sm_clock_hz() / 1e9:.2f} GHz "
        "(nvidia-smi, before the runs)")
  print("| chain | issues | ms | warp chains per cycle and SM | threads' links per cycle and SM |")
  print("|---|---|---|---|---|")
  for name, (asm, constraints, issues) in _CHAINS.items():
    run = jax.jit(lambda x, asm=asm, constraints=constraints: jax_triton.triton_call(
        x, kernel=kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.int32),
        grid=(programs,), num_warps=_WARPS, ASM=asm, CONSTRAINTS=constraints,
        ITERS=_ITERS, ELEMS=_ELEMS, FLOAT=constraints.startswith("=f")))
    seconds = time_call(run, x)
    clock = _sm_clock_hz()
    links = programs * _ELEMS * _ITERS  # one per thread value and iteration
    per_sm_cycle = links / (seconds * clock * sms)
    print(f"| {name} | {issues} | {seconds * 1e3:.3f} | {per_sm_cycle / 32:.2f} | "
          f"{per_sm_cycle:.1f} |", flush=True)


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.fp8_probe")
  parser.add_argument("--part", default="both", choices=["accumulation", "rates", "both"])
  args = parser.parse_args()
  benchmarks.require_gpu("benchmarks.fp8_probe")
  if args.part in ("accumulation", "both"):
    accumulation()
  if args.part in ("rates", "both"):
    rates()


if __name__ == "__main__":
  main()
