"""The arguments of `dot_product_attention`: checked, with clear errors naming
the argument, and brought to the forms the implementations take."""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.types import DS_PRECISIONS, QUANTIZATIONS, DsPrecision, Quantization

# Head dims the kernels run as they are; smaller ones are zero-padded up to
# the next of these inside the op.
KERNEL_HEAD_DIMS = (64, 128, 256)
MAX_HEAD_DIM = KERNEL_HEAD_DIMS[-1]
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def check_qkv(query, key, value) -> bool:
  """Validates shapes and dtypes; returns True for unbatched (rank-3) input."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim not in (3, 4):
      raise ValueError(f"{name} must have rank 4 (B, T, H, D) or 3 (T, H, D); "
                       f"got shape {x.shape}")
    if not any(x.dtype == d for d in SUPPORTED_DTYPES):
      raise TypeError(f"{name} must be bfloat16, float16 or float32; got {x.dtype}")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(f"query, key and value must have the same rank; got shapes "
                     f"{query.shape}, {key.shape}, {value.shape}")
  if not query.dtype == key.dtype == value.dtype:
    raise TypeError(f"query, key and value must share one dtype; got {query.dtype}, "
                    f"{key.dtype}, {value.dtype}")
  if key.shape != value.shape:
    raise ValueError(f"key and value must have the same shape; got {key.shape} and "
                     f"{value.shape}")
  if query.shape[:-3] != key.shape[:-3]:
    raise ValueError(f"query and key must have the same batch size; got shapes "
                     f"{query.shape} and {key.shape}")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"query and key must have the same head dim; got "
                     f"{query.shape[-1]} and {key.shape[-1]}")
  head_dim = query.shape[-1]
  if not 0 < head_dim <= MAX_HEAD_DIM:
    raise ValueError(f"head dim D={head_dim} is not supported; SageBwd takes 1 <= D <= "
                     f"{MAX_HEAD_DIM} (D in {KERNEL_HEAD_DIMS} natively, smaller D "
                     "zero-padded to the next of these)")
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if num_kv_heads == 0 or num_heads % num_kv_heads:
    raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads "
                     f"({num_kv_heads}) for grouped-query attention")
  if query.shape[-3] == 0 or key.shape[-3] == 0:
    raise ValueError("query and key must have at least one token")
  return query.ndim == 3


def check_trivial(name: str, x, is_trivial: Callable[[np.ndarray], bool], trivial: str,
                   why: str) -> None:
  """Accepts None or a concrete `x` that changes nothing (jax.nn accepts such
  arrays too); refuses anything else with a ValueError saying why."""
  if x is None:
    return
  try:
    concrete = np.asarray(x)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as e:
    raise ValueError(f"{name}: SageBwd attention accepts a {name} only when it is "
                     f"{trivial}, and a traced {name} cannot be checked: {why}.") from e
  if not is_trivial(concrete):
    raise ValueError(f"{name} is not supported by SageBwd attention unless it is "
                     f"{trivial}: {why}.")


# The quantization blocks' default, both sides: 64 x 64 blocks keep every
# Table 1 error within its bar, 128-row blocks of dO push dV's past it
# (docs/performance-log.md, "Figures the code's comments quoted").
DEFAULT_BLOCK = 64
# The smallest block chosen by default. Compiled on an H200, the portable
# kernels gave a wrong dQ with 16 x 16 blocks while 32 and up passed
# (tests/attention_suite.py::test_block_sizes_all_accurate; docs/performance-log.md);
# `dot_product_attention` refuses 16 on a GPU until that is fixed.
MIN_DEFAULT_BLOCK = 32


def block(name: str, value: int | None, default: int, seq_len: int) -> int:
  if value is None:
    # Short sequences: the smallest power-of-two tile that covers them.
    return min(default, max(MIN_DEFAULT_BLOCK, 1 << (seq_len - 1).bit_length()))
  if (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 16
      or value & (value - 1)):
    raise ValueError(f"{name} must be a power of two >= 16; got {value!r}")
  return int(value)


def scale(scale) -> float | jax.Array | None:
  """A concrete scale as a Python float, a traced one as an fp32 scalar."""
  if scale is None:
    return None
  if isinstance(scale, jax.core.Tracer):
    if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
      raise TypeError(f"scale must be a float scalar; got a traced {scale.dtype} array of "
                      f"shape {scale.shape}")
    return scale.astype(jnp.float32)
  try:
    scale = float(scale)
  except (TypeError, ValueError) as e:
    raise TypeError(f"scale must be a float scalar; got {scale!r}") from e
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite; got {scale}")
  return scale


def ds_precision(value) -> DsPrecision:
  if not isinstance(value, str) or value not in DS_PRECISIONS:
    raise ValueError(f"ds_precision must be one of {DS_PRECISIONS}; got {value!r}")
  return value


def quantization(value) -> Quantization:
  if not isinstance(value, str) or value not in QUANTIZATIONS:
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {value!r}")
  return value


def flag(name: str, value) -> bool:
  """A static on/off option: a Python or numpy bool (not a traced one: it
  picks what is computed)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool; got {value!r}")
  return bool(value)


