"""Sweep the Triton kernels' launch settings (warps, pipeline stages) on a GPU.

    python -m benchmarks.tune [--seq 4096] [--dims 128,64]

For each head dim and causal flag: the forward alone under each forward
setting, then forward+backward under each backward setting (with the best
forward), as TOPS and the ratio to cuDNN BF16 timed in the same process.
Each kernel's launch is swept with the others at their defaults: 4 warps x
64 rows or 8 x 128, 1 to 3 stages, conversion by instruction or not. The
winners go into `TritonBackend.tuned`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

import benchmarks
from benchmarks.attention import time_call
from pallas_kernels.types import Config, Masks
from sagebwd_jax.sagebwd import sagebwd_attention


def _sweeps():
  """(forward variants, backward variants), each a list of (label, backend);
  a backward variant runs with the best forward's `forward_launch`."""
  from pallas_kernels.jax_triton.backend import TritonBackend
  from pallas_kernels.jax_triton.launch import LaunchConfig
  default = TritonBackend.tuned(causal=False)  # only the forward's launch differs
  # 64 rows at 4 warps, 128 at 8 (a 64-row slice per warpgroup; at 64 rows 8
  # warps split the columns, ~1.7x the instructions); the conversion choice
  # trades instructions for the unit that also runs exp2 (tiles.py).
  settings = {f"w{w} s{s} rows {rows} convert {c}":
              LaunchConfig(num_warps=w, num_stages=s, tile_rows=rows, convert=c)
              for (w, rows), s, c in itertools.product(((4, 64), (8, 128)), (1, 2, 3),
                                                       (True, False))}
  def variants(kernel: str):
    return [(f"{kernel} {k}", dataclasses.replace(default, **{f"{kernel}_launch": c}))
            for k, c in settings.items()]
  return variants("forward"), variants("dq") + variants("dkdv")


def _ours(backend, causal: bool):
  def attn(q, k, v):
    d = q.shape[-1]
    config = Config(scale=d**-0.5, causal=causal, smooth_q=False, block_q=64, block_kv=64)
    return sagebwd_attention(q, k, v, Masks(), config, backend, True)
  return attn


def _rate(attn, q, k, v, do, flops, *, backward: bool) -> float:
  """TOPS of the forward, or of forward+backward."""
  fn = jax.jit(attn)
  if backward:
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    fn, flops = jax.jit(jax.grad(loss, (0, 1, 2))), 3.5 * flops
  try:
    return flops / time_call(fn, q, k, v) / 1e12
  except Exception as e:  # e.g. shared memory exceeded for this setting
    print(f"    failed: {type(e).__name__}: {str(e)[:120]}")
    return float("nan")


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.tune")
  parser.add_argument("--seq", type=int, default=4096, help="T, B = 16384 / T (default 4096)")
  parser.add_argument("--dims", default="128,64", help="head dims, H = 2048 / D (default 128,64)")
  args = parser.parse_args()
  benchmarks.require_gpu("benchmarks.tune")
  forward, backward = _sweeps()
  for head_dim in map(int, args.dims.split(",")):
    batch, heads = 16384 // args.seq, 2048 // head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (batch, args.seq, heads, head_dim), jnp.bfloat16)
                   for kk in keys)
    for causal in (False, True):
      flops = 4 * batch * heads * args.seq**2 * head_dim * (0.5 if causal else 1.0)
      ref = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                              implementation="cudnn")
      cudnn = [_rate(ref, q, k, v, do, flops, backward=b) for b in (False, True)]
      print(f"D={head_dim} causal={causal} cuDNN fwd {cudnn[0]:.1f} fwd+bwd {cudnn[1]:.1f}")
      fwd = {}
      for label, backend in forward:
        fwd[label] = _rate(_ours(backend, causal), q, k, v, do, flops, backward=False)
        print(f"  forward  {label}: {fwd[label]:.1f} ({fwd[label] / cudnn[0]:.2f}x)",
              flush=True)
      best = max(fwd, key=lambda s: -1 if fwd[s] != fwd[s] else fwd[s])
      best_launch = dict(forward)[best].forward_launch
      for label, backend in backward:
        backend = dataclasses.replace(backend, forward_launch=best_launch)
        total = _rate(_ours(backend, causal), q, k, v, do, flops, backward=True)
        print(f"  backward {label} (forward {best}): fwd+bwd {total:.1f} "
              f"({total / cudnn[1]:.2f}x)", flush=True)


if __name__ == "__main__":
  main()
