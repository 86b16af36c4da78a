"""The forward's quantization pass, one kernel: psi of Q per `block_q` rows and
of K - k_mean and V per `block_kv` rows, each 16-bit input read once and each
output written once, in the layouts the kernels that will run read
(`types.Layouts`): Q8 and K8 (T, D); Q8^T and K8^T (for a backward) and V8^T
transposed, TOKENS or REGISTER_B; per-token scales; Q-smoothing's block means;
and, where V8^T is TOKENS, the portable forward's P.V accumulator start.

K's mean (K-smoothing) needs every token of K before any is quantized, so it
arrives computed (`sagebwd.key_mean`; with `Config.causal_exact`
`sagebwd.first_block_mean`): K is read twice in all, V and Q once.

With quantization="int8_fp8" (`Config.fp8`) V goes to E4M3 with one scale
per `block_kv` rows (numerics.quantize_e4m3 over the block), in the same
launch and read; for a backward the pass also forms the FP8 backward's key
side from the blocks it holds (`types.Fp8Keys`: K' in E4M3, transposed, and
each block's largest ||V_j||), which would otherwise cost a copy of the
smoothed K and a second read of it and of V, and writes no K8^T, which only
an INT8 dS.K reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import numerics as nm
from pallas_kernels.jax_triton import tiles
from pallas_kernels.jax_triton.interpreter import device_function
from pallas_kernels.batching import batch_folded
from pallas_kernels.jax_triton.launch import LaunchConfig, placeholder
from pallas_kernels.layouts import REGISTER_BLOCK
from pallas_kernels.types import Config, Fp8Keys, Layouts, QuantizedQKV, TransposedLayout


@device_function
def _block(i, T: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
  """Block i of all (batch, head) rows as (t, head = b * H + h, b, h)."""
  t = i % (T // BLOCK)
  head = (i // (T // BLOCK)).to(tl.int64)
  return t, head, head // H, head % H


@device_function
def _quantize_q(q_ptr, q8_ptr, q8_t_ptr, q_scale_ptr, q_mean_ptr, i, T: tl.constexpr,
                H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                MULTIPLIER: tl.constexpr, SMOOTH: tl.constexpr, PER_ROW: tl.constexpr,
                TRANSPOSED: tl.constexpr, REGISTER_B: tl.constexpr):
  t, head, b, h = _block(i, T, H, BLOCK)
  rows = tiles.block_tokens(t, BLOCK, REGISTER_B)
  dims = tl.arange(0, D)
  x = tl.load(q_ptr + tiles.token_offsets(b, rows, h, T, H, D)).to(tl.float32)
  if SMOOTH:
    row_mean = tl.sum(x, axis=0) / BLOCK
    x = x - row_mean[None, :]
    tl.store(q_mean_ptr + (head * (T // BLOCK) + t) * D + dims, row_mean * MULTIPLIER)
  # The multiplier goes into the scale, not the values: one multiply per
  # element leaves no product that a compiler could fuse or reassociate
  # differently than the reference's.
  if PER_ROW:
    x8, scale = tiles.quantize_rows(x, tiles.abs_max(x, 1))
  else:
    x8, scale = tiles.quantize_tile(x)
    scale = tl.full((BLOCK,), scale, tl.float32)
  tl.store(q8_ptr + head * T * D + rows[:, None] * D + dims[None, :], x8)
  if TRANSPOSED:
    tiles.store_transposed(q8_t_ptr, x8, rows, head, t, T, D, BLOCK, REGISTER_B)
  tl.store(q_scale_ptr + head * T + rows, scale * MULTIPLIER)


@device_function
def _quantize_kv(k_ptr, v_ptr, k_mean_ptr, k8_ptr, k8_t_ptr, k_scale_ptr, v8_t_ptr, v_scale_ptr,
                 v_start_ptr, kf8_t_ptr, kf8_scale_ptr, v_norm_ptr, i, T: tl.constexpr,
                 H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_MEAN: tl.constexpr, K_TRANSPOSED: tl.constexpr,
                 K_REGISTER_B: tl.constexpr, V_REGISTER_B: tl.constexpr, FP8: tl.constexpr,
                 FP8_KEYS: tl.constexpr, INPUTS: tl.constexpr):
  t, head, b, h = _block(i, T, H, BLOCK)
  dims = tl.arange(0, D)
  rows = tiles.block_tokens(t, BLOCK, K_REGISTER_B)
  x = tl.load(k_ptr + tiles.token_offsets(b, rows, h, T, H, D)).to(tl.float32)
  if HAS_MEAN:
    x = x - tl.load(k_mean_ptr + head * D + dims)[None, :]
  # K' (the smoothed K in the inputs' dtype, as sagebwd's k16) before K8, so
  # that x dies with K8's stores (registers: docs/performance-log.md).
  if FP8_KEYS:
    kf8, scale = tiles.quantize_e4m3(tiles.sixteen_bit(x, INPUTS))
    tiles.store_transposed(kf8_t_ptr, kf8, rows, head, t, T, D, BLOCK, K_REGISTER_B)
    tl.store(kf8_scale_ptr + head * T + rows, tl.full((BLOCK,), scale, tl.float32))
  x8, scale = tiles.quantize_tile(x)
  tl.store(k8_ptr + head * T * D + rows[:, None] * D + dims[None, :], x8)
  if K_TRANSPOSED:
    tiles.store_transposed(k8_t_ptr, x8, rows, head, t, T, D, BLOCK, K_REGISTER_B)
  tl.store(k_scale_ptr + head * T + rows, tl.full((BLOCK,), scale, tl.float32))

  rows = tiles.block_tokens(t, BLOCK, V_REGISTER_B)
  y = tl.load(v_ptr + tiles.token_offsets(b, rows, h, T, H, D)).to(tl.float32)
  if FP8:
    y8, scale = tiles.quantize_e4m3(y)
  else:
    y8, scale = tiles.quantize_tile(y)
  tl.store(v_scale_ptr + head * T + rows, tl.full((BLOCK,), scale, tl.float32))
  tiles.store_transposed(v8_t_ptr, y8, rows, head, t, T, D, BLOCK, V_REGISTER_B)
  if not V_REGISTER_B and not FP8:
    tl.store(v_start_ptr + (head * (T // BLOCK) + t) * D + dims, tiles.block_start(y8))
  if FP8_KEYS:
    # A maximum of norms, so the rows' order is free; on the bits, so a NaN
    # norm carries as the XLA pass's maximum carries it.
    tl.store(v_norm_ptr + head * (T // BLOCK) + t, tiles.abs_max(tiles.row_norms(y), None))


@triton.jit
def _quantize_kernel(q_ptr, k_ptr, v_ptr, k_mean_ptr, q8_ptr, q8_t_ptr, q_scale_ptr, q_mean_ptr,
                     k8_ptr, k8_t_ptr, k_scale_ptr, v8_t_ptr, v_scale_ptr, v_start_ptr,
                     kf8_t_ptr, kf8_scale_ptr, v_norm_ptr, B: tl.constexpr, H: tl.constexpr,
                     HKV: tl.constexpr, TQ: tl.constexpr, TK: tl.constexpr, D: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, MULTIPLIER: tl.constexpr,
                     SMOOTH_Q: tl.constexpr, PER_ROW: tl.constexpr, HAS_MEAN: tl.constexpr,
                     Q_TRANSPOSED: tl.constexpr, K_TRANSPOSED: tl.constexpr,
                     BACKWARD_REGISTER_B: tl.constexpr, FORWARD_REGISTER_B: tl.constexpr,
                     FP8: tl.constexpr, FP8_KEYS: tl.constexpr, INPUTS: tl.constexpr):
  # One program per block: Q's blocks first, then K's and V's, a block of each.
  i = tl.program_id(0)
  q_blocks: tl.constexpr = B * H * (TQ // BLOCK_Q)
  if i < q_blocks:
    _quantize_q(q_ptr, q8_ptr, q8_t_ptr, q_scale_ptr, q_mean_ptr, i, TQ, H, D, BLOCK_Q,
                MULTIPLIER, SMOOTH_Q, PER_ROW, Q_TRANSPOSED, BACKWARD_REGISTER_B)
  else:
    _quantize_kv(k_ptr, v_ptr, k_mean_ptr, k8_ptr, k8_t_ptr, k_scale_ptr, v8_t_ptr, v_scale_ptr,
                 v_start_ptr, kf8_t_ptr, kf8_scale_ptr, v_norm_ptr, i - q_blocks, TK, HKV, D,
                 BLOCK_KV, HAS_MEAN, K_TRANSPOSED, BACKWARD_REGISTER_B, FORWARD_REGISTER_B,
                 FP8, FP8_KEYS, INPUTS)


def transposed_shape(batch: int, heads: int, head_dim: int, length: int,
                     layout: TransposedLayout) -> tuple[int, ...]:
  """The shape of a transposed int8 array in `layout` (types.TransposedLayout)."""
  if layout is TransposedLayout.REGISTER_B:
    return (batch, heads, length // REGISTER_BLOCK, head_dim, REGISTER_BLOCK)
  return (batch, heads, head_dim, length)


def check_register_blocks(layout: TransposedLayout, *blocks: int, smooth_q: bool = False):
  """REGISTER_B tiles are whole quantization blocks of 64 tokens, and their
  rows are permuted, which would reorder Q-smoothing's sums."""
  if layout is TransposedLayout.REGISTER_B and (
      any(block != REGISTER_BLOCK for block in blocks) or smooth_q):
    raise ValueError(f"the REGISTER_B layout takes {REGISTER_BLOCK}-token blocks and no "
                     f"Q-smoothing; got blocks {blocks}, smooth_q={smooth_q}")


