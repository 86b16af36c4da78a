"""What the portable (Pallas Triton) kernels share: launch settings, tiles of
scores, block scales, the loop over the key blocks a query block sees."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import causal_blocks
from pallas_kernels import numerics as nm
from pallas_kernels.types import Config


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """How kernels are launched (does not change results)."""

  interpret: bool = False
  num_warps: int = 4
  num_stages: int = 2

  def call(self, kernel, *, grid, in_specs, out_specs, out_shape, name):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=self.interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=self.num_warps,
                                             num_stages=self.num_stages))


def score_tile(q8, q_scale, k8, k_scale, q_mean, *, q_start, kv_start, q_ids, kv_ids,
               band: Config | None, bit_tricks: bool, transposed: bool = False):
  """Masked base-2 logits of one tile from int8 Q (block_q, D) and K (block_kv, D).

  (block_q, block_kv), or with `transposed` (block_kv, block_q) computed as
  K.Q^T, so every int8 operand keeps its contraction dimension contiguous.
  The scales are the blocks' scalars or Q's per-query vector (`q_scales`;
  one multiply per score); ids are the
  tile's per-token ids (1-D) or None; `band`: the config whose causality and
  window mask this tile, or None where the tile is seen whole. Masked scores
  are -inf. `bit_tricks` picks the int32 -> fp32 instructions
  (`numerics.int32_to_float`).
  """
  s = nm.dequantize(nm.int8_dot(k8, q8) if transposed else nm.int8_dot(q8, k8),
                    q_scale, k_scale, bit_tricks=bit_tricks)
  along_q, along_kv = _axes(transposed)
  if q_mean is not None:
    s = s + along_kv(nm.q_smoothing_bias(k8, k_scale, q_mean))
  mask = tile_mask(q8.shape[0], k8.shape[0], q_start=q_start, kv_start=kv_start,
                   q_ids=q_ids, kv_ids=kv_ids, band=band, transposed=transposed)
  return s if mask is None else jnp.where(mask, s, -jnp.inf)


def tile_mask(block_q: int, block_kv: int, *, q_start, kv_start, q_ids, kv_ids,
              band: Config | None, transposed: bool = False):
  """`numerics.tile_mask` of one (block_q, block_kv) tile, or (block_kv,
  block_q) with `transposed`; None when nothing is masked."""
  along_q, along_kv = _axes(transposed)
  return nm.tile_mask(
      along_q(q_start + jnp.arange(block_q)), along_kv(kv_start + jnp.arange(block_kv)),
      causal=band is not None and band.causal, window=None if band is None else band.window,
      q_ids=None if q_ids is None else along_q(q_ids),
      kv_ids=None if kv_ids is None else along_kv(kv_ids))


def _axes(transposed: bool):
  """Functions that lay a per-query and a per-key vector along the tile."""
  column, row = (lambda x: x[:, None]), (lambda x: x[None, :])
  return (row, column) if transposed else (column, row)


def block_scale(scale_ref, start=0):
  """A block's scale: the copy on its first token (all its tokens carry it).

  One scalar load; a reduction over the block's copies would cost a
  cross-thread max per key block.
  """
  return scale_ref[start]


def q_scales(q_scale_ref, rows, config: Config, *, transposed: bool = False):
  """Q's scales for the query block at `rows` (a slice of `q_scale_ref`, or
  None for the whole ref): its block scalar, or with `config.q_per_token` the
  per-query vector laid along a score tile's query axis (`score_tile`'s
  `transposed`)."""
  if not config.q_per_token:
    return block_scale(q_scale_ref, 0 if rows is None else rows.start)
  along_q, _ = _axes(transposed)
  return along_q(q_scale_ref[...] if rows is None else q_scale_ref[rows])


def loop_over_kv_blocks(i, kv_step, carry, *, config: Config, num_kv_blocks: int):
  """Runs kv_step(j, carry, band=...) over the key blocks that query block i
  sees (`causal_blocks.kv_range`): `band=config` where the mask is needed,
  None where the block is seen whole; the other blocks are skipped."""
  return _loop(causal_blocks.kv_range, i, kv_step, carry, config=config,
               num_blocks=num_kv_blocks)


def loop_over_q_blocks(j, q_step, carry, *, config: Config, num_q_blocks: int):
  """`loop_over_kv_blocks` for the query blocks that see key block j."""
  return _loop(causal_blocks.q_range, j, q_step, carry, config=config,
               num_blocks=num_q_blocks)


def _loop(block_range, index, step, carry, *, config: Config, num_blocks: int):
  if not config.banded:
    return lax.fori_loop(0, num_blocks, functools.partial(step, band=None), carry)
  left, right = causal_blocks.band(config.causal, config.window)
  start, full_start, full_end, end = block_range(index, config.block_q, config.block_kv,
                                                 num_blocks, left=left, right=right)
  # Python ints where a side is unbounded: those loops are known empty.
  for lo, hi, band in ((start, full_start, config), (full_start, full_end, None),
                       (full_end, end, config)):
    if not (isinstance(lo, int) and isinstance(hi, int) and lo >= hi):
      carry = lax.fori_loop(lo, hi, functools.partial(step, band=band), carry)
  return carry


def head_map(group: int):
  """Index maps from a query head's grid position to its kv head (GQA)."""
  return lambda h: h // group
