"""Error metrics between an approximation and a reference (tests, benchmarks,
training telemetry). Both are computed in fp32, or fp64 for fp64 inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _flat(x: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array]:
  x, ref = jnp.asarray(x), jnp.asarray(ref)
  if x.shape != ref.shape:
    raise ValueError(f"shapes differ: {x.shape} and {ref.shape}")
  dtype = jnp.float64 if jnp.float64 in (x.dtype, ref.dtype) else jnp.float32
  return x.astype(dtype).ravel(), ref.astype(dtype).ravel()


def cosine_similarity(x: jax.Array, ref: jax.Array) -> jax.Array:
  """<x, ref> / (|x| |ref|); 1 for two all-zero arrays."""
  x, ref = _flat(x, ref)
  norms = jnp.linalg.norm(x) * jnp.linalg.norm(ref)
  both_zero = jnp.logical_and(jnp.all(x == 0), jnp.all(ref == 0))
  return jnp.where(both_zero, 1.0, jnp.dot(x, ref) / jnp.where(norms == 0, 1.0, norms))


def relative_l2(x: jax.Array, ref: jax.Array) -> jax.Array:
  """|x - ref| / |ref|; 0 when both are all zero."""
  x, ref = _flat(x, ref)
  ref_norm = jnp.linalg.norm(ref)
  err = jnp.linalg.norm(x - ref)
  return jnp.where(ref_norm == 0, jnp.where(err == 0, 0.0, jnp.inf),
                   err / jnp.where(ref_norm == 0, 1.0, ref_norm))
