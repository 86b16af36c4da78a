"""The Pallas backend: the kernels behind the `Backend` interface."""

from __future__ import annotations

import dataclasses

from pallas_kernels.triton.backward_dkdv import backward_dkdv
from pallas_kernels.triton.backward_dq import backward_dq
from pallas_kernels.triton.backward_prepass import backward_prepass
from pallas_kernels.triton.common import LaunchConfig
from pallas_kernels.triton.forward import forward
from pallas_kernels.triton.quantize import quantize_qkv
from pallas_kernels import numerics as nm
from pallas_kernels.types import Config, Masks, QuantizedQKV


@dataclasses.dataclass(frozen=True)
class PallasBackend:
  """SageBwd on Pallas kernels (Triton lowering; `interpret` runs them on CPU).

  The forward (with its quantization pass) and the backward kernels are
  launched with their own warps and pipeline stages.
  """

  forward_launch: LaunchConfig = LaunchConfig()
  backward_launch: LaunchConfig = LaunchConfig()

  @classmethod
  def tuned(cls, *, causal: bool, interpret: bool = False) -> "PallasBackend":
    """Launch settings measured fastest by `python -m benchmarks.tune` on an
    H200 (B=4, T=4096, H=16, D=128, 64 x 64 tiles): 4 warps everywhere;
    forward 2 pipeline stages (3 when causal), backward 2."""
    return cls(LaunchConfig(interpret=interpret, num_warps=4, num_stages=3 if causal else 2),
               LaunchConfig(interpret=interpret, num_warps=4, num_stages=2))

  def quantize(self, q, k, v, k_mean, config: Config, *,
               for_backward: bool = True) -> QuantizedQKV:
    return quantize_qkv(q, k, v, k_mean, config, self.forward_launch, for_backward)

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    return forward(qkv, masks, config, out_dtype, self.forward_launch)

  def prepass(self, o, do, config: Config):
    """Delta = rowsum(dO * O) and psi(dO) per block_q rows, stored (B, H, D, T)."""
    delta, do8_t, do_scale = backward_prepass(o, do, block_q=config.block_q,
                                              launch=self.backward_launch)
    if config.banded:  # a NaN dO block reaches keys it never meets (reference.py says why)
      do_scale = nm.spread_nan(do_scale)
    return delta, do8_t, do_scale

  def backward(self, qkv: QuantizedQKV, v, o, lse, do, masks: Masks, config: Config):
    delta, do8_t, do_scale = self.prepass(o, do, config)
    dk, dv = backward_dkdv(qkv, v, lse, delta, do, do8_t, do_scale, masks, config,
                           self.backward_launch)
    dq = backward_dq(qkv, v, lse, delta, do, masks, config, self.backward_launch)
    return dq, dk, dv
