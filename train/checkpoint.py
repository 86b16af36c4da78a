"""Checkpoints with orbax: every `ckpt_every` steps, the last `keep` kept.

The train state is saved as a flat dict `{"params/layers/0/...": array}`
(names any reader can list) and put back into the structure of a freshly
built state, so nothing about flax's or optax's pytree classes reaches the
files. Saving is synchronous: the next step donates the state's buffers.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def _key(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def flatten(state) -> dict:
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  flat = {"/".join(_key(k) for k in path): x for path, x in leaves}
  assert len(flat) == len(leaves), "checkpoint names collide"
  return flat


def unflatten(flat: dict, like):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  return jax.tree_util.tree_unflatten(
      treedef, [flat["/".join(_key(k) for k in path)] for path, _ in leaves])


class Checkpoints:
  def __init__(self, run_dir: str, keep: int):
    self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    self.manager = ocp.CheckpointManager(
        self.dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(flatten(state)))
    self.manager.wait_until_finished()

  def restore(self, like, step: int | None = None):
    """The state saved at `step` (default: the latest), shaped like `like`."""
    step = self.latest_step() if step is None else step
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, flatten(like))
    flat = self.manager.restore(step, args=ocp.args.StandardRestore(target))
    return unflatten(flat, like)

  def close(self) -> None:
    self.manager.close()
