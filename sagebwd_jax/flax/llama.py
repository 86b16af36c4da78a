"""A Llama-style decoder-only language model in nnx, SageBwd attention inside.

Pre-norm blocks: x + Attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).
Attention has GQA, optional QK-norm and RoPE (see `attention.py`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sagebwd_jax.arguments import MAX_HEAD_DIM
from sagebwd_jax.flax.attention import IMPLEMENTATIONS, Attention, AttentionImpl, KVCache, RMSNorm

# GPT-2's initialization: N(0, 0.02), with the projections that write into the
# residual stream scaled by 1/sqrt(2 * n_layers) so its variance does not grow
# with depth.
_STD = 0.02


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model hyperparameters.

  `ffn_dim` defaults to Llama's rule: 8/3 * dim rounded up to a multiple of
  `multiple_of`. `dtype` is the compute dtype; parameters, norms' statistics,
  softmax statistics and the returned logits stay fp32.
  """

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int | None = None
  ffn_dim: int | None = None
  multiple_of: int = 256
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  qk_norm: bool = True
  tie_embeddings: bool = False
  attention: AttentionImpl = "sage"
  smooth_k: bool = True
  smooth_q: bool = False
  ds_precision: str = "int8"
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
      if getattr(self, name) <= 0:
        raise ValueError(f"LlamaConfig.{name} must be positive; got {getattr(self, name)}")
    if self.dim % self.n_heads:
      raise ValueError(f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads "
                       f"({self.n_heads})")
    if self.n_heads % self.kv_heads:
      raise ValueError(f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of "
                       f"n_kv_heads ({self.kv_heads})")
    if self.attention not in IMPLEMENTATIONS:
      raise ValueError(f"LlamaConfig.attention must be one of {IMPLEMENTATIONS}; "
                       f"got {self.attention!r}")
    if self.attention != "full" and self.head_dim > MAX_HEAD_DIM:
      raise ValueError(f"LlamaConfig: head_dim = dim // n_heads = {self.head_dim}; "
                       f"SageBwd attention takes at most {MAX_HEAD_DIM}")

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads

  @property
  def kv_heads(self) -> int:
    return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

  @property
  def hidden_dim(self) -> int:
    if self.ffn_dim is not None:
      return self.ffn_dim
    return self.multiple_of * math.ceil(int(8 * self.dim / 3) / self.multiple_of)


def _residual_std(config: LlamaConfig) -> float:
  return _STD / math.sqrt(2 * config.n_layers)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    def linear(fan_in: int, fan_out: int, std: float) -> nnx.Linear:
      return nnx.Linear(fan_in, fan_out, use_bias=False, dtype=config.dtype,
                        param_dtype=config.param_dtype,
                        kernel_init=nnx.initializers.normal(std), rngs=rngs)

    self.gate = linear(config.dim, config.hidden_dim, _STD)
    self.up = linear(config.dim, config.hidden_dim, _STD)
    self.down = linear(config.hidden_dim, config.dim, _residual_std(config))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """One pre-norm transformer block."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None):
    norm = lambda: RMSNorm(config.dim, eps=config.norm_eps, dtype=config.dtype,
                           param_dtype=config.param_dtype)
    self.attn_norm = norm()
    self.attn = Attention(
        config.dim, config.n_heads, num_kv_heads=config.kv_heads, causal=True,
        qk_norm=config.qk_norm, norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        implementation=config.attention, smooth_k=config.smooth_k,
        smooth_q=config.smooth_q, ds_precision=config.ds_precision, dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nnx.initializers.normal(_STD),
        out_kernel_init=nnx.initializers.normal(_residual_std(config)), mesh=mesh,
        rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))

  def prefill(self, x: jax.Array, max_len: int) -> tuple[jax.Array, KVCache]:
    y, cache = self.attn.prefill(self.attn_norm(x), max_len)
    x = x + y
    return x + self.mlp(self.mlp_norm(x)), cache

  def decode(self, x: jax.Array, cache: KVCache, position: jax.Array
             ) -> tuple[jax.Array, KVCache]:
    y, cache = self.attn.decode(self.attn_norm(x), cache, position)
    x = x + y
    return x + self.mlp(self.mlp_norm(x)), cache


class Llama(nnx.Module):
  """Decoder-only LM: int32 tokens (B, T) -> fp32 logits (B, T, vocab_size).

  With a `mesh` (axes "data" and "model"), attention runs under
  `jax.shard_map`: batch on "data", heads on "model" (`sagebwd_jax.sharding`);
  the rest of the model is left to jit's sharding propagation.
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=config.dtype,
                           param_dtype=config.param_dtype,
                           embedding_init=nnx.initializers.normal(_STD), rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs, mesh=mesh) for _ in range(config.n_layers)])
    self.norm = RMSNorm(config.dim, eps=config.norm_eps, dtype=config.dtype,
                        param_dtype=config.param_dtype)
    if config.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Linear(config.dim, config.vocab_size, use_bias=False,
                                dtype=config.dtype, param_dtype=config.param_dtype,
                                kernel_init=nnx.initializers.normal(_STD), rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    self._check(tokens)
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self._logits(x)

  def prefill(self, tokens: jax.Array) -> tuple[jax.Array, list[KVCache]]:
    """Generation's first call: the logits of a prompt (B, T), as `__call__`,
    and each layer's `KVCache` of max_seq_len positions, T of them filled."""
    self._check(tokens)
    x, caches = self.embed(tokens), []
    for block in self.blocks:
      x, cache = block.prefill(x, self.config.max_seq_len)
      caches.append(cache)
    return self._logits(x), caches

  def decode(self, token: jax.Array, caches: list[KVCache], position: jax.Array
             ) -> tuple[jax.Array, list[KVCache]]:
    """The next token's logits: `token` (B, 1) at `position` (< max_seq_len; the
    tokens before it are in `caches`), the logits (B, 1, vocab_size) and the
    caches with its keys and values. Attention runs on the cache through the
    op (`Attention.decode`)."""
    self._check(token)
    x, new = self.embed(token), []
    for block, cache in zip(self.blocks, caches):
      x, cache = block.decode(x, cache, position)
      new.append(cache)
    return self._logits(x), new

  def _check(self, tokens: jax.Array) -> None:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be an integer array of shape (batch, length); got "
                       f"{tokens.dtype} {tokens.shape}")
    if tokens.shape[1] > self.config.max_seq_len:
      raise ValueError(f"tokens has length {tokens.shape[1]} > max_seq_len "
                       f"{self.config.max_seq_len}")

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32)


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (nnx.Param leaves) in `model`."""
  return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
