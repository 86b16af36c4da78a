"""The transposed int8 layouts (`types.TransposedLayout`) in plain JAX: the
register order of REGISTER_B, which layout an array is in, and conversions.

The kernels never convert: the quantization pass and the backward pre-pass
write each layout straight from the 16-bit inputs (`types.Layouts` is the
contract). The conversions here serve the reference, the tests and the
benchmarks, which hand one backend's tensors to another's kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.types import Layouts, QuantizedQKV, TransposedLayout

TOKENS, REGISTER_B = TransposedLayout.TOKENS, TransposedLayout.REGISTER_B
REGISTER_BLOCK = 64  # tokens per REGISTER_B tile: a wgmma's 64-row A operand
_RANKS = {4: TOKENS, 5: REGISTER_B}


def permute_keys(x: jax.Array, axis: int = -1, *, inverse: bool = False) -> jax.Array:
  """Reorders `axis` (a multiple of 16) within each 16 as sigma16: position
  4c + 2h + e holds element 8h + 2c + e (c < 4; h, e < 2). `inverse` undoes it."""
  axis = axis % x.ndim
  n = x.shape[axis]
  split = (2, 4, 2) if not inverse else (4, 2, 2)
  split = x.reshape(*x.shape[:axis], n // 16, *split, *x.shape[axis + 1:])
  perm = list(range(split.ndim))
  perm[axis + 1], perm[axis + 2] = axis + 2, axis + 1
  return jnp.transpose(split, perm).reshape(x.shape)


def layout_of(x8_t: jax.Array) -> TransposedLayout:
  """The layout of a transposed int8 array, from its rank."""
  if x8_t.ndim not in _RANKS:
    raise ValueError(f"a transposed int8 array has rank 4 (TOKENS) or 5 (REGISTER_B); got "
                     f"shape {x8_t.shape}")
  return _RANKS[x8_t.ndim]


def backward_layout(qkv: QuantizedQKV) -> TransposedLayout:
  """`Layouts.backward` of the call `qkv` was quantized for, off the
  transposed keys its backward reads: K8^T, or where the quantization pass
  formed the FP8 key side in its place, K'^T (`QuantizedQKV.fp8_keys`)."""
  if qkv.k8_t is None and qkv.fp8_keys is None:
    raise ValueError("qkv has no transposed keys (k8_t, fp8_keys): it was quantized for a "
                     "forward alone (for_backward=False)")
  return layout_of(qkv.k8_t if qkv.k8_t is not None else qkv.fp8_keys.k8_t)


def check_layout(name: str, x8_t: jax.Array | None, layout: TransposedLayout) -> None:
  """Raises unless `x8_t` (None passes) is in `layout`: a kernel's guard
  against tensors quantized for another kernel (`types.Layouts`)."""
  if x8_t is not None and layout_of(x8_t) is not layout:
    raise ValueError(f"{name} is {layout_of(x8_t).name} {x8_t.shape}; this kernel reads "
                     f"{layout.name}: quantize with the layouts of the backend that runs it "
                     "(Backend.layouts)")


def to_layout(x8_t: jax.Array, layout: TransposedLayout) -> jax.Array:
  """`x8_t` in `layout` (an XLA pass, where it is not already)."""
  if layout_of(x8_t) is layout:
    return x8_t
  if layout is REGISTER_B:  # (B, H, D, T) -> (B, H, T // 64, D, 64)
    b, h, d, t = x8_t.shape
    blocks = permute_keys(x8_t).reshape(b, h, d, t // REGISTER_BLOCK, REGISTER_BLOCK)
    return jnp.swapaxes(blocks, 2, 3)
  b, h, n, d, _ = x8_t.shape
  tokens = jnp.swapaxes(x8_t, 2, 3).reshape(b, h, d, n * REGISTER_BLOCK)
  return permute_keys(tokens, inverse=True)


def arrange(qkv: QuantizedQKV, layouts: Layouts) -> QuantizedQKV:
  """`qkv` with its transposed tensors in `layouts`."""
  convert = lambda x, layout: None if x is None else to_layout(x, layout)
  return qkv._replace(q8_t=convert(qkv.q8_t, layouts.backward),
                      k8_t=convert(qkv.k8_t, layouts.backward),
                      v8_t=convert(qkv.v8_t, layouts.forward))
