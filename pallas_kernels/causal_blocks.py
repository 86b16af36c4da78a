"""Causal block skipping: which blocks of the other side a block sees.

One rule for every kernel (both backends) and the reference's loop bounds.
Queries and keys are top-left aligned (query i sees keys j <= i); blocks are
`block_q` queries and `block_kv` keys. The bounds are traced int32 scalars.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def kv_blocks(i, block_q: int, block_kv: int, num_kv_blocks: int):
  """Key blocks that query block i sees: [0, full) whole, [full, end) masked."""
  full = jnp.minimum(lax.div(i * block_q, block_kv), num_kv_blocks)
  end = jnp.minimum(lax.div((i + 1) * block_q + block_kv - 1, block_kv), num_kv_blocks)
  return full, end


def q_blocks(j, block_q: int, block_kv: int, num_q_blocks: int):
  """Query blocks that see key block j: [start, full) masked, [full, end) whole."""
  start = jnp.minimum(lax.div(j * block_kv, block_q), num_q_blocks)
  full = jnp.minimum(lax.div((j + 1) * block_kv + block_q - 2, block_q), num_q_blocks)
  return start, full, num_q_blocks
