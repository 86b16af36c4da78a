"""`dot_product_attention`: SageBwd behind the signature of jax.nn's.

This module checks arguments, pads sequences to whole blocks, builds the
masks and picks a backend; `sagebwd.py` holds the algorithm.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import numerics as nm
from pallas_kernels.triton.backend import PallasBackend
from pallas_kernels.mosaic.backend import MosaicBackend
from pallas_kernels.types import Backend, Config, Masks
from sagebwd_jax.reference import ReferenceBackend
from sagebwd_jax.sagebwd import sagebwd_attention

Implementation = Literal["pallas", "mosaic", "reference"]
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
SegmentIds = jax.Array | tuple[jax.Array, jax.Array]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    segment_ids: SegmentIds | None = None,
    smooth_k: bool = True,
    smooth_q: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    implementation: Implementation | None = None,
) -> jax.Array:
  """SageBwd attention: INT8 forward and backward, drop-in for jax.nn's.

  Args:
    query: (B, Tq, H, D) or (Tq, H, D); bf16, fp16 or fp32.
    key: (B, Tk, Hkv, D) with H a multiple of Hkv (GQA/MQA); same dtype.
    value: like `key`.
    bias: not supported (must be None): an arbitrary additive bias cannot be
      folded into int8 scores. Use the structured masks below.
    mask: not supported (must be None): use `is_causal`, sequence lengths
      or `segment_ids`, which the kernels honour tile by tile.
    scale: multiplies Q.K^T; default 1/sqrt(D).
    is_causal: query i sees keys j <= i (top-left aligned, as jax.nn).
    query_seq_lengths: (B,) int; query rows past the length output 0.
    key_value_seq_lengths: (B,) int; keys past the length are masked.
    segment_ids: (B, T) int when Tq == Tk, or a pair (q_ids (B, Tq),
      kv_ids (B, Tk)); a query sees only keys with its own id. A query row
      that sees no key at all outputs 0, never NaN.
    smooth_k: subtract the per-channel mean of K before quantizing (SPEC
      forward step 1); exact for softmax, essential for accuracy.
    smooth_q: per-block Q-smoothing with its fp32 bias (off by default).
    block_q, block_kv: tile sizes (powers of two >= 16); they fix the
      quantization blocks, so results depend on them. Default: the Pallas
      kernels' tuned sizes for this head dim.
    implementation: "pallas" (the portable GPU kernels; Pallas interpret
      mode on a machine without a GPU), "mosaic" (the backward in Mosaic GPU
      where its kernels take the case, the portable kernels for the rest,
      forward included, which measured at least as fast; needs an sm_90 GPU),
      "reference" (pure JAX, same int8 arithmetic) or None: "mosaic" on a
      Hopper GPU, "pallas" on other GPUs, "reference" without a GPU.

  Returns:
    The attention output, shaped and typed like `query`. Its gradient is
    SageBwd's quantized backward (a `jax.custom_vjp`).
  """
  if bias is not None:
    raise ValueError("bias is not supported by SageBwd attention: an additive bias "
                     "cannot enter int8 scores. Pass bias=None.")
  if mask is not None:
    raise ValueError("mask is not supported by SageBwd attention: a dense boolean mask "
                     "cannot be honoured tile by tile. Express it with is_causal, "
                     "query_seq_lengths/key_value_seq_lengths or segment_ids.")
  unbatched = _check_qkv(query, key, value)
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  batch, q_len, _, head_dim = query.shape
  kv_len = key.shape[1]

  backend = _backend(implementation, bool(is_causal))
  default_q, default_kv = _default_blocks(head_dim, is_causal)
  block_q = _block("block_q", block_q, default_q, q_len)
  block_kv = _block("block_kv", block_kv, default_kv, kv_len)
  config = Config(scale=_scale(scale, head_dim), causal=bool(is_causal),
                  smooth_q=bool(smooth_q), block_q=block_q, block_kv=block_kv)

  q_lengths = _lengths("query_seq_lengths", query_seq_lengths, batch)
  kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
  q_seg, kv_seg = _segments(segment_ids, batch, q_len, kv_len)

  q_pad, kv_pad = -q_len % block_q, -kv_len % block_kv
  pad_tokens = lambda x, n: jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))
  if kv_lengths is not None:
    # Keys past the length are masked; zeroed, they cannot set their block's
    # int8 scale either (a large value there would coarsen the valid keys).
    valid = (jnp.arange(kv_len)[None, :] < kv_lengths[:, None])[:, :, None, None]
    key, value = jnp.where(valid, key, 0), jnp.where(valid, value, 0)
  query = pad_tokens(query, q_pad)
  key, value = pad_tokens(key, kv_pad), pad_tokens(value, kv_pad)
  masks = Masks()  # padded query rows need no mask: they are sliced off
  if q_lengths is not None or kv_lengths is not None or q_seg is not None or kv_pad:
    masks = Masks(
        _token_ids(q_seg, q_lengths, batch, q_len, q_len + q_pad, nm.Q_INVALID_ID),
        _token_ids(kv_seg, kv_lengths, batch, kv_len, kv_len + kv_pad, nm.KV_INVALID_ID))

  out = sagebwd_attention(query, key, value, masks, config, backend, bool(smooth_k))
  out = out[:, :q_len]
  return out[0] if unbatched else out


def _check_qkv(query, key, value) -> bool:
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
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise ValueError(f"head dim D={head_dim} is not supported; SageBwd kernels take D in "
                     f"{SUPPORTED_HEAD_DIMS} (pad D with zeros and pass scale=1/sqrt(D))")
  num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
  if num_heads % num_kv_heads:
    raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads "
                     f"({num_kv_heads}) for grouped-query attention")
  if query.shape[-3] == 0 or key.shape[-3] == 0:
    raise ValueError("query and key must have at least one token")
  return query.ndim == 3


def _platform() -> str:
  """Where computations go now: honours `jax.default_device(...)` contexts."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  return device if isinstance(device, str) else device.platform


