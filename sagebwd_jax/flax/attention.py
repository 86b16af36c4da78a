"""`Attention`: an nnx self-attention layer for decoder LMs, SageBwd inside."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
from flax import nnx

from sagebwd_jax.api import DsPrecision, Quantization, dot_product_attention
from sagebwd_jax.arguments import MAX_HEAD_DIM, ds_precision as check_ds_precision
from sagebwd_jax.arguments import quantization as check_quantization
from sagebwd_jax.sharding import check_split, shard_attention

AttentionImpl = Literal["sage", "full", "reference"]
IMPLEMENTATIONS: tuple[AttentionImpl, ...] = get_args(AttentionImpl)


class RMSNorm(nnx.Module):
  """RMS normalization over the last axis with a learned gain.

  Statistics and the gain are fp32 whatever the compute dtype: bf16 sums of
  squares lose too many bits at model widths. (Not flax's `nnx.RMSNorm`, which
  rounds the gain to the compute dtype first: a second bf16 rounding.)
  """

  def __init__(self, dim: int, *, eps: float = 1e-6, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # The gain at x's rank: explicit broadcasting passes strict rank promotion.
    gain = self.weight[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
    return (x32 * gain).astype(self.dtype)


def apply_rope(x: jax.Array, theta: float, offset: int | jax.Array = 0) -> jax.Array:
  """Rotary position embedding on (B, T, H, D), positions offset..offset+T-1.

  Rotates the first half of the head dim against the second half (the
  Llama / GPT-NeoX layout); angles are computed in fp32 because bf16
  positions above 256 are not exact. (Not flax's `nnx.RoPE`, which rotates
  (..., T, D) arrays: these are (B, T, H, D), a transpose each way.)
  """
  seq_len, head_dim = x.shape[1], x.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  positions = jnp.arange(seq_len, dtype=jnp.float32) + jnp.asarray(offset, jnp.float32)
  angles = positions[:, None] * inv_freq[None, :]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


class KVCache(NamedTuple):
  """One layer's keys and values for decoding, (B, max_len, Hkv, D); those
  past the tokens decoded so far are zero and masked."""
  k: jax.Array
  v: jax.Array


class Attention(nnx.Module):
  """Multi-head self-attention with GQA, optional QK-norm, RoPE and SageBwd.

  Input and output are (B, T, in_features). Projections have no bias (as in
  Llama). With `qk_norm`, q and k are RMS-normalized per head (a learned gain
  over the head dim, shared by all heads) before RoPE.
  """

  def __init__(
      self,
      in_features: int,
      num_heads: int,
      *,
      num_kv_heads: int | None = None,
      head_dim: int | None = None,
      causal: bool = True,
      qk_norm: bool = False,
      norm_eps: float = 1e-6,
      rope_theta: float | None = 10000.0,
      implementation: AttentionImpl = "sage",
      smooth_k: bool = True,
      smooth_q: bool = False,
      ds_precision: DsPrecision = "int8",
      quantization: Quantization = "int8",
      dtype: Any = jnp.bfloat16,
      param_dtype: Any = jnp.float32,
      kernel_init: nnx.Initializer = nnx.initializers.lecun_normal(),
      out_kernel_init: nnx.Initializer | None = None,
      mesh: jax.sharding.Mesh | None = None,
      batch_axis: str | None = "data",
      head_axis: str | None = "model",
      rngs: nnx.Rngs,
  ):
    """
    Args:
      in_features: model width.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA); must divide num_heads. Default
        num_heads (plain multi-head attention).
      head_dim: default in_features // num_heads; at most 256 unless
        implementation="full" (64, 128 and 256 run natively, smaller head
        dims zero-padded inside the op).
      causal: each token attends to itself and earlier tokens only.
      qk_norm: RMS-normalize q and k per head before RoPE.
      norm_eps: epsilon of the QK-norm.
      rope_theta: RoPE base; None disables RoPE.
      implementation: "sage" (SageBwd with the op's default kernels: the
        Hopper backend on H100/H200, the Triton kernels on other GPUs, the
        pure-JAX reference elsewhere), "reference" (SageBwd, always
        the pure-JAX reference) or "full" (full-precision jax.nn.dot_product_attention,
        cuDNN on GPU for bf16/fp16) as the baseline.
      smooth_k, smooth_q: SageBwd smoothing options (ignored by "full").
      ds_precision: "int8" or "bf16" dS.K and dS^T.Q in SageBwd's backward
        (`sagebwd_jax.dot_product_attention`; ignored by "full").
      quantization: "int8" (the paper's) or "int8_fp8" (FP8 P and dS
        products; `sagebwd_jax.dot_product_attention`; ignored by "full").
      dtype: compute dtype of projections and attention.
      param_dtype: dtype of the parameters.
      kernel_init: initializer of the q/k/v projections.
      out_kernel_init: initializer of the output projection (default
        kernel_init); LMs scale it down with depth.
      mesh: run the attention op under `jax.shard_map` over this mesh, the
        batch split on `batch_axis` and the heads (query and key/value) on
        `head_axis` (see `sagebwd_jax.sharding`); None: no shard_map. Needed
        for the kernels on more than one device. num_kv_heads must be
        divisible by the head axis' size.
      batch_axis, head_axis: mesh axis names (None: that dimension not split).
      rngs: parameter initialization keys.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = in_features // num_heads if head_dim is None else head_dim
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; "
                       f"got {implementation!r}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of "
                       f"num_kv_heads ({num_kv_heads})")
    if implementation != "full" and not 0 < head_dim <= MAX_HEAD_DIM:
      raise ValueError(f"head_dim={head_dim} is not supported by SageBwd (need 1 to "
                       f"{MAX_HEAD_DIM}); change in_features/num_heads or head_dim, or use "
                       "implementation='full'")
    if mesh is not None:
      check_split(mesh, batch=None, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  batch_axis=batch_axis, head_axis=head_axis)
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.mesh, self.batch_axis, self.head_axis = mesh, batch_axis, head_axis
    self.causal = causal
    self.rope_theta = rope_theta
    self.implementation = implementation
    self.smooth_k, self.smooth_q = smooth_k, smooth_q
    self.ds_precision = check_ds_precision(ds_precision)
    self.quantization = check_quantization(quantization)
    self.dtype = dtype

    def linear(fan_in: int, fan_out: int, init: nnx.Initializer) -> nnx.Linear:
      return nnx.Linear(fan_in, fan_out, use_bias=False, dtype=dtype,
                        param_dtype=param_dtype, kernel_init=init, rngs=rngs)

    self.q_proj = linear(in_features, num_heads * head_dim, kernel_init)
    self.k_proj = linear(in_features, num_kv_heads * head_dim, kernel_init)
    self.v_proj = linear(in_features, num_kv_heads * head_dim, kernel_init)
    self.out_proj = linear(num_heads * head_dim, in_features, out_kernel_init or kernel_init)
    if qk_norm:
      self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
      self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x: jax.Array) -> jax.Array:
    """(B, T, in_features) -> (B, T, in_features) in the compute dtype."""
    q, k, v = self._project(x, 0)
    return self._output(self._attend(q, k, v))

  def prefill(self, x: jax.Array, max_len: int) -> tuple[jax.Array, KVCache]:
    """`__call__` on a prompt x (B, T, in_features), T <= max_len, and its
    keys and values as a `KVCache` of `max_len` for `decode` to extend."""
    if not self.causal:
      raise ValueError("prefill and decode need causal attention (causal=True)")
    q, k, v = self._project(x, 0)
    if x.shape[1] > max_len:
      raise ValueError(f"the prompt's {x.shape[1]} tokens exceed max_len={max_len}")
    pad = ((0, 0), (0, max_len - x.shape[1]), (0, 0), (0, 0))
    return self._output(self._attend(q, k, v)), KVCache(jnp.pad(k, pad), jnp.pad(v, pad))

  def decode(self, x: jax.Array, cache: KVCache, position: jax.Array
             ) -> tuple[jax.Array, KVCache]:
    """One new token per sequence, x (B, 1, in_features) at `position` (an int
    scalar, traced or not: the tokens before it are in `cache`): its output
    (B, 1, in_features) and the cache with its key and value. The token
    attends to the cache's first position + 1 keys through the op's
    `key_value_seq_lengths` (the others are masked and zeroed, so they
    cannot set an int8 block's scale)."""
    if x.shape[1] != 1:
      raise ValueError(f"decode takes one token per sequence, x (batch, 1, features); "
                       f"got {x.shape}")
    q, k, v = self._project(x, position)
    at = (0, position, 0, 0)
    cache = KVCache(jax.lax.dynamic_update_slice(cache.k, k, at),
                    jax.lax.dynamic_update_slice(cache.v, v, at))
    lengths = jnp.full((x.shape[0],), position + 1, jnp.int32)
    out = self._attend_local(q, cache.k, cache.v, is_causal=False, key_value_seq_lengths=lengths)
    return self._output(out), cache

  def _project(self, x: jax.Array, offset: int | jax.Array):
    """q, k, v of x (B, T, in_features) at positions offset.., in the compute dtype."""
    if x.ndim != 3:
      raise ValueError(f"x must have shape (batch, length, features); got {x.shape}")
    batch, seq_len, _ = x.shape
    q = self.q_proj(x).reshape(batch, seq_len, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.rope_theta is not None:
      q, k = apply_rope(q, self.rope_theta, offset), apply_rope(k, self.rope_theta, offset)
    return tuple(t.astype(self.dtype) for t in (q, k, v))

  def _output(self, out: jax.Array) -> jax.Array:
    batch, seq_len = out.shape[:2]
    return self.out_proj(out.reshape(batch, seq_len, self.num_heads * self.head_dim))

  def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    if self.mesh is None:
      return self._attend_local(q, k, v)
    return shard_attention(self._attend_local, self.mesh, batch_axis=self.batch_axis,
                           head_axis=self.head_axis)(q, k, v)

  def _attend_local(self, q: jax.Array, k: jax.Array, v: jax.Array, *,
                    is_causal: bool | None = None,
                    key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
    is_causal = self.causal if is_causal is None else is_causal
    if self.implementation == "full":
      # cuDNN's fused kernel is the fast full-precision baseline on GPU, but
      # it takes only half-precision inputs.
      use_cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
      return jax.nn.dot_product_attention(
          q, k, v, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
          implementation="cudnn" if use_cudnn else "xla")
    return dot_product_attention(
        q, k, v, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
        smooth_k=self.smooth_k, smooth_q=self.smooth_q, ds_precision=self.ds_precision,
        quantization=self.quantization,
        implementation="reference" if self.implementation == "reference" else None)
