"""Where the instructions of the kernels' inner loops go, read from their
SASS without a GPU: the register and spill report and warnings (ptxas's,
or for Triton cuobjdump's with the programs an SM holds), then each innermost
loop that issues wgmmas, its instructions by opcode and by source line, per
score.

    # Mosaic GPU kernels: their PTX, dumped on the GPU machine by any run
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dump python -m benchmarks.mosaic_backward --seq 1024
    python -m benchmarks.sass dump/*.ptx [--lines 20]
    # Triton kernels (implementation="triton"): compiled here for sm_90 by
    # Triton itself, under each launch setting
    python -m benchmarks.sass --triton [--causal] [--lines 0]

Needs ptxas and nvdisasm (CUDA 13, for the PTX 9.0 that jax 0.11.2 emits):
on PATH, or `pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm`; `--triton`
needs triton too. The counts are static (one pass through the loop body, both
branches of a select). Per score: a Mosaic loop does one 64 x 64 score tile
per 128-thread warpgroup (`--scores-per-thread`), a Triton loop one
block_q x block_kv tile over all the program's threads.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import benchmarks


def tool(name: str) -> str:
  """The path of a CUDA tool: on PATH, else in a pip-installed nvidia or triton
  package."""
  found = shutil.which(name)
  if found:
    return found
  for site in sys.path:  # pip's nvidia packages, and the tools the triton wheel carries
    hits = (glob.glob(os.path.join(site, "nvidia", "*", "bin", name))
            + glob.glob(os.path.join(site, "triton", "backends", "nvidia", "bin", name)))
    if hits:
      return hits[0]
  raise SystemExit(f"{name} not found: put it on PATH or `pip install nvidia-cuda-nvcc "
                   "nvidia-cuda-nvdisasm` (CUDA 13)")


TRITON_POINTER_TYPES = {"int8": "*i8", "int32": "*i32", "float32": "*fp32",
                        "bfloat16": "*bf16", "float16": "*fp16",
                        "float8_e4m3fn": "*fp8e4nv"}


@dataclasses.dataclass
class TritonLaunch:
  """One Triton kernel launch of the op, as `LaunchConfig.call` received it."""
  name: str
  kernel: object  # triton.JITFunction
  types: list[str]  # Triton's pointer type of each argument, then of each output
  constants: dict
  num_warps: int
  num_stages: int

  def compile(self, arch: int, num_warps: int | None = None,
              num_stages: int | None = None) -> bytes:
    """The launch's cubin for sm_`arch`, by Triton's own compiler (no GPU)."""
    return self.compiled(arch, num_warps, num_stages).asm["cubin"]

  def shared_memory(self, arch: int) -> int:
    """Bytes of shared memory the launch asks for per program on sm_`arch`.

    Triton allocates it in the first passes of its lowering to LLVM IR, so
    this runs those and stops: the rest (LLVM, PTX, ptxas) takes nearly all
    of a large kernel's compile and changes no allocation. The passes are
    Triton 3.6's (`make_llir`); a test holds the result to the cubin's.
    """
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    from triton.compiler.compiler import make_backend
    source, target, options = self._source(arch)
    backend = make_backend(target)
    options = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    stages = {}
    backend.add_stages(stages, options, source.language)
    metadata = {"target": target, **options.__dict__}
    for stage in ("ttir", "ttgir"):
      module = stages[stage](module, metadata)
    pm = ir.pass_manager(module.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(
        pm, arch, get_ptx_version_from_options(options, arch))
    pm.run(module, "shared_memory")
    return module.get_int_attr("ttg.shared")

  def compiled(self, arch: int, num_warps: int | None = None, num_stages: int | None = None):
    """Triton's compiled kernel of the launch (its own cache makes a repeat cheap)."""
    from triton import knobs
    from triton.compiler import compile as triton_compile
    if not knobs.cache.dir:  # TRITON_CACHE_DIR set empty, as on the device machines
      knobs.cache.dir = tempfile.mkdtemp(prefix="triton-cache-")
    source, target, options = self._source(arch, num_warps, num_stages)
    return triton_compile(source, target=target, options=options)

  def _source(self, arch: int, num_warps: int | None = None, num_stages: int | None = None):
    """The kernel as Triton's compiler takes it: source, target and options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    pointers = [n for n in self.kernel.arg_names if n not in self.constants]
    signature = dict(zip(pointers, self.types)) | {n: "constexpr" for n in self.constants}
    attrs = {(self.kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    options = dict(num_warps=num_warps or self.num_warps,
                   num_stages=num_stages or self.num_stages)
    source = ASTSource(self.kernel, signature, constexprs=self.constants, attrs=attrs)
    return source, GPUTarget("cuda", arch, 32), options


def triton_launches(fn, *args) -> list[TritonLaunch]:
  """Every Triton kernel launch in the trace of `fn(*args)` (nothing runs)."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.jax_triton import launch

  launches = []

  def record(config, kernel, args, out_shape, *, grid, name, **constants):
    del grid
    types = [TRITON_POINTER_TYPES[jnp.dtype(x.dtype).name] for x in (*args, *out_shape)]
    launches.append(TritonLaunch(name, kernel, types, constants, config.num_warps,
                                 config.num_stages))
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

  original = launch.LaunchConfig.call
  launch.LaunchConfig.call = record
  try:
    # The op's stages are jits: without this they would replay traces cached
    # before (recording nothing) or cache these (the stand-in zeros) for later.
    with jax.disable_jit():
      jax.eval_shape(fn, *args)
  finally:
    launch.LaunchConfig.call = original
  return launches