def quantize_qkv(q, k, v, k_mean, config: Config, launch: LaunchConfig, for_backward: bool,
                 layouts: Layouts = Layouts()) -> QuantizedQKV:
  """The forward's quantization pass (docs/algorithm.md, forward steps 1-3):
  Q's and K's transposed layouts, which only the backward reads, if
  `for_backward`; each transposed tensor in its `layouts`. With `Config.fp8`,
  V8^T is E4M3; no Q8^T (the FP8 dS^T.Q takes an FP8 copy of Q) and no
  accumulator start; for a backward, `QuantizedQKV.fp8_keys` in place of
  K8^T (not with `Config.causal_exact`)."""
  check_register_blocks(layouts.backward, config.block_q, config.block_kv,
                        smooth_q=config.smooth_q)
  check_register_blocks(layouts.forward, config.block_kv)
  # Per-token Q goes with 16-bit dS: no int8 dK product reads Q8 transposed.
  q_transposed = for_backward and not config.q_per_token and not config.fp8
  # causal_exact's K' is K less its first block's mean, unrounded: XLA's pass forms it.
  fp8_keys = for_backward and config.fp8 and not config.causal_exact
  # The FP8 dS.K reads K'^T; only an INT8 one reads K8^T (which, without the
  # key side, also tells the backward's layout: layouts.backward_layout).
  k_transposed = for_backward and not fp8_keys
  backward_b = layouts.backward is TransposedLayout.REGISTER_B
  forward_b = layouts.forward is TransposedLayout.REGISTER_B

  def run(q, k, v, k_mean):
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    i8, f32 = jnp.int8, jnp.float32
    outputs = [  # (wanted, shape, dtype)
        (True, (batch, heads, q_len, head_dim), i8),
        (q_transposed, transposed_shape(batch, heads, head_dim, q_len, layouts.backward), i8),
        (True, (batch, heads, q_len), f32),
        (config.smooth_q, (batch, heads, q_len // config.block_q, head_dim), f32),
        (True, (batch, kv_heads, kv_len, head_dim), i8),
        (k_transposed, transposed_shape(batch, kv_heads, head_dim, kv_len, layouts.backward),
         i8),
        (True, (batch, kv_heads, kv_len), f32),
        (True, transposed_shape(batch, kv_heads, head_dim, kv_len, layouts.forward),
         jnp.float8_e4m3fn if config.fp8 else i8),
        (True, (batch, kv_heads, kv_len), f32),
        (not forward_b and not config.fp8,
         (batch, kv_heads, kv_len // config.block_kv, head_dim), jnp.int32),
        # int8 where unused: sm_80 takes no E4M3 pointer.
        (fp8_keys, transposed_shape(batch, kv_heads, head_dim, kv_len, layouts.backward),
         jnp.float8_e4m3fn if fp8_keys else i8),
        (fp8_keys, (batch, kv_heads, kv_len), f32),
        (fp8_keys, (batch, kv_heads, kv_len // config.block_kv), f32),
    ]
    # Outputs not asked for get one element, never written.
    out_shape = [jax.ShapeDtypeStruct(shape if wanted else (1,), dtype)
                 for wanted, shape, dtype in outputs]
    blocks = (batch * heads * q_len // config.block_q
              + batch * kv_heads * kv_len // config.block_kv)
    outs = launch.call(
        _quantize_kernel, [q, k, v, placeholder(k_mean, f32)],
        out_shape, grid=(blocks,),
        name="sagebwd_triton_quantize", B=batch, H=heads, HKV=kv_heads, TQ=q_len, TK=kv_len,
        D=head_dim, BLOCK_Q=config.block_q, BLOCK_KV=config.block_kv,
        MULTIPLIER=config.scale * nm.LOG2_E, SMOOTH_Q=config.smooth_q,
        PER_ROW=config.q_per_token, HAS_MEAN=k_mean is not None, Q_TRANSPOSED=q_transposed,
        K_TRANSPOSED=k_transposed, BACKWARD_REGISTER_B=backward_b,
        FORWARD_REGISTER_B=forward_b, FP8=config.fp8, FP8_KEYS=fp8_keys,
        INPUTS=jnp.dtype(k.dtype).name)
    return tuple(y if wanted else None for (wanted, _, _), y in zip(outputs, outs))

  (q8, q8_t, q_scale, q_mean, k8, k8_t, k_scale, v8_t, v_scale, v_start,
   *keys) = batch_folded(run)(q, k, v, k_mean)
  return QuantizedQKV(q8=q8, q8_t=q8_t, q_scale=q_scale, q_mean=q_mean, k8=k8, k8_t=k8_t,
                      k_scale=k_scale, v8_t=v8_t, v_scale=v_scale, v_start=v_start,
                      fp8_keys=Fp8Keys(*keys) if fp8_keys else None)
