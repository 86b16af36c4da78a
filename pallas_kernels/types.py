"""What flows between the stages: quantize -> forward -> residuals -> backward.

Every backend (the Triton and Mosaic kernels, the pure-JAX reference) consumes and
produces these same containers, so one backend's quantized tensors can be fed
to another's forward and compared exactly.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax


@dataclasses.dataclass(frozen=True)
class Config:
  """Static options of one attention call (hashable: a jit static argument).

  `scale` multiplies Q.K^T. Sequences are already padded to multiples of
  `block_q` (queries) and `block_kv` (keys) when a backend sees them.
  `ds_precision`: "int8" (dQ = dS.K and dK = dS^T.Q in INT8) or "bf16"
  (both in the inputs' dtype with fp32 accumulation, like dP, from
  `QuantizedQKV.q16` and `k16`; Q is then quantized per token,
  `q_per_token`). `window` (left, right): query i sees only
  keys i - left .. i + right (jax.nn's `local_window_size`), besides
  causality.
  """

  scale: float
  causal: bool
  smooth_q: bool
  block_q: int
  block_kv: int
  ds_precision: str = "int8"
  window: tuple[int, int] | None = None

  @property
  def banded(self) -> bool:
    """Whether causality or a window limits the keys a query sees, so that
    the kernels skip blocks (`causal_blocks`)."""
    return self.causal or self.window is not None

  @property
  def q_per_token(self) -> bool:
    """Whether Q's int8 scale is per token rather than per `block_q` rows.

    A row scale factors out of Q.K^T (Q is its first operand) but not out of
    the int8 dS^T.Q, which contracts over Q's rows; with 16-bit dS products
    Q8 enters no other product, so the finer scale costs at most a multiply
    per score (where Q's rows are a tile's columns) and lowers the error of
    S, hence of P and every gradient.
    """
    return self.ds_precision == "bf16"


class Masks(NamedTuple):
  """Which keys each query may see, besides causality: per-token ids.

  A query sees a key only when their ids are equal. Segment ids, sequence
  lengths and block padding all fold into these two (B, T) int32 arrays
  (tokens past a length get a sentinel id that matches nothing), so a kernel
  tests one equality per score. Both are None when every pair is allowed.
  """

  q_ids: jax.Array | None = None
  kv_ids: jax.Array | None = None


class QuantizedQKV(NamedTuple):
  """Output of the quantization pass; head-major layout (B, H, T, D).

  Q is quantized after folding in `scale * log2(e)` (scores are base-2
  logits) and, with Q-smoothing, after subtracting each block's mean
  `q_mean`. K is quantized after K-smoothing. The `_t` arrays are the same
  int8 values stored (B, H, D, T): the int8 dots that contract over tokens
  need their second operand in that layout. Scales are stored per token
  (repeated over the block's rows) so kernels load them as row vectors.
  """

  q8: jax.Array  # (B, H, Tq, D) int8
  # The transposed layouts feed the backward only: None in a forward that no
  # backward follows (`Backend.quantize`'s for_backward=False).
  q8_t: jax.Array | None  # (B, H, D, Tq) int8; None with `Config.q_per_token` (unused)
  q_scale: jax.Array  # (B, H, Tq) fp32: each row's, or its block's (`Config.q_per_token`)
  q_mean: jax.Array | None  # (B, H, Tq // block_q, D) fp32, Q-smoothing only
  k8: jax.Array  # (B, Hkv, Tk, D) int8
  k8_t: jax.Array | None  # (B, Hkv, D, Tk) int8
  k_scale: jax.Array  # (B, Hkv, Tk) fp32
  v8_t: jax.Array  # (B, Hkv, D, Tk) int8
  v_scale: jax.Array  # (B, Hkv, Tk) fp32
  # ds_precision="bf16" only: Q and the smoothed K in the inputs' dtype and
  # layout (B, T, H, D), the second operands of dS.K and dS^T.Q.
  q16: jax.Array | None = None
  k16: jax.Array | None = None


class Backend(Protocol):
  """One implementation of SageBwd's stages. Inputs are (B, T, H, D)."""

  def quantize(self, q: jax.Array, k: jax.Array, v: jax.Array,
               k_mean: jax.Array | None, config: Config, *,
               for_backward: bool = True) -> QuantizedQKV:
    """psi of Q (scaled, optionally smoothed), K - k_mean and V, per block;
    the backward's transposed layouts only `for_backward`."""
    ...

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config,
              out_dtype) -> tuple[jax.Array, jax.Array]:
    """O (B, Tq, H, D) and the base-2 log-sum-exp `lse` (B, H, Tq)."""
    ...

  def backward(self, qkv: QuantizedQKV, v: jax.Array, o: jax.Array,
               lse: jax.Array, do: jax.Array, masks: Masks,
               config: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dQ, dK, dV, (B, T, H, D), from the saved residuals and dO.

    Any float dtype: the op casts them to the inputs' dtype.
    """
    ...


class PrepassBackend(Backend, Protocol):
  """A backend whose backward pre-pass other backends can borrow."""

  def prepass(self, o: jax.Array, do: jax.Array,
              config: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Delta = rowsum(dO * O) (B, H, Tq) fp32; psi(dO) per `block_q` rows,
    stored transposed (B, H, D, Tq) int8, with its per-token scales (B, H, Tq)."""
    ...