@dataclasses.dataclass
class Instruction:
  opcode: str
  text: str
  line: str  # source file:line, from the listing's line table


def disassemble(ptx: str, arch: str) -> tuple[str, str]:
  """(ptxas's report, nvdisasm's listing with line info) of a PTX file."""
  with tempfile.TemporaryDirectory() as tmp:
    cubin = os.path.join(tmp, "kernel.cubin")
    report = subprocess.run([tool("ptxas"), f"-arch={arch}", "-O3", "-v", ptx, "-o", cubin],
                            capture_output=True, text=True, check=True).stderr
    return report, listing(cubin)


def ptxas_summary(report: str) -> str:
  """ptxas's register and spill lines, its warnings and its performance
  advisories (the "(C7nnn)" lines it prints as info), indented: C7517
  "warpgroup.wait is injected" means a wgmma waits there for a product
  before it, C7515 that every wgmma of the function does, whatever the
  kernel's schedule; C7519 (an injected wgmma fence) costs little."""
  return "\n".join("  " + row.strip() for row in report.splitlines()
                   if "spill" in row or "Used" in row or "warning" in row.lower()
                   or "(C7" in row)


def listing(cubin_path: str) -> str:
  """nvdisasm's listing of a cubin, with source lines."""
  return subprocess.run([tool("nvdisasm"), "-c", "-g", cubin_path], capture_output=True,
                        text=True, check=True).stdout


def resources(cubin_path: str) -> tuple[int, int]:
  """(registers per thread, stack bytes per thread) of a one-kernel cubin, by
  cuobjdump."""
  usage = subprocess.run([tool("cuobjdump"), "-res-usage", cubin_path], capture_output=True,
                         text=True, check=True).stdout
  found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
  if found is None:
    raise ValueError(f"no resource usage in cuobjdump's answer: {usage[:200]!r}")
  return int(found[1]), int(found[2])


def programs_per_sm(registers: int, threads: int) -> int:
  """How many programs of `threads` threads an SM's 64K registers hold (Hopper
  and Ampere: registers allocated per warp in units of 256)."""
  per_warp = -(-registers * 32 // 256) * 256
  return 65536 // (per_warp * (threads // 32))


def parse_listing(listing: str) -> tuple[list[Instruction], dict[str, int]]:
  """The instructions of an nvdisasm -g listing, and label -> instruction index."""
  instructions, labels, line = [], {}, "?"
  for row in listing.splitlines():
    if m := re.match(r'\s*//## File "(.*?)", line (\d+)', row):
      line = f"{os.path.basename(m.group(1))}:{m.group(2)}"
    elif m := re.match(r"^(\.L_x_\d+):", row):
      labels[m.group(1)] = len(instructions)
    elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", row):
      text = m.group(1)
      opcode = re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0]
      instructions.append(Instruction(opcode, text, line))
  return instructions, labels


def wgmma_loops(instructions: list[Instruction], labels: dict[str, int]) -> list[range]:
  """Innermost loops that issue wgmmas (HGMMA/IGMMA): spans from a backward
  branch's target to the branch that hold no other such branch (a branch from
  an epilogue back into a loop spans the loop's own branch)."""
  spans = []
  for i, ins in enumerate(instructions):
    m = re.search(r"(\.L_x_\d+)", ins.text) if ins.opcode.startswith("BRA") else None
    if m and labels.get(m.group(1), len(instructions)) <= i:
      body = range(labels[m.group(1)], i + 1)
      if any("GMMA" in instructions[j].opcode for j in body):
        spans.append(body)
  return [span for span in spans
          if not any(other.stop - 1 in span for other in spans if other != span)]


