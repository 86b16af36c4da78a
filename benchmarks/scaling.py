"""Pre-training on several GPUs against one: loss, tokens/s per GPU, kernels.

    python -m benchmarks.scaling [--preset small --steps 100 --meshes data=2,model=1 data=1,model=2]

Runs `python -m train --attention sage` once on the first GPU alone and once
per mesh on the first data x model GPUs, with the same seed, tokens per step
and flags (extra flags after `--` go to `train` unchanged), each in a fresh
process, into <out>/<run> (default out: runs/scaling; a run folder already
there is refused, not overwritten). Prints for each run the training loss at
the last step and its validation loss, both against the one-GPU run's
(relative difference), and the median tokens/s per GPU (the first steps
excluded) as a share of one GPU's; draws the runs' curves into
<out>/loss.png. Then it profiles one forward+backward of the model's
attention under `shard_map` on each mesh (the preset's batch, sequence,
heads and head dim, bf16, causal) and lists the op's kernels by backend,
so a fallback from the Mosaic kernels to the Triton ones shows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import benchmarks
from train.config import preset
from train.metrics import kind, read
from train.sharding import parse_mesh

SKIP = 5  # steps left out of the median: the first ones run beside compilation's tail
ATTENTION = ("forward", "backward_dq", "backward_dkdv")  # in the kernels' names


def devices_of(mesh: str) -> int:
  """GPUs a `--mesh` spec takes (an axis left out: 1); ValueError naming it."""
  sizes = parse_mesh(mesh)
  return sizes.get("data", 1) * sizes.get("model", 1)


def gpu_count() -> int:
  """GPUs jax sees, asked in a child so this process never holds their memory
  while the runs train."""
  probe = subprocess.run(
      [sys.executable, "-c", "import jax; print(jax.default_backend(), jax.device_count())"],
      capture_output=True, text=True, check=True)
  backend, count = probe.stdout.split()
  return int(count) if backend == "gpu" else 0


def train(label: str, devices: int, mesh: str | None, args: argparse.Namespace,
          extra: list[str]) -> dict:
  """One run on the first `devices` GPUs: its last losses, tokens/s per GPU, folder."""
  out = os.path.join(args.out, label)
  cmd = [sys.executable, "-m", "train", "--preset", args.preset, "--steps", str(args.steps),
         "--seed", str(args.seed), "--attention", "sage", "--ckpt-every", "0",
         "--eval-every", str(args.steps), "--out", out, *extra]
  if mesh is not None:
    cmd += ["--mesh", mesh]
  env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(devices)))}
  print(f"{label}: {' '.join(cmd[1:])}", flush=True)
  subprocess.run(cmd, env=env, check=True)
  rows = read(os.path.join(out, "metrics.jsonl"))
  steps = [r for r in rows if kind(r) == "train"]
  evals = [r for r in rows if kind(r) == "eval"]
  return dict(label=label, devices=devices, dir=out, loss=steps[-1]["loss"],
              val_loss=evals[-1]["val_loss"],
              per_gpu=statistics.median(r["tokens_per_s"] for r in steps[SKIP:]) / devices)


def kernels(mesh_spec: str, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
  """The op's kernels (name: (ms per call, launches)) in one forward+backward
  of the preset's attention under shard_map over `mesh_spec`."""
  import jax
  import jax.numpy as jnp

  from benchmarks.breakdown import profile
  from sagebwd_jax.sharding import sharded_attention
  from train.sharding import make_mesh

  c = preset(args.preset)
  mesh = make_mesh(mesh_spec, jax.devices()[:devices_of(mesh_spec)])
  head_dim = c.dim // c.n_heads
  ks = jax.random.split(jax.random.key(0), 4)
  shape = lambda heads: (c.batch_size, c.seq_len, heads, head_dim)
  q, do = (jax.random.normal(key, shape(c.n_heads), jnp.bfloat16) for key in ks[:2])
  k, v = (jax.random.normal(key, shape(c.n_kv_heads), jnp.bfloat16) for key in ks[2:])

  @jax.jit
  def fwd_bwd(q, k, v, do):
    o, vjp = jax.vjp(lambda q, k, v: sharded_attention(mesh, q, k, v, is_causal=True), q, k, v)
    return o, *vjp(do)

  times = profile(fwd_bwd, (q, k, v, do), iters=3)
  return {name: (t * 1e3, launches) for name, (t, launches) in times.items()
          if name.startswith("sagebwd")}


