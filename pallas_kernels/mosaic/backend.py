"""The Hopper backend: Mosaic GPU kernels where they take the case, another
backend's (`fallback`) everywhere else.

The quantization pass, the backward pre-pass and the saturated rows'
recomputation are the fallback's (the same int8 values feed both paths),
written in the layouts the kernels that will run read (`layouts`,
`types.Layouts`): REGISTER_B for the Mosaic kernels, TOKENS for the
fallback's. The forward runs in Mosaic GPU when `forward.takes`
accepts the case (no masks but causality, no Q-smoothing,
ds_precision="int8", whose Q scales are per block, D in {64, 128}, 64 x 64
blocks, whole 128-key steps, Tq == Tk when causal, 16-bit output), quantizing
P per row of each 128-key step to 0..255; the dK/dV and dQ kernels when
`backward_takes` accepts it (the same, with queries and keys in whole CTA
tiles of 128), quantizing P^T per key row to 0..255 (`MOSAIC_NUMERICS`: both).
Anything else runs in the fallback, call by call (`reference_numerics` says
which numerics a call gets). With quantization="int8_fp8" the forward (FP8
P.V) and the backward (FP8 P^T.dO, dS^T.Q', dS.K') run in Mosaic GPU where
the same rules accept the case; the quantization pass where the Mosaic
forward runs, and the stages between the forward and the backward's kernels
(the pre-pass, the saturated rows, the FP8 operands) where the Mosaic
backward runs, are then `fallback`'s, whose Triton kernels take either mode,
and everything else `fp8_fallback`'s. `Config.causal_exact` runs in the
Mosaic kernels of both modes; with FP8 products its FP8 operands are XLA's
(`TritonBackend.fp8_operands`). The Mosaic kernels
compile for an sm_90 GPU only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.mosaic import common
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic.backward_dkdv import backward_dkdv_mosaic
from pallas_kernels.mosaic.backward_dq import backward_dq_mosaic, dq_step_keys
from pallas_kernels.mosaic.backward_dq_product import backward_dq_product
from pallas_kernels.mosaic import forward
from pallas_kernels.layouts import check_layout
from pallas_kernels.types import (Backend, Config, Fp8Operands, Layouts, Masks, Numerics,
                                  Prepass, QuantizedQKV, TransposedLayout)

# How the Mosaic kernels quantize P (the forward, per row of a step's keys)
# and P^T (dK/dV, per key row), both unsigned.
MOSAIC_NUMERICS = Numerics(p_block=forward.KV_STEP, unsigned_p=True, unsigned_p_t=True)


@dataclasses.dataclass(frozen=True)
class Launches:
  """The launch settings of one call's Mosaic kernels. `ds_bytes` (FP8 with
  the overlap, without `Config.causal_exact`): the largest dS'' (B * H * Tq *
  Tk bytes, alive between the two kernels) for which dK/dV writes it and dQ
  is its one product (`backward_dq_product`); past it, and with the default
  0, the dQ kernel recomputes dS in O(T) memory. `launches` leaves it at 0
  until it is measured on a GPU (docs/performance-log.md, 2026-12-08);
  `MosaicBackend(launches=...)` takes it."""

  forward: forward.ForwardTuning
  dkdv: BackwardTuning
  dq: BackwardTuning
  ds_bytes: int = 0

  def dq_product(self, config: Config, batch: int, heads: int, q_len: int,
                 kv_len: int) -> bool:
    """Whether dQ is the product of dK/dV's dS'' for a call of these sizes."""
    return (config.fp8 and not config.causal_exact and self.dkdv.overlap
            and batch * heads * q_len * kv_len <= self.ds_bytes)


def launches(config: Config) -> Launches:
  """The launches `python -m benchmarks.mosaic_forward` and `python -m
  benchmarks.mosaic_backward` measured fastest for a call
  (docs/performance-log.md, 2026-12-07). INT8 products: the schedule barrier.
  FP8 products: FlashAttention-3's overlap (the next step's first products
  issued before this step's last, its chain under them) without the
  barrier, but with `Config.exact_edges` (the diagonal's 16-bit step, which
  the overlap does not take), which keeps the barrier."""
  if not config.fp8 or config.exact_edges:
    return Launches(forward.ForwardTuning(), BackwardTuning(), BackwardTuning())
  overlap = dict(pipelined=True, overlap=True, schedule_barrier=False)
  backward = BackwardTuning(**overlap)
  return Launches(forward.ForwardTuning(**overlap), backward, backward)


