"""Checkpoints with orbax: every `ckpt_every` steps, the last `keep` kept, and
on resume the newest one that restores intact.

The train state is saved as a flat dict `{"params/blocks/0/...": array}`
(names any reader can list) and put back into the structure of a freshly
built state, so nothing about flax's or optax's pytree classes reaches the
files. A model with --scan-layers holds each block parameter stacked over the
layers; it is saved one array per layer all the same, so checkpoints do not
depend on the flag (nor did those written before it). Beside it each
checkpoint holds a CRC-32 of every array: orbax checks its own files'
structure, not the values in them, and a flipped byte would otherwise restore
silently.

Orbax writes a checkpoint into a temporary folder and renames it when done,
so a process killed mid-save leaves no checkpoint of that step (orbax deletes
the temporary folder the next time). On resume a checkpoint that orbax cannot
read, whose checksums differ, or that holds non-finite values is skipped with
a message saying why; the skipped ones newer than the one restored are moved
to `<run>/checkpoints-skipped/` (kept, out of the way of the steps that will
be saved again). Saving is synchronous: the next step donates the state's
buffers.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import sys
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from sagebwd_jax.flax.llama import is_stacked
from train.rundir import RunError


def _key(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _layer_names(keys: list[str], layers: int) -> list[str]:
  """The names of a leaf stacked over the layers (`is_stacked`), one per
  layer, as an unscanned model's parameters are named."""
  at = keys.index("blocks") + 1
  return ["/".join([*keys[:at], str(layer), *keys[at:]]) for layer in range(layers)]


def flatten(state) -> dict:
  named = []
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    keys = [_key(k) for k in path]
    if is_stacked(keys):
      named += zip(_layer_names(keys, x.shape[0]), x)
    else:
      named.append(("/".join(keys), x))
  flat = dict(named)
  assert len(flat) == len(named), "checkpoint names collide"
  return flat


def unflatten(flat: dict, like):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  values = []
  for path, x in leaves:
    keys = [_key(k) for k in path]
    if is_stacked(keys):  # its layers stacked again, placed as `like`'s
      layers = [flat[name] for name in _layer_names(keys, x.shape[0])]
      values.append(jax.device_put(jnp.stack(layers), x.sharding))
    else:
      values.append(flat["/".join(keys)])
  return jax.tree_util.tree_unflatten(treedef, values)


def _host(x) -> np.ndarray:
  """A replicated array's value, from this process's first copy."""
  return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def checksums(flat: dict) -> dict[str, int]:
  return {name: zlib.crc32(np.ascontiguousarray(_host(x))) for name, x in flat.items()}


def _one_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"


@contextlib.contextmanager
def _quiet():
  """Orbax logs each failure of its worker threads with a traceback, and
  after a failed write TensorStore's pending callbacks print "Event loop is
  closed" tracebacks (a full disk gave 19); the caller reports the error once,
  in one line. Without an error, what was printed is passed on."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL + 1)
  printed = io.StringIO()
  try:
    with contextlib.redirect_stderr(printed):
      try:
        yield
      except BaseException:
        # Those callbacks run after the error is raised: wait for them to stop,
        # and finalize orbax's abandoned coroutines while their noise is caught.
        size, deadline = -1, time.monotonic() + 5.0
        while printed.tell() != size and time.monotonic() < deadline:
          size = printed.tell()
          time.sleep(0.5)
          gc.collect()
        raise
  finally:
    logger.setLevel(level)
  sys.stderr.write(printed.getvalue())


class Corrupt(Exception):
  """A checkpoint that does not restore intact; the message says why."""


class Checkpoints:
  """The checkpoints of the run in `run_dir`; `primary`: the process that
  moves skipped ones aside (all processes save and restore). `read_only`
  (a reader beside a training that may be saving: `train.sample`) creates
  and cleans up nothing."""

  def __init__(self, run_dir: str, keep: int, primary: bool = True, read_only: bool = False):
    self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    self.skipped_dir = os.path.abspath(os.path.join(run_dir, "checkpoints-skipped"))
    self.primary = primary
    try:
      with _quiet():
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=not read_only, enable_async_checkpointing=False,
                cleanup_tmp_directories=not read_only, read_only=read_only))
    except Exception as e:
      raise RunError(f"opening the checkpoints in {self.dir} failed: {_one_line(e)}") from e

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state) -> None:
    flat = flatten(state)
    try:
      with _quiet():
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(flat), checksums=ocp.args.JsonSave(checksums(flat))))
        self.manager.wait_until_finished()
    except Exception as e:
      raise RunError(f"saving checkpoint {step} to {self.dir} failed: {_one_line(e)}") from e

  def restore(self, like, step: int | None = None):
    """The state saved at `step` (default: the latest), shaped like `like`;
    Corrupt if it does not restore intact."""
    step = self.latest_step() if step is None else step
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, flatten(like))
    try:
      with _quiet():
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), checksums=ocp.args.JsonRestore()))
    except Exception as e:
      raise Corrupt(f"orbax cannot read it ({_one_line(e)})") from e
    flat, saved = restored["state"], restored["checksums"]
    if not isinstance(saved, dict) or sorted(saved) != sorted(flat):
      raise Corrupt("its checksums do not list its arrays")
    for name, crc in checksums(flat).items():
      if crc != saved[name]:
        raise Corrupt(f"{name} differs from its checksum: its bytes changed after saving")
      if not np.isfinite(_host(flat[name])).all():
        raise Corrupt(f"{name} holds non-finite values")
    return unflatten(flat, like)

  def restore_newest(self, like, log: Callable[[str], None]):
    """(state, step) of the newest checkpoint that restores intact, or None if
    there is none; RunError if there are checkpoints but none restores."""
    failures = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state = self.restore(like, step)
      except Corrupt as e:
        log(f"warning: skipping checkpoint {step} in {self.dir}: {e}")
        failures.append((step, str(e)))
        continue
      if failures:
        self._set_aside([s for s, _ in failures], log)
      return state, step
    if failures:
      raise RunError(f"no checkpoint in {self.dir} restores ("
                     + "; ".join(f"step {s}: {why}" for s, why in failures)
                     + "); start over with --overwrite")
    return None

  def _set_aside(self, steps: list[int], log: Callable[[str], None]) -> None:
    from train.sharding import barrier
    if self.primary:
      stamp = time.strftime("%Y%m%d-%H%M%S")
      for step in steps:
        dest = os.path.join(self.skipped_dir, f"{step}-{stamp}")
        try:
          os.makedirs(self.skipped_dir, exist_ok=True)
          os.rename(os.path.join(self.dir, str(step)), dest)
        except OSError as e:
          raise RunError(f"moving the unreadable checkpoint {step} out of {self.dir} failed: "
                         f"{e.strerror}") from e
        log(f"moved the unreadable checkpoint {step} to {dest}")
    barrier("sagebwd-train: skipped checkpoints moved")
    self.manager.reload()

  def close(self) -> None:
    with _quiet():
      self.manager.close()
