"""sagebwd_jax.metrics against numpy in float64."""

import jax.numpy as jnp
import numpy as np
import pytest

from sagebwd_jax import metrics


def test_against_numpy():
  rng = np.random.default_rng(0)
  x, ref = rng.normal(size=(3, 5, 7)), rng.normal(size=(3, 5, 7))
  want_cos = np.dot(x.ravel(), ref.ravel()) / np.linalg.norm(x) / np.linalg.norm(ref)
  want_rel = np.linalg.norm(x - ref) / np.linalg.norm(ref)
  np.testing.assert_allclose(metrics.cosine_similarity(x, ref), want_cos, rtol=1e-5)
  np.testing.assert_allclose(metrics.relative_l2(x, ref), want_rel, rtol=1e-5)


def test_identical_scaled_and_opposite():
  x = jnp.arange(1.0, 9.0).reshape(2, 4)
  assert float(metrics.cosine_similarity(x, x)) == pytest.approx(1.0)
  assert float(metrics.cosine_similarity(3 * x, x)) == pytest.approx(1.0)
  assert float(metrics.cosine_similarity(-x, x)) == pytest.approx(-1.0)
  assert float(metrics.relative_l2(x, x)) == 0.0
  assert float(metrics.relative_l2(2 * x, x)) == pytest.approx(1.0)


def test_zero_arrays():
  z = jnp.zeros((4,))
  assert float(metrics.cosine_similarity(z, z)) == 1.0
  assert float(metrics.relative_l2(z, z)) == 0.0
  assert float(metrics.relative_l2(jnp.ones(4), z)) == np.inf


def test_bfloat16_inputs_are_measured_in_float32():
  x = jnp.array([1.0, 2.0, 3.0], jnp.bfloat16)
  assert metrics.relative_l2(x, x.astype(jnp.float32)).dtype == jnp.float32


def test_shape_mismatch_is_refused():
  with pytest.raises(ValueError, match="shapes differ"):
    metrics.relative_l2(jnp.ones((2, 3)), jnp.ones((3, 2)))
