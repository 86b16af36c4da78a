"""Token streams and batches.

Text becomes byte-level tokens (vocabulary 256): no tokenizer to download. The
default corpus is the Python standard library's own sources on this machine,
so `python -m train` runs offline. A nanoGPT `.bin` (uint16 tokens) is used
as is.

Split: a text document goes to validation when a hash of its path (relative
to the folder given) falls in the first `val_fraction` of the hash range, so
the split does not move when files are added elsewhere; with too few
documents for that, and for `.bin` files, the last `val_fraction` of the
stream is validation.

A batch is a pure function of (seed, step): resuming at step s reads exactly
what the uninterrupted run would have read.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DOC_SEPARATOR = 0  # byte 0 never occurs in text: it marks document boundaries
_TRAIN, _VAL = 0, 1


@dataclass
class Dataset:
  train: np.ndarray  # 1-D token streams (uint16 or a memmap)
  val: np.ndarray
  vocab_size: int
  source: str        # for the log


def stdlib_dir() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
  """Every *.py file of the standard library, sorted; no site-packages."""
  root = stdlib_dir()
  files = [p for p in root.rglob("*.py")
           if "site-packages" not in p.relative_to(root).parts
           and "__pycache__" not in p.relative_to(root).parts and p.is_file()]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_text(path: Path) -> bool:
  with open(path, "rb") as f:
    return b"\0" not in f.read(8192)


def _text_files(folder: Path) -> list[Path]:
  """Non-empty text files under `folder`, hidden ones skipped, sorted."""
  out = []
  for dirpath, dirnames, filenames in os.walk(folder):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    for name in sorted(filenames):
      p = Path(dirpath) / name
      if not name.startswith(".") and p.is_file() and p.stat().st_size and _is_text(p):
        out.append(p)
  return out


def _in_val(key: str, val_fraction: float) -> bool:
  h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
  return h < val_fraction * 2**64


def _split_stream(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  cut = int(len(tokens) * (1 - val_fraction))
  return tokens[:cut], tokens[cut:]


def documents(paths: list[str]) -> list[tuple[str, Path]]:
  """(split key, file) for every text file named by `paths`, with clear errors."""
  docs = []
  for arg in paths:
    p = Path(arg)
    if not p.exists():
      raise ValueError(f"--data: {arg!r} does not exist")
    if p.is_dir():
      files = _text_files(p)
      if not files:
        raise ValueError(f"--data: folder {arg!r} holds no non-empty text file")
      docs += [(f.relative_to(p).as_posix(), f) for f in files]
    elif p.is_file():
      if p.stat().st_size == 0:
        raise ValueError(f"--data: file {arg!r} is empty")
      if not _is_text(p):
        raise ValueError(f"--data: file {arg!r} is not text (it has NUL bytes); "
                         "token files must end in .bin")
      docs.append((p.name, p))
    else:
      raise ValueError(f"--data: {arg!r} is neither a file nor a folder")
  return docs


def _bytes_to_tokens(docs: list[Path]) -> np.ndarray:
  parts = []
  for f in docs:
    parts.append(np.frombuffer(f.read_bytes(), dtype=np.uint8))
    parts.append(np.array([DOC_SEPARATOR], dtype=np.uint8))
  return np.concatenate(parts).astype(np.uint16) if parts else np.zeros(0, np.uint16)


def load_text(docs: list[tuple[str, Path]], val_fraction: float, source: str) -> Dataset:
  val_docs = [f for key, f in docs if _in_val(key, val_fraction)]
  train_docs = [f for key, f in docs if not _in_val(key, val_fraction)]
  if val_docs and train_docs:
    train, val = _bytes_to_tokens(train_docs), _bytes_to_tokens(val_docs)
  else:  # too few documents for a split by document
    train, val = _split_stream(_bytes_to_tokens([f for _, f in docs]), val_fraction)
  return Dataset(train, val, 256, source)


def load_bin(path: str, val_fraction: float) -> Dataset:
  p = Path(path)
  if not p.is_file():
    raise ValueError(f"--data: {path!r} does not exist or is not a file")
  if p.stat().st_size == 0:
    raise ValueError(f"--data: file {path!r} is empty")
  if p.stat().st_size % 2:
    raise ValueError(f"--data: {path!r} has an odd size: not a uint16 token file")
  tokens = np.memmap(p, dtype=np.uint16, mode="r")
  vocab = int(tokens.max()) + 1
  train, val = _split_stream(tokens, val_fraction)
  return Dataset(train, val, -(-vocab // 64) * 64, f"{path} ({len(tokens):,} tokens)")


def load(paths: list[str], val_fraction: float, seq_len: int) -> Dataset:
  """The corpus named by --data (default: the stdlib), split train/val."""
  if not paths:
    root = stdlib_dir()
    files = stdlib_files()
    if not files:
      raise ValueError(f"no *.py files found under the stdlib folder {root}")
    ds = load_text([(f.relative_to(root).as_posix(), f) for f in files], val_fraction,
                   f"Python stdlib sources in {root} ({len(files)} files)")
  elif any(p.endswith(".bin") for p in paths):
    if len(paths) != 1:
      raise ValueError(f"--data: a .bin token file must come alone, got {paths}")
    ds = load_bin(paths[0], val_fraction)
  else:
    docs = documents(paths)
    ds = load_text(docs, val_fraction, f"{', '.join(paths)} ({len(docs)} files)")
  for split in ("train", "val"):
    n = len(getattr(ds, split))
    if n < seq_len + 1:
      raise ValueError(f"--data: the {split} split of {ds.source} has {n} tokens, fewer "
                       f"than seq_len + 1 = {seq_len + 1}; give more text or lower "
                       f"--seq-len / change --val-fraction")
  return ds


def _windows(tokens: np.ndarray, rng: np.random.Generator, shape: tuple, seq_len: int,
             rows: slice | None):
  starts = rng.integers(0, len(tokens) - seq_len, size=shape)  # windows of seq_len + 1
  if rows is not None:  # this process's share of the batch (the draws stay global)
    starts = starts[..., rows]
  idx = starts[..., None] + np.arange(seq_len + 1)
  return np.asarray(tokens[idx], dtype=np.int32)


def train_batch(ds: Dataset, seed: int, step: int, grad_accum: int, batch_size: int,
                seq_len: int, rows: slice | None = None) -> np.ndarray:
  """Tokens (grad_accum, batch_size, seq_len + 1) for `step`: inputs and targets.

  `rows`: only these sequences of each micro-batch (a process's share of the
  global batch); they are the same tokens whatever the number of processes.
  """
  rng = np.random.default_rng([seed, _TRAIN, step])
  return _windows(ds.train, rng, (grad_accum, batch_size), seq_len, rows)


def val_batch(ds: Dataset, seed: int, index: int, batch_size: int, seq_len: int,
              rows: slice | None = None) -> np.ndarray:
  """Validation batch `index` (batch_size, seq_len + 1); the same at every evaluation."""
  rng = np.random.default_rng([seed, _VAL, index])
  return _windows(ds.val, rng, (batch_size,), seq_len, rows)
