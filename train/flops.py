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


def measured_flops(dtype: str = "bfloat16", n: int = 1024, repeats: int = 3) -> float:
  """FLOP/s of jax's default device on an n x n matrix product in `dtype`,
  the best of `repeats` timed runs (a second or less on a CPU, compile
  included): more than a training step reaches, whose other work is slower."""
  import time

  import jax
  import jax.numpy as jnp
  x = jnp.ones((n, n), dtype)
  product = jax.jit(lambda a: a @ a)
  product(x).block_until_ready()  # compiles
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    product(x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n**3 / best


def duration(seconds: float) -> str:
  """`seconds` in the largest unit that keeps it at 1 or more: "40 s",
  "27 minutes", "3.6 hours", "2.1 days", "4.1 years"."""
  units = (("years", 365 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60), ("s", 1))
  for unit, size in units:
    if seconds >= size or unit == "s":
      value = seconds / size
      return f"{value:.2g} {unit}" if value < 10 else f"{value:.0f} {unit}"
  raise AssertionError("unreachable")


def cpu_refusal(cfg: Config, preset: str, flops_per_s: float) -> str:
  """The line with which `python -m train` refuses a GPU preset where jax sees
  no GPU: one step's FLOPs at the measured `flops_per_s` (a matrix
  product's rate in the compute dtype, so the time is a lower bound), and
  the flag that starts it anyway. `cfg.vocab_size` None counts bytes (256)."""
  vocab = cfg.vocab_size or 256
  cfg = Config(**{**cfg.__dict__, "vocab_size": vocab})
  params = params_besides_embeddings(cfg) + (1 if cfg.tie_embeddings else 2) * vocab * cfg.dim
  step = flops_per_token(cfg) * cfg.tokens_per_step
  return (f"--preset {preset} is sized for GPUs and jax sees no GPU here: one step "
          f"({cfg.tokens_per_step:,} tokens through {params / 1e6:.0f}M parameters, "
          f"{step:.1e} FLOPs) would take at least {duration(step / flops_per_s)} at this "
          f"CPU's measured {flops_per_s / 1e9:.0f} GFLOP/s ({cfg.dtype} matrix products), "
          f"the run's {cfg.steps:,} steps {duration(cfg.steps * step / flops_per_s)}; "
          f"use --preset tiny, or add --allow-cpu to start it anyway")
