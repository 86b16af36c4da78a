"""The quantization pass: psi of Q, K and V per block, in the layouts the int8
dots need (natural (T, D) and transposed (D, T)), with per-token scales."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import numerics as nm
from pallas_kernels.triton.common import LaunchConfig
from pallas_kernels.types import Config, QuantizedQKV


def quantize_block(x, *, multiplier: float = 1.0, mean=None, smooth_rows: bool = False,
                   per_row: bool = False):
  """psi of one (block, D) tile of `x * multiplier` after optional centering.

  Returns (x8, scale, row_mean): one scale for the tile, or with `per_row`
  one per row (block,); row_mean (in multiplied units) is the
  block's mean row when `smooth_rows` (Q-smoothing), else None. The
  multiplier goes into the scale, not the values: one multiply per element
  leaves no product that a compiler could fuse or reassociate differently
  on different backends.
  """
  x = x.astype(jnp.float32)
  if mean is not None:
    x = x - mean[None, :]
  row_mean = None
  if smooth_rows:
    row_mean = jnp.mean(x, axis=0)
    x = x - row_mean[None, :]
    row_mean = row_mean * multiplier
  quantize = nm.quantize_rows if per_row else nm.quantize_tile
  x8, scale = quantize(x, bit_tricks=True)
  return x8, scale * multiplier, row_mean


def _kernel(x_ref, *refs, multiplier, has_mean, smooth_rows, per_row, natural, transposed):
  refs = list(refs)
  mean = refs.pop(0)[...] if has_mean else None
  x8, scale, row_mean = quantize_block(x_ref[...], multiplier=multiplier, mean=mean,
                                       smooth_rows=smooth_rows, per_row=per_row)
  if natural:
    refs.pop(0)[...] = x8
  if transposed:
    refs.pop(0)[...] = x8.T
  scale_ref = refs.pop(0)
  scale_ref[...] = jnp.full(scale_ref.shape, scale, jnp.float32)
  if smooth_rows:
    refs.pop(0)[...] = row_mean


def quantize(x, *, block: int, launch: LaunchConfig, multiplier: float = 1.0, mean=None,
             smooth_rows: bool = False, per_row: bool = False, natural: bool = True,
             transposed: bool = True):
  """psi per `block` tokens (or per token, `per_row`) of x (B, T, H, D) ->
  int8 (B, H, T, D) and/or (B, H, D, T), scales (B, H, T), and block means
  (B, H, T // block, D)."""
  batch, seq_len, heads, head_dim = x.shape
  grid = (seq_len // block, batch, heads)
  in_specs = [pl.BlockSpec((None, block, None, head_dim), lambda t, b, h: (b, t, h, 0))]
  if mean is not None:
    in_specs.append(pl.BlockSpec((None, None, head_dim), lambda t, b, h: (b, h, 0)))
  out_specs, out_shape = [], []
  if natural:
    out_specs.append(pl.BlockSpec((None, None, block, head_dim), lambda t, b, h: (b, h, t, 0)))
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, seq_len, head_dim), jnp.int8))
  if transposed:
    out_specs.append(pl.BlockSpec((None, None, head_dim, block), lambda t, b, h: (b, h, 0, t)))
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, head_dim, seq_len), jnp.int8))
  out_specs.append(pl.BlockSpec((None, None, block), lambda t, b, h: (b, h, t)))
  out_shape.append(jax.ShapeDtypeStruct((batch, heads, seq_len), jnp.float32))
  if smooth_rows:
    out_specs.append(pl.BlockSpec((None, None, None, head_dim), lambda t, b, h: (b, h, t, 0)))
    out_shape.append(
        jax.ShapeDtypeStruct((batch, heads, seq_len // block, head_dim), jnp.float32))
  kernel = functools.partial(_kernel, multiplier=multiplier, has_mean=mean is not None,
                             smooth_rows=smooth_rows, per_row=per_row, natural=natural,
                             transposed=transposed)
  args = (x,) if mean is None else (x, mean)
  return launch.call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                     out_shape=out_shape, name="sagebwd_quantize")(*args)


def quantize_qkv(q, k, v, k_mean, config: Config, launch: LaunchConfig,
                 for_backward: bool) -> QuantizedQKV:
  """The forward's quantization pass (docs/algorithm.md, forward steps 1-3);
  Q's and K's transposed layouts, which only the backward reads, if
  `for_backward`."""
  # Per-token Q goes with 16-bit dS: no int8 dK product reads Q8 transposed.
  q_transposed = for_backward and not config.q_per_token
  q_out = list(quantize(q, block=config.block_q, launch=launch,
                        multiplier=config.scale * nm.LOG2_E, smooth_rows=config.smooth_q,
                        per_row=config.q_per_token, transposed=q_transposed))
  q8 = q_out.pop(0)
  q8_t = q_out.pop(0) if q_transposed else None
  q_scale = q_out.pop(0)
  q_mean = q_out.pop(0) if config.smooth_q else None
  k_out = list(quantize(k, block=config.block_kv, launch=launch, mean=k_mean,
                        transposed=for_backward))
  k8, k8_t, k_scale = k_out if for_backward else (k_out[0], None, k_out[1])
  v8_t, v_scale = quantize(v, block=config.block_kv, launch=launch, natural=False)
  return QuantizedQKV(q8=q8, q8_t=q8_t, q_scale=q_scale, q_mean=q_mean, k8=k8, k8_t=k8_t,
                      k_scale=k_scale, v8_t=v8_t, v_scale=v_scale)
