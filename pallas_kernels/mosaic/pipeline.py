"""The warp-specialized pipeline every Mosaic GPU kernel of this backend runs.

A CTA holds `Tuning.compute_wgs` compute warpgroups and one producer
warpgroup (`kernel`, `split`), which share the register file by setmaxnreg
(`Registers`). The producer streams the tiles of the side a kernel loops
over (keys and values in the forward and dQ; queries, cotangents and their
rows' lse and Delta in dK/dV) by TMA into a ring of `Ring.slots` shared-memory slots (`stream`):
a slot's load barrier says its tile arrived; every compute warpgroup
arrives on the slot's `consumed` barrier once done with it (`release` for
tiles a warpgroup skips), which lets the producer load the tile `slots`
steps later into it. With the schedule barrier (`Schedule`) two compute
warpgroups take turns: one issues its products while the other runs its
elementwise work; with issue turns they issue their products in turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

# setmaxnreg takes multiples of 8; a 128-thread slice of the register file
# holds 512 registers per thread, shared by one thread of each warpgroup.
_REGISTER_FILE = 512
# The most a compute warpgroup asks for: dK/dV needs it (fp32 dK and dV alone
# take 128 per thread).
_MAX_COMPUTE_REGISTERS = 240


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Launch settings of a warp-specialized kernel (they do not change
  results): `compute_wgs` compute warpgroups of 64 rows each, a ring of
  `max_concurrent_steps` slots, the schedule barrier, and with FP8 products
  `pipelined`: each step issues the next step's first products with its own
  last ones, and one wait at the step's end covers both (each kernel's
  tuning says which; the INT8 kernels ignore it). With the schedule barrier
  a pipelined warpgroup takes one turn a step, after that issue: a ping-pong,
  one warpgroup's products running while the other runs its chain. With
  `overlap` too, the next step's first products go out before this step's
  last ones, and the warpgroup waits for the first alone: the next step's
  chain runs under this step's last products (FlashAttention-3's
  intra-warpgroup overlap), in the warpgroup that issued them. With
  `issue_turns` (pipelined, in place of the schedule barrier) the two
  warpgroups issue their products in turn, as FlashAttention-3's
  warp-scheduler barriers order them: each waits for the other's issue
  before its own and passes the turn on right after, so its chain runs
  while the other's products are queued behind its own."""

  compute_wgs: int = 2
  max_concurrent_steps: int = 2
  schedule_barrier: bool = True
  pipelined: bool = False
  overlap: bool = False
  issue_turns: bool = False

  def __post_init__(self):
    # One or two 64-row blocks fit a 128-token step or CTA tile, so with
    # causal masking every warpgroup of a CTA sees the same steps (forward) or
    # releases the one it skips (backward).
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"compute_wgs must be 1 or 2; got {self.compute_wgs}")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps must be >= 2; got {self.max_concurrent_steps}")
    if self.schedule_barrier and self.compute_wgs != 2:
      raise ValueError("schedule_barrier alternates two compute warpgroups")
    if self.overlap and not self.pipelined:
      raise ValueError("overlap orders a pipelined step's products: pass pipelined=True")
    if self.issue_turns and (self.schedule_barrier or not self.pipelined
                             or self.compute_wgs != 2):
      raise ValueError("issue_turns orders the products of two compute warpgroups' pipelined "
                       "steps, in place of the schedule barrier: pass compute_wgs=2, "
                       "pipelined=True, schedule_barrier=False")


@dataclasses.dataclass(frozen=True)
class Registers:
  """A kernel's register budget: `producer` registers per thread for the
  producer warpgroup, and for each compute warpgroup what remains, evenly
  split, up to 240."""

  producer: int

  def __post_init__(self):
    if self.producer % 8 or not 24 <= self.producer <= _REGISTER_FILE // 2:
      raise ValueError(f"producer registers must be a multiple of 8 in [24, 256]; "
                       f"got {self.producer}")

  def compute(self, compute_wgs: int) -> int:
    share = (_REGISTER_FILE - self.producer) // compute_wgs // 8 * 8
    return min(_MAX_COMPUTE_REGISTERS, share)


# The forward's compute warpgroups run without spills at 232 (2026-11-30, the
# second Hopper forward, docs/performance-log.md); the backward's need all
# 240, so its producer keeps the least setmaxnreg allows.
FORWARD_REGISTERS = Registers(producer=40)
BACKWARD_REGISTERS = Registers(producer=24)


def kernel(body: Callable, *, tuning: Tuning, scratch, barriers, out_type, grid, grid_names,
           name: str):
  """`plgpu.kernel` with `tuning.compute_wgs` compute warpgroups and one
  producer, approximate exp2 and reciprocals.

  `body(*refs, scoped)` runs in every warpgroup ("wg" tells them apart; see
  `split`); `scoped` holds the `scratch` shared-memory tiles and the
  `barriers`, allocated once for all of them. `name` is the kernel's name in
  profiles.
  """
  def entry(*refs):
    pl.run_scoped(lambda *scoped: body(*refs, scoped), scratch, *barriers,
                  collective_axes="wg")

  return plgpu.kernel(
      entry, out_type=out_type, grid=grid, grid_names=grid_names,
      num_threads=tuning.compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, **_profile_params()),
      kernel_name=name)


