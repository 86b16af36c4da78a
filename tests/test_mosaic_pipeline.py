"""The Mosaic kernels' shared pipeline: register budgets and launch settings."""

from __future__ import annotations

import pytest

from pallas_kernels.mosaic import pipeline


@pytest.mark.parametrize("registers", [pipeline.FORWARD_REGISTERS, pipeline.BACKWARD_REGISTERS])
@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_register_budgets_fit_the_register_file(registers, compute_wgs):
  """setmaxnreg's rules: multiples of 8, and all warpgroups together within
  the 512 registers per thread of a 128-thread slice of the register file."""
  compute = registers.compute(compute_wgs)
  assert compute % 8 == 0 and 24 <= compute <= 240
  assert compute * compute_wgs + registers.producer <= 512


def test_backward_compute_warpgroups_get_the_most():
  assert pipeline.BACKWARD_REGISTERS.compute(2) == 240


@pytest.mark.parametrize("producer", [16, 28, 264])
def test_register_budget_is_checked(producer):
  with pytest.raises(ValueError, match="producer registers"):
    pipeline.Registers(producer=producer)
