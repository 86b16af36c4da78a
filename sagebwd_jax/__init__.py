"""sagebwd-jax: SageBwd, trainable INT8 attention for JAX."""

from sagebwd_jax import metrics
from sagebwd_jax.api import dot_product_attention
from sagebwd_jax.reference import full_precision_attention

__all__ = ["dot_product_attention", "full_precision_attention", "metrics"]
__version__ = "0.1.0"
