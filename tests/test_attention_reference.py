"""The behaviour suite against the pure-JAX reference backend, every case."""

from __future__ import annotations

import jax

from attention_suite import AttentionTestBase


class TestReference(AttentionTestBase):
  implementation = "reference"
  # On the CPU the reference against itself proves nothing. On a GPU it checks
  # that XLA:GPU computes the same int8 arithmetic as the CPU: its fusions once
  # miscompiled the rounding bit trick (wrong int8 under jit on an H200), which
  # is why the reference rounds with plain XLA ops.
  params = AttentionTestBase.params | (
      {} if jax.default_backend() == "gpu" else {"case": []})
