"""dQ: one program per (query block, batch, query head) loops over the key
blocks its queries see, recomputing P and dS like the forward; dS is the
first operand of INT8 dS.K and is quantized per query (a row here), or with
ds_precision="bf16" cast to the inputs' dtype for a 16-bit dS.K."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton import common
from pallas_kernels import numerics as nm
from pallas_kernels.triton.common import LaunchConfig
from pallas_kernels.types import Config, Masks, QuantizedQKV


# int32 -> fp32 of S and of dS.K by the conversion instruction, not the bit
# trick (numerics.int32_to_float), as in the forward. Decided by kernel time
# in `python -m benchmarks.breakdown --impls sage` (docs/performance.md).
CONVERT_BIT_TRICKS = False


def _kernel(q8_ref, q_scale_ref, q_mean_ref, lse_ref, delta_ref, do_ref, q_ids_ref, k8_ref,
            k8_t_ref, k_scale_ref, v_ref, kv_ids_ref, k16_ref, dq_ref, *, config: Config,
            num_kv_blocks: int):
  block_q, block_kv = config.block_q, config.block_kv
  i = pl.program_id(0)
  q8, q_scale = q8_ref[...], common.q_scales(q_scale_ref, None, config)
  q_mean = None if q_mean_ref is None else q_mean_ref[...]
  lse, delta, do = lse_ref[...], delta_ref[...], do_ref[...]
  q_ids = None if q_ids_ref is None else q_ids_ref[...]

  def kv_step(j, dq, *, band):
    kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
    k_scale = common.block_scale(k_scale_ref, j * block_kv)
    s = common.score_tile(q8, q_scale, k8_ref[kv, :], k_scale, q_mean, q_start=i * block_q,
                          kv_start=j * block_kv, q_ids=q_ids,
                          kv_ids=None if kv_ids_ref is None else kv_ids_ref[kv],
                          band=band, bit_tricks=CONVERT_BIT_TRICKS)
    p = jnp.exp2(s - lse[:, None])
    ds = p * (nm.float_dot(do, v_ref[kv, :]) - delta[:, None])
    if k16_ref is not None:
      return dq + jnp.dot(ds.astype(k16_ref.dtype), k16_ref[kv, :],
                          preferred_element_type=jnp.float32)
    ds8, ds_scale = nm.quantize_rows(ds, bit_tricks=True)
    return dq + nm.dequantize(nm.int8_dot(ds8, k8_t_ref[:, kv]), ds_scale[:, None], k_scale,
                              bit_tricks=CONVERT_BIT_TRICKS)

  dq = common.loop_over_kv_blocks(i, kv_step, jnp.zeros(q8.shape, jnp.float32),
                                  config=config, num_kv_blocks=num_kv_blocks)
  dq_ref[...] = (dq * config.scale).astype(dq_ref.dtype)


def backward_dq(qkv: QuantizedQKV, v, lse, delta, do, masks: Masks, config: Config,
                launch: LaunchConfig):
  """dQ (B, Tq, H, D) in dO's dtype."""
  batch, heads, q_len, head_dim = qkv.q8.shape
  kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
  kv_head = common.head_map(heads // kv_heads)
  bq = config.block_q
  with_ids = masks.q_ids is not None
  rows = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  tokens = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
  kv_full = lambda i, b, h: (b, kv_head(h), 0, 0)
  in_specs = [
      pl.BlockSpec((None, None, bq, head_dim), lambda i, b, h: (b, h, i, 0)),
      rows,
      (pl.BlockSpec((None, None, None, head_dim), lambda i, b, h: (b, h, i, 0))
       if config.smooth_q else None),
      rows, rows, tokens,
      pl.BlockSpec((None, bq), lambda i, b, h: (b, i)) if with_ids else None,
      pl.BlockSpec((None, None, kv_len, head_dim), kv_full),
      pl.BlockSpec((None, None, head_dim, kv_len), kv_full),
      pl.BlockSpec((None, None, kv_len), lambda i, b, h: (b, kv_head(h), 0)),
      pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, kv_head(h), 0)),
      pl.BlockSpec((None, kv_len), lambda i, b, h: (b, 0)) if with_ids else None,
      (pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, kv_head(h), 0))
       if qkv.k16 is not None else None),
  ]
  kernel = functools.partial(_kernel, config=config, num_kv_blocks=kv_len // config.block_kv)
  return launch.call(kernel, grid=(q_len // bq, batch, heads), in_specs=in_specs,
                     out_specs=tokens,
                     out_shape=jax.ShapeDtypeStruct((batch, q_len, heads, head_dim),
                                                    do.dtype),
                     name="sagebwd_backward_dq")(
      qkv.q8, qkv.q_scale, qkv.q_mean, lse, delta, do, masks.q_ids, qkv.k8, qkv.k8_t,
      qkv.k_scale, v, masks.kv_ids, qkv.k16)
