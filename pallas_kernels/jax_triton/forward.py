"""The forward kernel: INT8 Q.K^T, online softmax, unsigned INT8 P, INT8 P.V.

One program per (query tile `TILE_Q`, batch, query head; the tile is the
launch's `tile_rows_for`, Q's scales read per token) loops over the key blocks
(`BLOCK_KV`) its queries can see (block skipping under causality or a window;
the mask only on the blocks the band's edges cross, or on every block with
ids). P follows numerics.folded_softmax_step with one
key block per step and 255 levels (`TritonBackend.NUMERICS`): V's
block scale is folded into P, which is quantized per row of the tile against
E, its row's largest folded score. Per score that is one add and one
multiply-add for the exp2 argument (the exact distance to the row's largest
score in the tile, times the scale, plus a row constant with -E and log2 sV:
so the largest gets exactly log2 255 at any logit scale, and none more),
exp2 and one add to round.

P in 0..255 enters the signed INT8 dot as P - 128, and 128 times the V
block's column sums come back through the accumulator's start (tiles.py).

With `Config.causal_exact` each 8-bit block's top also takes q_i . m (K8
lacks m, the first key block's mean; `tiles.mean_scores`, once per row
before the loop), and the blocks the band's right edge
crosses (`tiles.right_edge`; they lie among the masked steps) run in 16 bits
from Q, K and V as the op passed them (`_edge_step`), one query block per
program: which blocks are edges is a query block's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import causal_blocks, numerics as nm
from pallas_kernels.jax_triton import tiles
from pallas_kernels.jax_triton.backward_dq import dot_precision
from pallas_kernels.jax_triton.interpreter import device_function
from pallas_kernels.batching import batch_folded
from pallas_kernels.jax_triton.launch import LaunchConfig, placeholder
from pallas_kernels.layouts import check_layout
from pallas_kernels.types import Config, Masks, QuantizedQKV, TransposedLayout

E_FLOOR = tl.constexpr(nm.E_FLOOR_BELOW_MAX)
NOTHING_SEEN = tl.constexpr(nm.NOTHING_SEEN)


@device_function
def _kv_step(acc, m, e, l, q8, q_scale, q_mean, row_mean, q_pos, q_ids, k8_ptr, k_scale_ptr,
             v8_t_ptr, v_scale_ptr, pv_init_ptr, kv_ids_ptr, j, TK: tl.constexpr,
             D: tl.constexpr, TILE_Q: tl.constexpr, BLOCK_KV: tl.constexpr, LEFT: tl.constexpr,
             RIGHT: tl.constexpr, IDS: tl.constexpr, SMOOTH_Q: tl.constexpr,
             MEANS: tl.constexpr, CONVERT: tl.constexpr):
  x, c, keys, _ = tiles.key_block_scores(q8, q_scale, q_mean, q_pos, q_ids, k8_ptr,
                                         k_scale_ptr, kv_ids_ptr, j, D, BLOCK_KV, LEFT, RIGHT, IDS,
                                         SMOOTH_Q, CONVERT)
  dims = tl.arange(0, D)

  # numerics.folded_v_scales: an all-zero V block folds with scale 1 (a NaN
  # scale stays NaN).
  v_scale = tl.load(v_scale_ptr + j * BLOCK_KV)
  v_scale = tl.where(v_scale == 0, 1.0, v_scale)
  log2_v = tl.log2(v_scale)
  x_top, top = tiles.row_top(x, c, SMOOTH_Q)
  if MEANS:  # the same for every key of the row: it moves the top only
    top = top + row_mean
  top = top + log2_v  # -inf where the row sees no key here
  m_new = tl.maximum(m, top)
  e_new = tl.maximum(top, m_new - E_FLOOR)
  alpha = tl.exp2(e - e_new)
  # top - e_new is exact where top is the row's maximum and at most 0
  # elsewhere, and x - x_top at most 0: every argument is at most log2(255),
  # the row's largest score's exactly, so P needs no clip.
  row = (top - e_new) + tiles.LOG2_UINT8_MAX
  p = tl.exp2(tiles.from_top(x, x_top) * c + row[:, None])
  l = l * alpha + tl.sum(p, axis=1) * (1.0 / v_scale)
  p8 = tiles.unsigned_byte(p)

  v8 = tl.load(v8_t_ptr + dims[:, None] * TK + keys[None, :])
  pv_init = tl.load(pv_init_ptr + j * D + dims)
  pv = tl.dot(p8, tl.trans(v8), acc=tl.broadcast_to(pv_init[None, :], (TILE_Q, D)),
              out_dtype=tl.int32)
  return acc * alpha[:, None] + tiles.exact_float(pv), m_new, e_new, l


@device_function
def _edge_step(acc, m, e, l, q16, q_pos, q_ids, k16_ptr, v16_ptr, kv_ids_ptr, j,
               HKV: tl.constexpr, D: tl.constexpr, BLOCK_KV: tl.constexpr, LEFT: tl.constexpr,
               RIGHT: tl.constexpr, IDS: tl.constexpr, MULTIPLIER: tl.constexpr,
               INPUTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """`_kv_step` of an edge tile: S from the 16-bit Q and K, P (V's scale 1,
  255 at the row's top) rounded to the inputs' dtype times their V."""
  s, k16, tokens = tiles.edge_key_block(q16, q_pos, q_ids, k16_ptr, kv_ids_ptr, j, HKV, D,
                                        BLOCK_KV, LEFT, RIGHT, IDS, MULTIPLIER, DOT_PRECISION)
  top = tl.max(s, axis=1)
  m_new = tl.maximum(m, top)
  e_new = tl.maximum(top, m_new - E_FLOOR)
  alpha = tl.exp2(e - e_new)
  p = tiles.UINT8_MAX * tl.exp2(tiles.from_top(s, top) + (top - e_new)[:, None])
  l = l * alpha + tl.sum(p, axis=1)
  v16 = tl.load(v16_ptr + tokens)
  pv = tl.dot(tiles.sixteen_bit(p, INPUTS).to(v16.dtype), v16, input_precision=DOT_PRECISION)
  return acc * alpha[:, None] + pv, m_new, e_new, l


@triton.jit
def _forward_kernel(q8_ptr, q_scale_ptr, q_mean_ptr, k8_ptr, k_scale_ptr, v8_t_ptr, v_scale_ptr,
                    pv_init_ptr, q16_ptr, k16_ptr, v16_ptr, k_mean_ptr, q_ids_ptr, kv_ids_ptr,
                    o_ptr, lse_ptr, H: tl.constexpr, HKV: tl.constexpr, TQ: tl.constexpr,
                    TK: tl.constexpr, D: tl.constexpr, TILE_Q: tl.constexpr,
                    BLOCK_KV: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                    IDS: tl.constexpr, SMOOTH_Q: tl.constexpr, MEANS: tl.constexpr,
                    EXACT_EDGES: tl.constexpr, MULTIPLIER: tl.constexpr, INPUTS: tl.constexpr,
                    CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr):
  i = tl.program_id(0)
  if RIGHT is not None:  # the longest rows first, so the last wave is of short ones
    i = TQ // TILE_Q - 1 - i
  b = tl.program_id(1).to(tl.int64)
  h = tl.program_id(2)
  q_head = b * H + h
  kv_head = b * HKV + h // (H // HKV)
  rows = i * TILE_Q + tl.arange(0, TILE_Q)
  q8, q_scale, q_mean, q_ids = tiles.query_tile(q8_ptr, q_scale_ptr, q_mean_ptr, q_ids_ptr, b,
                                                q_head, i, rows, TQ, D, TILE_Q, IDS, SMOOTH_Q)
  k8_ptr += kv_head * TK * D
  k_scale_ptr += kv_head * TK
  v8_t_ptr += kv_head * D * TK
  v_scale_ptr += kv_head * TK
  pv_init_ptr += kv_head * (TK // BLOCK_KV) * D
  k16_ptr += b * TK * HKV * D + (h // (H // HKV)) * D
  v16_ptr += b * TK * HKV * D + (h // (H // HKV)) * D
  kv_ids_ptr += b * TK
  q16 = 0.0
  if MEANS or EXACT_EDGES:
    q16 = tl.load(q16_ptr + tiles.token_offsets(b, rows, h, TQ, H, D))
  row_mean = (tiles.mean_scores(q16, tl.load(k_mean_ptr + kv_head * D + tl.arange(0, D)),
                                MULTIPLIER) if MEANS else 0.0)

  acc = tl.zeros((TILE_Q, D), tl.float32)
  m = tl.full((TILE_Q,), NOTHING_SEEN, tl.float32)
  e = tl.full((TILE_Q,), float("-inf"), tl.float32)
  l = tl.zeros((TILE_Q,), tl.float32)
  full_start = 0
  full_end = TK // BLOCK_KV
  if LEFT is not None or RIGHT is not None:
    start, full_start, full_end, end = tiles.kv_range(i, TILE_Q, BLOCK_KV, TK // BLOCK_KV,
                                                      LEFT, RIGHT)
    # The band's masked blocks first, as straight-line steps: after the
    # pipelined loop a second pass of the step held more registers, a
    # program per SM (docs/performance-log.md). Each step quantizes P against its
    # own block's top (numerics.folded_softmax_step), so the order changes no
    # P tile of the reference's ascending one, but a block's whose top lies
    # E_FLOOR below the row's maximum so far (P < 2**-52 of the row's).
    right: tl.constexpr = tiles.edge_blocks(TILE_Q, BLOCK_KV, RIGHT)  # causal: the diagonal
    # Every block of the right run is an edge; a window's left run may hold
    # some too. (The right run's as a constant: Triton 3.6's TritonGPUCoalesce
    # crashed on the causal forward's `if` whose test folds to true.)
    edge_start, _ = tiles.right_edge(i, TILE_Q, BLOCK_KV, TK // BLOCK_KV, RIGHT)
    for s in tl.static_range(right + tiles.edge_blocks(TILE_Q, BLOCK_KV, LEFT)):
      j, inside = tiles.edge_block(s, right, full_end, end, start, full_start)
      if inside:
        if EXACT_EDGES and (s < right or j >= edge_start):
          acc, m, e, l = _edge_step(acc, m, e, l, q16, rows[:, None], q_ids, k16_ptr, v16_ptr,
                                    kv_ids_ptr, j, HKV, D, BLOCK_KV, LEFT, RIGHT, IDS,
                                    MULTIPLIER, INPUTS, DOT_PRECISION)
        else:
          acc, m, e, l = _kv_step(acc, m, e, l, q8, q_scale, q_mean, row_mean, rows[:, None],
                                  q_ids, k8_ptr, k_scale_ptr, v8_t_ptr, v_scale_ptr, pv_init_ptr,
                                  kv_ids_ptr, j, TK, D, TILE_Q, BLOCK_KV, LEFT, RIGHT, IDS,
                                  SMOOTH_Q, MEANS, CONVERT)
  for j in range(full_start, full_end):
    acc, m, e, l = _kv_step(acc, m, e, l, q8, q_scale, q_mean, row_mean, rows[:, None], q_ids,
                            k8_ptr, k_scale_ptr, v8_t_ptr, v_scale_ptr, pv_init_ptr, kv_ids_ptr,
                            j, TK, D, TILE_Q, BLOCK_KV, None, None, IDS, SMOOTH_Q, MEANS,
                            CONVERT)

  # numerics.finalize_folded_rows: rows that saw no key give O = 0, lse = +inf.
  empty = l == 0
  l = tl.where(empty, 1.0, l)
  lse = tl.where(empty, float("inf"), e + tl.log2(l) - tiles.LOG2_UINT8_MAX)
  o = acc / l[:, None]
  tl.store(o_ptr + tiles.token_offsets(b, rows, h, TQ, H, D),
           o.to(o_ptr.dtype.element_ty))
  tl.store(lse_ptr + q_head * TQ + rows, lse)


def forward(qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype,
            launch: LaunchConfig) -> tuple[jax.Array, jax.Array]:
  """O (B, Tq, H, D) in `out_dtype` and the base-2 log-sum-exp (B, H, Tq)."""

  def run(q8, q_scale, q_mean, k8, k_scale, v8_t, v_scale, v_start, q16, k16, v16, k_mean,
          q_ids, kv_ids):
    batch, heads, q_len, head_dim = q8.shape
    kv_heads, kv_len = k8.shape[1], k8.shape[2]
    inputs = jnp.dtype(out_dtype if q16 is None else q16.dtype)
    args = [q8, q_scale, placeholder(q_mean, jnp.float32), k8, k_scale, v8_t, v_scale,
            tiles.accumulator_start(v_start, v8_t, config.block_kv),
            placeholder(q16, inputs), placeholder(k16, inputs), placeholder(v16, inputs),
            placeholder(k_mean, jnp.float32), placeholder(q_ids, jnp.int32),
            placeholder(kv_ids, jnp.int32)]
    out_shape = [jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), out_dtype),
                 jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)]
    rows = launch.tile_rows_for(q_len, config.block_q,
                                free=q_mean is None and not config.causal_exact)
    left, right = causal_blocks.band(config.causal, config.window)
    # Kept: the query tile's Q8 (and Q); per stage, a key block's K8 and V8^T
    # (and K and V for the edge tiles).
    size = inputs.itemsize
    fitted = launch.fitted(
        fixed_bytes=rows * head_dim * (1 + size * config.causal_exact),
        stage_bytes=config.block_kv * head_dim * (2 + 2 * size * config.exact_edges))
    o, lse = fitted.call(
        _forward_kernel, args, out_shape, grid=(q_len // rows, batch, heads),
        name="sagebwd_triton_forward", H=heads, HKV=kv_heads, TQ=q_len, TK=kv_len,
        D=head_dim, TILE_Q=rows, BLOCK_KV=config.block_kv, LEFT=left, RIGHT=right,
        IDS=q_ids is not None, SMOOTH_Q=q_mean is not None, MEANS=k_mean is not None,
        EXACT_EDGES=config.exact_edges, MULTIPLIER=config.scale * nm.LOG2_E,
        INPUTS=inputs.name, CONVERT=launch.convert, DOT_PRECISION=dot_precision(inputs))
    return o, lse

  check_layout("v8_t", qkv.v8_t, TransposedLayout.TOKENS)
  return batch_folded(run)(qkv.q8, qkv.q_scale, qkv.q_mean, qkv.k8, qkv.k_scale, qkv.v8_t,
                           qkv.v_scale, qkv.v_start, qkv.q16, qkv.k16, qkv.v16, qkv.k_mean,
                           masks.q_ids, masks.kv_ids)
