"""The FP8 backward's operands (`Config.fp8`): its second operands in E4M3 and
the scales of its first ones, every one known before the loop that uses it
(docs/algorithm.md, "FP8 products"). One definition for the reference and the
kernels; it runs between the pre-pass and the backward's loops.

Statistics over keys are taken over the key blocks that each query block
sees (`seen_key_blocks`): causality, a window and the sequences' ids leave
out every block no row of the query block can attend to, so a key or value a
row cannot see (a later token, padding) does not move that row's scales.
With `Config.exact_edges` the blocks that the band's right edge crosses
(`edge_key_blocks`) hold keys after some of the block's rows: K''s largest
block scale leaves them out (their dS.K runs in 16 bits), and the dS bound
takes each row's own largest ||V_j|| over their keys up to its last.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import causal_blocks
from pallas_kernels import numerics as nm
from pallas_kernels.layouts import to_layout
from pallas_kernels.types import (Config, Fp8Operands, Masks, Prepass, QuantizedQKV,
                                  TransposedLayout)

_f32 = jnp.float32


def check_norms(prepass: Prepass) -> None:
  """Raises unless the pre-pass formed ||dO_i|| (`Prepass.do_norm`)."""
  if prepass.do_norm is None:
    raise ValueError("prepass.do_norm is None: the FP8 operands take ||dO_i|| from a pre-pass "
                     "run with quantization='int8_fp8' (Config.fp8)")


def seen_key_blocks(masks: Masks, config: Config, q_len: int, kv_len: int) -> jax.Array:
  """(B or 1, Tq // block_q, Tk // block_kv) bool: whether any row of the
  query block may attend to any key of the key block."""
  num_q, num_kv = q_len // config.block_q, kv_len // config.block_kv
  left, right = causal_blocks.band(config.causal, config.window)
  i = jnp.arange(num_q, dtype=jnp.int32)
  start, _, _, end = causal_blocks.kv_range(i, config.block_q, config.block_kv, num_kv,
                                            left=left, right=right)
  j = jnp.arange(num_kv, dtype=jnp.int32)[None]
  in_band = (j >= jnp.reshape(start, (-1, 1))) & (j < jnp.reshape(end, (-1, 1)))
  seen = jnp.broadcast_to(in_band, (1, num_q, num_kv))
  if masks.q_ids is not None:
    batch = masks.q_ids.shape[0]
    q_ids = masks.q_ids.reshape(batch, num_q, config.block_q, 1, 1)
    kv_ids = masks.kv_ids.reshape(batch, 1, 1, num_kv, config.block_kv)
    seen = seen & jnp.any(q_ids == kv_ids, axis=(2, 4))
  return seen


def edge_key_blocks(config: Config, q_len: int, kv_len: int) -> jax.Array | None:
  """(1, Tq // block_q, Tk // block_kv) bool: the edge tiles
  (`causal_blocks.right_edge`), None without `Config.exact_edges`."""
  if not config.exact_edges:
    return None
  num_kv = kv_len // config.block_kv
  _, right = causal_blocks.band(config.causal, config.window)
  start, end = causal_blocks.right_edge(jnp.arange(q_len // config.block_q, dtype=jnp.int32),
                                        config.block_q, config.block_kv, num_kv, right=right)
  j = jnp.arange(num_kv, dtype=jnp.int32)[None]
  return ((j >= start[:, None]) & (j < end[:, None]))[None]


def _max_over_edges(per_key: jax.Array, edge: jax.Array, config: Config,
                    q_len: int) -> jax.Array:
  """(B, Hkv, Tk) values of keys -> (B, Hkv, Tq): each query's largest over
  the keys of its block's edge blocks (`edge`, (1, nq, nk)) up to the last
  key it sees (its position + the band's right), 0 where none: a running
  maximum within each key block, and the edge blocks before the one that
  holds that key whole."""
  block_q, block_kv = config.block_q, config.block_kv
  batch, kv_heads, kv_len = per_key.shape
  num_kv = kv_len // block_kv
  blocked = per_key.reshape(batch, kv_heads, num_kv, block_kv)
  running = jax.lax.cummax(blocked, axis=3).reshape(per_key.shape)
  _, right = causal_blocks.band(config.causal, config.window)
  last = jnp.minimum(jnp.arange(q_len) + right, kv_len - 1)  # (Tq,)
  last_block = last // block_kv
  edge_rows = jnp.repeat(edge[0], block_q, axis=0)  # (Tq, nk)
  within = jnp.where(edge_rows[jnp.arange(q_len), last_block], running[..., last], 0.0)
  before = edge_rows & (jnp.arange(num_kv)[None] < last_block[:, None])
  whole = jnp.max(jnp.where(before[None, None], jnp.max(blocked, axis=-1)[:, :, None], 0.0),
                  axis=-1)
  return jnp.maximum(within, whole)


def max_over_seen(per_block: jax.Array, seen: jax.Array, heads: int, block_q: int) -> jax.Array:
  """(B, Hkv, Tk // block_kv) values of key blocks -> (B, H, Tq), each query
  token's largest over the blocks its block sees (0 where it sees none)."""
  kv_heads = per_block.shape[1]
  best = jnp.max(jnp.where(seen[:, None], per_block[:, :, None, :], 0.0), axis=-1)
  return jnp.repeat(jnp.repeat(best, heads // kv_heads, axis=1), block_q, axis=-1)


def _group_max(scale: jax.Array, kv_heads: int) -> jax.Array:
  """(B, H, ...) -> (B, Hkv): the largest over each key/value head's group
  (dK and dV sum over it, so their FP8 sums share one scale)."""
  return jnp.max(scale.reshape(scale.shape[0], kv_heads, -1), axis=-1)


def _e4m3_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """(B, H, T, D) -> E4M3 with one scale per `block` rows: the values (B, H,
  T, D) and the scales per token (B, H, T)."""
  b, h, t, d = x.shape
  x8, scale = nm.quantize_e4m3(x.reshape(b, h, t // block, block, d), axis=(-2, -1))
  return x8.reshape(x.shape), jnp.repeat(scale[..., 0, 0], block, axis=-1)


def fp8_operands(qkv: QuantizedQKV, v: jax.Array, prepass: Prepass, row_max: jax.Array,
                 lse: jax.Array, masks: Masks, config: Config,
                 layout: TransposedLayout) -> Fp8Operands:
  """The operands from the forward's row maxima and lse, the pre-pass's
  Delta, dO block scales and ||dO_i|| (B, H, Tq), Q and the smoothed K in
  the inputs' dtype (`qkv.q16`, `qkv.k16`) and V (B, Tk, Hkv, D); the
  transposed E4M3 tensors in `layout` (the call's `Layouts.backward`).
  jax_triton/fp8_operands.py forms the same in a Triton launch."""
  check_norms(prepass)
  batch, heads, q_len = prepass.delta.shape
  kv_heads, kv_len = v.shape[2], v.shape[1]
  seen = seen_key_blocks(masks, config, q_len, kv_len)
  edge = edge_key_blocks(config, q_len, kv_len)
  if edge is not None:
    seen = seen & ~edge
  if masks.kv_ids is not None:  # padding's values bound nothing
    v = jnp.where((masks.kv_ids != nm.KV_INVALID_ID)[:, :, None, None], v, 0)
  v_key_norm = nm.token_norms(v)
  v_norm = jnp.max(v_key_norm.reshape(batch, kv_heads, -1, config.block_kv), axis=-1)
  v_norm = max_over_seen(v_norm, seen, heads, config.block_q)
  if edge is not None:
    v_norm = jnp.maximum(v_norm, jnp.repeat(_max_over_edges(v_key_norm, edge, config, q_len),
                                            heads // kv_heads, axis=1))
  ds_bound = nm.ds_row_bound(row_max, lse, prepass.delta, prepass.do_norm, v_norm)

  q = jnp.swapaxes(qkv.q16, 1, 2).astype(_f32) * (config.scale * nm.LOG2_E)
  q8, q_scale = _e4m3_blocks(q * ds_bound[..., None], config.block_q)
  k = jnp.swapaxes(qkv.k16, 1, 2).astype(_f32)
  if qkv.k_mean is not None:  # causal_exact: K16 is not smoothed, K' is
    k = k - qkv.k_mean[:, :, None, :]
  k8, k_scale = _e4m3_blocks(k, config.block_kv)
  transposed = lambda x8: to_layout(jnp.swapaxes(x8, -1, -2), layout)
  return assemble(transposed(q8), q_scale, transposed(k8), k_scale, prepass.do_scale, ds_bound,
                  seen, config)


def assemble(q8_t: jax.Array, q_scale: jax.Array, k8_t: jax.Array, k_scale: jax.Array,
             do_scale: jax.Array, ds_bound: jax.Array, seen: jax.Array,
             config: Config) -> Fp8Operands:
  """`Fp8Operands` from Q'^T and K'^T (E4M3, transposed), their block scales
  per token, dO's, the bound b_i and `seen_key_blocks`: the group maxima and
  factors, small arrays, whichever pass formed the large ones."""
  heads, kv_heads = q_scale.shape[1], k_scale.shape[1]
  q_top = _group_max(q_scale, kv_heads)
  k_top = max_over_seen(k_scale[..., ::config.block_kv], seen, heads, config.block_q)
  do_top = _group_max(do_scale, kv_heads)
  safe = lambda x: jnp.where(x > 0, x, 1.0)
  group = lambda x: jnp.repeat(x, heads // kv_heads, axis=1)[..., None]
  # A block of zeros in Q folds 1, not 0: its Q' is zero, so dK takes nothing
  # from it either way, and dS' keeps what the Hopper dQ product reads.
  q_fold = jnp.where(q_scale == 0, 1.0, q_scale / group(safe(q_top)))
  return Fp8Operands(
      q8_t=q8_t, q_fold=q_fold, dk_scale=q_top / nm.E4M3_MAX,
      k8_t=k8_t, k_scale=k_scale, k_top=k_top,
      p_factor=nm.inverse_scale(group(do_top), nm.E4M3_MAX) * do_scale,
      dv_scale=do_top / nm.E4M3_MAX, ds_bound=ds_bound)
