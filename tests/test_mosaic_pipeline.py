"""The Mosaic kernels' shared pipeline: register budgets, launch settings, and
the paths `registers.steps` gives the overlap schedules' loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mosaic import pipeline
from pallas_kernels.mosaic import registers


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


def _visits(start, stop, one, *, traced: bool):
  """The steps `registers.steps` runs for segments [0, start) (a loop) and
  [start, stop) (`one`), then `finish`, recorded in order."""

  def record(i, carry):
    log, n = carry
    return log.at[n].set(i), n + 1

  def run(start, stop):
    carry = (jnp.full((8,), -1, jnp.int32), jnp.int32(0))
    segments = ((0, start, record, False), (start, stop, record, one))
    return registers.steps(carry, segments, lambda carry: (carry[0].at[carry[1]].set(99),
                                                           carry[1] + 1))

  log, n = jax.jit(run)(start, stop) if traced else run(start, stop)
  return [int(x) for x in log[:int(n)]]


@pytest.mark.parametrize("traced", [True, False])
@pytest.mark.parametrize("start, stop", [(0, 0), (0, 1), (3, 3), (3, 4), (2, 2)])
def test_steps_run_every_segment_then_finish(start, stop, traced):
  """Each combination of empty and non-empty segments, sizes known when
  tracing or not, runs the steps in order and `finish` once."""
  assert _visits(start, stop, True, traced=traced) == [*range(stop), 99]


def test_steps_loop_segment_runs_every_step():
  assert _visits(2, 6, False, traced=True) == [0, 1, 2, 3, 4, 5, 99]


def test_steps_one_step_segment_is_checked_when_known():
  with pytest.raises(ValueError, match="one step holds 2"):
    _visits(1, 3, True, traced=False)
