"""The behaviour suite against the GPU backends, compiled, every case: the
Triton kernels on any GPU, the Hopper backend ("mosaic")
on an H100/H200. (The reference runs on the GPU too, from
test_attention_reference.py.)"""

from __future__ import annotations

import jax
import pytest

from attention_suite import AttentionTestBase

pytestmark = pytest.mark.gpu


class TestTritonGpu(AttentionTestBase):
  implementation = "triton"


def _hopper() -> bool:
  return jax.default_backend() == "gpu" and jax.devices()[0].compute_capability == "9.0"


@pytest.mark.skipif(not _hopper(), reason="the Mosaic backend needs a Hopper GPU")
class TestMosaicGpu(AttentionTestBase):
  implementation = "mosaic"
