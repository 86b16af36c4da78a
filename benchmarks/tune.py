"""Sweep the Pallas kernels' launch settings (warps, pipeline stages) on a GPU.

    python -m benchmarks.tune [--seq 4096] [--dims 128,64]

For each head dim and causal flag: the forward alone under each forward
setting, then forward+backward under each backward setting (with the best
forward), as TOPS and the ratio to cuDNN BF16 timed in the same process. The
winners go into `PallasBackend.tuned`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import warnings

import jax
import jax.numpy as jnp

from benchmarks.attention import time_call
from pallas_kernels.triton.backend import PallasBackend
from pallas_kernels.triton.common import LaunchConfig
from sagebwd_jax.sagebwd import sagebwd_attention

warnings.filterwarnings("ignore", category=DeprecationWarning)
SETTINGS = [LaunchConfig(num_warps=w, num_stages=s)
            for w, s in itertools.product((4, 8), (2, 3, 4))]


def _ours(backend: PallasBackend, causal: bool):
  from pallas_kernels.types import Config, Masks
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
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--dims", default="128,64")
  args = parser.parse_args()
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
      for s in SETTINGS:
        fwd[s] = _rate(_ours(PallasBackend(s, LaunchConfig()), causal), q, k, v, do, flops,
                       backward=False)
        print(f"  forward  w{s.num_warps} s{s.num_stages}: {fwd[s]:.1f} "
              f"({fwd[s] / cudnn[0]:.2f}x)", flush=True)
      best = max(fwd, key=lambda s: -1 if fwd[s] != fwd[s] else fwd[s])
      for s in SETTINGS:
        total = _rate(_ours(PallasBackend(best, s), causal), q, k, v, do, flops, backward=True)
        print(f"  backward w{s.num_warps} s{s.num_stages} (forward w{best.num_warps} "
              f"s{best.num_stages}): fwd+bwd {total:.1f} ({total / cudnn[1]:.2f}x)", flush=True)


if __name__ == "__main__":
  main()