def roles(found: dict) -> list[tuple[str, str]]:
  """(product, backend) of each of the attention's kernels among `found`:
  the forward, dQ and dK/dV, each Mosaic's or Triton's (the quantization and
  the backward pre-pass are Triton's on either path)."""
  return sorted({(role, "mosaic" if "mosaic" in name else "triton")
                 for name in found for role in ATTENTION if role in name})


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.scaling")
  parser.add_argument("--preset", default="small", help="train's preset (default small)")
  parser.add_argument("--steps", type=int, default=100, help="default 100")
  parser.add_argument("--seed", type=int, default=0, help="default 0")
  parser.add_argument("--meshes", nargs="+", default=["data=2,model=1", "data=1,model=2"],
                      metavar="MESH", help="train's --mesh of each multi-GPU run "
                                           "(default data=2,model=1 data=1,model=2)")
  parser.add_argument("--out", default=os.path.join("runs", "scaling"),
                      help="where the runs and loss.png go (default runs/scaling)")
  args, extra = parser.parse_known_args()
  extra = [x for x in extra if x != "--"]
  try:
    meshes = {spec: devices_of(spec) for spec in args.meshes}
  except ValueError as e:
    raise SystemExit(f"error: --meshes: {e}")
  labels = {"1-gpu": (1, None), **{spec.replace(",", "-").replace("=", ""): (n, spec)
                                   for spec, n in meshes.items()}}
  taken = [os.path.join(args.out, label) for label in labels
           if os.path.exists(os.path.join(args.out, label))]
  if taken:
    raise SystemExit(f"error: run folder(s) already there: {', '.join(taken)}; pass "
                     f"another --out (nothing there is overwritten)")
  need, have = max(meshes.values(), default=1), gpu_count()
  if have < need:
    raise SystemExit(f"error: python -m benchmarks.scaling needs {need} GPUs for --meshes "
                     f"{' '.join(args.meshes)}; jax sees {have} here")
  runs = [train(label, n, spec, args, extra) for label, (n, spec) in labels.items()]

  from train.plot import plot
  png = plot([r["dir"] for r in runs], os.path.join(args.out, "loss.png"))
  one = runs[0]
  print(f"\n{args.preset} preset, {args.steps} steps, seed {args.seed}, SageBwd attention; "
        f"curves: {png}")
  print(f"{'run':<16} {'GPUs':>4} {'loss':>8} {'vs 1 GPU':>9} {'val_loss':>9} {'vs 1 GPU':>9} "
        f"{'tokens/s/GPU':>13} {'vs 1 GPU':>9}")
  for r in runs:
    rel = lambda key: f"{(r[key] - one[key]) / one[key]:+.2%}"
    print(f"{r['label']:<16} {r['devices']:>4} {r['loss']:>8.4f} {rel('loss'):>9} "
          f"{r['val_loss']:>9.4f} {rel('val_loss'):>9} {r['per_gpu']:>13,.0f} "
          f"{r['per_gpu'] / one['per_gpu']:>9.1%}")

  for spec in ["data=1,model=1", *meshes]:
    found = kernels(spec, args)
    print(f"\nkernels of one forward+backward on {spec} (ms summed over the GPUs): "
          + (", ".join(f"{role} {backend}" for role, backend in roles(found))
             or "none of the op's in the trace"))
    for name, (ms, launches) in sorted(found.items(), key=lambda kv: -kv[1][0]):
      print(f"  {ms:8.3f} ms  x{launches:<4g} {name}")


if __name__ == "__main__":
  main()