# Mosaic GPU's on-device profiler: with SAGEBWD_MOSAIC_PROFILE=DIR[:EVENTS],
# each warpgroup records the clock at the bounds of the kernels'
# `jax.named_scope` regions (up to EVENTS ranges, in shared memory) and each
# call writes a trace to DIR (`python -m benchmarks.mosaic_profile`).
PROFILE_ENV = "SAGEBWD_MOSAIC_PROFILE"


def _profile_params() -> dict:
  setting = os.environ.get(PROFILE_ENV)
  if not setting:
    return {}
  folder, _, events = setting.partition(":")
  return dict(profile_space=int(events or 256), profile_dir=folder, profile_bounds_check=True)


def split(wg, tuning: Tuning, registers: Registers, *, compute: Callable[[], None],
          producer: Callable[[], None]):
  """Runs `compute` in the compute warpgroups and `producer` in the last one
  (`wg` is this warpgroup's index), each with its share of the registers."""

  @pl.when(wg < tuning.compute_wgs)
  def _compute():
    plgpu.set_max_registers(registers.compute(tuning.compute_wgs), action="increase")
    compute()

  @pl.when(wg == tuning.compute_wgs)
  def _producer():
    plgpu.set_max_registers(registers.producer, action="decrease")
    producer()


@dataclasses.dataclass(frozen=True)
class Ring:
  """The producer's ring of `slots` shared-memory slots; tile i goes to slot
  i % slots."""

  slots: int

  def slot(self, i):
    return lax.rem(i, jnp.array(self.slots, i.dtype))


def stream(ring: Ring, *, first, end, groups: Sequence[tuple[Callable, Sequence]]):
  """The producer's loop over tiles i in [first, end): for each (load,
  consumed) of `groups`, `load(i, slot)` once the compute warpgroups
  released the slot's previous tiles of that group on every barrier array
  of `consumed`; then it observes the last releases too, so every barrier
  phase is waited on. A group released early (the tiles a step's first
  products read) refills while the step's later products still read the
  others."""

  def wait_released(i, consumed):
    for bar in consumed:
      plgpu.barrier_wait(bar.at[ring.slot(i)])

  @pl.loop(first, jnp.minimum(first + ring.slots, end))
  def _prologue(i):
    for load, _ in groups:
      load(i, ring.slot(i))

  @pl.loop(first + ring.slots, end)
  def _steady(i):
    for load, consumed in groups:
      wait_released(i, consumed)  # tile i - slots is done with
      load(i, ring.slot(i))

  @pl.loop(jnp.maximum(end - ring.slots, first), end)
  def _drain(i):
    for _, consumed in groups:
      wait_released(i, consumed)


class Schedule:
  """The two compute warpgroups' order, no-ops without one.

  The schedule barrier (`Tuning.schedule_barrier`): a warpgroup arrives
  when it has issued its wgmmas or finished its elementwise work, then waits
  for the other one's turn. Issue turns (`Tuning.issue_turns`): one barrier
  per warpgroup, which the other arrives at once it has issued; a
  warpgroup waits at its own before issuing (`issuing`)."""

  def __init__(self, barrier, tuning: Tuning, wg):
    self._barrier = barrier if tuning.schedule_barrier else None
    self._turns = barrier if tuning.issue_turns else None
    self._wg = wg

  @staticmethod
  def barrier(tuning: Tuning):
    """The barrier a kernel allocates for `Schedule`."""
    if tuning.issue_turns:
      return plgpu.Barrier(num_barriers=2)
    return plgpu.Barrier(num_arrivals=tuning.compute_wgs)

  def arrive(self):
    if self._barrier is not None:
      plgpu.barrier_arrive(self._barrier)

  def wait(self):
    if self._barrier is not None:
      plgpu.barrier_wait(self._barrier)

  def turn(self):
    self.arrive()
    self.wait()

  @contextlib.contextmanager
  def issuing(self):
    """Around a pipelined step's issue: with issue turns, first the
    warpgroup's turn, passed on after; with the schedule barrier, a turn
    after."""
    if self._turns is not None:
      with jax.named_scope("turn"):
        plgpu.barrier_wait(self._turns.at[self._wg])
    yield
    if self._turns is not None:
      plgpu.barrier_arrive(self._turns.at[1 - self._wg])
    with jax.named_scope("turn"):
      self.turn()

  def lead_in(self):
    """Before the loop: the second warpgroup takes one turn, so the two
    alternate (with issue turns, it gives the first one its first)."""
    if self._barrier is not None:
      pl.when(self._wg == 1)(self.turn)
    if self._turns is not None:
      pl.when(self._wg == 1)(lambda: plgpu.barrier_arrive(self._turns.at[0]))

  def lead_out(self):
    """After the loop: the first takes one, so both took as many. (The
    second warpgroup's last issue turn passes to no one: that barrier's
    phase ends with the kernel.)"""
    if self._barrier is not None:
      pl.when(self._wg == 0)(self.turn)


def release(ring: Ring, first, end, *, bars: Sequence, consumed: Sequence,
            schedule: Schedule):
  """Waits for and releases (on each barrier array of `consumed`) ring tiles
  [first, end) that a compute warpgroup does not use (another one of its
  CTA does). It still takes its two turns per tile at the schedule barrier,
  so both warpgroups pass it equally often."""

  @pl.loop(first, end)
  def _release(i):
    for bar in bars:
      plgpu.barrier_wait(bar.at[ring.slot(i)])
    for bar in consumed:
      plgpu.barrier_arrive(bar.at[ring.slot(i)])
    schedule.turn()
    schedule.turn()
