"""The paper's Table 1: SageBwd's error against fp64 attention, beside the paper's.

    python -m benchmarks.accuracy [--implementation triton] [--seq 4096] [--ds-precision bf16]

Gaussian Q, K with sigma in {1, 3, 5, 8, 10}, V and dO with sigma 1, bf16
inputs, B=1, H=1, D=128. Prints cosine similarity / relative L2 of O, dQ, dK,
dV and the paper's relative L2, and whether ours is within 1.25x of it, one
sigma at a time. `--ds-precision bf16` runs the op's 16-bit dS.K and dS^T.Q
(the paper's figures stay those of its INT8 backward). Without a GPU the op
runs its pure-JAX reference (the kernels' int8 arithmetic), about a minute
per sigma on two CPU cores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import benchmarks
import sagebwd_jax
from sagebwd_jax import metrics

# sigma: (O, dQ, dK, dV) relative L2 from the paper's Table 1.
PAPER = {1: (.0160, .0184, .0220, .0159), 3: (.0389, .0758, .0777, .0387),
         5: (.0603, .2014, .2007, .0605), 8: (.0972, .4666, .4699, .0973),
         10: (.1161, .6648, .6684, .1157)}


def errors(sigma: float, seq: int, implementation: str | None, ds_precision: str = "int8"):
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (1, seq, 1, 128)
  q, k = (sigma * jax.random.normal(kk, shape) for kk in keys[:2])
  v, do = (jax.random.normal(kk, shape) for kk in keys[2:])
  q, k, v, do = (x.astype(jnp.bfloat16) for x in (q, k, v, do))
  ours = lambda q, k, v: sagebwd_jax.dot_product_attention(
      q, k, v, implementation=implementation, ds_precision=ds_precision)
  o, vjp = jax.vjp(ours, q, k, v)
  with jax.enable_x64(True):
    wide = [x.astype(jnp.float64) for x in (q, k, v, do)]
    o64, vjp64 = jax.vjp(sagebwd_jax.full_precision_attention, *wide[:3])
    grads64 = vjp64(wide[3])
    return [(float(metrics.cosine_similarity(a, b)), float(metrics.relative_l2(a, b)))
            for a, b in zip((o, *vjp(do)), (o64, *grads64))]


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.accuracy")
  parser.add_argument("--implementation", default=None, choices=["triton", "mosaic", "reference"],
                      help="the op's implementation (default: the op's own choice: the "
                           "Hopper backend on an H100/H200, Triton on other GPUs, the "
                           "reference without a GPU)")
  parser.add_argument("--seq", type=int, default=4096, help="T (default 4096)")
  parser.add_argument("--ds-precision", default="int8", choices=["int8", "bf16"],
                      help="precision of the backward's dS.K and dS^T.Q (default int8)")
  parser.add_argument("--sigmas", default=",".join(map(str, PAPER)),
                      help="comma list of the paper's sigmas to run")
  args = parser.parse_args()
  names = args.sigmas.split(",")
  unknown = [x for x in names if not x.isdigit() or int(x) not in PAPER]
  if unknown:
    parser.error(f"--sigmas: {unknown} not in the paper's Table 1 ({sorted(PAPER)})")
  sigmas = [int(x) for x in names]
  if args.implementation is None and jax.default_backend() != "gpu":
    print("no GPU: the op runs its pure-JAX reference on the CPU, about a minute per sigma",
          flush=True)
  print("| sigma | tensor | cosine | rel. L2 | paper rel. L2 | within 1.25x |")
  print("|---|---|---|---|---|---|")
  for sigma, paper in ((s, PAPER[s]) for s in sigmas):
    for name, (cos, rel), ref in zip(("O", "dQ", "dK", "dV"),
                                     errors(sigma, args.seq, args.implementation,
                                            args.ds_precision), paper):
      print(f"| {sigma} | {name} | {cos:.4f} | {rel:.4f} | {ref:.4f} | "
            f"{'yes' if rel <= 1.25 * ref else 'NO'} |", flush=True)


if __name__ == "__main__":
  main()
