"""The Mosaic GPU forward against the Triton forward and cuDNN BF16.

    python -m benchmarks.mosaic_forward [--seq 4096] [--variants all]

B=4, T=4096, H=16, D=128 by default, causal and not. Both INT8 forwards are
timed on the same quantized values (the quantization pass is timed apart, in
the layouts of each: `quantize_pass` TOKENS, `quantize_pass_mosaic` with V^T
REGISTER_B); cuDNN on the bf16 inputs. TOPS = 4*B*H*T*T*D / time (halved when causal). Each
Mosaic variant's O and lse are checked against `ReferenceBackend(MOSAIC_NUMERICS)`
run on the same device (relative L2). Then quantization="int8_fp8": its
quantization (the reference's XLA pass: Q, K int8, V^T E4M3 per 64-key
block REGISTER_B; `quantize_fp8_xla`) and the Mosaic FP8 forward (`mosaic_fp8`),
checked against the reference's FP8 forward in 128-key steps, under each
schedule (`mosaic_fp8_pipelined`: P.V issued with the next step's S;
`mosaic_fp8_pingpong`: that with the schedule barrier, one turn a step;
`mosaic_fp8_overlap`: the next S first, its softmax under P.V).
Causal, both modes again with `causal_exact=True` (`mosaic_causal_exact`,
`mosaic_fp8_causal_exact`: the reference's passes, K's first-block mean, the
16-bit operands), against `mosaic` and `mosaic_fp8`. Writes
mosaic_forward.csv to --out (default $OUT, else nothing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from benchmarks.attention import time_call, write_csv
from benchmarks.variants import Rows, parse_args, random_inputs, rel_l2
from pallas_kernels.jax_triton.backend import TritonBackend
from pallas_kernels.jax_triton.forward import forward
from pallas_kernels.mosaic.backend import MOSAIC_NUMERICS, MosaicBackend
from pallas_kernels.mosaic.forward import KV_STEP, ForwardTuning, forward_mosaic
from pallas_kernels.types import Config, Layouts, Masks, Numerics, TransposedLayout
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean, quantize


VARIANTS = {
    "mosaic": ForwardTuning(),
    "mosaic_3st": ForwardTuning(max_concurrent_steps=3),
    "mosaic_nosched": ForwardTuning(schedule_barrier=False),
    "mosaic_1wg": ForwardTuning(compute_wgs=1, schedule_barrier=False),
    "mosaic_fp8": ForwardTuning(),
    "mosaic_fp8_pipelined": ForwardTuning(pipelined=True, schedule_barrier=False),
    "mosaic_fp8_pingpong": ForwardTuning(pipelined=True),
    "mosaic_fp8_pingpong_3st": ForwardTuning(pipelined=True, max_concurrent_steps=3),
    "mosaic_fp8_pingpong_4st": ForwardTuning(pipelined=True, max_concurrent_steps=4),
    "mosaic_fp8_overlap": ForwardTuning(pipelined=True, overlap=True, schedule_barrier=False),
    "mosaic_fp8_overlap_pingpong": ForwardTuning(pipelined=True, overlap=True),
    "mosaic_fp8_overlap_turns": ForwardTuning(pipelined=True, overlap=True,
                                              schedule_barrier=False, issue_turns=True),
    "mosaic_fp8_overlap_pingpong_3st": ForwardTuning(pipelined=True, overlap=True,
                                                     max_concurrent_steps=3),
}
FP8_PREFIX = "mosaic_fp8"  # variants run with quantization="int8_fp8"
# The FP8 forward's reference: its numerics, P quantized per 128-key step.
REFERENCE_FP8 = ReferenceBackend(Numerics(p_block=KV_STEP))


def quantize_fp8(q, k, v, config: Config):
  """The FP8 forward's QuantizedQKV: the reference's XLA pass, V^T E4M3 per
  64-key block REGISTER_B."""
  return REFERENCE_FP8.quantize(q, k, v, key_mean(k, None), config, for_backward=False,
                                layouts=Layouts(forward=TransposedLayout.REGISTER_B))


def time_variants(names, config: Config, qkv, want, record, table: Rows):
  """The Mosaic forward under each variant of `names` on `qkv`, timed, its O
  and lse checked against `want` (the reference's)."""
  o_ref, lse_ref = want
  for name in names:
    fn = jax.jit(lambda qkv, tuning=VARIANTS[name]: forward_mosaic(
        qkv, Masks(), config, jnp.bfloat16, tuning))
    try:
      o, lse, _ = jax.block_until_ready(fn(qkv))
      record(name, time_call(fn, qkv), o_rel_l2=rel_l2(o, o_ref), lse_rel_l2=rel_l2(lse, lse_ref))
    except Exception as e:  # report and go on with the other variants
      table.failed(name, config.causal, e)


def exact_inputs(q, k, v, config: Config):
  """The forward's QuantizedQKV for `config` (causal_exact's operands
  included) from the reference's passes in the Mosaic layouts."""
  passes = MosaicBackend(ReferenceBackend(), fp8_fallback=ReferenceBackend())
  return jax.jit(lambda q, k, v: quantize(q, k, v, Masks(), config, passes, True, False))(
      q, k, v)


def time_causal_exact(config: Config, q, k, v, record, table: Rows):
  """The forward with causal_exact in both modes, on the reference's passes
  in the Mosaic layouts, checked against the reference's forward on the
  same device."""
  for name, mode in (("mosaic_causal_exact", "int8"), ("mosaic_fp8_causal_exact", "int8_fp8")):
    exact = dataclasses.replace(config, quantization=mode, causal_exact=True)
    qkv = exact_inputs(q, k, v, exact)
    o_ref, lse_ref, _ = jax.block_until_ready(jax.jit(lambda qkv: ReferenceBackend(
        MOSAIC_NUMERICS).forward(qkv, Masks(), exact, jnp.bfloat16))(qkv))
    fn = jax.jit(lambda qkv: forward_mosaic(qkv, Masks(), exact, jnp.bfloat16))
    try:
      o, lse, _ = jax.block_until_ready(fn(qkv))
      record(name, time_call(fn, qkv), o_rel_l2=rel_l2(o, o_ref), lse_rel_l2=rel_l2(lse, lse_ref))
    except Exception as e:  # report and go on with the other variants
      table.failed(name, True, e)


def main():
  args, names = parse_args(__doc__, "benchmarks.mosaic_forward", VARIANTS)
  b, t, h, d = args.batch, args.seq, args.heads, args.head_dim
  q, k, v = random_inputs(args, 3)
  table = Rows(args, width=16)
  for causal in (False, True):
    config = Config(scale=d**-0.5, causal=causal, smooth_q=False, block_q=64, block_kv=64)
    triton = TritonBackend.tuned(causal=causal)
    quantize = jax.jit(lambda q, k, v, layouts=Layouts(): triton.quantize(
        q, k, v, key_mean(k, None), config, layouts=layouts), static_argnames="layouts")
    qkv = jax.block_until_ready(quantize(q, k, v))
    mosaic_layouts = Layouts(forward=TransposedLayout.REGISTER_B)
    qkv_mosaic = jax.block_until_ready(quantize(q, k, v, mosaic_layouts))
    record = functools.partial(table.record, causal=causal,
                               flops=4 * b * h * t * t * d * (0.5 if causal else 1.0))
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    ref_row = record("cudnn", time_call(cudnn, q, k, v))
    record("quantize_pass", time_call(quantize, q, k, v))
    record("quantize_pass_mosaic", time_call(functools.partial(quantize, layouts=mosaic_layouts),
                                             q, k, v))
    triton_forward = jax.jit(lambda qkv: forward(qkv, Masks(), config, jnp.bfloat16,
                                                 triton.forward_launch))
    record("triton_fwd", time_call(triton_forward, qkv))
    reference = jax.jit(lambda qkv: ReferenceBackend(MOSAIC_NUMERICS).forward(
        qkv, Masks(), config, jnp.bfloat16))
    o_ref, lse_ref, _ = jax.block_until_ready(reference(qkv))
    time_variants([name for name in names if not name.startswith(FP8_PREFIX)], config,
                  qkv_mosaic, (o_ref, lse_ref), record, table)
    fp8 = dataclasses.replace(config, quantization="int8_fp8")
    fp8_pass = jax.jit(functools.partial(quantize_fp8, config=fp8))
    qkv_fp8 = jax.block_until_ready(fp8_pass(q, k, v))
    record("quantize_fp8_xla", time_call(fp8_pass, q, k, v))
    o_ref, lse_ref, _ = jax.block_until_ready(jax.jit(lambda qkv: REFERENCE_FP8.forward(
        qkv, Masks(), fp8, jnp.bfloat16))(qkv_fp8))
    time_variants([name for name in names if name.startswith(FP8_PREFIX)], fp8, qkv_fp8,
                  (o_ref, lse_ref), record, table)
    if causal:  # the op applies causal_exact with causality only
      time_causal_exact(config, q, k, v, record, table)
    table.ratios(causal, ref_row)

  print("\n| impl | causal | ms | TOPS | x cuDNN | O rel L2 vs reference | lse rel L2 |")
  print("|---|---|---|---|---|---|---|")
  for r in table.rows:
    print(f"| {r['impl']} | {r['causal']} | {r['ms']:.3f} | {r['tops']:.1f} | "
          f"{r['x_cudnn']:.2f} | {r.get('o_rel_l2', float('nan')):.2e} | "
          f"{r.get('lse_rel_l2', float('nan')):.2e} |")
  if args.out:
    write_csv(table.rows, args.out, "mosaic_forward.csv")


if __name__ == "__main__":
  main()
