import os, sys, tempfile
import jax, jax.numpy as jnp
from benchmarks import sass
from sagebwd_jax import dot_product_attention
causal = "--nc" not in sys.argv
D = 64 if "--d64" in sys.argv else 128
shape = jax.ShapeDtypeStruct((1, 4096, 2, D), jnp.bfloat16)
f = lambda q, k, v: dot_product_attention(q, k, v, implementation="triton", is_causal=causal)
for launch in sass.triton_launches(f, shape, shape, shape):
  if "forward" not in launch.name: continue
  for stages in (2, 3):
    with tempfile.TemporaryDirectory() as tmp:
      cubin = os.path.join(tmp, "k.cubin")
      open(cubin, "wb").write(launch.compile(90, 4, stages))
      ins, labels = sass.parse_listing(sass.listing(cubin))
      regs, stack = sass.resources(cubin)
    print(f"stages={stages} regs={regs} stack={stack}", launch.constants["BQ"], launch.constants["BK"])
    sass.report_loops(ins, labels, launch.constants["BQ"] * launch.constants["BK"] / 128, int(os.environ.get("LINES", "0")))
