"""dK and dV: one program per (key tile, batch, key/value head) loops over
the query heads of its group and the query blocks that see its keys. It works
on transposed tiles (S^T = K.Q^T, dP^T = V.dO^T) so P^T and dS^T are the first
operands of their INT8 dots and are quantized per key (a row here; with
ds_precision="bf16" dS^T.Q runs in the inputs' dtype instead). P^T is
unsigned, as the Hopper backward has it (`TritonBackend.NUMERICS`):
0..255 against the row's largest, from the exponent (one add per score, no
division), and dS^T is formed from those unrounded 0..255 values, its row
scale absorbing P^T's. The group's sum (GQA) stays in the program's fp32
accumulators.

The key tile (`TILE_KV`, the launch's `tile_rows_for`) need not be K's
quantization block: K's scales are read per key, so 128 keys at 8 warps put
two 64-key warpgroups on each query block's loads with the results of 64-key
programs."""

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
from pallas_kernels.types import Config, Masks, QuantizedQKV

LN_2 = tl.constexpr(nm.LN_2)


@device_function
def _dv_half(dv, p8_t, row_scale, do8_t_ptr, dv_start_ptr, i, rows, dims, TQ: tl.constexpr,
             TILE_KV: tl.constexpr, D: tl.constexpr):
  """dV's columns `dims` += P^T.dO8 (unsigned P^T, tiles.py), scaled per row."""
  do8_t = tl.load(do8_t_ptr + dims[:, None] * TQ + rows[None, :])
  dv_start = tl.load(dv_start_ptr + i * D + dims)
  start = tl.broadcast_to(dv_start[None, :], (TILE_KV, dims.shape[0]))
  prod = tl.dot(p8_t, tl.trans(do8_t), acc=start, out_dtype=tl.int32)
  return dv + tiles.exact_float(prod) * row_scale


