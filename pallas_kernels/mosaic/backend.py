"""The Hopper backend: Mosaic GPU kernels where they take the case, another
backend's (`fallback`) everywhere else.

The quantization pass and the backward pre-pass are the fallback's (the same
int8 tensors feed both paths). The forward runs in Mosaic GPU when
`forward.takes` accepts the case (no masks but causality, no Q-smoothing,
ds_precision="int8", whose Q scales are per block, D in
{64, 128}, 64 x 64 blocks, whole 128-key steps, Tq == Tk when causal, 16-bit
output), quantizing P as `ReferenceBackend(p_block=128, unsigned_p=True)`
does; the dK/dV and dQ kernels when `backward_takes` accepts it (the same, with
queries and keys in whole CTA tiles of 128), quantizing P^T as
`ReferenceBackend(unsigned_p_t=True)` does (`reference.HOPPER_NUMERICS`: both).
Anything else runs in the fallback, call by call. The Mosaic kernels compile
for an sm_90 GPU only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.mosaic import common
from pallas_kernels.mosaic.backward_common import BackwardTuning
from pallas_kernels.mosaic.backward_dkdv import backward_dkdv_mosaic
from pallas_kernels.mosaic.backward_dq import backward_dq_mosaic
from pallas_kernels.mosaic import forward
from pallas_kernels.types import Config, Masks, PrepassBackend, QuantizedQKV


def backward_takes(qkv: QuantizedQKV, masks: Masks, config: Config, dtype,
                   tuning: BackwardTuning = BackwardTuning()) -> bool:
  """Whether the Mosaic backward kernels run this case (`dtype`: V's, which the
  backward's dO.V^T wgmma takes as is). Their dS products are INT8 only:
  ds_precision="bf16" runs in the fallback."""
  q_len, kv_len = qkv.q8.shape[2], qkv.k8.shape[2]
  cta_rows = tuning.compute_wgs * common.BLOCK
  return (common.supports(masks, config, qkv.q8.shape[-1])
          and config.ds_precision == "int8" and config.window is None
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and q_len % cta_rows == 0 and kv_len % cta_rows == 0
          and (not config.causal or q_len == kv_len))


@dataclasses.dataclass(frozen=True)
class MosaicBackend:
  """SageBwd on Hopper (sm_90): Mosaic GPU kernels, each where it is faster.

  `fallback` runs the quantization pass, the backward pre-pass and every case
  `forward.takes` or `backward_takes` refuses (the op passes the portable
  backend). `forward_mosaic=None` keeps the fallback's forward.
  """

  fallback: PrepassBackend
  forward_mosaic: forward.ForwardTuning | None = forward.ForwardTuning()
  dkdv_tuning: BackwardTuning = BackwardTuning()
  dq_tuning: BackwardTuning = BackwardTuning()

  @classmethod
  def tuned(cls, fallback: PrepassBackend) -> "MosaicBackend":
    """The launches `python -m benchmarks.attention` and
    `python -m benchmarks.mosaic_backward` measured fastest on an H200
    (docs/performance.md)."""
    return cls(fallback, forward_mosaic=forward.ForwardTuning(),
               dkdv_tuning=BackwardTuning(), dq_tuning=BackwardTuning(schedule_barrier=False))

  def quantize(self, q, k, v, k_mean, config: Config, *,
               for_backward: bool = True) -> QuantizedQKV:
    return self.fallback.quantize(q, k, v, k_mean, config, for_backward=for_backward)

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    q_len, head_dim = qkv.q8.shape[2:]
    if self.forward_mosaic is None or not forward.takes(masks, config, q_len, qkv.k8.shape[2],
                                                        head_dim, out_dtype):
      return self.fallback.forward(qkv, masks, config, out_dtype)
    return forward.forward_mosaic(qkv, masks, config, out_dtype, self.forward_mosaic)

  def backward(self, qkv: QuantizedQKV, v, o, lse, do, masks: Masks, config: Config):
    if not all(backward_takes(qkv, masks, config, v.dtype, tuning)
               for tuning in (self.dkdv_tuning, self.dq_tuning)):
      return self.fallback.backward(qkv, v, o, lse, do, masks, config)
    delta, do8_t, do_scale = self.fallback.prepass(o, do, config)
    dk, dv = backward_dkdv_mosaic(qkv, v, lse, delta, do, do8_t, do_scale, masks, config,
                                  self.dkdv_tuning)
    dq = backward_dq_mosaic(qkv, v, lse, delta, do, masks, config, self.dq_tuning)
    return dq, dk, dv
