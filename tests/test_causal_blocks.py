"""causal_blocks: the key blocks a query block sees and the query blocks that
see a key block, under causality and windows, against every (query, key)
pair of every tile."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import causal_blocks

BANDS = [(None, 0), (0, 0), (5, 0), (None, 3), (3, None), (17, 40), (100, 1), (0, 200),
         (63, 64)]


def _seen(block_q, block_kv, num_q, num_kv, left, right):
  """(num_q, num_kv) pairs of blocks: 0 none, 1 some, 2 every pair visible."""
  i = np.arange(num_q * block_q)[:, None]
  j = np.arange(num_kv * block_kv)[None, :]
  visible = np.ones((i.size, j.size), bool)
  if left is not None:
    visible &= j >= i - left
  if right is not None:
    visible &= j <= i + right
  tiles = visible.reshape(num_q, block_q, num_kv, block_kv)
  return tiles.any(axis=(1, 3)).astype(int) + tiles.all(axis=(1, 3))


def _check(ranges, seen):
  for index, (start, full_start, full_end, end) in enumerate(ranges):
    row = seen[index]
    assert 0 <= start <= full_start <= full_end <= end <= row.size
    blocks = np.arange(row.size)
    np.testing.assert_array_equal(row > 0, (blocks >= start) & (blocks < end))
    whole = (blocks >= full_start) & (blocks < full_end)
    assert np.all(row[whole] == 2)  # no mask needed there
    # Masking a whole block changes nothing; the ranges may do it at each edge.
    assert np.sum((row == 2) & ~whole) <= 2


@pytest.mark.parametrize("block_q,block_kv", [(16, 16), (32, 64), (64, 32), (128, 64)])
def test_block_ranges_are_the_visible_blocks(block_q, block_kv):
  num_q, num_kv = 4, 5
  kv_range = jax.jit(causal_blocks.kv_range, static_argnums=(1, 2, 3),
                     static_argnames=("left", "right"))
  q_range = jax.jit(causal_blocks.q_range, static_argnums=(1, 2, 3),
                    static_argnames=("left", "right"))
  for left, right in BANDS:
    seen = _seen(block_q, block_kv, num_q, num_kv, left, right)
    ranges = [[int(x) for x in kv_range(jnp.int32(i), block_q, block_kv, num_kv, left=left,
                                        right=right)] for i in range(num_q)]
    _check(ranges, seen)
    ranges = [[int(x) for x in q_range(jnp.int32(j), block_q, block_kv, num_q, left=left,
                                       right=right)] for j in range(num_kv)]
    _check(ranges, seen.T)


def test_band_combines_causality_and_window():
  assert causal_blocks.band(False, None) == (None, None)
  assert causal_blocks.band(True, None) == (None, 0)
  assert causal_blocks.band(True, (8, 3)) == (8, 0)
  assert causal_blocks.band(False, (8, 3)) == (8, 3)


def test_causal_helpers_are_the_band_with_right_0():
  for i, j in itertools.product(range(4), range(5)):
    full, end = causal_blocks.kv_blocks(i, 32, 64, 5)
    assert (int(full), int(end)) == tuple(int(x) for x in causal_blocks.kv_range(
        i, 32, 64, 5, left=None, right=0)[2:])
    start, full, end = causal_blocks.q_blocks(j, 32, 64, 4)
    assert (int(start), int(full), int(end)) == (
        min(j * 64 // 32, 4), min(((j + 1) * 64 + 30) // 32, 4), 4)
