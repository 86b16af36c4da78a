"""The Pallas backend: the kernels behind the `Backend` interface."""

from __future__ import annotations

import dataclasses

from pallas_kernels.backward_dkdv import backward_dkdv
from pallas_kernels.backward_dq import backward_dq
from pallas_kernels.backward_prepass import backward_prepass
from pallas_kernels.common import LaunchConfig
from pallas_kernels.forward import forward
from pallas_kernels.quantize import quantize_qkv
from pallas_kernels.types import Config, Masks, QuantizedQKV


@dataclasses.dataclass(frozen=True)
class PallasBackend:
  """SageBwd on Pallas kernels (Triton lowering; `interpret` runs them on CPU)."""

  launch: LaunchConfig = LaunchConfig()

  def quantize(self, q, k, v, k_mean, config: Config) -> QuantizedQKV:
    return quantize_qkv(q, k, v, k_mean, config, self.launch)

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    return forward(qkv, masks, config, out_dtype, self.launch)

  def backward(self, qkv: QuantizedQKV, v, o, lse, do, masks: Masks, config: Config):
    delta, do8_t, do_scale = backward_prepass(o, do, block_q=config.block_q,
                                              launch=self.launch)
    dk, dv = backward_dkdv(qkv, v, lse, delta, do, do8_t, do_scale, masks, config,
                           self.launch)
    dq = backward_dq(qkv, v, lse, delta, do, masks, config, self.launch)
    return dq, dk, dv
