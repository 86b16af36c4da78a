"""Quantized tiles fed to wgmma straight from registers.

A tile of P computed in the accumulator layout of a previous wgmma (WGMMA:
each thread holds, per 16 columns, columns {2c, 2c+1, 2c+8, 2c+9}) becomes the
8-bit register A operand of the next one (WGMMA_8BIT: per 16 columns, four
consecutive ones {4c..4c+3}) without moving data between threads: the four
values a thread holds are packed into one 32-bit register as they are, so A's
column 4c+i holds P's column sigma16(4c+i). The B operand's rows (keys) are
stored in that same order (`layouts.permute_keys`: the REGISTER_B layout,
which the quantization pass and the pre-pass write), so the product is
unchanged.

The values arrive as the int32 bits of `x + 1.5 * 2**23` (the rounding add of
`numerics`), whose low byte is round(x) as an unsigned byte for 0 <= x <= 255
and as a two's-complement byte for -128 <= x <= 127: three byte permutes pack
four of them. jax 0.11.2's wgmma has no unsigned A operand; `dots`
issues its instructions as `.u8.s8` when asked (see `_WgmmaRewrite`), so P may
use all 256 levels.

FP8 (`Config.fp8`): fp32 values in the same places, two conversions to an
E4M3 pair and one move pack four (`pack_e4m3`, round to nearest even,
saturated at 448 as `numerics.to_e4m3`); `dots` adds the products into
running fp32 accumulators, and `store_transposed` writes such a tile
transposed to shared memory, for a product over its rows.

A `dots` group is fenced once, before its first wgmma. Left in flight
(`InFlight`), it keeps the A tiles its wgmmas read live until `wait_for`;
loops that carry such tiles into later products run through `steps`. Both
keep ptxas from running the kernel's wgmmas one at a time (C7513).
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import re
from typing import NamedTuple

import jax
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
import jax.numpy as jnp
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith
from jaxlib.mlir.dialects import llvm
from jaxlib.mlir.dialects import nvvm
from jaxlib.mlir.dialects import vector
import numpy as np


# The module, not the function of the same name that `mosaic.gpu` exports.
mgpu_wgmma = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")

ROWS = 64  # rows of a wgmma M tile: one warpgroup's query block


def _pack_words(x: fa.FragmentedArray, asm: str, element_type: ir.Type,
                is_signed: bool | None) -> fa.FragmentedArray:
  """A WGMMA-layout tile -> the WGMMA_8BIT tile of its 8-bit forms: `asm`
  makes one 32-bit word of four values (operands $1..$4, in register order)."""
  i32 = ir.IntegerType.get_signless(32)
  shape = fa.WGMMA_LAYOUT_8BIT.registers_shape(x.shape)
  packed = np.empty(shape, dtype=object)
  constraint = "r" if isinstance(x.mlir_dtype, ir.IntegerType) else "f"

  def element(vec, i):
    return llvm.extractelement(vec, llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, i)).result)

  for idx in np.ndindex(shape):
    lo = x.registers[(idx[0], 2 * idx[1], *idx[2:])]
    hi = x.registers[(idx[0], 2 * idx[1] + 1, *idx[2:])]
    word = llvm.inline_asm(
        i32, [element(lo, 0), element(lo, 1), element(hi, 0), element(hi, 1)], asm,
        "=r," + ",".join([constraint] * 4), has_side_effects=False)
    packed[idx] = vector.bitcast(ir.VectorType.get((4,), element_type),
                                 vector.broadcast(ir.VectorType.get((1,), i32), word))
  return fa.FragmentedArray(_registers=packed, _layout=fa.WGMMA_LAYOUT_8BIT,
                            _is_signed=is_signed)


def _pack_low_bytes(x: fa.FragmentedArray) -> fa.FragmentedArray:
  """int32 WGMMA-layout tile -> int8 WGMMA_8BIT tile of each value's low byte."""
  return _pack_words(
      x, "{ .reg .b32 t0, t1; prmt.b32 t0, $1, $2, 0x0040; prmt.b32 t1, $3, $4, 0x0040;"
      " prmt.b32 $0, t0, t1, 0x5410; }", ir.IntegerType.get_signless(8), True)


