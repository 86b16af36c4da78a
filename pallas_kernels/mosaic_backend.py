"""The Hopper backend: Mosaic GPU kernels where they apply, portable ones elsewhere.

The quantization pass and the backward pre-pass are the portable kernels' (the
same int8 tensors feed both paths); the forward and the dK/dV and dQ kernels
run in Mosaic GPU when `mosaic_forward.supports` takes the case (no masks but
causality, no Q-smoothing, D in {64, 128}, 64 x 64 blocks, sequence lengths
multiples of 64, Tq == Tk when causal) and fall back to the Triton kernels
otherwise, call by call. With `interpret` launches (no GPU) the Mosaic kernels
run in Mosaic GPU interpret mode and the portable ones in Pallas interpret mode.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic_forward
from pallas_kernels.backend import PallasBackend
from pallas_kernels.backward_prepass import backward_prepass
from pallas_kernels.mosaic_backward import (MosaicBackwardLaunch, backward_dkdv_mosaic,
                                            backward_dq_mosaic)
from pallas_kernels.mosaic_forward import MosaicLaunch, forward_mosaic
from pallas_kernels.types import Config, Masks, QuantizedQKV


def takes(qkv: QuantizedQKV, masks: Masks, config: Config) -> bool:
  """Whether the Mosaic kernels run this case."""
  q_len, kv_len = qkv.q8.shape[2], qkv.k8.shape[2]
  block = mosaic_forward.BLOCK
  return (mosaic_forward.supports(masks, config, qkv.q8.shape[-1])
          and q_len % block == 0 and kv_len % block == 0
          and (not config.causal or q_len == kv_len))


@dataclasses.dataclass(frozen=True)
class MosaicBackend(PallasBackend):
  """SageBwd on Hopper (sm_90): Mosaic GPU forward and backward kernels."""

  forward_mosaic: MosaicLaunch = MosaicLaunch()
  backward_mosaic: MosaicBackwardLaunch = MosaicBackwardLaunch()

  @classmethod
  def tuned(cls, *, causal: bool, interpret: bool = False) -> "MosaicBackend":
    portable = PallasBackend.tuned(causal=causal, interpret=interpret)
    return cls(portable.forward_launch, portable.backward_launch)

  def _mosaic_mode(self):
    # Only around the Mosaic kernels: the interpreter's mode would also take
    # the portable pallas_calls, which it cannot run.
    if self.forward_launch.interpret:
      return plgpu.force_gpu_interpret_mode()
    return contextlib.nullcontext()

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    if not takes(qkv, masks, config):
      return super().forward(qkv, masks, config, out_dtype)
    with self._mosaic_mode():
      return forward_mosaic(qkv, masks, config, out_dtype, self.forward_mosaic)

  def backward(self, qkv: QuantizedQKV, v, o, lse, do, masks: Masks, config: Config):
    if not takes(qkv, masks, config):
      return super().backward(qkv, v, o, lse, do, masks, config)
    delta, do8_t, do_scale = backward_prepass(o, do, block_q=config.block_q,
                                              launch=self.backward_launch)
    with self._mosaic_mode():
      dk, dv = backward_dkdv_mosaic(qkv, v, lse, delta, do, do8_t, do_scale, masks, config,
                                    self.backward_mosaic)
      dq = backward_dq_mosaic(qkv, v, lse, delta, do, masks, config, self.backward_mosaic)
    return dq, dk, dv
