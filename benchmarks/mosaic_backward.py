"""The Mosaic GPU backward kernels against the Triton ones and cuDNN.

    python -m benchmarks.mosaic_backward [--seq 4096] [--variants all]

B=4, T=4096, H=16, D=128 by default, causal and not. Every backward is timed
on the same inputs (the Triton quantization pass, forward and pre-pass; the
Mosaic kernels' transposed int8 tensors REGISTER_B, the Triton ones' TOKENS);
dK/dV and dQ apart. cuDNN's backward is its forward+backward minus its
forward, both timed here. TOPS = 2.5 * 4*B*H*T*T*D / time (halved when
causal). The stages around the kernels (the pre-pass in either layout, the
saturated rows' launch) are timed alone. Each Mosaic variant's dQ, dK, dV
are compared with the Triton kernels' in the same run (relative L2; both
quantize P^T per key to 0..255). The `_fp8` variants run the FP8 backward
(quantization="int8_fp8") on the reference's quantization, forward and
pre-pass, compared with the reference's FP8 backward; `fp8_operands` times
the stage that forms their operands (`pallas_kernels.fp8_operands`, XLA).
Writes mosaic_backward.csv to --out (default $OUT, else nothing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from benchmarks.attention import time_call, write_csv
from benchmarks.variants import Rows, parse_args, random_inputs, rel_l2
from pallas_kernels.jax_triton.backend import TritonBackend
from pallas_kernels.jax_triton.backward_dkdv import backward_dkdv
from pallas_kernels.jax_triton.backward_dq import backward_dq
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic.backward_dkdv import backward_dkdv_mosaic
from pallas_kernels.mosaic.backward_dq import backward_dq_mosaic
from pallas_kernels.mosaic.backward_dq_product import backward_dq_product
from pallas_kernels.layouts import REGISTER_B, arrange, to_layout
from pallas_kernels.fp8_operands import fp8_operands
from pallas_kernels.types import Config, Layouts, Masks
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

MOSAIC_LAYOUTS = Layouts(REGISTER_B, REGISTER_B)


VARIANTS = {
    "mosaic": BackwardTuning(),
    "mosaic_no_sched": BackwardTuning(schedule_barrier=False),
    "mosaic_3st": BackwardTuning(max_concurrent_steps=3),
    "mosaic_1wg": BackwardTuning(compute_wgs=1, schedule_barrier=False),
    "mosaic_fp8": BackwardTuning(),
    "mosaic_fp8_no_sched": BackwardTuning(schedule_barrier=False),
    "mosaic_fp8_pipelined": BackwardTuning(pipelined=True, schedule_barrier=False),
    "mosaic_fp8_pingpong": BackwardTuning(pipelined=True),
    # dK/dV alone with these (dQ's three-slot ring overflows shared memory at D=128).
    "mosaic_fp8_3st": (BackwardTuning(max_concurrent_steps=3), BackwardTuning()),
    "mosaic_fp8_pipelined_3st": (BackwardTuning(pipelined=True, schedule_barrier=False,
                                                max_concurrent_steps=3), BackwardTuning()),
    "mosaic_fp8_pingpong_3st": (BackwardTuning(pipelined=True, max_concurrent_steps=3),
                                BackwardTuning(pipelined=True)),
    "mosaic_fp8_overlap": BackwardTuning(pipelined=True, overlap=True),
    "mosaic_fp8_overlap_nosched": BackwardTuning(pipelined=True, overlap=True,
                                                 schedule_barrier=False),
    # dK/dV (the overlap) writes dS'' and dQ is its one product (`backward_dq_product`).
    "mosaic_fp8_overlap_product": BackwardTuning(pipelined=True, overlap=True,
                                                 schedule_barrier=False),
    "mosaic_fp8_overlap_turns": BackwardTuning(pipelined=True, overlap=True,
                                               schedule_barrier=False, issue_turns=True),
    "mosaic_fp8_overlap_nosched_3st": (BackwardTuning(pipelined=True, overlap=True,
                                                      schedule_barrier=False,
                                                      max_concurrent_steps=3),
                                       BackwardTuning(pipelined=True, overlap=True,
                                                      schedule_barrier=False)),
    "mosaic_fp8_overlap_3st": (BackwardTuning(pipelined=True, overlap=True,
                                              max_concurrent_steps=3),
                               BackwardTuning(pipelined=True, overlap=True)),
}


def tunings(name: str) -> tuple[BackwardTuning, BackwardTuning]:
  """A variant's dK/dV and dQ launch settings."""
  variant = VARIANTS[name]
  return variant if isinstance(variant, tuple) else (variant, variant)