def window(local_window_size) -> tuple[int, int] | None:
  """jax.nn's `local_window_size` as (left, right): an int w is (w, w)."""
  if local_window_size is None:
    return None
  sizes = ((local_window_size, local_window_size)
           if isinstance(local_window_size, (int, np.integer)) else local_window_size)
  if (not isinstance(sizes, (tuple, list)) or len(sizes) != 2
      or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0
                 for x in sizes)):
    raise ValueError(f"local_window_size must be None, an int >= 0 or a pair (left, right) "
                     f"of ints >= 0; got {local_window_size!r}")
  return int(sizes[0]), int(sizes[1])


def lengths(name: str, lengths, batch: int, seq_len: int) -> jax.Array | None:
  """(B,) int32 lengths clipped to [0, seq_len] (in their own dtype first,
  so a uint32 2**32 - 1 means 'all', not -1)."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape (batch,) = ({batch},); got {lengths.shape}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array; got {lengths.dtype}")
  if jnp.issubdtype(lengths.dtype, jnp.signedinteger):
    lengths = jnp.maximum(lengths, 0)
  return jnp.minimum(lengths, seq_len).astype(jnp.int32)


def valid(lengths: jax.Array | None, seq_len: int) -> jax.Array | None:
  """(B, T) bool: True for tokens before the length; None without lengths."""
  if lengths is None:
    return None
  return jnp.arange(seq_len)[None, :] < lengths[:, None]


def zero_invalid(x: jax.Array, valid: jax.Array | None) -> jax.Array:
  """x (B, T, H, D) with tokens past the length set to 0 (a select, so NaN
  there does not survive and their cotangent is dropped)."""
  return x if valid is None else jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))


def token_ids(segment_ids, lengths, batch: int, seq_len: int, padded_len: int,
               invalid: int) -> jax.Array:
  """Segment ids (0 without them), `invalid` past the length and in padding."""
  ids = jnp.zeros((batch, padded_len), jnp.int32)
  if segment_ids is not None:
    # A pad, not a scatter: XLA:CPU crashed on the scatter under shard_map.
    ids = jnp.pad(segment_ids, ((0, 0), (0, padded_len - seq_len)))
  length = (jnp.full((batch, 1), seq_len, jnp.int32) if lengths is None
            else lengths[:, None])
  return jnp.where(jnp.arange(padded_len)[None, :] < length, ids, jnp.int32(invalid))


def segments(segment_ids, batch: int, q_len: int, kv_len: int):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be an array or a pair (q_segment_ids, "
                       "kv_segment_ids)")
    q_ids, kv_ids = segment_ids
  else:
    if q_len != kv_len:
      raise ValueError(f"one segment_ids array needs Tq == Tk (got {q_len} and {kv_len}); "
                       "pass a pair (q_segment_ids, kv_segment_ids)")
    q_ids = kv_ids = segment_ids
  checked = []
  for name, ids, length in (("query", q_ids, q_len), ("key/value", kv_ids, kv_len)):
    ids = jnp.asarray(ids)
    if ids.shape != (batch, length):
      raise ValueError(f"{name} segment_ids must have shape ({batch}, {length}); "
                       f"got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"segment_ids must be integer arrays; got {ids.dtype}")
    checked.append(ids.astype(jnp.int32))
  return tuple(checked)
