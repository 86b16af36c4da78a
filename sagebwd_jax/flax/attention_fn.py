"""`attention_fn` for Flax's own attention modules.

`flax.nnx.MultiHeadAttention(attention_fn=...)` and
`flax.linen.MultiHeadDotProductAttention(attention_fn=...)` call their
attention function with Flax's keyword set (mask, dropout, dtype, ...).
SageBwd cannot honour all of it: a dense mask or an additive bias cannot
enter int8 tiles, and there is no attention-probability matrix to drop out
or to sow. Rather than ignoring such arguments, the function refuses them
with a ValueError that says what to do instead.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from sagebwd_jax.api import Implementation, dot_product_attention

AttentionFn = Callable[..., jax.Array]

_MASK_ADVICE = ("Pass is_causal=True instead (nnx.MultiHeadAttention.__call__ takes it; "
                "for linen use make_attention_fn(is_causal=True)); for padding or packed "
                "documents call sagebwd_jax.dot_product_attention with "
                "query_seq_lengths/key_value_seq_lengths or segment_ids.")


def make_attention_fn(
    *,
    smooth_k: bool = True,
    smooth_q: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    implementation: Implementation | None = None,
    is_causal: bool = False,
) -> AttentionFn:
  """Returns a Flax-compatible attention function backed by SageBwd.

  Args:
    smooth_k, smooth_q, block_q, block_kv, implementation: forwarded to
      `sagebwd_jax.dot_product_attention`.
    is_causal: always apply a causal mask. Linen's module has no `is_causal`
      argument, so this is how a linen model asks for causal attention.

  Returns:
    A function with the keyword signature of `flax.nnx.dot_product_attention`.
  """
  always_causal = is_causal

  def sagebwd_attention_fn(
      query: jax.Array,
      key: jax.Array,
      value: jax.Array,
      bias: jax.Array | None = None,
      mask: jax.Array | None = None,
      broadcast_dropout: bool = True,
      dropout_rng: jax.Array | None = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      dtype: Any = None,
      precision: Any = None,
      module: Any = None,
      is_causal: bool = False,
      force_fp32_for_softmax: bool = False,
      qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
      attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
  ) -> jax.Array:
    """SageBwd attention on (B, T, H, D) inputs, with Flax's keywords.

    `precision` has no effect (the products are int8 with int32 accumulation
    and the one bf16/fp16 product accumulates in fp32), and softmax is always
    computed in fp32, whatever `force_fp32_for_softmax` says.
    `broadcast_dropout` and `dropout_rng` only matter with dropout, which is
    refused.
    """
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if bias is not None:
      raise ValueError("bias is not supported by SageBwd attention: an additive bias "
                       "cannot enter int8 scores. Pass bias=None.")
    if dropout_rate and not deterministic:
      raise ValueError(f"attention dropout (dropout_rate={dropout_rate}, "
                       "deterministic=False) is not supported by SageBwd attention: "
                       "the probability matrix is never materialized. Set "
                       "dropout_rate=0.0 or deterministic=True.")
    if module is not None:
      raise ValueError("sow_weights=True is not supported by SageBwd attention: the "
                       "attention weights are never materialized.")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise ValueError("qk_attn_weights_einsum / attn_weights_value_einsum are not "
                       "supported by SageBwd attention, which does its own int8 "
                       "products. Leave them None.")
    for name, x in (("query", query), ("key", key), ("value", value)):
      if getattr(x, "ndim", None) != 4:
        raise ValueError(f"{name} must have rank 4 (batch, length, heads, head_dim) for "
                         f"SageBwd attention; got shape {getattr(x, 'shape', None)}. "
                         "Flatten extra batch dimensions into one.")
    causal = bool(is_causal or always_causal)
    if mask is not None:
      causal = causal or _mask_is_causal(mask, query.shape[1], key.shape[1])
    if dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    return dot_product_attention(
        query, key, value, is_causal=causal, smooth_k=smooth_k, smooth_q=smooth_q,
        block_q=block_q, block_kv=block_kv, implementation=implementation)

  return sagebwd_attention_fn


def _mask_is_causal(mask: jax.Array, q_len: int, kv_len: int) -> bool:
  """Maps a concrete dense mask onto the op's masks, or raises ValueError.

  Only two masks can be honoured exactly: all-True (no masking, returns False)
  and the top-left aligned lower triangle (returns True), for every batch
  element and head. Anything else, or a mask whose values are unknown under
  tracing, is refused.
  """
  try:
    dense = np.asarray(mask).astype(bool)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as e:
    raise ValueError("mask: a traced (jit-compiled) dense mask cannot be checked, so "
                     f"SageBwd attention refuses it. {_MASK_ADVICE}") from e
  try:
    dense = np.broadcast_to(dense, dense.shape[:-2] + (q_len, kv_len))
  except ValueError as e:
    raise ValueError(f"mask of shape {dense.shape} does not broadcast to "
                     f"(..., {q_len}, {kv_len})") from e
  if dense.all():
    return False
  if (dense == np.tril(np.ones((q_len, kv_len), bool))).all():
    return True
  raise ValueError("mask: SageBwd attention honours a dense mask only when it is all "
                   f"True or exactly causal; this one is neither. {_MASK_ADVICE}")


attention_fn: AttentionFn = make_attention_fn()
attention_fn.__doc__ = """SageBwd attention with default options, for
`nnx.MultiHeadAttention(attention_fn=attention_fn)` and
`linen.MultiHeadDotProductAttention(attention_fn=attention_fn)`."""
