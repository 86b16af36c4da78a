"""`causal_exact=True` against the default, causal: Table 1's inputs, and K
with an offset that drifts along the sequence.

    python -m benchmarks.causal_exact table [--seq 4096] [--sigmas 1,3,5,8] [--seed 0]
    python -m benchmarks.causal_exact drift [--seq 4096] [--drift 5] [--start 0] [--sigma 1]

Relative L2 of O / dQ / dK / dV against fp64 attention, in both numerics
modes, with the option off and on, and on over off. `table`: Table 1's
inputs (`accuracy.inputs`; `--seed` another draw of the same). `drift`:
those inputs at `--sigma`, K plus b * s(t) with b ~ N(0, sigma^2) per
channel and s rising linearly from `--start` to `--drift` along the
sequence. The option smooths K by one mean, the first key block's, which a
drifting offset leaves partly in K - m (docs/algorithm.md, "Statistics over
what each row sees"). The reference (the default: the op takes the
reference with causal_exact) runs a cell in a few seconds at T=4096 on two
CPU cores.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

import benchmarks
import sagebwd_jax
from benchmarks import accuracy
from sagebwd_jax import metrics


def errors(q, k, v, do, quantization: str, causal_exact: bool, exact, implementation):
  ours = lambda q, k, v: sagebwd_jax.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation, quantization=quantization,
      causal_exact=causal_exact)
  o, vjp = jax.vjp(ours, q, k, v)
  return [float(metrics.relative_l2(a, b)) for a, b in zip((o, *vjp(do)), exact)]


def inputs(sigma: float, seq: int, seed: int = 0):
  """`accuracy.inputs`, or with `seed` another draw of them."""
  if seed == 0:
    return accuracy.inputs(sigma, seq)
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = (1, seq, 1, 128)
  q, k = (sigma * jax.random.normal(kk, shape) for kk in keys[:2])
  v, do = (jax.random.normal(kk, shape) for kk in keys[2:])
  return tuple(x.astype(jnp.bfloat16) for x in (q, k, v, do))


def drift_inputs(seq: int, drift: float, start: float = 0.0, sigma: float = 1.0,
                 seed: int = 0):
  q, k, v, do = inputs(sigma, seq, seed)
  b = sigma * jax.random.normal(jax.random.key(7), (1, 1, 1, k.shape[-1]))
  ramp = jnp.linspace(start, drift, seq)[None, :, None, None]
  return q, (k.astype(jnp.float32) + ramp * b).astype(k.dtype), v, do


def rows(name: str, q, k, v, do, implementation):
  """The case's table rows, one per numerics mode."""
  exact = accuracy.exact(q, k, v, do, causal=True)
  fmt = lambda xs: " / ".join(f"{x:.4f}" for x in xs)
  for mode in ("int8", "int8_fp8"):
    cells = []
    for causal_exact in (False, True):
      start = time.time()
      cells.append(errors(q, k, v, do, mode, causal_exact, exact, implementation))
      print(f"  [{name} {mode} causal_exact={causal_exact}: {time.time() - start:.0f} s]",
            file=sys.stderr, flush=True)
    off, on = cells
    ratio = " / ".join(f"{a / b:.3f}" for a, b in zip(on, off))
    print(f"| {name} | {mode} | {fmt(off)} | {fmt(on)} | {ratio} |", flush=True)


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.causal_exact")
  parser.add_argument("case", choices=["table", "drift"])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--sigmas", default="1,3,5,8", help="table: Q's and K's sigmas")
  parser.add_argument("--seed", type=int, default=0, help="the inputs' draw (0: Table 1's)")
  parser.add_argument("--sigma", type=float, default=1.0, help="drift: Q's and K's sigma")
  parser.add_argument("--drift", type=float, default=5.0,
                      help="drift: the offset at the last token, in sigmas")
  parser.add_argument("--start", type=float, default=0.0,
                      help="drift: the offset at the first token, in sigmas")
  parser.add_argument("--implementation", default=None)
  args = parser.parse_args()
  print("| case | mode | off: O / dQ / dK / dV | causal_exact | causal_exact / off |")
  print("|---|---|---|---|---|")
  seed = f", seed {args.seed}" if args.seed else ""
  if args.case == "table":
    for sigma in map(float, args.sigmas.split(",")):
      rows(f"sigma {sigma:g}{seed}", *inputs(sigma, args.seq, args.seed), args.implementation)
  else:
    rows(f"sigma {args.sigma:g}, offset {args.start:g}->{args.drift:g} sigma{seed}",
         *drift_inputs(args.seq, args.drift, args.start, args.sigma, args.seed),
         args.implementation)


if __name__ == "__main__":
  main()