def _pack_e4m3(x: fa.FragmentedArray) -> fa.FragmentedArray:
  """fp32 WGMMA-layout tile -> float8_e4m3fn WGMMA_8BIT tile. cvt's first
  source goes to the upper byte of its pair."""
  return _pack_words(
      x, "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;"
      " cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
      ir.Float8E4M3FNType.get(), None)


class _WgmmaRewrite:
  """Stands in for the `llvm` module of jax's wgmma lowering and rewrites the
  instructions it emits: with `fresh` the first ignores its accumulator
  input (its scale-d predicate false), so the accumulator needs no start value
  and no instruction sets one; with `unsigned_a`, `.s32.s8.s8` becomes
  `.s32.u8.s8`."""

  def __init__(self, real, *, fresh: bool, unsigned_a: bool):
    self._real, self._unsigned_a, self._first = real, unsigned_a, fresh

  def __getattr__(self, name):
    return getattr(self._real, name)

  def inline_asm(self, result, operands, asm, constraints, *args, **kwargs):
    if self._unsigned_a:
      asm = asm.replace(".s32.s8.s8", ".s32.u8.s8")
    if self._first and "wgmma.mma_async" in asm:
      # `wgmma_m64` sets the scale-d predicate from the operand it names here
      # ($n counts the outputs first).
      flag = int(re.search(r"setp\.ne\.b32 p, \$(\d+), 0;", asm).group(1))
      flag -= sum(c.startswith("=") for c in constraints.split(","))
      i32 = ir.IntegerType.get_signless(32)
      operands = list(operands)
      operands[flag] = llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, 0)).result
      self._first = False
    return self._real.inline_asm(result, operands, asm, constraints, *args, **kwargs)


@contextlib.contextmanager
def _fenced_wgmma(*, fresh: bool, unsigned_a: bool):
  """While lowering the wgmmas of one accumulator in `dots` (and nothing
  else): jax's wgmma does not fence its register operands, which `dots`
  fenced once for the whole group, and `_WgmmaRewrite` edits the
  instructions when asked. Remove when jax's wgmma takes unsigned int8 A
  operands, a first product that ignores the accumulator, and operands
  already fenced."""
  real_llvm, real_fence = mgpu_wgmma.llvm, mgpu_wgmma.wgmma_fence
  if unsigned_a or fresh:
    mgpu_wgmma.llvm = _WgmmaRewrite(real_llvm, fresh=fresh, unsigned_a=unsigned_a)
  mgpu_wgmma.wgmma_fence = lambda array: array
  try:
    yield
  finally:
    mgpu_wgmma.llvm, mgpu_wgmma.wgmma_fence = real_llvm, real_fence


def _fence(arrays: list[fa.FragmentedArray]) -> list[fa.FragmentedArray]:
  """`arrays` computed before the one wgmma fence that follows them (what
  jax's `wgmma_fence` does for one array). Fencing a group's operands once,
  before its first wgmma, leaves no instruction between its wgmmas: a copy
  of a register operand there (LLVM makes one where the unfenced value stays
  live) would make ptxas run every wgmma of the kernel alone (C7513)."""
  fenced = fa.optimization_barrier(*arrays)
  nvvm.wgmma_fence_aligned()
  return [fenced] if len(arrays) == 1 else list(fenced)


def pack(bits: jax.Array) -> jax.Array:
  """(64, 64) int32 rounding-add bits, WGMMA layout -> the (64, 64) int8
  register A operand of a wgmma (WGMMA_8BIT layout) holding their low bytes.

  Packing as soon as the bits exist keeps a quarter of the registers live
  until the product is issued."""

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(bits.shape, jnp.int8, layout=plgpu.Layout.WGMMA_8BIT))
  def packed(ctx, x):
    del ctx
    return _pack_low_bytes(x)

  return packed(bits)


