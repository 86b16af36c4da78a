"""The Triton backend: the kernels of this folder behind the `Backend` interface."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_kernels.jax_triton.backward_dkdv import backward_dkdv
from pallas_kernels.jax_triton.backward_dq import backward_dq
from pallas_kernels.jax_triton.backward_prepass import backward_prepass
from pallas_kernels.fp8_operands import fp8_operands as xla_fp8_operands
from pallas_kernels.jax_triton.forward import forward
from pallas_kernels.jax_triton.fp8_operands import fp8_operands as triton_fp8_operands
from pallas_kernels.jax_triton.launch import LaunchConfig
from pallas_kernels.jax_triton.quantize import quantize_qkv
from pallas_kernels.jax_triton.saturated_rows import saturated_rows
from pallas_kernels.layouts import check_layout, layout_of
from pallas_kernels.types import (Config, Fp8Operands, Layouts, Masks, Numerics, Prepass,
                                  QuantizedQKV, TransposedLayout)

# Tiles up to 128: every int8 product then stays below 2**22 in magnitude,
# which the exact int32 -> fp32 reading of the accumulators needs (tiles.py).
MAX_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class TritonBackend:
  """SageBwd on Triton kernels called through jax_triton (`interpret`: Triton's
  interpreter on the CPU).

  P and the backward's P^T are quantized as `NUMERICS` says (0..255 per row
  of each key block, V's scale folded in; 0..255 per key row); the rest is
  the reference's arithmetic. `forward_launch` runs the forward,
  `dq_launch` the backward pre-pass, the saturated rows, the FP8 operands and
  dQ, `dkdv_launch` dK/dV, `quantize_launch` the quantization pass (which
  the Hopper backend borrows).
  """

  forward_launch: LaunchConfig = LaunchConfig(num_stages=3)
  dq_launch: LaunchConfig = LaunchConfig()
  dkdv_launch: LaunchConfig = LaunchConfig(num_warps=8, num_stages=3, tile_rows=128)
  quantize_launch: LaunchConfig = LaunchConfig()

  NUMERICS: ClassVar[Numerics] = Numerics(unsigned_p=True, unsigned_p_t=True)

  @classmethod
  def tuned(cls, *, causal: bool, interpret: bool = False) -> "TritonBackend":
    """The default launches (interpreted or not), as `python -m benchmarks.tune`
    and the causal forward's register count chose them on an H200
    (docs/performance-log.md): the forward at 3 pipeline stages, 2 when causal
    (the causal forward keeps three programs per SM only at 2), dK/dV at 3,
    dQ at 2; dK/dV 128 keys at 8 warps: each warpgroup keeps whole 64-key
    rows (64 keys at 8 warps split every tile's columns between the
    warpgroups) and the two share each query block's loads."""
    default = cls()
    forward_launch = default.forward_launch
    if causal:
      forward_launch = dataclasses.replace(forward_launch, num_stages=2)
    return cls(*(dataclasses.replace(launch, interpret=interpret) for launch in
                 (forward_launch, default.dq_launch, default.dkdv_launch,
                  default.quantize_launch)))

  def layouts(self, q, k, masks: Masks, config: Config) -> Layouts:
    """Its kernels read every transposed tensor TOKENS."""
    del q, k, masks, config
    return Layouts()

  def reference_numerics(self, q, k, masks: Masks, config: Config) -> Numerics:
    """Every kernel here quantizes P and P^T as `NUMERICS` says."""
    del q, k, masks, config
    return self.NUMERICS

  def quantize(self, q, k, v, k_mean, config: Config, *, for_backward: bool = True,
               layouts: Layouts = Layouts()) -> QuantizedQKV:
    """Either mode (the Hopper backend runs it for quantization='int8_fp8'
    where its forward runs); the kernels after it refuse
    quantization='int8_fp8'."""
    _check_blocks(config)
    return quantize_qkv(q, k, v, k_mean, config, self.quantize_launch, for_backward, layouts)

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    _check_config(config)
    return *forward(qkv, masks, config, out_dtype, self.forward_launch), None

  def prepass(self, o, do, config: Config,
              layout: TransposedLayout = TransposedLayout.TOKENS) -> Prepass:
    """One kernel (`backward_prepass`); the Mosaic backend borrows it."""
    return backward_prepass(o, do, block_q=config.block_q, launch=self.dq_launch,
                            layout=layout, fp8=config.fp8)

  def saturated_rows(self, qkv: QuantizedQKV, v, lse, do, delta, masks: Masks,
                     config: Config):
    """One kernel (`saturated_rows`); the Mosaic backend borrows it (in either
    mode: the rows' scores and dP do not depend on it)."""
    _check_blocks(config)
    return saturated_rows(qkv, v, lse, do, delta, masks, config, self.dq_launch)

  def fp8_operands(self, qkv: QuantizedQKV, v, prepass: Prepass, row_max, lse,
                   masks: Masks, config: Config) -> Fp8Operands:
    """One kernel (`jax_triton.fp8_operands`) after this backend's
    quantization pass, which formed the key side (`QuantizedQKV.fp8_keys`),
    without masks; XLA's pass with them, with `Config.causal_exact` (K' less
    its first block's mean, the bounds over what each row sees) or after
    another backend's quantization. The Mosaic backend borrows it."""
    args = (qkv, v, prepass, row_max, lse, masks, config, layout_of(prepass.do8_t))
    if masks.q_ids is not None or config.causal_exact or qkv.fp8_keys is None:
      return xla_fp8_operands(*args)
    return triton_fp8_operands(*args, self.dq_launch)

  def backward(self, qkv: QuantizedQKV, v, lse, do, prepass: Prepass, masks: Masks,
               config: Config):
    _check_config(config)
    for name in ("q8_t", "k8_t"):
      check_layout(name, getattr(qkv, name), TransposedLayout.TOKENS)
    check_layout("do8_t", prepass.do8_t, TransposedLayout.TOKENS)
    dk, dv = backward_dkdv(qkv, v, lse, prepass.delta, do, prepass.do8_t, prepass.do_scale,
                           masks, config, self.dkdv_launch, prepass.do_start)
    dq = backward_dq(qkv, v, lse, prepass.delta, do, masks, config, self.dq_launch)
    return dq, dk, dv


def _check_config(config: Config) -> None:
  if config.fp8:
    raise NotImplementedError(
        "the Triton forward and backward kernels have no quantization='int8_fp8' (FP8 "
        "products) yet; implementation='reference' computes it in plain JAX")
  _check_blocks(config)


def _check_blocks(config: Config) -> None:
  if max(config.block_q, config.block_kv) > MAX_BLOCK:
    raise NotImplementedError(
        f"block_q={config.block_q}, block_kv={config.block_kv}: the Triton kernels take "
        f"tiles up to {MAX_BLOCK}")
