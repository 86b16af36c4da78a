"""dQ: one program per (query tile, batch, query head) loops over the key
blocks its queries see, recomputing P and dS like the forward; dS is the
first operand of INT8 dS.K and is quantized per query (a row here; with
ds_precision="bf16" dS.K runs in the inputs' dtype instead). The
query tile is the launch's `tile_rows_for` (Q's scales are read per
token), one query block with `Config.causal_exact`, whose scores are the
forward's (forward.py) and whose dQ is dS.(K - m'): m' is K8's m where the
query block has 8-bit tiles (`QuantizedQKV.k_mean_seen`), so only the edge
tiles take it (`_edge_step`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import causal_blocks
from pallas_kernels import numerics as nm
from pallas_kernels.jax_triton import tiles
from pallas_kernels.jax_triton.interpreter import device_function
from pallas_kernels.batching import batch_folded
from pallas_kernels.jax_triton.launch import LaunchConfig, placeholder
from pallas_kernels.types import Config, Masks, QuantizedQKV


@device_function
def _kv_step(dq, q8, q_scale, q_mean, row_mean, k_mean, q_pos, q_ids, lse, delta, do, k8_ptr,
             k8_t_ptr, k_scale_ptr, v_ptr, k16_ptr, kv_ids_ptr, j, TK: tl.constexpr,
             HKV: tl.constexpr, D: tl.constexpr, TILE_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
             LEFT: tl.constexpr, RIGHT: tl.constexpr, IDS: tl.constexpr, SMOOTH_Q: tl.constexpr,
             MEANS: tl.constexpr, INPUTS: tl.constexpr, DS16: tl.constexpr,
             CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr):
  x, c, keys, k_scale = tiles.key_block_scores(q8, q_scale, q_mean, q_pos, q_ids, k8_ptr,
                                               k_scale_ptr, kv_ids_ptr, j, D, BLOCK_KV, LEFT,
                                               RIGHT, IDS, SMOOTH_Q, CONVERT)
  dims = tl.arange(0, D)
  # exp2(S - lse): rows that saw no key have lse = +inf, so P = 0 there.
  if MEANS:  # S with q_i . m, which K8 lacks (`Config.causal_exact`)
    s = tiles.scores(x, c, SMOOTH_Q) + row_mean[:, None]
    p = tl.exp2(tiles.at_most_zero(s - lse[:, None]))
  else:
    p = tl.exp2(tiles.log2_p(x, c, lse[:, None], SMOOTH_Q))

  tokens = keys[:, None] * HKV * D + dims[None, :]
  v = tl.load(v_ptr + tokens)
  dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
  ds = p * (dp - delta[:, None])
  if DS16:  # dS and K in the inputs' dtype (ds_precision="bf16")
    k16 = tl.load(k16_ptr + tokens)
    if MEANS:  # K as the op passed it: less m, as K8
      k16 = tiles.sixteen_bit(k16.to(tl.float32) - k_mean[None, :], INPUTS).to(k16.dtype)
    dq += tl.dot(ds.to(k16.dtype), k16, input_precision=DOT_PRECISION)
  else:
    ds8, ds_scale = tiles.quantize_rows(ds, tl.max(tl.abs(ds), axis=1))
    k8_t = tl.load(k8_t_ptr + dims[:, None] * TK + keys[None, :])
    dq += tiles.int8_product(ds8, k8_t, CONVERT) * (ds_scale[:, None] * k_scale)
  return dq


@device_function
def _edge_step(dq, q16, q_pos, q_ids, lse, delta, do, dq_mean, v_ptr, k16_ptr, kv_ids_ptr, j,
               HKV: tl.constexpr, D: tl.constexpr, BLOCK_KV: tl.constexpr, LEFT: tl.constexpr,
               RIGHT: tl.constexpr, IDS: tl.constexpr, MEANS: tl.constexpr,
               MULTIPLIER: tl.constexpr, INPUTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """`_kv_step` of an edge tile: S from the 16-bit Q and K, and dQ = dS.(K -
  m') with dS and K - m' rounded to the inputs' dtype."""
  s, k16, tokens = tiles.edge_key_block(q16, q_pos, q_ids, k16_ptr, kv_ids_ptr, j, HKV, D,
                                        BLOCK_KV, LEFT, RIGHT, IDS, MULTIPLIER, DOT_PRECISION)
  p = tl.exp2(tiles.at_most_zero(s - lse[:, None]))
  v = tl.load(v_ptr + tokens)
  dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
  ds = p * (dp - delta[:, None])
  if MEANS:
    k16 = tiles.sixteen_bit(k16.to(tl.float32) - dq_mean[None, :], INPUTS).to(k16.dtype)
  return dq + tl.dot(tiles.sixteen_bit(ds, INPUTS).to(k16.dtype), k16,
                     input_precision=DOT_PRECISION)


@triton.jit
def _dq_kernel(q8_ptr, q_scale_ptr, q_mean_ptr, lse_ptr, delta_ptr, do_ptr, q_ids_ptr, k8_ptr,
               k8_t_ptr, k_scale_ptr, v_ptr, q16_ptr, k16_ptr, k_mean_ptr, k_mean_seen_ptr,
               kv_ids_ptr, dq_ptr, H: tl.constexpr, HKV: tl.constexpr, TQ: tl.constexpr,
               TK: tl.constexpr, D: tl.constexpr, TILE_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
               SCALE: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, IDS: tl.constexpr,
               SMOOTH_Q: tl.constexpr, MEANS: tl.constexpr, EXACT_EDGES: tl.constexpr,
               MULTIPLIER: tl.constexpr, INPUTS: tl.constexpr, DS16: tl.constexpr,
               CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr):
  i = tl.program_id(0)
  if RIGHT is not None:  # the longest rows first, so the last wave is of short ones
    i = TQ // TILE_Q - 1 - i
  b = tl.program_id(1).to(tl.int64)
  h = tl.program_id(2)
  kvh = h // (H // HKV)
  q_head = b * H + h
  kv_head = b * HKV + kvh
  rows = i * TILE_Q + tl.arange(0, TILE_Q)
  tokens = tiles.token_offsets(b, rows, h, TQ, H, D)
  q8, q_scale, q_mean, q_ids = tiles.query_tile(q8_ptr, q_scale_ptr, q_mean_ptr, q_ids_ptr, b,
                                                q_head, i, rows, TQ, D, TILE_Q, IDS, SMOOTH_Q)
  lse = tl.load(lse_ptr + q_head * TQ + rows)
  delta = tl.load(delta_ptr + q_head * TQ + rows)
  do = tl.load(do_ptr + tokens)
  k8_ptr += kv_head * TK * D
  k8_t_ptr += kv_head * D * TK
  k_scale_ptr += kv_head * TK
  v_ptr += b * TK * HKV * D + kvh * D
  k16_ptr += b * TK * HKV * D + kvh * D
  kv_ids_ptr += b * TK
  q16 = 0.0
  if MEANS or EXACT_EDGES:
    q16 = tl.load(q16_ptr + tokens)
  k_mean = 0.0
  row_mean = 0.0
  dq_mean = 0.0
  if MEANS:
    k_mean = tl.load(k_mean_ptr + kv_head * D + tl.arange(0, D))
    row_mean = tiles.mean_scores(q16, k_mean, MULTIPLIER)
    # m', the one mean dQ's K is taken less in every tile (`QuantizedQKV.k_mean_seen`).
    dq_mean = tl.load(k_mean_seen_ptr + (kv_head * (TQ // TILE_Q) + i) * D + tl.arange(0, D))

  dq = tl.full((TILE_Q, D), 0.0, tl.float32)
  full_start = 0
  full_end = TK // BLOCK_KV
  if LEFT is not None or RIGHT is not None:
    start, full_start, full_end, end = tiles.kv_range(i, TILE_Q, BLOCK_KV, TK // BLOCK_KV,
                                                      LEFT, RIGHT)
  for j in range(full_start, full_end):
    dq = _kv_step(dq, q8, q_scale, q_mean, row_mean, k_mean, rows[:, None], q_ids, lse, delta,
                  do, k8_ptr, k8_t_ptr, k_scale_ptr, v_ptr, k16_ptr, kv_ids_ptr, j, TK, HKV, D,
                  TILE_Q, BLOCK_KV, None, None, IDS, SMOOTH_Q, MEANS, INPUTS, DS16, CONVERT,
                  DOT_PRECISION)
  if LEFT is not None or RIGHT is not None:
    # The band's masked blocks as straight-line steps (forward.py says why),
    # after the loop: the order dQ's launch was tuned with.
    right: tl.constexpr = tiles.edge_blocks(TILE_Q, BLOCK_KV, RIGHT)  # causal: the diagonal
    edge_start, _ = tiles.right_edge(i, TILE_Q, BLOCK_KV, TK // BLOCK_KV, RIGHT)
    for s in tl.static_range(right + tiles.edge_blocks(TILE_Q, BLOCK_KV, LEFT)):
      j, inside = tiles.edge_block(s, right, full_end, end, start, full_start)
      if inside:
        if EXACT_EDGES and (s < right or j >= edge_start):  # forward.py's test
          dq = _edge_step(dq, q16, rows[:, None], q_ids, lse, delta, do, dq_mean, v_ptr,
                          k16_ptr, kv_ids_ptr, j, HKV, D, BLOCK_KV, LEFT, RIGHT, IDS, MEANS,
                          MULTIPLIER, INPUTS, DOT_PRECISION)
        else:
          dq = _kv_step(dq, q8, q_scale, q_mean, row_mean, k_mean, rows[:, None], q_ids, lse,
                        delta, do, k8_ptr, k8_t_ptr, k_scale_ptr, v_ptr, k16_ptr, kv_ids_ptr, j,
                        TK, HKV, D, TILE_Q, BLOCK_KV, LEFT, RIGHT, IDS, SMOOTH_Q, MEANS, INPUTS,
                        DS16, CONVERT, DOT_PRECISION)
  # S was formed from Q * scale * log2(e): dQ takes `scale` once (the 16-bit
  # product, of dS and K, too).
  tl.store(dq_ptr + tokens, (dq * SCALE).to(dq_ptr.dtype.element_ty))


def dot_precision(dtype) -> str:
  """tl.dot's input precision for dO.V^T: fp32 inputs get fp32 products (not
  TF32), as the reference's; 16-bit inputs multiply as they are."""
  return "ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32"


def backward_dq(qkv: QuantizedQKV, v, lse, delta, do, masks: Masks, config: Config,
                launch: LaunchConfig) -> jax.Array:
  """dQ (B, Tq, H, D) in dO's dtype."""

  def run(q8, q_scale, q_mean, lse, delta, do, q_ids, k8, k8_t, k_scale, v, q16, k16, k_mean,
          k_mean_seen, kv_ids):
    batch, heads, q_len, head_dim = q8.shape
    kv_heads, kv_len = k8.shape[1], k8.shape[2]
    args = [q8, q_scale, placeholder(q_mean, jnp.float32), lse, delta, do,
            placeholder(q_ids, jnp.int32), k8, k8_t, k_scale, v, placeholder(q16, v.dtype),
            placeholder(k16, v.dtype), placeholder(k_mean, jnp.float32),
            placeholder(k_mean_seen, jnp.float32), placeholder(kv_ids, jnp.int32)]
    rows = launch.tile_rows_for(q_len, config.block_q,
                                free=q_mean is None and not config.causal_exact)
    left, right = causal_blocks.band(config.causal, config.window)
    # Kept: the query tile's Q8 and dO (and Q); per stage, a key block's K8,
    # K8^T and V (and K with 16-bit dS or edge tiles).
    size, ds16 = v.dtype.itemsize, config.ds_precision == "bf16"
    k16_kept = ds16 or config.exact_edges
    fitted = launch.fitted(fixed_bytes=rows * head_dim * (1 + size * (1 + config.causal_exact)),
                           stage_bytes=config.block_kv * head_dim * (2 + size * (1 + k16_kept)))
    (dq,) = fitted.call(
        _dq_kernel, args, [jax.ShapeDtypeStruct(do.shape, do.dtype)],
        grid=(q_len // rows, batch, heads), name="sagebwd_triton_backward_dq",
        H=heads, HKV=kv_heads, TQ=q_len, TK=kv_len, D=head_dim, TILE_Q=rows,
        BLOCK_KV=config.block_kv, SCALE=config.scale, LEFT=left, RIGHT=right, IDS=q_ids is not None,
        SMOOTH_Q=q_mean is not None, MEANS=k_mean_seen is not None,
        EXACT_EDGES=config.exact_edges, MULTIPLIER=config.scale * nm.LOG2_E,
        INPUTS=jnp.dtype(v.dtype).name, DS16=ds16, CONVERT=launch.convert,
        DOT_PRECISION=dot_precision(v.dtype))
    return (dq,)

  return batch_folded(run)(qkv.q8, qkv.q_scale, qkv.q_mean, lse, delta, do, masks.q_ids,
                           qkv.k8, qkv.k8_t, qkv.k_scale, v, qkv.q16, qkv.k16, qkv.k_mean,
                           qkv.k_mean_seen, masks.kv_ids)[0]