@device_function
def _dk_half(dk, ds_t, ds8_t, scale, p_scale, q8_t_ptr, q_mean_ptr, q16_ptr, i, rows, dims,
             TQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, SMOOTH_Q: tl.constexpr,
             DS16: tl.constexpr, CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """dK's columns `dims` += dS^T.Q (int8 with dS^T per row, or 16-bit)."""
  if DS16:  # dS^T and Q in the inputs' dtype (ds_precision="bf16")
    q16 = tl.load(q16_ptr + rows[:, None] * H * D + dims[None, :])
    dk += tl.dot((ds_t * p_scale[:, None]).to(q16.dtype), q16, input_precision=DOT_PRECISION)
  else:
    q8_t = tl.load(q8_t_ptr + dims[:, None] * TQ + rows[None, :])
    dk += tiles.int8_product(ds8_t, q8_t, CONVERT) * scale
    if SMOOTH_Q:
      q_mean = tl.load(q_mean_ptr + i * D + dims)
      dk += (tl.sum(ds_t, axis=1) * p_scale)[:, None] * q_mean[None, :]
  return dk


@device_function
def _q_step(dk_lo, dk_hi, dv_lo, dv_hi, k8, k_scale, v, k16, kv_pos, kv_ids, q8_ptr, q8_t_ptr,
            q_scale_ptr, q_mean_ptr, lse_ptr, delta_ptr, do_ptr, do8_t_ptr, do_scale_ptr,
            dv_start_ptr, q16_ptr, row_mean_ptr, q_ids_ptr, i, j, TQ: tl.constexpr,
            H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_KV: tl.constexpr,
            NK: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, IDS: tl.constexpr,
            SMOOTH_Q: tl.constexpr, Q_PER_TOKEN: tl.constexpr, MEANS: tl.constexpr,
            EXACT_EDGES: tl.constexpr, MULTIPLIER: tl.constexpr, DS16: tl.constexpr,
            CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr):
  rows = i * BLOCK_Q + tl.arange(0, BLOCK_Q)
  dims = tl.arange(0, D)
  lo = tl.arange(0, D // 2)
  hi = D // 2 + lo
  q8 = tl.load(q8_ptr + rows[:, None] * D + dims[None, :])
  if Q_PER_TOKEN:  # a scale per column
    q_scale = tl.load(q_scale_ptr + rows)[None, :]
  else:
    q_scale = tl.load(q_scale_ptr + i * BLOCK_Q)
  q_mean = tl.load(q_mean_ptr + i * D + dims) if SMOOTH_Q else 0.0
  bias = tiles.q_smoothing_bias(k8, k_scale, q_mean)[:, None] if SMOOTH_Q else 0.0
  x, c = tiles.score_tile(k8, q8, k_scale[:, None], q_scale, bias, SMOOTH_Q, CONVERT)
  q_ids = tl.load(q_ids_ptr + rows)[None, :] if IDS else 0
  x = tiles.masked(x, rows[None, :], kv_pos, q_ids, kv_ids, LEFT, RIGHT, IDS)
  lse = tl.load(lse_ptr + rows)[None, :]
  if EXACT_EDGES:
    q16 = tl.load(q16_ptr + rows[:, None] * H * D + dims[None, :])
  # `Config.causal_exact`: the forward's scores (forward.py), a key tile
  # being one key block.
  edge_start, edge_end = tiles.right_edge(i, BLOCK_Q, TILE_KV, NK, RIGHT)
  if EXACT_EDGES and (j >= edge_start) & (j < edge_end):
    s = tiles.masked(tiles.edge_scores(k16, q16, MULTIPLIER, DOT_PRECISION), rows[None, :],
                     kv_pos, q_ids, kv_ids, LEFT, RIGHT, IDS)
    a = tiles.at_most_zero(s - lse)
  elif MEANS:
    s = tiles.scores(x, c, SMOOTH_Q) + tl.load(row_mean_ptr + rows)[None, :]
    a = tiles.at_most_zero(s - lse)
  else:
    a = tiles.log2_p(x, c, lse, SMOOTH_Q)
  # numerics.unsigned_rows: P^T = pq * exp2(top), pq in 0..255. (tl.max
  # skips a NaN column: sagebwd.py carries it to dV.)
  top = tl.max(a, axis=1)
  top = tl.where(top == float("-inf"), 0.0, top) - tiles.LOG2_UINT8_MAX
  pq_t = tl.exp2(a - top[:, None])
  p_scale = tl.exp2(top)

  do = tl.load(do_ptr + rows[:, None] * H * D + dims[None, :])
  dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
  ds_t = pq_t * (dp_t - tl.load(delta_ptr + rows)[None, :])
  p8_t = tiles.unsigned_byte(pq_t)

  # dV and dK in column halves: an int32 product of half the width is live
  # at a time, registers that otherwise spill (docs/performance-log.md).
  dv_scale = p_scale[:, None] * tl.load(do_scale_ptr + i * BLOCK_Q)
  dv_lo = _dv_half(dv_lo, p8_t, dv_scale, do8_t_ptr, dv_start_ptr, i, rows, lo, TQ, TILE_KV, D)
  dv_hi = _dv_half(dv_hi, p8_t, dv_scale, do8_t_ptr, dv_start_ptr, i, rows, hi, TQ, TILE_KV, D)
  ds8_t, dk_scale = ds_t, 0.0
  if not DS16:
    ds8_t, ds_scale = tiles.quantize_rows(ds_t, tl.max(tl.abs(ds_t), axis=1))
    dk_scale = (ds_scale * p_scale)[:, None] * q_scale
  dk_lo = _dk_half(dk_lo, ds_t, ds8_t, dk_scale, p_scale, q8_t_ptr, q_mean_ptr, q16_ptr, i,
                   rows, lo, TQ, H, D, SMOOTH_Q, DS16, CONVERT, DOT_PRECISION)
  dk_hi = _dk_half(dk_hi, ds_t, ds8_t, dk_scale, p_scale, q8_t_ptr, q_mean_ptr, q16_ptr, i,
                   rows, hi, TQ, H, D, SMOOTH_Q, DS16, CONVERT, DOT_PRECISION)
  return dk_lo, dk_hi, dv_lo, dv_hi


@triton.jit
def _dkdv_kernel(k8_ptr, k_scale_ptr, v_ptr, kv_ids_ptr, q8_ptr, q8_t_ptr, q_scale_ptr,
                 q_mean_ptr, lse_ptr, delta_ptr, do_ptr, do8_t_ptr, do_scale_ptr, dv_start_ptr,
                 q16_ptr, k16_ptr, row_mean_ptr, q_ids_ptr, dk_ptr, dv_ptr, H: tl.constexpr,
                 HKV: tl.constexpr, TQ: tl.constexpr, TK: tl.constexpr, D: tl.constexpr,
                 BLOCK_Q: tl.constexpr, TILE_KV: tl.constexpr, SCALE: tl.constexpr,
                 LEFT: tl.constexpr, RIGHT: tl.constexpr, IDS: tl.constexpr,
                 SMOOTH_Q: tl.constexpr, Q_PER_TOKEN: tl.constexpr, MEANS: tl.constexpr,
                 EXACT_EDGES: tl.constexpr, MULTIPLIER: tl.constexpr, DS16: tl.constexpr,
                 CONVERT: tl.constexpr, DOT_PRECISION: tl.constexpr):
  j = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  kvh = tl.program_id(2)
  kv_head = b * HKV + kvh
  keys = j * TILE_KV + tl.arange(0, TILE_KV)
  dims = tl.arange(0, D)
  tokens = tiles.token_offsets(b, keys, kvh, TK, HKV, D)
  k8 = tl.load(k8_ptr + kv_head * TK * D + keys[:, None] * D + dims[None, :])
  k_scale = tl.load(k_scale_ptr + kv_head * TK + keys)
  v = tl.load(v_ptr + tokens)
  k16 = tl.load(k16_ptr + tokens) if EXACT_EDGES else 0.0
  kv_ids = tl.load(kv_ids_ptr + b * TK + keys)[:, None] if IDS else 0
  q_ids_ptr += b * TQ
  nq = TQ // BLOCK_Q
  full_start = 0
  full_end = nq
  if LEFT is not None or RIGHT is not None:
    start, full_start, full_end, end = tiles.q_range(j, BLOCK_Q, TILE_KV, nq, LEFT, RIGHT)

  dk_lo = tl.full((TILE_KV, D // 2), 0.0, tl.float32)
  dk_hi = tl.full((TILE_KV, D // 2), 0.0, tl.float32)
  dv_lo = tl.full((TILE_KV, D // 2), 0.0, tl.float32)
  dv_hi = tl.full((TILE_KV, D // 2), 0.0, tl.float32)
  for g in range(0, H // HKV):
    h = kvh * (H // HKV) + g
    q_head = b * H + h
    q8_h = q8_ptr + q_head * TQ * D
    q8_t_h = q8_t_ptr + q_head * D * TQ
    q_scale_h = q_scale_ptr + q_head * TQ
    q_mean_h = q_mean_ptr + q_head * nq * D
    lse_h = lse_ptr + q_head * TQ
    delta_h = delta_ptr + q_head * TQ
    do_h = do_ptr + b * TQ * H * D + h * D
    q16_h = q16_ptr + b * TQ * H * D + h * D
    row_mean_h = row_mean_ptr + q_head * TQ
    do8_t_h = do8_t_ptr + q_head * D * TQ
    do_scale_h = do_scale_ptr + q_head * TQ
    dv_start_h = dv_start_ptr + q_head * nq * D
    for i in range(full_start, full_end):
      dk_lo, dk_hi, dv_lo, dv_hi = _q_step(
          dk_lo, dk_hi, dv_lo, dv_hi, k8, k_scale, v, k16, keys[:, None], kv_ids, q8_h, q8_t_h,
          q_scale_h, q_mean_h, lse_h, delta_h, do_h, do8_t_h, do_scale_h, dv_start_h, q16_h,
          row_mean_h, q_ids_ptr, i, j, TQ, H, D, BLOCK_Q, TILE_KV, TK // TILE_KV, None, None,
          IDS, SMOOTH_Q, Q_PER_TOKEN, MEANS, False, MULTIPLIER, DS16, CONVERT, DOT_PRECISION)
    # The band's masked steps last, straight-line as the forward's
    # (forward.py says why): before the loop they cost it spills. Only the
    # fp32 sums' order differs from the reference's; every int8 tile is its.
    if LEFT is not None or RIGHT is not None:
      right: tl.constexpr = tiles.edge_blocks(TILE_KV, BLOCK_Q, RIGHT)  # causal: the diagonal
      for s in tl.static_range(right + tiles.edge_blocks(TILE_KV, BLOCK_Q, LEFT)):
        i, inside = tiles.edge_block(s, right, start, full_start, full_end, end)
        if inside:
          dk_lo, dk_hi, dv_lo, dv_hi = _q_step(
              dk_lo, dk_hi, dv_lo, dv_hi, k8, k_scale, v, k16, keys[:, None], kv_ids, q8_h,
              q8_t_h, q_scale_h, q_mean_h, lse_h, delta_h, do_h, do8_t_h, do_scale_h,
              dv_start_h, q16_h, row_mean_h, q_ids_ptr, i, j, TQ, H, D, BLOCK_Q, TILE_KV,
              TK // TILE_KV, LEFT, RIGHT, IDS, SMOOTH_Q, Q_PER_TOKEN, MEANS, EXACT_EDGES,
              MULTIPLIER, DS16, CONVERT, DOT_PRECISION)
  # Q was quantized as Q * scale * log2(e): the int8 product carries log2(e);
  # the 16-bit one is of Q itself.
  dk_factor = SCALE if DS16 else LN_2
  lo = tl.arange(0, D // 2)
  out = (b * TK + keys[:, None]) * HKV * D + kvh * D
  tl.store(dk_ptr + out + lo[None, :], (dk_lo * dk_factor).to(dk_ptr.dtype.element_ty))
  tl.store(dk_ptr + out + (D // 2 + lo)[None, :], (dk_hi * dk_factor).to(dk_ptr.dtype.element_ty))
  tl.store(dv_ptr + out + lo[None, :], dv_lo.to(dv_ptr.dtype.element_ty))
  tl.store(dv_ptr + out + (D // 2 + lo)[None, :], dv_hi.to(dv_ptr.dtype.element_ty))


def backward_dkdv(qkv: QuantizedQKV, v, lse, delta, do, do8_t, do_scale, masks: Masks,
                  config: Config, launch: LaunchConfig, do_start: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """dK, dV (B, Tk, Hkv, D) in V's dtype, summed over each kv head's group.

  Each program takes `launch.tile_rows_for(Tk, block_kv)` keys. `do_start`: the
  pre-pass's P^T.dO accumulator start (`types.Prepass`), else formed here.
  """

  def run(k8, k_scale, v, kv_ids, q8, q8_t, q_scale, q_mean, lse, delta, do, do8_t, do_scale,
          do_start, q16, k16, k_mean, q_ids):
    batch, heads, q_len, head_dim = q8.shape
    kv_heads, kv_len = k8.shape[1], k8.shape[2]
    multiplier = config.scale * nm.LOG2_E
    args = [k8, k_scale, v, placeholder(kv_ids, jnp.int32), q8, placeholder(q8_t, jnp.int8),
            q_scale, placeholder(q_mean, jnp.float32), lse, delta, do, do8_t, do_scale,
            tiles.accumulator_start(do_start, do8_t, config.block_q), placeholder(q16, v.dtype),
            placeholder(k16, v.dtype),
            placeholder(None if k_mean is None else nm.mean_scores(q16, k_mean, multiplier),
                        jnp.float32),
            placeholder(q_ids, jnp.int32)]
    shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
    # One key block per program with `Config.causal_exact`: which query
    # blocks' tiles are edges is a key block's.
    keys = launch.tile_rows_for(kv_len, config.block_kv, free=not config.causal_exact)
    left, right = causal_blocks.band(config.causal, config.window)
    # Kept: the key tile's K8 and V (and K for the edge tiles); per stage, a
    # query step's Q8, Q8^T, dO8^T and dO (and Q with 16-bit dS).
    size, ds16 = v.dtype.itemsize, config.ds_precision == "bf16"
    fitted = launch.fitted(
        fixed_bytes=keys * head_dim * (1 + size * (1 + config.exact_edges)),
        stage_bytes=config.block_q * head_dim * (3 + size * (1 + ds16)))
    dk, dv = fitted.call(
        _dkdv_kernel, args, [shape, shape], grid=(kv_len // keys, batch, kv_heads),
        name="sagebwd_triton_backward_dkdv", H=heads, HKV=kv_heads, TQ=q_len, TK=kv_len,
        D=head_dim, BLOCK_Q=config.block_q, TILE_KV=keys, SCALE=config.scale, LEFT=left,
        RIGHT=right, IDS=q_ids is not None, SMOOTH_Q=q_mean is not None,
        Q_PER_TOKEN=config.q_per_token, MEANS=k_mean is not None,
        EXACT_EDGES=config.exact_edges, MULTIPLIER=multiplier, DS16=ds16,
        CONVERT=launch.convert, DOT_PRECISION=dot_precision(v.dtype))
    return dk, dv

  return batch_folded(run)(qkv.k8, qkv.k_scale, v, masks.kv_ids, qkv.q8, qkv.q8_t,
                           qkv.q_scale, qkv.q_mean, lse, delta, do, do8_t, do_scale,
                           do_start, qkv.q16, qkv.k16, qkv.k_mean, masks.q_ids)
