"""A Llama-style decoder-only language model in nnx, SageBwd attention inside.

Pre-norm blocks: x + Attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).
Attention has GQA, optional QK-norm and RoPE (see `attention.py`). The blocks
run one after another, or (`scan_layers`) as one block under `jax.lax.scan`
over their stacked parameters; `remat` sets what each keeps for the backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.types import DsPrecision, Quantization
from sagebwd_jax import arguments
from sagebwd_jax.arguments import MAX_HEAD_DIM
from sagebwd_jax.flax.attention import IMPLEMENTATIONS, Attention, AttentionImpl, KVCache, RMSNorm

# GPT-2's initialization: N(0, 0.02), with the projections that write into the
# residual stream scaled by 1/sqrt(2 * n_layers) so its variance does not grow
# with depth.
_STD = 0.02

Remat = Literal["none", "full", "dots"]
# What a block keeps for the backward (MaxText's remat policies, by name):
# everything; only its input (the backward runs the block again); the
# products of its weight matrices (attention and the rest are recomputed).
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Model hyperparameters.

  `ffn_dim` defaults to Llama's rule: 8/3 * dim rounded up to a multiple of
  `multiple_of`. `dtype` is the compute dtype; parameters, norms' statistics,
  softmax statistics and the returned logits stay fp32.

  `scan_layers`: each parameter of the blocks is one array stacked over the
  layers (leading axis n_layers, `is_stacked` tells which) and the blocks run
  under `jax.lax.scan`, so a step traces, lowers and compiles one block
  whatever n_layers; same initial values and results as without (up to
  floating-point reassociation). `remat`: what each block keeps for the
  backward, "none" (all its intermediates), "full" (its input alone: the
  backward runs the block again) or "dots" (the products with its weight
  matrices; the rest, attention included, recomputed).
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
  ds_precision: DsPrecision = "int8"
  quantization: Quantization = "int8"
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  scan_layers: bool = False
  remat: Remat = "none"

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
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"LlamaConfig.remat must be one of {tuple(REMAT_POLICIES)}; "
                       f"got {self.remat!r}")
    for check in (arguments.ds_precision, arguments.quantization):
      try:
        check(getattr(self, check.__name__))
      except ValueError as e:
        raise ValueError(f"LlamaConfig.{e}") from None
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
        smooth_q=config.smooth_q, ds_precision=config.ds_precision,
        quantization=config.quantization, dtype=config.dtype,
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
    blocks = [Block(config, rngs=rngs, mesh=mesh) for _ in range(config.n_layers)]
    self.blocks = _stacked(blocks) if config.scan_layers else nnx.List(blocks)
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
    remat = self.config.remat
    if self.config.scan_layers:
      graphdef, stacked = nnx.split(self.blocks)
      step = lambda x, layer: (_run(nnx.merge(graphdef, layer), x, remat), None)
      x, _ = jax.lax.scan(step, x, stacked)
    else:
      for block in self.blocks:
        x = _run(block, x, remat)
    return self._logits(x)

  def prefill(self, tokens: jax.Array) -> tuple[jax.Array, list[KVCache]]:
    """Generation's first call: the logits of a prompt (B, T), as `__call__`,
    and each layer's `KVCache` of max_seq_len positions, T of them filled."""
    self._check(tokens)
    x, caches = self.embed(tokens), []
    for block in unscanned(self).blocks:
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
    for block, cache in zip(unscanned(self).blocks, caches, strict=True):
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


def _stacked(blocks: list[Block]) -> Block:
  """One Block whose every variable is the blocks' stacked (leading axis: the
  layer); built from blocks initialized one by one, so its initial values are
  an unscanned model's."""
  graphdef, _ = nnx.split(blocks[0])
  return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs),
                                          *(nnx.state(b) for b in blocks)))


def _run(block: Block, x: jax.Array, remat: str) -> jax.Array:
  """block(x), keeping for the backward what `remat` says."""
  if remat == "none":
    return block(x)
  graphdef, state = nnx.split(block)
  return jax.checkpoint(lambda state, x: nnx.merge(graphdef, state)(x),
                        policy=REMAT_POLICIES[remat])(state, x)


def unscanned(model: Llama) -> Llama:
  """`model` with its blocks one by one, on slices of its stacked variables
  when it has `scan_layers` (a copy): for code that hooks each layer."""
  if not model.config.scan_layers:
    return model
  graphdef, stacked = nnx.split(model.blocks)
  copy = nnx.merge(*nnx.split(model))
  copy.config = dataclasses.replace(model.config, scan_layers=False)
  copy.blocks = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda x: x[i], stacked))
                          for i in range(model.config.n_layers)])
  return copy


def is_stacked(path: Sequence[str | int]) -> bool:
  """Whether the variable at `path` (its keys' names, from the model or from a
  pytree that mirrors it, such as an optimizer's state) is stacked over the
  layers: under "blocks" with no layer index after it (`scan_layers`)."""
  keys = [str(k) for k in path]
  after = keys[keys.index("blocks") + 1:] if "blocks" in keys else []
  return bool(after) and not after[0].isdigit()


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (nnx.Param leaves) in `model`."""
  return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