def report_loops(instructions: list[Instruction], labels: dict[str, int],
                 scores_per_thread: float, lines: int) -> None:
  for body in wgmma_loops(instructions, labels):
    loop = [instructions[j] for j in body]
    ops = collections.Counter(i.opcode for i in loop)
    spills = sum(n for op, n in ops.items() if op.startswith(("STL", "LDL")))
    print(f"  loop of {len(loop)} instructions = {len(loop) / scores_per_thread:.1f} per "
          f"score ({spills} spill loads/stores)")
    print("    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    # One wait a wgmma: each product runs alone (ptxas's C7517 or C7515).
    print(f"    {sum(n for op, n in ops.items() if 'GMMA' in op)} wgmmas, "
          f"{ops['WARPGROUP.DEPBAR.LE']} waits for them, {ops['WARPGROUP.ARRIVE']} fences")
    for line, n in collections.Counter(i.line for i in loop).most_common(lines):
      mix = collections.Counter(i.opcode for i in loop if i.line == line)
      print(f"    {n / scores_per_thread:5.2f}/score {n:4d} {line}: "
            + ", ".join(f"{k} {v}" for k, v in mix.most_common(5)))


def _triton(args) -> None:
  import jax
  import jax.numpy as jnp
  from sagebwd_jax import dot_product_attention

  shape = jax.ShapeDtypeStruct((1, 4096, 2, args.head_dim), jnp.bfloat16)
  loss = lambda q, k, v: dot_product_attention(
      q, k, v, implementation="triton", is_causal=args.causal).astype(jnp.float32).sum()
  for launch in triton_launches(jax.grad(loss, argnums=(0, 1, 2)), shape, shape, shape):
    if "quantize" in launch.name or "prepass" in launch.name:
      continue  # no loop over score tiles
    c = launch.constants  # each loop's score tile: a query side by a key side
    tile = c.get("TILE_Q", c.get("BLOCK_Q")) * c.get("TILE_KV", c.get("BLOCK_KV"))
    for warps, stages in ((4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 3)):
      with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
          f.write(launch.compile(90, warps, stages))
        instructions, labels = parse_listing(listing(cubin))
        registers, stack = resources(cubin)
      print(f"## {launch.name} num_warps={warps} num_stages={stages}")
      print(f"  {registers} registers, {stack} stack bytes per thread: "
            f"{programs_per_sm(registers, 32 * warps)} programs per SM by registers")
      report_loops(instructions, labels, tile / (32 * warps), args.lines)


def main(argv: list[str] | None = None) -> None:
  parser = benchmarks.parser(__doc__, "benchmarks.sass")
  parser.add_argument("ptx", nargs="*", help="PTX files (MOSAIC_GPU_DUMP_PTX=1's *.ptx)")
  parser.add_argument("--arch", default="sm_90a", help="ptxas target (default sm_90a)")
  parser.add_argument("--lines", type=int, default=15,
                      help="source lines to list per loop (default 15)")
  parser.add_argument("--scores-per-thread", type=float, default=64 * 64 / 128,
                      help="scores one thread computes per loop pass, the divisor of the "
                           "per-score counts (default 32: a 64 x 64 tile per warpgroup)")
  parser.add_argument("--triton", action="store_true",
                      help="the Triton kernels instead (T=4096, 2 heads, compiled for sm_90)")
  parser.add_argument("--causal", action="store_true", help="with --triton: causal masking")
  parser.add_argument("--head-dim", type=int, default=128, help="with --triton")
  args = parser.parse_args(argv)
  if args.triton:
    return _triton(args)
  if not args.ptx:
    parser.error("give PTX files, or --triton")
  missing = [p for p in args.ptx if not os.path.isfile(p)]
  if missing:
    parser.error(f"no such PTX file: {', '.join(missing)}")
  for path in args.ptx:
    report, text = disassemble(path, args.arch)
    print(f"## {os.path.basename(path)}")
    print(ptxas_summary(report))
    report_loops(*parse_listing(text), args.scores_per_thread, args.lines)


if __name__ == "__main__":
  main()
