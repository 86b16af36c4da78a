"""What the Mosaic GPU kernels share besides their pipeline (`pipeline`): the
cases they take, the scale floor, shared-memory layouts."""

from __future__ import annotations

import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import numerics as nm
from pallas_kernels.types import Config, Masks, QuantizedQKV

BLOCK = 64  # rows per compute warpgroup = quantization block = key tile
HEAD_DIMS = (64, 128)


def supports(masks: Masks, config: Config, head_dim: int) -> bool:
  """Whether the Mosaic kernels take this case (else the portable ones run).
  Their Q scales are per block (`Config.q_per_token` is not)."""
  return (masks.q_ids is None and masks.kv_ids is None and not config.smooth_q
          and not config.q_per_token and head_dim in HEAD_DIMS
          and config.block_q == BLOCK and config.block_kv == BLOCK)


def check_supported(qkv: QuantizedQKV, masks: Masks, config: Config, name: str,
                    multiple: int = BLOCK):
  """Raises unless the Mosaic backward kernels take this case (`supports`,
  sequence lengths in whole tiles of `multiple` tokens)."""
  head_dim = qkv.q8.shape[-1]
  if not supports(masks, config, head_dim):
    raise NotImplementedError(
        f"{name}: needs no masks, smooth_q=False, ds_precision='int8', "
        f"block_q=block_kv=64, D in {HEAD_DIMS}; "
        f"got masks={masks.q_ids is not None or masks.kv_ids is not None}, "
        f"smooth_q={config.smooth_q}, ds_precision={config.ds_precision!r}, "
        f"blocks=({config.block_q}, {config.block_kv}), D={head_dim}")
  q_len, kv_len = qkv.q8.shape[2], qkv.k8.shape[2]
  if q_len % multiple or kv_len % multiple:
    raise ValueError(f"{name}: sequence lengths {q_len}, {kv_len} must be multiples of "
                     f"{multiple}")


def positive_scale(c):
  """A score tile's scale product, floored at `numerics.SCALE_FLOOR`. A NaN
  scale (a non-finite input block) stays NaN: a max would drop it (PTX's max
  returns the other operand)."""
  return jnp.where(c < nm.SCALE_FLOOR, nm.SCALE_FLOOR, c)


def smem_transforms(minor_elems: int, dtype) -> tuple:
  """Tiling and swizzle of a shared-memory tile whose minor dim has `minor_elems`."""
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


