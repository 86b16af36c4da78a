"""The Hopper backend: Mosaic GPU kernels where they apply, portable ones elsewhere.

The quantization pass and the backward pre-pass are the portable kernels' (the
same int8 tensors feed both paths); the dK/dV and dQ kernels (and the
forward, when `forward_mosaic` asks for it) run in Mosaic GPU when `takes`
accepts the case (no masks but causality, no Q-smoothing, D in {64, 128},
64 x 64 blocks, sequence lengths multiples of 64, Tq == Tk when causal, 16-bit
inputs) and fall back to the Triton kernels otherwise, call by call. The Mosaic
kernels compile for an sm_90 GPU only (their tests run them in Mosaic GPU
interpret mode one by one: tests/test_mosaic*.py).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import mosaic_forward
from pallas_kernels.backend import PallasBackend
from pallas_kernels.mosaic_backward import (MosaicBackwardLaunch, backward_dkdv_mosaic,
                                            backward_dq_mosaic)
from pallas_kernels.mosaic_forward import MosaicLaunch, forward_mosaic
from pallas_kernels.types import Config, Masks, QuantizedQKV


def takes(qkv: QuantizedQKV, masks: Masks, config: Config, dtype) -> bool:
  """Whether the Mosaic kernels run this case (`dtype`: V's, which the
  backward's dO.V^T wgmma takes as is)."""
  q_len, kv_len = qkv.q8.shape[2], qkv.k8.shape[2]
  block = mosaic_forward.BLOCK
  return (mosaic_forward.supports(masks, config, qkv.q8.shape[-1])
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and q_len % block == 0 and kv_len % block == 0
          and (not config.causal or q_len == kv_len))


@dataclasses.dataclass(frozen=True)
class MosaicBackend(PallasBackend):
  """SageBwd on Hopper (sm_90): Mosaic GPU kernels, each where it is faster.

  `forward_mosaic=None` keeps the portable forward (what `tuned` picks); the
  backward always runs in Mosaic GPU when `takes`.
  """

  forward_mosaic: MosaicLaunch | None = MosaicLaunch()
  backward_mosaic: MosaicBackwardLaunch = MosaicBackwardLaunch()

  @classmethod
  def tuned(cls, *, causal: bool, interpret: bool = False) -> "MosaicBackend":
    """Launches measured fastest on an H200 (benchmarks/mosaic_backward.py,
    breakdown.py, attention.py; B=4, T=4096, H=16, D=128): the backward in
    Mosaic GPU with two compute warpgroups and the fp32 bit tricks (dK/dV + dQ
    4.44 ms of kernel time against the portable 5.57, causal 2.98 against
    3.13); the portable forward,
    which since it converts its int32 products by instruction is at least as
    fast as the Mosaic one everywhere measured (op forward TOPS, portable
    against Mosaic: causal 234 against 209, at T=16k 308 against 308; not
    causal 306 against 301)."""
    portable = PallasBackend.tuned(causal=causal, interpret=interpret)
    return cls(portable.forward_launch, portable.backward_launch, forward_mosaic=None,
               backward_mosaic=MosaicBackwardLaunch(warp_specialized=True, bit_tricks=True))

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    if self.forward_mosaic is None or not takes(qkv, masks, config, out_dtype):
      return super().forward(qkv, masks, config, out_dtype)
    return forward_mosaic(qkv, masks, config, out_dtype, self.forward_mosaic)

  def gradients(self, qkv: QuantizedQKV, v, lse, delta, do, do8_t, do_scale, masks: Masks,
                config: Config):
    if not takes(qkv, masks, config, v.dtype):
      return super().gradients(qkv, v, lse, delta, do, do8_t, do_scale, masks, config)
    dk, dv = backward_dkdv_mosaic(qkv, v, lse, delta, do, do8_t, do_scale, masks, config,
                                  self.backward_mosaic)
    dq = backward_dq_mosaic(qkv, v, lse, delta, do, masks, config, self.backward_mosaic)
    return dq, dk, dv