def fp8_inputs(q, k, v, do, config: Config):
  """The FP8 backward's inputs as the op forms them (the reference's
  quantization, forward and pre-pass, in the Mosaic kernels' layouts, and
  the operands), the forward's row maxima, and the reference's FP8 dQ, dK,
  dV from them."""
  reference = ReferenceBackend()
  k_mean = key_mean(k, None)
  qkv = reference.quantize(q, k, v, k_mean, config, layouts=MOSAIC_LAYOUTS)._replace(
      q16=q, k16=(k.astype(jnp.float32) - k_mean[:, None]).astype(k.dtype))
  o, lse, row_max = reference.forward(qkv, Masks(), config, jnp.bfloat16)
  pre = reference.prepass(o, do, config, REGISTER_B)
  pre = pre._replace(fp8=operands(qkv, v, pre, row_max, lse, config))
  want = reference.backward(qkv, v, lse, do, pre, Masks(), config)
  return (qkv, v, lse, pre, do), row_max, want


def fp8_arguments(qkv, v, lse, pre, do):
  """The FP8 dK/dV and dQ kernels' arguments (`fp8_kernels`) from
  `fp8_inputs`' first."""
  return ((qkv, v, lse, pre.delta, do, pre.do8_t, pre.do_scale, pre.fp8),
          (qkv, v, lse, pre.delta, do, pre.fp8))


def fp8_kernels(name: str, config: Config):
  """A variant's FP8 dK/dV and dQ kernels, each on its `fp8_arguments`
  (a `_product` variant's dQ on `dq_arguments`)."""
  dkdv_tuning, dq_tuning = tunings(name)
  if name.endswith("_product"):
    return (lambda *a: backward_dkdv_mosaic(*a[:-1], Masks(), config, dkdv_tuning, fp8=a[-1],
                                            write_ds=True),
            lambda ds8, fp8: backward_dq_product(ds8, fp8, config, jnp.bfloat16))
  return (lambda *a: backward_dkdv_mosaic(*a[:-1], Masks(), config, dkdv_tuning, fp8=a[-1]),
          lambda *a: backward_dq_mosaic(*a[:-1], Masks(), config, dq_tuning, fp8=a[-1]))


def dq_arguments(dq_args, dkdv_outputs):
  """The dQ kernel's arguments: `dq_args`, or after a dK/dV that wrote dS''
  (a `_product` variant), dS'' and the FP8 operands."""
  return (dkdv_outputs[2], dq_args[-1]) if len(dkdv_outputs) == 3 else dq_args


def operands(qkv, v, pre, row_max, lse, config: Config):
  return fp8_operands(qkv, v, pre, row_max, lse, Masks(), config,
                      REGISTER_B)


