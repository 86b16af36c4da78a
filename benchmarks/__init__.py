"""Benchmarks of the SageBwd op and its kernels, run from the repository root
as modules (`python -m benchmarks.attention`; benchmarks/README.md lists them).
Most need a GPU; none is imported by the package itself."""

from __future__ import annotations

import argparse


def parser(doc: str, module: str) -> argparse.ArgumentParser:
  """The script's argument parser: `--help` shows its whole docstring."""
  from train.cli import ArgumentParser  # errors in two lines, not after the usage
  return ArgumentParser(prog=f"python -m {module}", description=doc,
                        formatter_class=argparse.RawDescriptionHelpFormatter)


def require_gpu(module: str) -> None:
  """Ends the script with one line when jax sees no GPU: it times GPU kernels,
  and on a CPU it would time the pure-JAX reference for minutes instead."""
  import jax
  if jax.default_backend() != "gpu":
    raise SystemExit(f"error: python -m {module} times GPU kernels, and jax sees no GPU here "
                     f"(backend {jax.default_backend()!r}); run it on a machine with a CUDA "
                     f"GPU. On this one, python -m benchmarks.accuracy measures the op's "
                     f"accuracy with the pure-JAX reference.")
