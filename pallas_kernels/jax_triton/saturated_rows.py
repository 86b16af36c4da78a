"""The saturated rows' Delta and lse (`sagebwd_jax.saturated_rows` states the
rule) in one launch: a program per `CHECK_ROWS` rows of a (batch, query head)
reads their lse and copies them and their Delta unless one of them
saturates, so training pays one near-empty launch per backward where a
`lax.cond` would block the host on its predicate (docs/performance-log.md).
A query block with a saturated row walks the key blocks its queries see, as
dQ does, with the online maximum and sum of the forward and the 16-bit dP =
dO.V^T of the backward, and replaces those rows' Delta and lse; it copies
the others as given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import causal_blocks
from pallas_kernels import numerics as nm
from pallas_kernels.batching import batch_folded
from pallas_kernels.jax_triton import tiles
from pallas_kernels.jax_triton.backward_dq import dot_precision
from pallas_kernels.jax_triton.interpreter import device_function
from pallas_kernels.jax_triton.launch import LaunchConfig, placeholder
from pallas_kernels.types import Config, Masks, QuantizedQKV

# Rows one program checks (a power of two, whole query blocks): few enough
# programs that the launch is one wave (docs/performance-log.md).
CHECK_ROWS = 1024


@device_function
def _query_block(q8_ptr, q_scale_ptr, q_mean_ptr, lse_ptr, delta_ptr, do_ptr, q_ids_ptr, k8_ptr,
                 k_scale_ptr, v_ptr, q16_ptr, k16_ptr, k_mean_ptr, kv_ids_ptr, delta_out_ptr,
                 lse_out_ptr, i, b, h, H: tl.constexpr, HKV: tl.constexpr, TQ: tl.constexpr,
                 TK: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_KV: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                 IDS: tl.constexpr, SMOOTH_Q: tl.constexpr, MEANS: tl.constexpr,
                 EXACT_EDGES: tl.constexpr, MULTIPLIER: tl.constexpr, CONVERT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, SATURATED: tl.constexpr, MARGIN: tl.constexpr,
                 NOTHING_SEEN: tl.constexpr):
  """Query block i of head (b, h): its rows' Delta and lse, recomputed where
  a row saturates, else as given."""
  kvh = h // (H // HKV)
  q_head = b * H + h
  rows = i * BLOCK_Q + tl.arange(0, BLOCK_Q)
  lse = tl.load(lse_ptr + q_head * TQ + rows)
  delta = tl.load(delta_ptr + q_head * TQ + rows)
  saturated = (tl.abs(lse) > SATURATED) & (tl.abs(lse) < float("inf"))
  if tl.max(saturated.to(tl.int32), axis=0) > 0:
    dims = tl.arange(0, D)
    q8, q_scale, q_mean, q_ids = tiles.query_tile(q8_ptr, q_scale_ptr, q_mean_ptr, q_ids_ptr, b,
                                                  q_head, i, rows, TQ, D, BLOCK_Q, IDS, SMOOTH_Q)
    do = tl.load(do_ptr + tiles.token_offsets(b, rows, h, TQ, H, D))
    kv_head = b * HKV + kvh
    v_ptr += b * TK * HKV * D + kvh * D
    k16_ptr += b * TK * HKV * D + kvh * D
    if MEANS or EXACT_EDGES:
      q16 = tl.load(q16_ptr + tiles.token_offsets(b, rows, h, TQ, H, D))
    if MEANS:
      row_mean = tiles.mean_scores(q16, tl.load(k_mean_ptr + kv_head * D + dims), MULTIPLIER)
    edge_start, _ = tiles.right_edge(i, BLOCK_Q, BLOCK_KV, TK // BLOCK_KV, RIGHT)
    m = tl.full((BLOCK_Q,), NOTHING_SEEN, tl.float32)
    l = tl.zeros((BLOCK_Q,), tl.float32)
    d = tl.zeros((BLOCK_Q,), tl.float32)
    start, _, _, end = tiles.kv_range(i, BLOCK_Q, BLOCK_KV, TK // BLOCK_KV, LEFT, RIGHT)
    # Every block masked as an edge block: this path runs on saturated inputs only.
    for j in range(start, end):
      x, c, keys, k_scale = tiles.key_block_scores(
          q8, q_scale, q_mean, rows[:, None], q_ids, k8_ptr + kv_head * TK * D,
          k_scale_ptr + kv_head * TK, kv_ids_ptr + b * TK, j, D, BLOCK_KV, LEFT, RIGHT, IDS,
          SMOOTH_Q, CONVERT)
      # `Config.causal_exact`: the forward's scores (forward.py).
      if EXACT_EDGES and j >= edge_start:
        k16 = tl.load(k16_ptr + keys[:, None] * HKV * D + dims[None, :])
        kv_ids = tl.load(kv_ids_ptr + b * TK + keys)[None, :] if IDS else 0
        s = tiles.masked(tiles.edge_scores(q16, k16, MULTIPLIER, DOT_PRECISION), rows[:, None],
                         keys[None, :], q_ids, kv_ids, LEFT, RIGHT, IDS)
      elif MEANS:
        s = tiles.scores(x, c, SMOOTH_Q) + row_mean[:, None]
      else:
        s = tiles.scores(x, c, SMOOTH_Q)
      v = tl.load(v_ptr + keys[:, None] * HKV * D + dims[None, :])
      dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
      m_new = tl.maximum(m, tl.max(s, axis=1))
      alpha = tl.exp2(m - m_new)
      w = tl.exp2(s - m_new[:, None])  # 0 where masked: m_new is finite
      l = alpha * l + tl.sum(w, axis=1)
      d = alpha * d + tl.sum(w * dp, axis=1)
      m = m_new
    seen = l > 0
    l_safe = tl.where(seen, l, 1.0)
    delta = tl.where(saturated, tl.where(seen, d / l_safe, 0.0), delta)
    # numerics.saturated_lse
    own_lse = m + tl.log2(l_safe) - MARGIN * tl.abs(m)
    lse = tl.where(saturated, tl.where(seen, own_lse, float("inf")), lse)
  tl.store(delta_out_ptr + q_head * TQ + rows, delta)
  tl.store(lse_out_ptr + q_head * TQ + rows, lse)


@triton.jit
def _saturated_rows_kernel(q8_ptr, q_scale_ptr, q_mean_ptr, lse_ptr, delta_ptr, do_ptr,
                           q_ids_ptr, k8_ptr, k_scale_ptr, v_ptr, q16_ptr, k16_ptr, k_mean_ptr,
                           kv_ids_ptr, delta_out_ptr, lse_out_ptr, H: tl.constexpr,
                           HKV: tl.constexpr, TQ: tl.constexpr, TK: tl.constexpr, D: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, ROWS: tl.constexpr,
                           LEFT: tl.constexpr, RIGHT: tl.constexpr, IDS: tl.constexpr,
                           SMOOTH_Q: tl.constexpr, MEANS: tl.constexpr,
                           EXACT_EDGES: tl.constexpr, MULTIPLIER: tl.constexpr,
                           CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                           SATURATED: tl.constexpr, MARGIN: tl.constexpr,
                           NOTHING_SEEN: tl.constexpr):
  # One program per ROWS rows of a head, which it copies unless one
  # saturates; then each of its query blocks is redone.
  c = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  h = tl.program_id(2)
  offsets = (b * H + h) * TQ + c * ROWS + tl.arange(0, ROWS)
  lse = tl.load(lse_ptr + offsets)
  saturated = (tl.abs(lse) > SATURATED) & (tl.abs(lse) < float("inf"))
  if tl.max(saturated.to(tl.int32), axis=0) > 0:
    for i in range(c * (ROWS // BLOCK_Q), (c + 1) * (ROWS // BLOCK_Q)):
      _query_block(q8_ptr, q_scale_ptr, q_mean_ptr, lse_ptr, delta_ptr, do_ptr, q_ids_ptr, k8_ptr,
                   k_scale_ptr, v_ptr, q16_ptr, k16_ptr, k_mean_ptr, kv_ids_ptr, delta_out_ptr,
                   lse_out_ptr, i, b, h, H, HKV, TQ, TK, D, BLOCK_Q, BLOCK_KV, LEFT, RIGHT, IDS,
                   SMOOTH_Q, MEANS, EXACT_EDGES, MULTIPLIER, CONVERT, DOT_PRECISION, SATURATED,
                   MARGIN, NOTHING_SEEN)
  else:
    tl.store(delta_out_ptr + offsets, tl.load(delta_ptr + offsets))
    tl.store(lse_out_ptr + offsets, lse)


def rows_per_program(q_len: int, block_q: int) -> int:
  """The rows one program checks: `block_q` times the largest power of two
  that divides the query blocks, up to `CHECK_ROWS`."""
  rows = block_q
  while rows * 2 <= CHECK_ROWS and q_len % (rows * 2) == 0:
    rows *= 2
  return rows


def saturated_rows(qkv: QuantizedQKV, v, lse, do, delta, masks: Masks, config: Config,
                   launch: LaunchConfig) -> tuple[jax.Array, jax.Array]:
  """Delta and lse (B, H, Tq) fp32, the saturated rows' recomputed
  (`Backend.saturated_rows`)."""

  def run(q8, q_scale, q_mean, lse, delta, do, q_ids, k8, k_scale, v, q16, k16, k_mean,
          kv_ids):
    batch, heads, q_len, head_dim = q8.shape
    kv_heads, kv_len = k8.shape[1], k8.shape[2]
    args = [q8, q_scale, placeholder(q_mean, jnp.float32), lse, delta, do,
            placeholder(q_ids, jnp.int32), k8, k_scale, v, placeholder(q16, v.dtype),
            placeholder(k16, v.dtype), placeholder(k_mean, jnp.float32),
            placeholder(kv_ids, jnp.int32)]
    left, right = causal_blocks.band(config.causal, config.window)
    rows = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
    per_program = rows_per_program(q_len, config.block_q)
    # Kept: the query block's Q8 and dO; per stage, a key block's K8 and V.
    size = v.dtype.itemsize
    fitted = launch.fitted(fixed_bytes=config.block_q * head_dim * (1 + size),
                           stage_bytes=config.block_kv * head_dim * (1 + size))
    new_delta, new_lse = fitted.call(
        _saturated_rows_kernel, args, [rows, rows], grid=(q_len // per_program, batch, heads),
        name="sagebwd_triton_saturated_rows", H=heads, HKV=kv_heads, TQ=q_len, TK=kv_len,
        D=head_dim, BLOCK_Q=config.block_q, BLOCK_KV=config.block_kv, ROWS=per_program,
        LEFT=left, RIGHT=right,
        IDS=q_ids is not None, SMOOTH_Q=q_mean is not None, MEANS=k_mean is not None,
        EXACT_EDGES=config.exact_edges, MULTIPLIER=config.scale * nm.LOG2_E,
        CONVERT=launch.convert,
        DOT_PRECISION=dot_precision(v.dtype), SATURATED=nm.saturation_threshold(v.dtype),
        MARGIN=nm.SATURATED_MARGIN, NOTHING_SEEN=nm.NOTHING_SEEN)
    return new_delta, new_lse

  return batch_folded(run)(qkv.q8, qkv.q_scale, qkv.q_mean, lse, delta, do, masks.q_ids,
                           qkv.k8, qkv.k_scale, v, qkv.q16, qkv.k16, qkv.k_mean, masks.kv_ids)