def main():
  args, names = parse_args(__doc__, "benchmarks.mosaic_backward", VARIANTS)
  b, t, h, d = args.batch, args.seq, args.heads, args.head_dim
  q, k, v, do = random_inputs(args, 4)
  table = Rows(args, width=20)
  for causal in (False, True):
    config = Config(scale=d**-0.5, causal=causal, smooth_q=False, block_q=64, block_kv=64)
    triton = TritonBackend.tuned(causal=causal)

    @jax.jit
    def residuals(q, k, v, do):
      qkv = triton.quantize(q, k, v, key_mean(k, None), config)
      o, lse, _ = triton.forward(qkv, Masks(), config, jnp.bfloat16)
      return (qkv, lse) + triton.prepass(o, do, config)[:3]

    qkv, lse, delta, do8_t, do_scale = jax.block_until_ready(residuals(q, k, v, do))
    dkdv_args = (qkv, v, lse, delta, do, do8_t, do_scale)
    dq_args = (qkv, v, lse, delta, do)
    mosaic_qkv = arrange(qkv, Layouts(backward=REGISTER_B))
    mosaic_args = ((mosaic_qkv, v, lse, delta, do, to_layout(do8_t, REGISTER_B), do_scale),
                   (mosaic_qkv, v, lse, delta, do))
    record = functools.partial(table.record, causal=causal,
                               flops=2.5 * 4 * b * h * t * t * d * (0.5 if causal else 1.0))

    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    cudnn_fwd = time_call(jax.jit(attn), q, k, v)
    cudnn_both = time_call(jax.jit(jax.grad(loss, (0, 1, 2))), q, k, v)
    ref_row = record("cudnn_bwd", cudnn_both - cudnn_fwd)
    for name, layout in (("prepass", Layouts().backward), ("prepass_mosaic", REGISTER_B)):
      record(name, time_call(jax.jit(lambda o, do, layout=layout: triton.prepass(
          o, do, config, layout)), q, do))  # q: any random O
    # The stage every backward runs between the two: no row saturates here,
    # so its programs return at once.
    record("saturated_rows", time_call(jax.jit(
        lambda *a: triton.saturated_rows(*a, Masks(), config)), qkv, v, lse, do, delta))

    def time_pair(name, dkdv, dq, want=None, inputs=(dkdv_args, dq_args)):
      dkdv, dq = jax.jit(dkdv), jax.jit(dq)
      dkdv_args, dq_args = inputs
      try:
        dkdv_out = jax.block_until_ready(dkdv(*dkdv_args))
        (dk, dv, *_), dq_args = dkdv_out, dq_arguments(dq_args, dkdv_out)
        dq_out = jax.block_until_ready(dq(*dq_args))
        t_dkdv, t_dq = time_call(dkdv, *dkdv_args), time_call(dq, *dq_args)
      except Exception as e:  # report and go on with the other variants
        table.failed(name, causal, e)
        return None
      extra = dict(dkdv_ms=t_dkdv * 1e3, dq_ms=t_dq * 1e3)
      if want is not None:
        extra.update(dq_rel=rel_l2(dq_out, want[0]), dk_rel=rel_l2(dk, want[1]),
                     dv_rel=rel_l2(dv, want[2]))
      record(name, t_dkdv + t_dq, **extra)
      return dq_out, dk, dv

    want = time_pair("triton",
                     lambda *a: backward_dkdv(*a, Masks(), config, triton.dkdv_launch),
                     lambda *a: backward_dq(*a, Masks(), config, triton.dq_launch))
    for name in (n for n in names if "fp8" not in n):
      time_pair(name,
                lambda *a, l=tunings(name)[0]: backward_dkdv_mosaic(*a, Masks(), config, l),
                lambda *a, l=tunings(name)[1]: backward_dq_mosaic(*a, Masks(), config, l),
                want, mosaic_args)
    fp8_names = [n for n in names if "fp8" in n]
    if fp8_names:
      fp8_config = dataclasses.replace(config, quantization="int8_fp8")
      fp8_args, row_max, fp8_want = jax.block_until_ready(
          jax.jit(functools.partial(fp8_inputs, config=fp8_config))(q, k, v, do))
      qkv8, v8, lse8, pre8, do8 = fp8_args
      record("fp8_operands", time_call(jax.jit(functools.partial(operands, config=fp8_config)),
                                       qkv8, v8, do8, pre8, row_max, lse8))
      pair = fp8_arguments(*fp8_args)
      for name in fp8_names:
        time_pair(name, *fp8_kernels(name, fp8_config), fp8_want, pair)
    table.ratios(causal, ref_row)

  print("\n| impl | causal | ms (dK/dV + dQ) | TOPS | x cuDNN bwd | dQ / dK / dV rel L2 vs Triton "
        "(FP8: vs the reference) |")
  print("|---|---|---|---|---|---|")
  for r in table.rows:
    split = f" ({r['dkdv_ms']:.3f} + {r['dq_ms']:.3f})" if "dkdv_ms" in r else ""
    errors = (f"{r['dq_rel']:.1e} / {r['dk_rel']:.1e} / {r['dv_rel']:.1e}"
              if "dq_rel" in r else "-")
    print(f"| {r['impl']} | {r['causal']} | {r['ms']:.3f}{split} | {r['tops']:.1f} | "
          f"{r['x_cudnn']:.2f} | {errors} |")
  if args.out:
    write_csv(table.rows, args.out, "mosaic_backward.csv")


if __name__ == "__main__":
  main()
