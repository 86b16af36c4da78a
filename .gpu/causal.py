"""Causal forward variants of the Triton kernel vs the Pallas kernels, one process."""
import dataclasses, os, sys, warnings
warnings.filterwarnings("ignore", category=DeprecationWarning)
import jax, jax.numpy as jnp
from benchmarks.attention import implementations, time_call
from pallas_kernels.jax_triton.backend import TritonBackend
from pallas_kernels.jax_triton.launch import LaunchConfig

orig = TritonBackend.tuned.__func__
STAGES = {"s": 3}
def tuned(cls, *, interpret=False):
  b = orig(cls, interpret=interpret)
  return dataclasses.replace(b, forward_launch=dataclasses.replace(b.forward_launch, num_stages=STAGES["s"]))
TritonBackend.tuned = classmethod(tuned)

impls = implementations()
variants = [("A diag-after s3", dict(DIAG_FIRST="0", NOLICM="0"), 3),
            ("B diag-first s2", dict(DIAG_FIRST="1", NOLICM="0"), 2),
            ("C diag-first s3", dict(DIAG_FIRST="1", NOLICM="0"), 3),
            ("D diag-first s3 nolicm", dict(DIAG_FIRST="1", NOLICM="1"), 3)]
shapes = [(16, 1024, 128), (4, 4096, 128), (1, 16384, 128), (4, 4096, 64)]
for causal in ([True, False] if "--both" in sys.argv else [True]):
  for batch, seq, d in shapes:
    heads = 2048 // d
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (batch, seq, heads, d), jnp.bfloat16) for kk in keys)
    flops = 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
    res = {}
    for rep in range(2):
      for name in ("cudnn", "sage"):
        f = jax.jit(lambda q, k, v, n=name: impls[n](q, k, v, causal))
        res.setdefault(name, []).append(flops / time_call(f, q, k, v) / 1e12)
      for label, env, s in variants:
        os.environ.update(env); STAGES["s"] = s
        f = jax.jit(lambda q, k, v: impls["sage_triton"](q, k, v, causal))
        res.setdefault(label, []).append(flops / time_call(f, q, k, v) / 1e12)
    c = sum(res["cudnn"]) / 2; p = sum(res["sage"]) / 2
    print(f"B{batch} T{seq} D{d} causal={causal}: cudnn {res['cudnn']} sage {res['sage']}")
    for label in res:
      r = res[label]
      print(f"  {label:24s} {' '.join(f'{x:.1f}' for x in r)}  x cudnn {max(r)/c:.3f}  x sage {max(r)/p:.3f}", flush=True)
