"""What the Mosaic GPU kernels share: the cases they take, the warp-specialized
launch (compute warpgroups and a TMA producer), shared-memory layouts."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.types import Config, Masks, QuantizedQKV

BLOCK = 64  # rows per compute warpgroup = quantization block = key tile
COMPUTE_WGS = 2
HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Launch settings of a warp-specialized Mosaic kernel (they do not change
  results): `compute_wgs` compute warpgroups of 64 rows each and a TMA
  producer streaming the other side's tiles through a ring."""

  compute_wgs: int = 2  # warpgroups of 64 rows per CTA
  max_concurrent_steps: int = 2  # ring depth, in steps
  schedule_barrier: bool = True  # compute warpgroups take turns on the tensor cores

  def __post_init__(self):
    # One or two 64-row blocks fit a 128-token step or CTA tile, so with
    # causal masking every warpgroup of a CTA sees the same steps (forward) or
    # releases the one it skips (backward).
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"compute_wgs must be 1 or 2; got {self.compute_wgs}")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps must be >= 2; got {self.max_concurrent_steps}")
    if self.schedule_barrier and self.compute_wgs != 2:
      raise ValueError("schedule_barrier alternates two compute warpgroups")


def supports(masks: Masks, config: Config, head_dim: int) -> bool:
  """Whether the Mosaic kernels take this case (else the portable ones run).
  Their Q scales are per block (`Config.q_per_token` is not)."""
  return (masks.q_ids is None and masks.kv_ids is None and not config.smooth_q
          and not config.q_per_token and head_dim in HEAD_DIMS
          and config.block_q == BLOCK and config.block_kv == BLOCK)


def check_supported(qkv: QuantizedQKV, masks: Masks, config: Config, name: str,
                    multiple: int = BLOCK):
  """Raises unless the Mosaic kernels take this case (`supports`, sequence
  lengths in whole tiles of `multiple` tokens)."""
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
  """A score tile's scale product, floored at 2**-100 so masked scores stay
  -inf (-inf * 0 is NaN); the floor moves an all-zero block's scores by less
  than 2**-75. A NaN scale (a non-finite input block) stays NaN: a max would
  drop it (PTX's max returns the other operand)."""
  return jnp.where(c < 2.0**-100, 2.0**-100, c)


def warp_specialized_kernel(kernel, *, scratch, barriers, out_type, grid, grid_names,
                            approx_math: bool, name: str, compute_wgs: int = COMPUTE_WGS):
  """`plgpu.kernel` with `compute_wgs` compute warpgroups and one producer.

  `kernel(*refs, scoped)` runs in every warpgroup ("wg" tells them apart);
  `scoped` holds the `scratch` shared-memory tiles and the `barriers`, allocated
  once for all of them. `name` is the kernel's name in profiles.
  """
  def entry(*refs):
    pl.run_scoped(lambda *scoped: kernel(*refs, scoped), scratch, *barriers,
                  collective_axes="wg")

  return plgpu.kernel(
      entry, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=approx_math), kernel_name=name)


def smem_transforms(minor_elems: int, dtype) -> tuple:
  """Tiling and swizzle of a shared-memory tile whose minor dim has `minor_elems`."""
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