def backward_takes(masks: Masks, config: Config, q_len: int, kv_len: int, head_dim: int,
                   dtype, tuning: BackwardTuning = BackwardTuning()) -> bool:
  """Whether the Mosaic backward kernels run this case (`dtype`: V's, which the
  backward's dO.V^T wgmma takes as is). Their dS products are 8-bit only:
  ds_precision="bf16" runs in the fallback."""
  tile = max(tuning.compute_wgs * common.BLOCK, dq_step_keys(config.fp8))
  return (common.supports(masks, config, head_dim)
          and config.ds_precision == "int8" and config.window is None
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and q_len % tile == 0 and kv_len % tile == 0
          and (not config.causal or q_len == kv_len))


@dataclasses.dataclass(frozen=True)
class MosaicBackend:
  """SageBwd on Hopper (sm_90): Mosaic GPU kernels, each where it is faster.

  `fallback` runs the quantization pass, the backward pre-pass and every case
  `forward.takes` or `backward_takes` refuses (the op passes the portable
  backend); `fp8_fallback` does so for quantization="int8_fp8" where the
  Mosaic kernels do not run (the op passes the reference; None: such calls
  raise NotImplementedError). `mosaic_forward=False` keeps the fallback's
  forward. `launches`: every call's (None: `launches(config)`, per call).
  """

  fallback: Backend
  fp8_fallback: Backend | None = None
  mosaic_forward: bool = True
  launches: Launches | None = None

  def _launches(self, config: Config) -> Launches:
    return launches(config) if self.launches is None else self.launches

  def _fallback(self, config: Config) -> Backend:
    if not config.fp8:
      return self.fallback
    if self.fp8_fallback is None:
      raise NotImplementedError("the Hopper backend was given no fp8_fallback for "
                                "quantization='int8_fp8' (its quantization pass and "
                                "pre-pass)")
    return self.fp8_fallback

  def _runs_forward(self, masks: Masks, config: Config, q_len: int, kv_len: int,
                    head_dim: int, dtype) -> bool:
    return self.mosaic_forward and forward.takes(masks, config, q_len, kv_len, head_dim,
                                                 dtype)

  def _runs_backward(self, masks: Masks, config: Config, q_len: int, kv_len: int,
                     head_dim: int, dtype) -> bool:
    launch = self._launches(config)
    return all(backward_takes(masks, config, q_len, kv_len, head_dim, dtype, tuning)
               for tuning in (launch.dkdv, launch.dq))

  def _runs(self, q, k, masks: Masks, config: Config) -> tuple[bool, bool]:
    """Whether the Mosaic forward and backward run for these inputs, by the
    rules `forward` and `backward` follow (with q's dtype, the op's output's
    and V's)."""
    case = (masks, config, q.shape[1], k.shape[1], q.shape[-1], q.dtype)
    return self._runs_forward(*case), self._runs_backward(*case)

  def layouts(self, q, k, masks: Masks, config: Config) -> Layouts:
    """REGISTER_B for each direction whose Mosaic kernels will run, TOKENS
    for the fallback's."""
    pick = lambda mosaic: TransposedLayout.REGISTER_B if mosaic else TransposedLayout.TOKENS
    runs_forward, runs_backward = self._runs(q, k, masks, config)
    return Layouts(forward=pick(runs_forward), backward=pick(runs_backward))

  def reference_numerics(self, q, k, masks: Masks, config: Config) -> Numerics:
    """`MOSAIC_NUMERICS` for each direction whose Mosaic kernels will run,
    the fallback's for the rest."""
    numerics = self._fallback(config).reference_numerics(q, k, masks, config)
    runs_forward, runs_backward = self._runs(q, k, masks, config)
    if runs_forward:
      numerics = dataclasses.replace(numerics, p_block=MOSAIC_NUMERICS.p_block,
                                     unsigned_p=MOSAIC_NUMERICS.unsigned_p)
    if runs_backward:
      numerics = dataclasses.replace(numerics, unsigned_p_t=MOSAIC_NUMERICS.unsigned_p_t)
    return numerics

  def quantize(self, q, k, v, k_mean, config: Config, *, for_backward: bool = True,
               layouts: Layouts = Layouts()) -> QuantizedQKV:
    """`fallback`'s pass where the Mosaic forward runs (in either mode: the
    Triton pass writes the FP8 mode's E4M3 V too), else the mode's fallback's."""
    # V8^T is REGISTER_B exactly where the Mosaic forward runs (`layouts`).
    runs_mosaic = layouts.forward is TransposedLayout.REGISTER_B
    return (self.fallback if runs_mosaic else self._fallback(config)).quantize(
        q, k, v, k_mean, config, for_backward=for_backward, layouts=layouts)

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    q_len, head_dim = qkv.q8.shape[2:]
    if not self._runs_forward(masks, config, q_len, qkv.k8.shape[2], head_dim, out_dtype):
      return self._fallback(config).forward(qkv, masks, config, out_dtype)
    return forward.forward_mosaic(qkv, masks, config, out_dtype, self._launches(config).forward)

  def _backward_stages(self, qkv: QuantizedQKV, v, masks: Masks, config: Config) -> Backend:
    """Who runs the stages between the forward and the backward's kernels
    (pre-pass, saturated rows, FP8 operands): `fallback` where the Mosaic
    backward runs (in either mode: the Triton kernels' passes), else the
    mode's fallback."""
    q_len, head_dim = qkv.q8.shape[2:]
    if self._runs_backward(masks, config, q_len, qkv.k8.shape[2], head_dim, v.dtype):
      return self.fallback
    return self._fallback(config)

  def prepass(self, o, do, config: Config,
              layout: TransposedLayout = TransposedLayout.TOKENS) -> Prepass:
    # The layout says where the pre-pass's dO8^T goes: REGISTER_B exactly
    # where the Mosaic backward runs (`layouts`).
    runs_mosaic = layout is TransposedLayout.REGISTER_B
    return (self.fallback if runs_mosaic else self._fallback(config)).prepass(
        o, do, config, layout)

  def saturated_rows(self, qkv: QuantizedQKV, v, lse, do, delta, masks: Masks,
                     config: Config):
    return self._backward_stages(qkv, v, masks, config).saturated_rows(
        qkv, v, lse, do, delta, masks, config)

  def fp8_operands(self, qkv: QuantizedQKV, v, prepass: Prepass, row_max, lse,
                   masks: Masks, config: Config) -> Fp8Operands:
    return self._backward_stages(qkv, v, masks, config).fp8_operands(
        qkv, v, prepass, row_max, lse, masks, config)

  def backward(self, qkv: QuantizedQKV, v, lse, do, prepass: Prepass, masks: Masks,
               config: Config):
    q_len, head_dim = qkv.q8.shape[2:]
    if not self._runs_backward(masks, config, q_len, qkv.k8.shape[2], head_dim, v.dtype):
      return self._fallback(config).backward(qkv, v, lse, do, prepass, masks, config)
    check_layout("do8_t", prepass.do8_t, TransposedLayout.REGISTER_B)
    launch = self._launches(config)
    if launch.dq_product(config, *qkv.q8.shape[:3], qkv.k8.shape[2]):
      dk, dv, ds8 = backward_dkdv_mosaic(qkv, v, lse, prepass.delta, do, prepass.do8_t,
                                         prepass.do_scale, masks, config, launch.dkdv,
                                         fp8=prepass.fp8, write_ds=True)
      return backward_dq_product(ds8, prepass.fp8, config, do.dtype), dk, dv
    dk, dv = backward_dkdv_mosaic(qkv, v, lse, prepass.delta, do, prepass.do8_t,
                                  prepass.do_scale, masks, config, launch.dkdv, fp8=prepass.fp8)
    dq = backward_dq_mosaic(qkv, v, lse, prepass.delta, do, masks, config, launch.dq,
                            fp8=prepass.fp8)
    return dq, dk, dv

