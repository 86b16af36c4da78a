"""The behaviour suite against the portable Pallas kernels in interpret mode
(no GPU), on a narrower case list than the reference's so that `make test`
stays within its budget. On a GPU, tests/test_attention_gpu.py runs them
compiled on every case instead."""

from __future__ import annotations

import jax
import pytest

from attention_suite import AttentionTestBase


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="compiled on the GPU by tests/test_attention_gpu.py")
class TestPallasInterpret(AttentionTestBase):
  implementation = "pallas"
  # Table 1 at T=4096 is the slowest case in interpret mode; its sigmas probe
  # the int8 rules the reference shares with the kernels, while agreement with
  # the reference on every kernel case is checked by test_matches_reference_backend.
  params = AttentionTestBase.params | {
      "sigma": [1.0],
      "tq,tk": [(100, 75), (17, 200)],
      "window_case": [(128, 128, True, (40, 40)), (96, 160, False, (0, 70))],
  }
