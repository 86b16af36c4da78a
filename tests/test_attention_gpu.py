"""The behaviour suite against the GPU backends, compiled, every case: the
Triton kernels on any GPU, the Hopper backend ("mosaic")
on an H100/H200. (The reference runs on the GPU too, from
test_attention_reference.py.)"""

from __future__ import annotations

import jax
import pytest

from attention_suite import AttentionTestBase
from conftest import (HOPPER_CASES, check_against_reference, use_hopper_numerics,
                      use_triton_numerics)

pytestmark = pytest.mark.gpu


class TestTritonGpu(AttentionTestBase):
  implementation = "triton"

  def test_matches_reference_backend(self, case, monkeypatch):
    """The reference with the Triton kernels' P and P^T (`TRITON_NUMERICS`)."""
    use_triton_numerics(monkeypatch)
    check_against_reference(case, self.implementation)


def _hopper() -> bool:
  return jax.default_backend() == "gpu" and jax.devices()[0].compute_capability == "9.0"


@pytest.mark.skipif(not _hopper(), reason="the Mosaic backend needs a Hopper GPU")
class TestMosaicGpu(AttentionTestBase):
  implementation = "mosaic"

  def test_matches_reference_backend(self, case, monkeypatch):
    """The reference quantizes P as the kernels that run the case do: the
    Mosaic forward where it takes the case, the Triton kernels elsewhere."""
    if case in HOPPER_CASES:
      use_hopper_numerics(monkeypatch)
    else:
      use_triton_numerics(monkeypatch)
    check_against_reference(case, self.implementation)
