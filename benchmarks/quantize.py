"""The passes around the attention kernels against the GPU's copy bandwidth.

    python -m benchmarks.quantize [--shapes 4x4096x16x128,16x1024x16x128] [--warps 8]
        [--out DIR]

For each shape (B x T x H x D, bf16; H = Hkv), in one process: first a
device-to-device copy of a 1 GiB buffer, as an XLA copy and as an elementwise
kernel (its bytes read + written over its time: the copy bandwidth, the
larger of the two); then each pass of the op's data flow, with the bytes it
must move (each input read once, each output written once: from the arrays'
sizes), its GPU time (kernels of a `jax.profiler` trace, per call, summed
over the pass's launches) and that rate as a share of the copy's:

  k_mean            K's mean for K-smoothing (XLA): K's first read
  k_mean_by_blocks  a candidate for it: sums of 64-key blocks, then of those
  quantize_fwd      the quantization pass of a forward alone, V8^T REGISTER_B
                    (the Mosaic forward's layout)
  quantize_fwd_bwd  the same with Q8^T and K8^T REGISTER_B (a gradient follows)
  quantize_tokens   the same, every layout TOKENS (the portable kernels')
  quantize_fp8_fwd  quantization="int8_fp8"'s pass of a forward alone, V8^T
                    E4M3 per 64-key block REGISTER_B (the Mosaic FP8
                    forward's): one launch, as the INT8 pass
  quantize_fp8_fwd_bwd  the same with K8^T REGISTER_B (no Q8^T in FP8) and
                    the FP8 backward's key side (K'^T REGISTER_B, its scales,
                    V's block norms: `types.Fp8Keys`)
  quantize_fp8_xla  the same in XLA: the reference's pass, which the Hopper
                    backend ran for the mode before the Triton one
  prepass           the backward pre-pass, dO8^T REGISTER_B
  prepass_tokens    the same, TOKENS
  fp8_operands_xla  quantization="int8_fp8"'s backward operands (Q'^T, K'^T
                    REGISTER_B, b_i, the factors) from Q, the smoothed K, V
                    and the forward's and pre-pass's rows: the XLA pass
                    (`pallas_kernels.fp8_operands`)
  fp8_operands      the same in one Triton launch (jax_triton/fp8_operands.py),
                    the key side from quantize_fp8_fwd_bwd
  forward_total     k_mean + quantize_fwd_bwd: what the op's forward runs
                    before its kernel, K read twice
  forward_total_fp8 k_mean + quantize_fp8_fwd_bwd, the same in the FP8 mode

Issue 31's bar: every pass at >= 0.70 of the copy. Writes quantize.csv to
--out (default $OUT, else nothing). Needs a GPU.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

import benchmarks
from benchmarks.attention import time_call, write_csv
from benchmarks.breakdown import profile
from pallas_kernels import fp8_operands as xla_fp8
from pallas_kernels.jax_triton import fp8_operands as triton_fp8
from pallas_kernels.jax_triton.backend import TritonBackend
from pallas_kernels.layouts import REGISTER_B, TOKENS
from pallas_kernels.types import Config, Layouts, Masks, Prepass, QuantizedQKV
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import key_mean

COPY_BYTES = 1 << 30


def moved_bytes(fn, *args) -> tuple[int, int]:
  """(bytes read, bytes written) by `fn(*args)` if it reads each input and
  writes each output once."""
  size = lambda tree: sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
  return size(args), size(jax.eval_shape(fn, *args))


def device_seconds(fn, args, iters: int) -> float:
  """GPU time per call of the compiled `fn(*args)`, summed over its kernels
  (wall time per call, `time_call`'s, where the trace shows none: a copy the
  runtime does by DMA may not appear among a stream's kernels)."""
  return sum(t for t, _ in profile(fn, args, iters).values()) or time_call(fn, *args)


def copy_bandwidth(iters: int) -> dict[str, float]:
  """Bytes per second (read + written) of a 1 GiB device-to-device copy."""
  x = jnp.arange(COPY_BYTES // 4, dtype=jnp.uint32)
  copies = {"copy_xla": jax.jit(jnp.copy), "copy_kernel": jax.jit(lambda x: x ^ 1)}
  return {name: 2 * COPY_BYTES / device_seconds(fn, (x,), iters)
          for name, fn in copies.items()}


def key_mean_by_blocks(k: jax.Array) -> jax.Array:
  """`key_mean(k, None)` summed in two reductions, 64 keys then the blocks: a
  candidate (issue 31), whose first reduction has T / 64 times the outputs
  of XLA's single one over T (0.54 of the copy at T=4096) to spread over the
  GPU."""
  batch, seq, heads, head_dim = k.shape
  blocks = k.astype(jnp.float32).reshape(batch, seq // 64, 64, heads, head_dim).sum(axis=2)
  return blocks.sum(axis=1) / seq


def passes(batch: int, seq: int, heads: int, head_dim: int,
           quantize_warps: int | None = None) -> dict:
  """{name: (jitted fn, args)} for each pass the module docstring lists; the
  Triton quantization passes at `quantize_warps` warps (None: the backend's)."""
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v, o, do = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.bfloat16)
                    for key in keys)
  config = Config(scale=head_dim**-0.5, causal=False, smooth_q=False, block_q=64, block_kv=64)
  fp8_config = dataclasses.replace(config, quantization="int8_fp8")
  triton = TritonBackend.tuned(causal=False)
  if quantize_warps is not None:
    triton = dataclasses.replace(triton, quantize_launch=dataclasses.replace(
        triton.quantize_launch, num_warps=quantize_warps))
  k_mean = key_mean(k, None)

  def quantize(for_backward: bool, layouts: Layouts, config: Config = config,
               backend=triton):
    return jax.jit(lambda q, k, v, k_mean: backend.quantize(
        q, k, v, k_mean, config, for_backward=for_backward, layouts=layouts))

  def prepass(layout):
    return jax.jit(lambda o, do: triton.prepass(o, do, config, layout))

  # Only what each pass reads: Q, and the smoothed K in 16 bits and V (XLA)
  # or the key side's scales and norms, which the quantization pass formed
  # (Triton); dO's scales and norms, the forward's row maxima and lse and
  # Delta (B, H, T).
  rows = [jax.random.normal(key, (batch, heads, seq), jnp.float32)
          for key in jax.random.split(jax.random.key(1), 5)]
  rows = (jnp.abs(rows[0]), jnp.abs(rows[1]), *rows[2:])
  prepass_rows = lambda do_scale, do_norm, row_max, lse, delta: (
      Prepass(delta=delta, do8_t=None, do_scale=do_scale, do_norm=do_norm), row_max, lse)
  fp8_keys = quantize(True, Layouts(REGISTER_B, REGISTER_B), fp8_config)(
      q, k, v, k_mean).fp8_keys
  v_shape = jax.ShapeDtypeStruct(v.shape, v.dtype)  # the Triton pass reads V's shape alone

  def xla_operands(q16, k16, v, *rows):
    qkv = QuantizedQKV(*[None] * 9, q16=q16, k16=k16)
    return xla_fp8.fp8_operands(qkv, v, *prepass_rows(*rows), Masks(), fp8_config, REGISTER_B)

  def triton_operands(q16, k_scale, v_norm, *rows):
    # K'^T passes through untouched: not among what the pass reads or writes.
    k8_t = jnp.zeros(fp8_keys.k8_t.shape, fp8_keys.k8_t.dtype)
    qkv = QuantizedQKV(*[None] * 9, q16=q16, fp8_keys=fp8_keys._replace(
        k8_t=k8_t, k_scale=k_scale, v_norm=v_norm))
    return triton_fp8.fp8_operands(qkv, v_shape, *prepass_rows(*rows), Masks(), fp8_config,
                                   REGISTER_B, triton.dq_launch)._replace(k8_t=None)

  return {
      "k_mean": (jax.jit(lambda k: key_mean(k, None)), (k,)),
      "k_mean_by_blocks": (jax.jit(key_mean_by_blocks), (k,)),
      "quantize_fwd": (quantize(False, Layouts(forward=REGISTER_B)), (q, k, v, k_mean)),
      "quantize_fwd_bwd": (quantize(True, Layouts(REGISTER_B, REGISTER_B)), (q, k, v, k_mean)),
      "quantize_tokens": (quantize(True, Layouts(TOKENS, TOKENS)), (q, k, v, k_mean)),
      "quantize_fp8_fwd": (quantize(False, Layouts(forward=REGISTER_B), fp8_config),
                           (q, k, v, k_mean)),
      "quantize_fp8_fwd_bwd": (quantize(True, Layouts(REGISTER_B, REGISTER_B), fp8_config),
                               (q, k, v, k_mean)),
      "quantize_fp8_xla": (quantize(True, Layouts(REGISTER_B, REGISTER_B), fp8_config,
                                    ReferenceBackend()), (q, k, v, k_mean)),
      "prepass": (prepass(REGISTER_B), (o, do)),
      "prepass_tokens": (prepass(TOKENS), (o, do)),
      "fp8_operands_xla": (jax.jit(xla_operands), (q, k, v, *rows)),
      "fp8_operands": (jax.jit(triton_operands),
                       (q, fp8_keys.k_scale, fp8_keys.v_norm, *rows)),
  }


def row(shape: str, name: str, read: int, written: int, seconds: float, copy: float) -> dict:
  rate = (read + written) / seconds
  return dict(shape=shape, name=name, mb_read=read / 1e6, mb_written=written / 1e6,
              us=seconds * 1e6, tb_s=rate / 1e12, x_copy=rate / copy)


def main():
  parser = benchmarks.parser(__doc__, "benchmarks.quantize")
  parser.add_argument("--shapes", default="4x4096x16x128,16x1024x16x128",
                      help="B x T x H x D, comma-separated")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--warps", default="",
                      help="also time the Triton quantization passes at these num_warps "
                           "(comma-separated), as quantize_*@<warps>")
  parser.add_argument("--out", default=os.environ.get("OUT"))
  args = parser.parse_args()
  benchmarks.require_gpu("benchmarks.quantize")
  if jax.default_backend() != "gpu":
    raise SystemExit("benchmarks.quantize times GPU kernels: run it on a GPU")

  copies = copy_bandwidth(args.iters)
  copy = max(copies.values())
  print(", ".join(f"{name} {rate / 1e12:.2f} TB/s" for name, rate in copies.items()))
  rows = []
  for shape in args.shapes.split(","):
    batch, seq, heads, head_dim = (int(x) for x in shape.split("x"))
    totals = {}
    for name, (fn, fn_args) in passes(batch, seq, heads, head_dim).items():
      read, written = moved_bytes(fn, *fn_args)
      totals[name] = (read, written, device_seconds(fn, fn_args, args.iters))
      rows.append(row(shape, name, *totals[name], copy))
    for total, quantize_pass in (("forward_total", "quantize_fwd_bwd"),
                                 ("forward_total_fp8", "quantize_fp8_fwd_bwd")):
      parts = [totals[name] for name in ("k_mean", quantize_pass)]
      rows.append(row(shape, total, *map(sum, zip(*parts)), copy))
    for warps in filter(None, args.warps.split(",")):
      for name, (fn, fn_args) in passes(batch, seq, heads, head_dim, int(warps)).items():
        if name.startswith("quantize") and not name.endswith("_xla"):
          timed = (*moved_bytes(fn, *fn_args), device_seconds(fn, fn_args, args.iters))
          rows.append(row(shape, f"{name}@{warps}", *timed, copy))

  print(f"\n| shape | pass | MB read | MB written | us | TB/s | x copy ({copy / 1e12:.2f} TB/s) |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['shape']} | {r['name']} | {r['mb_read']:.1f} | {r['mb_written']:.1f} | "
          f"{r['us']:.1f} | {r['tb_s']:.2f} | {r['x_copy']:.2f} |")
  if args.out:
    write_csv(rows + [dict(name=name, tb_s=rate / 1e12) for name, rate in copies.items()],
              args.out, "quantize.csv")


if __name__ == "__main__":
  main()
