"""Where the Mosaic forward's time goes: the kernel timed with parts removed.

    PYTHONPATH=.:benchmarks python benchmarks/mosaic_ablation.py [--seq 4096]

Each ablation edits the source of `pallas_kernels/mosaic/forward.py` (a
textual substitution, so the kernel itself carries no switches) and times the
result against the whole kernel and cuDNN BF16 on the same inputs, B=4,
H=16, D=128, causal and not. The ablated kernels compute wrong results by
design: only their time means anything. Writes mosaic_ablation.csv to --out
(default $OUT, else nothing).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import types
import warnings

import jax
import jax.numpy as jnp

from benchmarks.attention import time_call, write_csv
from pallas_kernels.triton.backend import PallasBackend
from pallas_kernels.types import Config, Masks
from sagebwd_jax.sagebwd import key_mean

warnings.filterwarnings("ignore", category=DeprecationWarning)

SOURCE = pathlib.Path(__file__).resolve().parents[1] / "pallas_kernels" / "mosaic" / "forward.py"

# name: (text in pallas_kernels/mosaic/forward.py, its replacement)
ABLATIONS = {
    # S goes to P.V unconverted: no dequantizing, max, exp2, sum or requantizing
    "no_softmax": [
        ("        s = nm.int32_to_float(s_int, bit_tricks=bit_tricks) * lax.broadcast_in_dim(",
         "        return s_int\n"
         "        s = nm.int32_to_float(s_int, bit_tricks=bit_tricks) * lax.broadcast_in_dim("),
        ("        m_tile = jnp.max(s, axis=1)\n",
         "        return (plgpu.layout_cast(jnp.full((BLOCK,), 1.0, jnp.float32), row), m, l,\n"
         "                v_scale_row)\n"),
    ],
    # the P.V accumulator added as raw bits: no conversion or per-row scaling
    "no_pv_convert": [
        ("        pv = nm.int32_to_float(pv, bit_tricks=bit_tricks)\n",
         "        return (acc * lax.broadcast_in_dim(alpha, acc.shape, [0])\n"
         "                + lax.bitcast_convert_type(pv, jnp.float32))\n"),
    ],
    # no proxy fence between the P store and the wgmma that reads it
    "no_commit": [
        ("                                       nonnegative=True, bit_tricks=bit_tricks)\n"
         "        plgpu.commit_smem()\n",
         "                                       nonnegative=True, bit_tricks=bit_tricks)\n"),
    ],
    # k and v scales from registers instead of a per-step global load
    "no_scale_loads": [
        ("        kv = pl.ds(j * BLOCK, BLOCK)\n        return (plgpu.load(",
         "        return (q_scale_row * 0.5, q_scale_row * 0.25)\n"
         "        kv = pl.ds(j * BLOCK, BLOCK)\n        return (plgpu.load("),
    ],
}
VARIANTS = [(), ("no_scale_loads",), ("no_commit",), ("no_pv_convert",), ("no_softmax",),
            ("no_softmax", "no_pv_convert")]


def ablated_module(names) -> types.ModuleType:
  """pallas_kernels/mosaic/forward.py with the named ablations applied, as a fresh module."""
  source = SOURCE.read_text()
  for name in names:
    for old, new in ABLATIONS[name]:
      if source.count(old) != 1:
        raise ValueError(f"ablation {name!r} no longer matches pallas_kernels/mosaic/forward.py: {old!r}")
      source = source.replace(old, new)
  module = types.ModuleType("mosaic_forward_" + "_".join(names))
  sys.modules[module.__name__] = module  # dataclasses look their module up
  exec(compile(source, str(SOURCE), "exec"), module.__dict__)
  return module


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--out", default=os.environ.get("OUT"))
  args = parser.parse_args()
  b, t, h, d = 4, args.seq, 16, 128
  q, k, v = (jax.random.normal(key, (b, t, h, d), jnp.bfloat16)
             for key in jax.random.split(jax.random.key(0), 3))
  rows = []
  for causal in (False, True):
    config = Config(scale=d**-0.5, causal=causal, smooth_q=False, block_q=64, block_kv=64)
    pallas = PallasBackend.tuned(causal=causal)
    qkv = jax.block_until_ready(jax.jit(
        lambda q, k, v: pallas.quantize(q, k, v, key_mean(k, None), config))(q, k, v))
    cudnn = time_call(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn")), q, k, v)
    print(f"causal={causal} cudnn {cudnn * 1e3:.3f} ms", flush=True)
    for overlap_qk in (False, True):
      for names in VARIANTS:
        module = ablated_module(names)
        launch = module.MosaicLaunch(bit_tricks=True, overlap_qk=overlap_qk)
        fn = jax.jit(lambda qkv, m=module, launch=launch: m.forward_mosaic(
            qkv, Masks(), config, jnp.bfloat16, launch))
        sec = time_call(fn, qkv)
        label = "+".join(names) or "whole kernel"
        rows.append(dict(causal=causal, overlap_qk=overlap_qk, ablation=label, ms=sec * 1e3,
                         x_cudnn=cudnn / sec))
        print(f"causal={causal!s:5} overlap_qk={overlap_qk!s:5} {label:>26} "
              f"{sec * 1e3:7.3f} ms  {cudnn / sec:.2f}x cuDNN", flush=True)
  if args.out:
    write_csv(rows, args.out, "mosaic_ablation.csv")


if __name__ == "__main__":
  main()