def pack_e4m3(p: jax.Array) -> jax.Array:
  """(64, 64) fp32, WGMMA layout -> the (64, 64) float8_e4m3fn register A
  operand of a wgmma (WGMMA_8BIT layout), columns in `layouts.permute_keys`
  order as `pack`'s."""

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(p.shape, jnp.float8_e4m3fn,
                                         layout=plgpu.Layout.WGMMA_8BIT))
  def packed(ctx, x):
    del ctx
    return _pack_e4m3(x)

  return packed(p)


def store_transposed(x8: jax.Array, ref, transforms) -> None:
  """A (64, 64) `pack_e4m3` tile (rows r) transposed into the (64, 64) tile
  `ref` (64-byte swizzle, rows r in `permute_keys` order): the K-major A
  operand (E4M3's only kind) of a product over r with REGISTER_B tiles, by a
  shuffle (xor 4), byte permutes and stmatrix's transposed b16 form."""
  assert x8.shape == ref.shape == (ROWS, ROWS) and transforms[-1].swizzle == 64

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT, plgpu.RefType(transforms)))
  def store(_, x, smem):
    i32 = ir.IntegerType.get_signless(32)
    const = lambda v: arith.constant(i32, v)
    asm = lambda text, *args: llvm.inline_asm(i32, list(args), text, "=r" + ",r" * len(args),
                                              has_side_effects=False)
    lane = arith.remui(mgpu_utils.thread_idx(), const(32))
    warp = arith.remui(arith.divui(mgpu_utils.thread_idx(), const(32)), const(4))
    odd = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(lane, const(4)), const(0))  # row r odd
    # Lane L: row L of the x4 store's matrices, warp w's bytes 16w.. (swizzled).
    chunk = arith.xori(warp, arith.andi(arith.shrui(lane, const(1)), const(3)))
    row = arith.addi(llvm.ptrtoint(i32, mgpu_utils.memref_ptr(smem)),
                     arith.addi(arith.muli(lane, const(ROWS)), arith.shli(chunk, const(4))))
    word = lambda reg: llvm.extractelement(vector.bitcast(ir.VectorType.get((1,), i32), reg),
                                           const(0))
    for first in (0, 2):  # 16-column groups first, first + 1: columns 16 * first + L
      words = []
      for group in (first, first + 1):
        top, bottom = (word(x.registers[(0, group, 0, 0, half, 0, 0, 0, 0)]) for half in (0, 1))
        received = asm("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;",
                       arith.select(odd, top, bottom))
        low, high = arith.select(odd, received, top), arith.select(odd, bottom, received)
        words += [asm("prmt.b32 $0, $1, $2, 0x5140;", low, high),
                  asm("prmt.b32 $0, $1, $2, 0x7362;", low, high)]
      llvm.inline_asm(ir.Type.parse("!llvm.void"), [arith.addi(row, const(16 * first * ROWS)),
                      *words], "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, "
                      "$3, $4};", "r,r,r,r,r", has_side_effects=True)

  store(x8, ref)


class _Product(NamedTuple):
  """What `dots` lowers one product from."""
  has_start: bool
  count: int  # A (and B) tiles
  a_in_smem: bool
  swizzle: int
  shape: tuple
  acc_dtype: type


class InFlight(NamedTuple):
  """One `dots(..., wait=False)` group: its accumulators, which nothing may
  read before `wait_for` returns them, and the register A tiles its wgmmas
  read, which keep their registers until that wait."""
  accs: tuple
  reads: tuple


