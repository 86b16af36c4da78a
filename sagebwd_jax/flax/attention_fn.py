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

from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sagebwd_jax import arguments, implementations
from sagebwd_jax.api import DsPrecision, Quantization, dot_product_attention
from sagebwd_jax.implementations import Implementation

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
    implementation: Implementation | Sequence[Implementation] | None = None,
    is_causal: bool = False,
    ds_precision: DsPrecision = "int8",
    quantization: Quantization = "int8",
) -> AttentionFn:
  """Returns a Flax-compatible attention function backed by SageBwd.

  Args:
    smooth_k, smooth_q, block_q, block_kv, implementation, ds_precision,
      quantization: forwarded to `sagebwd_jax.dot_product_attention`.
    is_causal: always apply a causal mask. Linen's module has no `is_causal`
      argument, so this is how a linen model asks for causal attention.

  Returns:
    A function with the keyword signature of `flax.nnx.dot_product_attention`
    and `flax.linen.dot_product_attention` (plus nnx's `input_positions`).

  Raises:
    ValueError naming the argument, for a `quantization`, `ds_precision`,
    `block_q`, `block_kv` or `implementation` the op does not take.
  """
  # Checked here, where the mistake is made, rather than at the first call.
  quantization = arguments.quantization(quantization)
  ds_precision = arguments.ds_precision(ds_precision)
  for name, size in (("block_q", block_q), ("block_kv", block_kv)):
    if size is not None:
      arguments.block(name, size, arguments.DEFAULT_BLOCK, size)
  if implementation is not None:  # None is resolved per call: it asks which devices exist
    implementations.resolve(implementation, quantization)
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
      promote_dtype: Callable[..., Any] | None = None,
      is_causal: bool = False,
      force_fp32_for_softmax: bool = False,
      einsum_dot_general: Callable[..., jax.Array] | None = None,
      qk_attn_weights_einsum: Callable[..., jax.Array] | None = None,
      attn_weights_value_einsum: Callable[..., jax.Array] | None = None,
      input_positions: jax.Array | None = None,
  ) -> jax.Array:
    """SageBwd attention on (batch..., T, H, D) inputs, with Flax's keywords.

    A mask that depends only on the key (shape (batch..., 1, 1, Tk), such as
    nnx's decode mask over its cache or a padding mask in decode) is honoured
    exactly, traced or not, as segment ids (masked keys are zeroed too, so
    they cannot set an int8 block's scale); any other mask must be concrete
    and all True or exactly causal. `module` is what Flax passes when
    attention weights are to be sown (`sow_weights=True`), which SageBwd
    cannot do, so it is refused. `precision` has no effect (the products
    are int8 with int32 accumulation and the one bf16/fp16 product
    accumulates in fp32), softmax is always fp32 whatever
    `force_fp32_for_softmax` says, and `promote_dtype` is not needed: q, k
    and v are cast to `dtype` (or their common dtype). `input_positions` is
    for nnx's rotary attention functions; SageBwd applies no position
    encoding of its own (rotate q and k before), so it is unused.
    `broadcast_dropout` and `dropout_rng` only matter with dropout, which is
    refused.
    """
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax, input_positions
    del promote_dtype
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
    if (einsum_dot_general is not None or qk_attn_weights_einsum is not None
        or attn_weights_value_einsum is not None):
      raise ValueError("einsum_dot_general / qk_attn_weights_einsum / "
                       "attn_weights_value_einsum are not supported by SageBwd "
                       "attention, which does its own int8 products. Leave them None.")
    for name, x in (("query", query), ("key", key), ("value", value)):
      if getattr(x, "ndim", 0) < 3:
        raise ValueError(f"{name} must have shape (batch..., length, heads, head_dim); "
                         f"got shape {getattr(x, 'shape', None)}")
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
      raise ValueError(f"query, key and value must share their batch dimensions; got "
                       f"shapes {query.shape}, {key.shape}, {value.shape}")
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype).reshape(-1, *x.shape[-3:])
                         for x in (query, key, value))
    q_len, kv_len = query.shape[1], key.shape[1]
    causal = bool(is_causal or always_causal)
    segment_ids = None
    if mask is not None:
      keys = _key_mask(mask, batch_shape, kv_len)
      if keys is not None:
        key, value = (jnp.where(keys[:, :, None, None], x, jnp.zeros((), x.dtype))
                      for x in (key, value))
        segment_ids = (jnp.zeros((keys.shape[0], q_len), jnp.int32),
                       jnp.where(keys, 0, 1).astype(jnp.int32))
      else:
        causal = _mask_is_causal(mask, q_len, kv_len) or causal
    out = dot_product_attention(
        query, key, value, is_causal=causal, segment_ids=segment_ids, smooth_k=smooth_k,
        smooth_q=smooth_q, block_q=block_q, block_kv=block_kv,
        implementation=implementation, ds_precision=ds_precision, quantization=quantization)
    return out.reshape(*batch_shape, *out.shape[1:])

  return sagebwd_attention_fn


def _key_mask(mask, batch_shape: tuple[int, ...], kv_len: int) -> jax.Array | None:
  """A mask of shape (batch..., 1, 1, Tk) (after broadcasting) as a (B, Tk)
  bool array with the batch dims flattened; None for any other mask."""
  mask = jnp.asarray(mask)
  if mask.ndim < 3 or mask.shape[-3:-1] != (1, 1) or mask.shape[-1] not in (1, kv_len):
    return None
  try:
    keys = jnp.broadcast_to(mask[..., 0, 0, :], (*batch_shape, kv_len))
  except ValueError as e:
    raise ValueError(f"mask of shape {mask.shape} does not broadcast to "
                     f"({', '.join(map(str, batch_shape))}, 1, 1, {kv_len})") from e
  return keys.astype(bool).reshape(-1, kv_len)


def _mask_is_causal(mask: jax.Array, q_len: int, kv_len: int) -> bool:
  """Maps a concrete dense mask onto the op's masks, or raises ValueError.

  Only two masks that vary over queries can be honoured exactly: all-True
  (no masking, returns False) and the top-left aligned lower triangle
  (returns True), for every batch element and head. Anything else, or such
  a mask whose values are unknown under tracing, is refused.
  """
  try:
    dense = np.asarray(mask).astype(bool)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as e:
    raise ValueError("mask: a traced (jit-compiled) dense mask that varies over queries "
                     f"cannot be checked, so SageBwd attention refuses it. {_MASK_ADVICE}"
                     ) from e
  try:
    dense = np.broadcast_to(dense, dense.shape[:-2] + (q_len, kv_len))
  except ValueError as e:
    raise ValueError(f"mask of shape {dense.shape} does not broadcast to "
                     f"(..., {q_len}, {kv_len})") from e
  if dense.all():
    return False
  if (dense == np.tril(np.ones((q_len, kv_len), bool))).all():
    return True
  raise ValueError("mask: SageBwd attention honours a dense mask only when it depends on "
                   "the key alone, is all True or is exactly causal; this one is none of "
                   f"these. {_MASK_ADVICE}")


attention_fn: AttentionFn = make_attention_fn()
attention_fn.__doc__ = """SageBwd attention with default options, for
`nnx.MultiHeadAttention(attention_fn=attention_fn)` and
`linen.MultiHeadDotProductAttention(attention_fn=attention_fn)`."""
