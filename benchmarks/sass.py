"""Where the instructions of the Mosaic GPU kernels' inner loops go, from the
PTX the GPU machine dumps: ptxas's register and spill report, then each
innermost loop that issues wgmmas, its instructions by opcode and by source
line, per score.

    # on the GPU machine (any run that compiles the kernels):
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dump python -m benchmarks.mosaic_backward --seq 1024
    # anywhere, GPU or not:
    python -m benchmarks.sass dump/*.ptx [--lines 20]

Needs ptxas and nvdisasm (CUDA 13, for the PTX 9.0 that jax 0.11.2 emits):
on PATH, or `pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm`. The counts
are static (one pass through the loop body, both branches of a select); a
loop's instructions per score assume one 64 x 64 score tile per 128-thread
warpgroup and iteration (`--scores-per-thread`), as in the backward kernels.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile


def tool(name: str) -> str:
  """The path of a CUDA tool: on PATH, else in a pip-installed nvidia package."""
  found = shutil.which(name)
  if found:
    return found
  for site in sys.path:
    hits = glob.glob(os.path.join(site, "nvidia", "*", "bin", name))
    if hits:
      return hits[0]
  raise SystemExit(f"{name} not found: put it on PATH or `pip install nvidia-cuda-nvcc "
                   "nvidia-cuda-nvdisasm` (CUDA 13)")


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
    listing = subprocess.run([tool("nvdisasm"), "-c", "-g", cubin], capture_output=True,
                             text=True, check=True).stdout
  return report, listing


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


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("ptx", nargs="+", help="PTX files (MOSAIC_GPU_DUMP_PTX=1's *.ptx)")
  parser.add_argument("--arch", default="sm_90a")
  parser.add_argument("--lines", type=int, default=15, help="source lines to list per loop")
  parser.add_argument("--scores-per-thread", type=float, default=64 * 64 / 128)
  args = parser.parse_args(argv)
  for path in args.ptx:
    report, listing = disassemble(path, args.arch)
    instructions, labels = parse_listing(listing)
    print(f"## {os.path.basename(path)}")
    print("\n".join("  " + r.strip() for r in report.splitlines()
                    if "spill" in r or "Used" in r))
    for body in wgmma_loops(instructions, labels):
      loop = [instructions[j] for j in body]
      ops = collections.Counter(i.opcode for i in loop)
      print(f"  loop of {len(loop)} instructions = "
            f"{len(loop) / args.scores_per_thread:.1f} per score")
      print("    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
      lines = collections.Counter(i.line for i in loop)
      for line, n in lines.most_common(args.lines):
        mix = collections.Counter(i.opcode for i in loop if i.line == line)
        print(f"    {n / args.scores_per_thread:5.2f}/score {n:4d} {line}: "
              + ", ".join(f"{k} {v}" for k, v in mix.most_common(5)))


if __name__ == "__main__":
  main()