def _backend(implementation, causal: bool) -> Backend:
  on_gpu = _platform() in ("gpu", "cuda", "rocm")
  if implementation is None:
    implementation = ("mosaic" if _hopper() else "pallas") if on_gpu else "reference"
  if implementation == "reference":
    return ReferenceBackend()
  if implementation == "pallas":
    return PallasBackend.tuned(causal=causal, interpret=not on_gpu)
  if implementation == "mosaic":
    if not (on_gpu and _hopper()):
      device = _device()
      where = (f"{device.device_kind} has compute capability "
               f"{getattr(device, 'compute_capability', None)}" if on_gpu
               else f"computations go to {_platform()}")
      raise ValueError(
          f"implementation='mosaic' needs an NVIDIA Hopper GPU (compute capability 9.0); "
          f"{where}. Use implementation='pallas' (Pallas interpret mode without a GPU).")
    return MosaicBackend.tuned(PallasBackend.tuned(causal=causal))
  raise ValueError(f"implementation must be 'pallas', 'mosaic', 'reference' or None; "
                   f"got {implementation!r}")


def _device() -> jax.Device:
  device = jax.config.jax_default_device
  return device if isinstance(device, jax.Device) else jax.devices()[0]


def _hopper() -> bool:
  return getattr(_device(), "compute_capability", None) == "9.0"


def _default_blocks(head_dim: int, causal: bool) -> tuple[int, int]:
  # 64 x 64 quantization blocks keep every Table 1 error within 1.25x the
  # paper's at sigma 1 (O 0.0197, dV 0.0197 at T=4096, D=128); 128-row
  # blocks of dO push dV past it (0.0218).
  del head_dim, causal
  return 64, 64


def _block(name: str, value: int | None, default: int, seq_len: int) -> int:
  if value is None:
    # Short sequences: the smallest power-of-two tile (>= 16) that covers them.
    return min(default, max(16, 1 << (seq_len - 1).bit_length()))
  if (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 16
      or value & (value - 1)):
    raise ValueError(f"{name} must be a power of two >= 16; got {value!r}")
  return int(value)


def _scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  try:
    scale = float(scale)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(f"scale must be a Python float known at trace time; got {scale!r}") from e
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"scale must be a positive finite float; got {scale}")
  return scale


def _lengths(name: str, lengths, batch: int) -> jax.Array | None:
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape (batch,) = ({batch},); got {lengths.shape}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array; got {lengths.dtype}")
  return lengths.astype(jnp.int32)


def _token_ids(segment_ids, lengths, batch: int, seq_len: int, padded_len: int,
               invalid: int) -> jax.Array:
  """Segment ids (0 without them), `invalid` past the length and in padding."""
  ids = jnp.zeros((batch, padded_len), jnp.int32)
  if segment_ids is not None:
    # A pad, not a scatter: XLA:CPU crashed on the scatter under shard_map.
    ids = jnp.pad(segment_ids, ((0, 0), (0, padded_len - seq_len)))
  length = seq_len if lengths is None else jnp.minimum(lengths, seq_len)[:, None]
  return jnp.where(jnp.arange(padded_len)[None, :] < length, ids, invalid)


def _segments(segment_ids, batch: int, q_len: int, kv_len: int):
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
