"""The behaviour suite against the Triton kernels in Triton's interpreter (no
GPU), on a narrower case list than the reference's so that `make test` stays
within its budget. On a GPU, tests/test_attention_gpu.py runs them compiled
through jax_triton on every case instead."""

from __future__ import annotations

import jax
import pytest

from attention_suite import AttentionTestBase

pytest.importorskip("triton", reason="the Triton kernels need the package triton")


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="compiled on the GPU by tests/test_attention_gpu.py")
class TestTritonInterpret(AttentionTestBase):
  implementation = "triton"
  # The interpreter runs a kernel's Python body once per program and tile
  # (docs/performance-log.md): Table 1 at T=4096 alone would take minutes. Its accuracy is the
  # reference's with unsigned P and P^T (which test_matches_reference_backend
  # ties these kernels to, case by case); the GPU suite runs Table 1 through
  # them.
  params = AttentionTestBase.params | {
      "sigma": [],
      "tq,tk": [(100, 75), (17, 200)],
      "dtype": [jax.numpy.float16, jax.numpy.bfloat16],
  }
