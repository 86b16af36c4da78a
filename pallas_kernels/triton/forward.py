"""The forward kernel: INT8 Q.K^T, online softmax, INT8 P.V.

One program per (query block, batch, query head); it loops over the key
blocks its queries can see (block skipping under causality or a window),
applying the mask only on the blocks the band's edges cross. P follows `numerics.folded_softmax_step` with one
key block per step: P = round(127 * exp2(S - the row's max in the block)),
with the row's accumulators rescaled to each block's max and V's block scale,
so the largest P of every row of every tile is exactly 127.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton import common
from pallas_kernels import numerics as nm
from pallas_kernels.triton.common import LaunchConfig
from pallas_kernels.types import Config, Masks, QuantizedQKV


# int32 -> fp32 of P.V by the conversion instruction, not the bit trick
# (numerics.int32_to_float, which says why the faster one depends on the
# kernel): here the instruction measured faster. Decided by kernel time in
# `python -m benchmarks.breakdown --impls sage` (figures: docs/performance.md).
# (S's conversions are `numerics.block_scores`', always instructions.)
CONVERT_BIT_TRICKS = False


def _kernel(q8_ref, q_scale_ref, q_mean_ref, k8_ref, k_scale_ref, v8_t_ref, v_scale_ref,
            q_ids_ref, kv_ids_ref, o_ref, lse_ref, *, config: Config, num_kv_blocks: int):
  block_q, block_kv = config.block_q, config.block_kv
  i = pl.program_id(0)
  q8, q_scale = q8_ref[...], common.q_scales(q_scale_ref, None, config)
  q_mean = None if q_mean_ref is None else q_mean_ref[...]
  q_ids = None if q_ids_ref is None else q_ids_ref[...]

  def kv_step(j, carry, *, band):
    acc, m, e, l = carry
    kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
    k8, k_scale = k8_ref[kv, :], common.block_scale(k_scale_ref, j * block_kv)
    mask = common.tile_mask(
        block_q, block_kv, q_start=i * block_q, kv_start=j * block_kv, q_ids=q_ids,
        kv_ids=None if kv_ids_ref is None else kv_ids_ref[kv], band=band)
    bias = None if q_mean is None else nm.q_smoothing_bias(k8, k_scale, q_mean)[None, :]
    scores = nm.block_scores(nm.int8_dot(q8, k8), q_scale * k_scale, mask=mask, bias=bias)
    v_scale = common.block_scale(v_scale_ref, j * block_kv)
    # An all-zero V block (scale 0) quantizes to zeros: any factor will do.
    v_scale = jnp.where(v_scale == 0, 1.0, v_scale)
    p, alpha, m, e, l = nm.folded_softmax_step([scores], [jnp.log2(v_scale)],
                                               [1.0 / v_scale], m, e, l, levels=nm.INT8_MAX)
    p8 = nm.round_to_int8(p, nonnegative=True, bit_tricks=True)
    pv = nm.int32_to_float(nm.int8_dot(p8, v8_t_ref[:, kv]), bit_tricks=CONVERT_BIT_TRICKS)
    return acc * alpha[:, None] + pv, m, e, l

  head_dim = q8.shape[-1]
  row = lambda x: jnp.full((block_q,), x, jnp.float32)
  carry = (jnp.zeros((block_q, head_dim), jnp.float32), row(nm.NOTHING_SEEN), row(-jnp.inf),
           row(0.0))
  acc, _, e, l = common.loop_over_kv_blocks(i, kv_step, carry, config=config,
                                            num_kv_blocks=num_kv_blocks)
  o, lse = nm.finalize_folded_rows(acc, e, l, levels=nm.INT8_MAX)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def forward(qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype,
            launch: LaunchConfig):
  """O (B, Tq, H, D) in `out_dtype` and the base-2 log-sum-exp (B, H, Tq)."""
  batch, heads, q_len, head_dim = qkv.q8.shape
  kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
  kv_head = common.head_map(heads // kv_heads)
  bq = config.block_q
  q_block = lambda i, b, h: (b, h, i, 0)
  kv_full = lambda i, b, h: (b, kv_head(h), 0, 0)
  kv_scale = lambda i, b, h: (b, kv_head(h), 0)
  with_ids = masks.q_ids is not None
  in_specs = [
      pl.BlockSpec((None, None, bq, head_dim), q_block),
      pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
      pl.BlockSpec((None, None, None, head_dim), q_block) if config.smooth_q else None,
      pl.BlockSpec((None, None, kv_len, head_dim), kv_full),
      pl.BlockSpec((None, None, kv_len), kv_scale),
      pl.BlockSpec((None, None, head_dim, kv_len), kv_full),
      pl.BlockSpec((None, None, kv_len), kv_scale),
      pl.BlockSpec((None, bq), lambda i, b, h: (b, i)) if with_ids else None,
      pl.BlockSpec((None, kv_len), lambda i, b, h: (b, 0)) if with_ids else None,
  ]
  out_specs = [pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0)),
               pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))]
  out_shape = [jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
               jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)]
  kernel = functools.partial(_kernel, config=config, num_kv_blocks=kv_len // config.block_kv)
  return launch.call(kernel, grid=(q_len // bq, batch, heads), in_specs=in_specs,
                     out_specs=out_specs, out_shape=out_shape, name="sagebwd_forward")(
                         qkv.q8, qkv.q_scale, qkv.q_mean, qkv.k8, qkv.k_scale, qkv.v8_t,
                         qkv.v_scale, masks.q_ids, masks.kv_ids)
