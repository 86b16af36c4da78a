"""`jax.vmap` of a function whose arrays all lead with the batch axis: the
mapped axis folded into the batch axis, so the function runs once on the
merged batch.

The Triton launches need it (`jax_triton.triton_call` has no batching
rule), and so does the backward's saturated-rows Delta, whose `lax.cond`
vmap would otherwise turn into a select that runs both branches.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def batch_folded(fn: Callable) -> Callable:
  """`fn` (arrays, or None, in; a tuple of arrays out; every array with the
  batch axis first) under `jax.vmap`: the mapped axis is folded into the batch
  axis and `fn` runs once on the merged batch."""
  folded = jax.custom_batching.custom_vmap(fn)

  @folded.def_vmap
  def _rule(axis_size: int, in_batched, *args):
    args = jax.tree.map(
        lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)),
        args, tuple(in_batched))
    outs = folded(*jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), args))
    outs = jax.tree.map(lambda y: y.reshape(axis_size, -1, *y.shape[1:]), outs)
    return outs, jax.tree.map(lambda _: True, outs)

  return folded
