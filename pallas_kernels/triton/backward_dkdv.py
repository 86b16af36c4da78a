"""dK and dV: one program per (key block, batch, query head) loops over the
query blocks that see its keys. It works on transposed tiles (S^T = K.Q^T,
dP^T = V.dO^T) so P^T and dS^T are the first operands of their INT8 dots and
are quantized per key (a row here); with ds_precision="bf16" dS^T.Q runs in
the inputs' dtype instead. With GQA each query head writes its own
partial dK, dV; the caller sums the group."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton import common
from pallas_kernels import numerics as nm
from pallas_kernels.triton.common import LaunchConfig
from pallas_kernels.types import Config, Masks, QuantizedQKV


# int32 -> fp32: dS^T.Q by the conversion instruction, S^T and P^T.dO by the
# bit trick (numerics.int32_to_float). A mix: the conversion unit also runs
# this kernel's exp2, so converting every product by instruction measured
# slower, and so did the trick everywhere. Decided by kernel time in
# `python -m benchmarks.breakdown --impls sage` over the combinations
# (docs/performance.md lists them).
SCORE_BIT_TRICKS, DV_BIT_TRICKS, DK_BIT_TRICKS = True, True, False


def _kernel(k8_ref, k_scale_ref, v_ref, kv_ids_ref, q8_ref, q8_t_ref, q_scale_ref,
            q_mean_ref, lse_ref, delta_ref, do_ref, do8_t_ref, do_scale_ref, q_ids_ref,
            q16_ref, dk_ref, dv_ref, *, config: Config, num_q_blocks: int):
  block_q, block_kv = config.block_q, config.block_kv
  j = pl.program_id(0)
  k8, k_scale, v = k8_ref[...], common.block_scale(k_scale_ref), v_ref[...]
  kv_ids = None if kv_ids_ref is None else kv_ids_ref[...]

  def q_step(i, carry, *, band):
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    q_mean = None if q_mean_ref is None else q_mean_ref[i, :]
    q_scale = common.q_scales(q_scale_ref, rows, config, transposed=True)
    s_t = common.score_tile(q8_ref[rows, :], q_scale, k8, k_scale, q_mean,
                            q_start=i * block_q, kv_start=j * block_kv,
                            q_ids=None if q_ids_ref is None else q_ids_ref[rows],
                            kv_ids=kv_ids, band=band, bit_tricks=SCORE_BIT_TRICKS,
                            transposed=True)
    p_t = jnp.exp2(s_t - lse_ref[rows][None, :])

    p8_t, p_scale = nm.quantize_rows(p_t, nonnegative=True, bit_tricks=True)
    dv = dv + nm.dequantize(nm.int8_dot(p8_t, do8_t_ref[:, rows]), p_scale[:, None],
                            common.block_scale(do_scale_ref, i * block_q),
                            bit_tricks=DV_BIT_TRICKS)

    dp_t = nm.float_dot(v, do_ref[rows, :])
    ds_t = p_t * (dp_t - delta_ref[rows][None, :])
    if q16_ref is not None:
      return dk + jnp.dot(ds_t.astype(q16_ref.dtype), q16_ref[rows, :],
                          preferred_element_type=jnp.float32), dv
    ds8_t, ds_scale = nm.quantize_rows(ds_t, bit_tricks=True)
    dk = dk + nm.dequantize(nm.int8_dot(ds8_t, q8_t_ref[:, rows]), ds_scale[:, None],
                            q_scale, bit_tricks=DK_BIT_TRICKS)
    if q_mean is not None:
      dk = dk + jnp.sum(ds_t, axis=1)[:, None] * q_mean[None, :]
    return dk, dv

  head_dim = k8.shape[-1]
  zeros = jnp.zeros((block_kv, head_dim), jnp.float32)
  dk, dv = common.loop_over_q_blocks(j, q_step, (zeros, zeros), config=config,
                                     num_q_blocks=num_q_blocks)
  # Q was quantized as Q * scale * log2(e): the int8 product carries log2(e);
  # the 16-bit one is of Q itself.
  dk_ref[...] = (dk * (nm.LN_2 if q16_ref is None else config.scale)).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_dkdv(qkv: QuantizedQKV, v, lse, delta, do, do8_t, do_scale, masks: Masks,
                  config: Config, launch: LaunchConfig):
  """dK, dV (B, Tk, Hkv, D) in V's dtype, summed over each kv head's group.

  With GQA the per-query-head partials are kept in fp32 until summed.
  """
  batch, heads, q_len, head_dim = qkv.q8.shape
  kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
  group = heads // kv_heads
  kv_head = common.head_map(group)
  bk = config.block_kv
  with_ids = masks.q_ids is not None
  q_full = lambda j, b, h: (b, h, 0, 0)
  q_rows = lambda j, b, h: (b, h, 0)
  in_specs = [
      pl.BlockSpec((None, None, bk, head_dim), lambda j, b, h: (b, kv_head(h), j, 0)),
      pl.BlockSpec((None, None, bk), lambda j, b, h: (b, kv_head(h), j)),
      pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, kv_head(h), 0)),
      pl.BlockSpec((None, bk), lambda j, b, h: (b, j)) if with_ids else None,
      pl.BlockSpec((None, None, q_len, head_dim), q_full),
      pl.BlockSpec((None, None, head_dim, q_len), q_full) if qkv.q8_t is not None else None,
      pl.BlockSpec((None, None, q_len), q_rows),
      (pl.BlockSpec((None, None, q_len // config.block_q, head_dim), q_full)
       if config.smooth_q else None),
      pl.BlockSpec((None, None, q_len), q_rows),
      pl.BlockSpec((None, None, q_len), q_rows),
      pl.BlockSpec((None, q_len, None, head_dim), lambda j, b, h: (b, 0, h, 0)),
      pl.BlockSpec((None, None, head_dim, q_len), q_full),
      pl.BlockSpec((None, None, q_len), q_rows),
      pl.BlockSpec((None, q_len), lambda j, b, h: (b, 0)) if with_ids else None,
      (pl.BlockSpec((None, q_len, None, head_dim), lambda j, b, h: (b, 0, h, 0))
       if qkv.q16 is not None else None),
  ]
  partial = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
  shape = jax.ShapeDtypeStruct((batch, kv_len, heads, head_dim),
                               v.dtype if group == 1 else jnp.float32)
  kernel = functools.partial(_kernel, config=config, num_q_blocks=q_len // config.block_q)
  dk, dv = launch.call(kernel, grid=(kv_len // bk, batch, heads), in_specs=in_specs,
                       out_specs=[partial, partial], out_shape=[shape, shape],
                       name="sagebwd_backward_dkdv")(
      qkv.k8, qkv.k_scale, v, masks.kv_ids, qkv.q8, qkv.q8_t, qkv.q_scale, qkv.q_mean,
      lse, delta, do, do8_t, do_scale, masks.q_ids, qkv.q16)
  if group > 1:
    sum_group = lambda x: x.reshape(batch, kv_len, kv_heads, group, head_dim).sum(axis=3)
    dk, dv = sum_group(dk).astype(v.dtype), sum_group(dv).astype(v.dtype)
  return dk, dv
