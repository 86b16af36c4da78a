"""jax's persistent compilation cache for `python -m train`.

A run's compiled programs (the train step above all) are kept in a folder,
keyed by their HLO, so that a second run of the same model, or a resumed
one, loads them instead of compiling again:

- `--compile-cache DIR` puts the folder at DIR; `--compile-cache none`
  turns the cache off.
- Default: `$JAX_COMPILATION_CACHE_DIR` where that is set (jax's own
  variable), else `$XDG_CACHE_HOME/sagebwd-jax/jax-cache`, that is
  `~/.cache/sagebwd-jax/jax-cache`.

jax caches only what it took a second or more to compile (its
`jax_persistent_cache_min_compile_time_secs`). Every entry is written to a
temporary file in the folder and renamed into place, so runs sharing the
folder at the same time never read a half-written entry (they compile what
is not there yet, and the first to finish writes it). On a hit, tracing
and lowering still run; XLA's compile does not (docs/training.md has the
figures).

The folder holds executables this process would run: do not share it with
users you do not trust (jax's own warning about its cache).
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time

NONE = "none"  # --compile-cache none: no cache
_SUFFIX = "-cache"  # jax's LRUCache names its entries <key>-cache; so do we


def default_dir() -> str:
  """The cache folder when --compile-cache is not given."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "sagebwd-jax", "jax-cache")


def resolve(flag: str | None) -> str | None:
  """The folder --compile-cache asks for (None: the cache is off)."""
  if flag is None:
    return default_dir()
  return None if flag.strip().lower() == NONE else os.path.expanduser(flag)


class AtomicFileCache:
  """jax's file cache with whole-file writes: an entry appears by rename,
  complete, or not at all. Counts the lookups and the hits of this process."""

  def __init__(self, path: str):
    self._path = pathlib.Path(path)
    self._path.mkdir(parents=True, exist_ok=True)
    self.lookups = self.hits = self.writes = 0
    # What a process killed mid-write left: a day old, no writer is on it.
    for tmp in self._path.glob(".*.tmp"):
      try:
        if time.time() - tmp.stat().st_mtime > 86400:
          tmp.unlink()
      except OSError:
        pass

  def get(self, key: str) -> bytes | None:
    self.lookups += 1
    try:
      value = (self._path / f"{key}{_SUFFIX}").read_bytes()
    except FileNotFoundError:
      return None
    self.hits += 1
    return value

  def put(self, key: str, value: bytes) -> None:
    target = self._path / f"{key}{_SUFFIX}"
    if target.exists():
      return
    fd, tmp = tempfile.mkstemp(dir=self._path, prefix=f".{key}.", suffix=".tmp")
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(value)
      os.chmod(tmp, 0o666 & ~_umask())  # as a plain write would make it, not mkstemp's 0600
      os.replace(tmp, target)
      self.writes += 1
    except BaseException:
      try:
        os.unlink(tmp)
      except FileNotFoundError:
        pass
      raise

  def clear(self) -> None:
    for entry in self._path.glob(f"*{_SUFFIX}"):
      entry.unlink(missing_ok=True)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


_active: AtomicFileCache | None = None


def enable(path: str) -> AtomicFileCache:
  """Makes jax compile through the cache in `path` from now on (the folder is
  created). ValueError, naming the folder, when it cannot be created."""
  global _active
  try:
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
      raise PermissionError("no write permission")
  except OSError as e:
    raise ValueError(f"--compile-cache {path}: cannot use the folder ({e.strerror or e}); "
                     f"name another, or 'none' to run without the cache") from None
  import jax
  from jax._src import compilation_cache as jax_cache
  from jax.experimental.compilation_cache import compilation_cache as public
  public.reset_cache()  # forget a cache this process opened before: the next compile opens ours
  jax.config.update("jax_enable_compilation_cache", True)
  public.set_cache_dir(path)
  cache = AtomicFileCache(path)
  jax_cache._cache = cache  # jax asks `_cache` first and opens its own only when it is None
  _active = cache
  return cache


def disable() -> None:
  """No persistent cache from now on (--compile-cache none)."""
  global _active
  import jax
  from jax.experimental.compilation_cache import compilation_cache as public
  public.reset_cache()
  jax.config.update("jax_enable_compilation_cache", False)
  _active = None


def active() -> AtomicFileCache | None:
  """The cache `enable` installed, if it is the one jax uses."""
  from jax._src import compilation_cache as jax_cache
  return _active if _active is not None and jax_cache._cache is _active else None
