"""Model FLOPs utilization (MFU): the model's training FLOPs per second over
the devices' peak.

The model's FLOPs per token count its matrix products, forward and backward
(3x the forward's): 6 per weight of the blocks and the output layer (the
embedding lookup is no product), plus causal attention's Q.K^T and P.V, 6 x
seq_len x dim per layer. They do not change with the attention's
implementation: MFU says how much of the GPU's dense BF16 peak the same
model reaches, whatever runs its attention (INT8 products included), as
tokens/s would.
"""

from __future__ import annotations

from train.config import Config, params_besides_embeddings

# Dense BF16 peak TFLOP/s per device, by a substring of jax's device_kind
# (first match; vendors' datasheets, SXM parts).
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
               ("L40S", 362.0), ("L4", 121.0), ("RTX 4090", 165.0), ("A10", 125.0))


def flops_per_token(cfg: Config) -> float:
  """Training FLOPs per token of `cfg`'s model (vocab_size resolved)."""
  weights = params_besides_embeddings(cfg) + cfg.vocab_size * cfg.dim  # + the output layer
  return 6.0 * weights + 6.0 * cfg.n_layers * cfg.seq_len * cfg.dim


def device_peak_tflops(device_kind: str) -> float | None:
  """The dense BF16 peak of one device of this kind, None if unknown."""
  return next((peak for name, peak in PEAK_TFLOPS if name in device_kind), None)


def peak_flops(devices, override_tflops: float | None = None) -> float | None:
  """Peak FLOP/s of `devices` together: `override_tflops` per device
  (--peak-tflops), else the table's for their kind; None if unknown (CPUs)."""
  per_device = override_tflops or device_peak_tflops(devices[0].device_kind)
  return None if per_device is None else per_device * 1e12 * len(devices)
