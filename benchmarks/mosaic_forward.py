"""The Mosaic GPU forward against the portable (Triton) forward and cuDNN BF16.

    PYTHONPATH=.:benchmarks python benchmarks/mosaic_forward.py [--seq 4096] [--variants all]

B=4, T=4096, H=16, D=128 by default, causal and not. Both SageBwd forwards are
timed on the same quantized inputs (the quantization pass is timed apart and
is the same for both); cuDNN on the bf16 inputs. TOPS = 4*B*H*T*T*D / time
(halved when causal). Each Mosaic variant's O and lse are checked against the
Triton forward's in the same run (relative L2). Writes mosaic_forward.csv to
--out (default $OUT, else nothing).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from benchmarks.attention import time_call, write_csv
from benchmarks.variants import Rows, parse_args, random_inputs, rel_l2
from pallas_kernels.triton.backend import PallasBackend
from pallas_kernels.triton.forward import forward
from pallas_kernels.mosaic.forward import MosaicLaunch, forward_mosaic
from pallas_kernels.types import Config, Masks
from sagebwd_jax.sagebwd import key_mean

warnings.filterwarnings("ignore", category=DeprecationWarning)

VARIANTS = {
    "mosaic": MosaicLaunch(),
    "mosaic_bits": MosaicLaunch(bit_tricks=True),
    "mosaic_3st": MosaicLaunch(max_concurrent_steps=3),
    "mosaic_bits_3st": MosaicLaunch(bit_tricks=True, max_concurrent_steps=3),
    "mosaic_nosched": MosaicLaunch(use_schedule_barrier=False),
    "mosaic_overlap": MosaicLaunch(overlap_qk=True),
    "mosaic_overlap_bits": MosaicLaunch(overlap_qk=True, bit_tricks=True),
    "mosaic_overlap_bits_3st": MosaicLaunch(overlap_qk=True, bit_tricks=True,
                                            max_concurrent_steps=3),
    "mosaic_overlap_nosched": MosaicLaunch(overlap_qk=True, use_schedule_barrier=False),
}


def main():
  args, names = parse_args(__doc__, VARIANTS)
  b, t, h, d = args.batch, args.seq, args.heads, args.head_dim
  q, k, v = random_inputs(args, 3)
  table = Rows(args, width=16)
  for causal in (False, True):
    config = Config(scale=d**-0.5, causal=causal, smooth_q=False, block_q=64, block_kv=64)
    pallas = PallasBackend.tuned(causal=causal)
    quantize = jax.jit(lambda q, k, v: pallas.quantize(q, k, v, key_mean(k, None), config))
    qkv = jax.block_until_ready(quantize(q, k, v))
    record = functools.partial(table.record, causal=causal,
                               flops=4 * b * h * t * t * d * (0.5 if causal else 1.0))
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    ref_row = record("cudnn", time_call(cudnn, q, k, v))
    record("quantize_pass", time_call(quantize, q, k, v))
    triton = jax.jit(lambda qkv: forward(qkv, Masks(), config, jnp.bfloat16, pallas.forward_launch))
    o_t, lse_t = jax.block_until_ready(triton(qkv))
    record("triton_fwd", time_call(triton, qkv))
    for name in names:
      fn = jax.jit(lambda qkv, launch=VARIANTS[name]: forward_mosaic(
          qkv, Masks(), config, jnp.bfloat16, launch))
      try:
        o, lse = jax.block_until_ready(fn(qkv))
        record(name, time_call(fn, qkv), o_rel_l2=rel_l2(o, o_t), lse_rel_l2=rel_l2(lse, lse_t))
      except Exception as e:  # report and go on with the other variants
        table.failed(name, causal, e)
    table.ratios(causal, ref_row)

  print("\n| impl | causal | ms | TOPS | x cuDNN | O rel L2 vs Triton | lse rel L2 |")
  print("|---|---|---|---|---|---|---|")
  for r in table.rows:
    print(f"| {r['impl']} | {r['causal']} | {r['ms']:.3f} | {r['tops']:.1f} | "
          f"{r['x_cudnn']:.2f} | {r.get('o_rel_l2', float('nan')):.2e} | "
          f"{r.get('lse_rel_l2', float('nan')):.2e} |")
  if args.out:
    write_csv(table.rows, args.out, "mosaic_forward.csv")


if __name__ == "__main__":
  main()
