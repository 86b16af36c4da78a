"""Block skipping: which blocks of the other side a block sees.

One rule for every kernel (both backends) and the reference's loop bounds.
Query i sees key j when i - left <= j <= i + right (jax.nn's
`local_window_size`; causal masking is right = 0, top-left aligned; None is
unbounded). Blocks are `block_q` queries and `block_kv` keys. The bounds are
traced int32 scalars, or Python ints where a side is unbounded.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def band(causal: bool, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
  """(left, right) of causal masking and a window together; None: unbounded."""
  left, right = window if window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def kv_range(i, block_q: int, block_kv: int, num_kv_blocks: int, *,
             left: int | None, right: int | None):
  """Key blocks that query block i sees: (start, full_start, full_end, end);
  [start, full_start) and [full_end, end) need the mask, [full_start,
  full_end) are seen whole (`full_end` may stop one block short of exact:
  masking a whole block changes nothing)."""
  start, full_start = 0, 0
  full_end = end = num_kv_blocks
  if right is not None:
    full_end = jnp.minimum(_div(_plus(i * block_q, right), block_kv), num_kv_blocks)
    end = jnp.minimum(_div(_plus((i + 1) * block_q, right) + block_kv - 1, block_kv),
                      num_kv_blocks)
  if left is not None:
    start = jnp.clip(_div(i * block_q - left, block_kv), 0, end)
    full_start = jnp.clip(_div((i + 1) * block_q - left + block_kv - 2, block_kv), start,
                          end)
    full_end = jnp.clip(full_end, full_start, end)
  return start, full_start, full_end, end


def right_edge(i, block_q: int, block_kv: int, num_kv_blocks: int, *, right: int):
  """Key blocks [start, end) that the band's right edge crosses for query
  block i: each holds keys after the last key some row of the block sees, so
  a statistic of the block would carry a later key to that row
  (`Config.exact_edges`). A window's left edge is left out: the keys it
  hides come before the row."""
  _, _, start, end = kv_range(i, block_q, block_kv, num_kv_blocks, left=None, right=right)
  return start, end


def q_range(j, block_q: int, block_kv: int, num_q_blocks: int, *,
            left: int | None, right: int | None):
  """Query blocks that see key block j: (start, full_start, full_end, end),
  as `kv_range`."""
  start, full_start = 0, 0
  full_end = end = num_q_blocks
  if right is not None:
    start = jnp.minimum(_at_least_0(_div(_plus(j * block_kv, -right), block_q), right),
                        num_q_blocks)
    full_start = jnp.minimum(
        _at_least_0(_div(_plus((j + 1) * block_kv + block_q - 2, -right), block_q), right),
        num_q_blocks)
  if left is not None:
    end = jnp.clip(_div((j + 1) * block_kv + left + block_q - 1, block_q), start,
                   num_q_blocks)
    full_start = jnp.clip(full_start, start, end)
    full_end = jnp.clip(_div(j * block_kv + left, block_q), full_start, end)
  return start, full_start, full_end, end


def kv_blocks(i, block_q: int, block_kv: int, num_kv_blocks: int):
  """Causal only: key blocks that query block i sees, [0, full) whole,
  [full, end) masked."""
  _, _, full, end = kv_range(i, block_q, block_kv, num_kv_blocks, left=None, right=0)
  return full, end


def q_blocks(j, block_q: int, block_kv: int, num_q_blocks: int):
  """Causal only: query blocks that see key block j, [start, full) masked,
  [full, end) whole."""
  start, full, _, end = q_range(j, block_q, block_kv, num_q_blocks, left=None, right=0)
  return start, full, end


def _div(x, d: int):
  # lax.div truncates toward 0 (the bounds rely on it) but does not promote:
  # under jax_enable_x64 the Python int would be int64 beside an int32 index.
  return lax.div(x, jnp.asarray(d, jnp.result_type(x)))


def _plus(x, offset: int):
  return x if offset == 0 else x + offset


def _at_least_0(x, right: int):
  # lax.div truncates toward 0; a numerator below 0 (only with right > 0)
  # rounds up to 0 or stays below it, and either way the block is 0.
  return x if right == 0 else jnp.maximum(x, 0)