def dots(*products, unsigned_a: bool = False, wait: bool = True):
  """For each (start, A tiles, B tiles, B's transforms) of `products`: start +
  sum over i of A_i.B_i^T by wgmmas, all issued before one commit and one
  wait; returns the (64, n) accumulators, WGMMA layout.

  `start`: the accumulator's start (for FP8 products: the running sum they
  add into), or None: the first wgmma ignores its input, so no instruction
  sets it (int32 for int8 A, else fp32). A tiles: (64, 64) 8-bit register
  operands (`pack`, `pack_e4m3`), whose B tiles are shared-memory (n, 64)
  tiles of B^T with the contraction axis in `layouts.permute_keys` order
  (REGISTER_B); or (ref, transforms) of shared-memory (64, k) tiles, with
  (n, k) B^T tiles stored as they are. `unsigned_a`: int8 A read as
  unsigned (P in 0..255). The starts and register A tiles are fenced once,
  before the first wgmma. `wait=False` returns the group in flight
  (`InFlight`), for `wait_for`.
  """
  arg_types, args, specs, read_types = [], [], [], []
  for start, a_tiles, b_tiles, b_transforms in products:
    in_smem = isinstance(a_tiles[0], tuple)
    a_dtype = jnp.dtype((a_tiles[0][0] if in_smem else a_tiles[0]).dtype)
    acc_dtype = jnp.int32 if a_dtype == jnp.int8 else jnp.float32
    if start is not None:
      arg_types.append(plgpu.Layout.WGMMA)
      args.append(start)
    if in_smem:
      arg_types += [plgpu.RefType(transforms) for _, transforms in a_tiles]
      args += [ref for ref, _ in a_tiles]
    else:
      arg_types += [plgpu.Layout.WGMMA_8BIT] * len(a_tiles)
      args += list(a_tiles)
      read_types += [plgpu.ShapeDtypeStruct(a.shape, a.dtype, layout=plgpu.Layout.WGMMA_8BIT)
                     for a in a_tiles]
    arg_types += [plgpu.RefType(b_transforms)] * len(b_tiles)
    args += list(b_tiles)
    specs.append(_Product(start is not None, len(a_tiles), in_smem, b_transforms[-1].swizzle,
                          (ROWS, b_tiles[0].shape[0]), acc_dtype))
  acc_types = tuple(plgpu.ShapeDtypeStruct(spec.shape, spec.acc_dtype,
                                           layout=plgpu.Layout.WGMMA) for spec in specs)

  @plgpu.inline_mgpu(arg_types=tuple(arg_types),
                     return_type=acc_types if wait else acc_types + tuple(read_types))
  def product(ctx, *values):
    del ctx
    values, accs, a_groups, b_groups = list(values), [], [], []
    for spec in specs:
      signed = True if spec.acc_dtype == jnp.int32 else None
      if spec.has_start:
        start = values.pop(0)
        start = fa.FragmentedArray(_registers=start.registers, _layout=start.layout,
                                   _is_signed=signed)
      else:
        element = ir.IntegerType.get_signless(32) if signed else ir.F32Type.get()
        start = fa.FragmentedArray.splat(llvm.mlir_undef(element), spec.shape,
                                         fa.WGMMA_LAYOUT, is_signed=signed)
      accs.append(mgpu.WGMMAAccumulator.from_registers(start, sync=False))
      a_groups.append(values[:spec.count])
      b_groups.append(values[spec.count:2 * spec.count])
      del values[:2 * spec.count]
    # One fence for every accumulator (its registers, in the accumulator's
    # own layout: the pytree leaf) and every register A tile.
    reads = [a for a_tiles, spec in zip(a_groups, specs) if not spec.a_in_smem
             for a in a_tiles]
    fenced = iter(_fence([acc.tree_flatten()[0][0] for acc in accs] + reads))
    accs = [type(acc).tree_unflatten(acc.tree_flatten()[1], [next(fenced)]) for acc in accs]
    reads = list(fenced)
    fenced_reads = iter(reads)
    a_groups = [a_tiles if spec.a_in_smem else [next(fenced_reads) for _ in a_tiles]
                for a_tiles, spec in zip(a_groups, specs)]
    results = []
    for acc, a_tiles, b_tiles, spec in zip(accs, a_groups, b_groups, specs):
      with _fenced_wgmma(fresh=not spec.has_start, unsigned_a=unsigned_a):
        for a, b in zip(a_tiles, b_tiles):
          acc = mgpu.wgmma(acc, a, mgpu_utils.memref_transpose(b, (1, 0, 3, 2)),
                           swizzle=spec.swizzle)
      results.append(acc.value)
    void = ir.Type.parse("!llvm.void")
    llvm.inline_asm(void, [], "wgmma.commit_group.sync.aligned;", "", has_side_effects=True)
    if wait:
      llvm.inline_asm(void, [], "wgmma.wait_group.sync.aligned 0;", "", has_side_effects=True)
      return tuple(results)
    return (*results, *reads)

  values = product(*args)
  if wait:
    return values
  return InFlight(tuple(values[:len(specs)]), tuple(values[len(specs):]))


