"""The quantization pass: psi of Q, K and V per block, in the layouts the int8
dots need (natural (T, D) and transposed (D, T)), with per-token scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import numerics as nm
from pallas_kernels.jax_triton import tiles
from pallas_kernels.jax_triton.launch import LaunchConfig, batch_folded, placeholder
from pallas_kernels.types import Config, QuantizedQKV


@triton.jit
def _quantize_kernel(x_ptr, mean_ptr, x8_ptr, x8_t_ptr, scale_ptr, row_mean_ptr,
                     T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     MULTIPLIER: tl.constexpr, HAS_MEAN: tl.constexpr, SMOOTH_ROWS: tl.constexpr,
                     PER_ROW: tl.constexpr, NATURAL: tl.constexpr, TRANSPOSED: tl.constexpr):
  t = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  h = tl.program_id(2)
  head = b * H + h
  rows = t * BLOCK + tl.arange(0, BLOCK)
  dims = tl.arange(0, D)
  x = tl.load(x_ptr + tiles.token_offsets(b, rows, h, T, H, D)).to(tl.float32)
  if HAS_MEAN:
    x = x - tl.load(mean_ptr + head * D + dims)[None, :]
  if SMOOTH_ROWS:
    row_mean = tl.sum(x, axis=0) / BLOCK
    x = x - row_mean[None, :]
    tl.store(row_mean_ptr + (head * (T // BLOCK) + t) * D + dims, row_mean * MULTIPLIER)
  # The multiplier goes into the scale, not the values: one multiply per
  # element leaves no product that a compiler could fuse or reassociate
  # differently than the reference's.
  if PER_ROW:
    x8, scale = tiles.quantize_rows(x, tiles.abs_max(x, 1))
  else:
    x8, scale = tiles.quantize_tile(x)
    scale = tl.full((BLOCK,), scale, tl.float32)
  if NATURAL:
    tl.store(x8_ptr + head * T * D + rows[:, None] * D + dims[None, :], x8)
  if TRANSPOSED:
    tl.store(x8_t_ptr + head * D * T + dims[:, None] * T + rows[None, :], tl.trans(x8))
  tl.store(scale_ptr + head * T + rows, scale * MULTIPLIER)


def quantize(x: jax.Array, *, block: int, launch: LaunchConfig, multiplier: float = 1.0,
             mean: jax.Array | None = None, smooth_rows: bool = False, per_row: bool = False,
             natural: bool = True, transposed: bool = True) -> tuple[jax.Array | None, ...]:
  """psi per `block` tokens (or per token, `per_row`) of x (B, T, H, D) minus
  `mean` (B, H, D): int8 (B, H, T, D) if `natural`, int8 (B, H, D, T) if
  `transposed`, scales (B, H, T), and with `smooth_rows` the block means
  (B, H, T // block, D) times `multiplier`; None for the tensors not asked
  for."""

  def run(x, mean):
    batch, seq_len, heads, head_dim = x.shape
    wanted = (natural, transposed, True, smooth_rows)
    shapes = [((batch, heads, seq_len, head_dim), jnp.int8),
              ((batch, heads, head_dim, seq_len), jnp.int8),
              ((batch, heads, seq_len), jnp.float32),
              ((batch, heads, seq_len // block, head_dim), jnp.float32)]
    # Outputs not asked for get one element, never written.
    out_shape = [jax.ShapeDtypeStruct(shape if want else (1,), dtype)
                 for want, (shape, dtype) in zip(wanted, shapes)]
    outs = launch.call(
        _quantize_kernel, [x, placeholder(mean, jnp.float32)], out_shape,
        grid=(seq_len // block, batch, heads), name="sagebwd_triton_quantize", T=seq_len,
        H=heads, D=head_dim, BLOCK=block, MULTIPLIER=multiplier, HAS_MEAN=mean is not None,
        SMOOTH_ROWS=smooth_rows, PER_ROW=per_row, NATURAL=natural, TRANSPOSED=transposed)
    return tuple(y if want else None for want, y in zip(wanted, outs))

  return batch_folded(run)(x, mean)


def quantize_qkv(q, k, v, k_mean, config: Config, launch: LaunchConfig,
                 for_backward: bool) -> QuantizedQKV:
  """The forward's quantization pass (docs/algorithm.md, forward steps 1-3);
  Q's and K's transposed layouts, which only the backward reads, if
  `for_backward`."""
  # Per-token Q goes with 16-bit dS: no int8 dK product reads Q8 transposed.
  q8, q8_t, q_scale, q_mean = quantize(q, block=config.block_q, launch=launch,
                                       multiplier=config.scale * nm.LOG2_E,
                                       smooth_rows=config.smooth_q, per_row=config.q_per_token,
                                       transposed=for_backward and not config.q_per_token)
  k8, k8_t, k_scale, _ = quantize(k, block=config.block_kv, launch=launch, mean=k_mean,
                                  transposed=for_backward)
  _, v8_t, v_scale, _ = quantize(v, block=config.block_kv, launch=launch, natural=False)
  return QuantizedQKV(q8=q8, q8_t=q8_t, q_scale=q_scale, q_mean=q_mean, k8=k8, k8_t=k8_t,
                      k_scale=k_scale, v8_t=v8_t, v_scale=v_scale)
