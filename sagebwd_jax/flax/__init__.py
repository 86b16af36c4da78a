"""Flax integration: a drop-in `attention_fn` for Flax's attention modules,
an nnx `Attention` layer and a Llama-style LM, all on SageBwd attention."""

from sagebwd_jax.flax.attention import Attention
from sagebwd_jax.flax.attention_fn import attention_fn, make_attention_fn
from sagebwd_jax.flax.llama import Llama, LlamaConfig, count_params

__all__ = ["Attention", "Llama", "LlamaConfig", "attention_fn", "count_params",
           "make_attention_fn"]