def wait_for(*groups: InFlight, pending: int = 0) -> tuple[jax.Array, ...]:
  """Waits until at most `pending` of this warpgroup's wgmma groups are in
  flight, the latest ones (groups complete in order); returns the
  accumulators of `groups`, which must be among those waited for, as values
  that nothing reads before the wait (values already finished, as an
  `InFlight` with no reads, pass through it: computed before the wait).

  The groups' register A tiles stay live until the wait, so no instruction
  before it takes their registers (a chain packing the next step's tiles
  would otherwise write into them, and ptxas then runs every wgmma of the
  kernel alone: C7513)."""
  accs = [acc for group in groups for acc in group.accs]
  reads = [a for group in groups for a in group.reads]
  count = len(accs)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,) * count + (plgpu.Layout.WGMMA_8BIT,) * len(reads),
      return_type=tuple(plgpu.ShapeDtypeStruct(acc.shape, acc.dtype, layout=plgpu.Layout.WGMMA)
                        for acc in accs))
  def waited(ctx, *values):
    del ctx
    void = ir.Type.parse("!llvm.void")
    llvm.inline_asm(void, [], f"wgmma.wait_group.sync.aligned {pending};", "",
                    has_side_effects=True)
    if len(values) == 1:
      return (fa.optimization_barrier(values[0]),)
    return tuple(fa.optimization_barrier(*values))[:count]

  return waited(*accs, *reads)


def steps(carry, segments, finish):
  """`finish(carry)` after the steps of each (start, stop, step, one) of
  `segments`: `step(i, carry)` for i in [start, stop), in a loop, or as one
  call where `one` says the segment holds at most one step. For loops whose
  carry holds register A tiles that the products after them read (the
  overlap schedules).

  A segment whose size is not known when tracing gets a path of its own to
  `finish` (a `lax.cond` on whether it is empty, the rest traced on both
  sides), and on that path a loop runs `max(stop - start, 1)` times, which
  LLVM sees is not zero. Where a loop's exit and a path that skips the loop
  join before the products that read its carry, ptxas runs every wgmma of
  the kernel alone (C7513), though no register is written in flight.
  """
  if not segments:
    return finish(carry)
  (start, stop, step, one), rest = segments[0], segments[1:]
  try:  # known when tracing (Python ints, concrete arrays)
    start, stop = operator.index(start), operator.index(stop)
  except TypeError:
    pass
  else:
    if one and stop - start > 1:
      raise ValueError(f"a segment of one step holds {stop - start}")
    return steps(lax.fori_loop(start, stop, step, carry), rest, finish)

  def run(carry):
    if one:
      carry = step(start, carry)
    else:
      carry = lax.fori_loop(0, jnp.maximum(stop - start, 1),
                            lambda i, carry: step(start + i, carry), carry)
    return steps(carry, rest, finish)

  return lax.cond(stop > start, run, lambda carry: steps(carry, rest, finish), carry)
