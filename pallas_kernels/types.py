"""What flows between the stages: quantize -> forward -> residuals -> backward.

Every backend (the Triton and Mosaic kernels, the pure-JAX reference) consumes and
produces these same containers, so one backend's quantized tensors can be fed
to another's forward (in the layouts it reads: `Layouts`) and compared exactly.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal, NamedTuple, Protocol, get_args

import jax

# The precision of the backward's dS products, dQ = dS.K and dK = dS^T.Q.
DsPrecision = Literal["int8", "bf16"]
DS_PRECISIONS: tuple[DsPrecision, ...] = get_args(DsPrecision)
# The numerics mode: "int8", the paper's (six of seven products in INT8), or
# "int8_fp8": Q.K^T in INT8, the products whose 8-bit operand is a
# probability or a gradient (P.V, P^T.dO, dS.K, dS^T.Q) in FP8 E4M3 with
# scales known before the loop (docs/algorithm.md).
Quantization = Literal["int8", "int8_fp8"]
QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)


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
  causality. `quantization`: the numerics mode (`Quantization`); with
  "int8_fp8" and ds_precision="bf16", dS.K and dS^T.Q run in 16 bits and
  P.V and P^T.dO in FP8.
  `causal_exact`: no output row, nor its dQ, depends on a key or value after
  the last one it sees (docs/algorithm.md, "Statistics over what each row
  sees"): K-smoothing by the first `block_kv` keys' mean m, with the exact
  score q_i . m restored per row in the 8-bit tiles; the tiles that the
  band's right edge crosses (`exact_edges`) in 16 bits; with "int8_fp8", the
  backward's statistics over the keys each row sees. The reference, the Triton kernels (INT8) and
  the Hopper kernels (either mode) implement it; the op sets it only with
  causality or a window (`banded`).
  """

  scale: float
  causal: bool
  smooth_q: bool
  block_q: int
  block_kv: int
  ds_precision: DsPrecision = "int8"
  window: tuple[int, int] | None = None
  quantization: Quantization = "int8"
  causal_exact: bool = False

  @property
  def fp8(self) -> bool:
    """Whether P.V and P^T.dO (and, with INT8 dS, dS.K and dS^T.Q) are FP8."""
    return self.quantization == "int8_fp8"

  @property
  def keeps_qk16(self) -> bool:
    """Whether the backward reads Q and the smoothed K in the inputs' dtype
    (`QuantizedQKV.q16`, `k16`): the 16-bit dS products take them as they
    are, the FP8 ones as the sources of their FP8 copies, and with
    `causal_exact` the 8-bit tiles' q_i . m and the 16-bit edge tiles."""
    return self.ds_precision == "bf16" or self.fp8 or self.causal_exact

  @property
  def exact_edges(self) -> bool:
    """Whether the tiles that the band's right edge crosses (some of whose
    keys come after some of their rows' last visible key) run in 16 bits
    from the unquantized Q, K and V (`causal_exact` with causality or a
    window): no statistic of a key block then reaches a row that cannot see
    all of that block."""
    return self.causal_exact and (self.causal or self.window is not None)

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


class TransposedLayout(enum.Enum):
  """How an int8 tensor stored transposed, channels by tokens, is laid out:
  `QuantizedQKV.q8_t`, `k8_t`, `v8_t` and the pre-pass's `Prepass.do8_t`.
  The int8 products that contract over tokens read their second operand so.

  TOKENS: (B, H, D, T), tokens in order. The portable kernels and the
  reference read it.
  REGISTER_B: (B, H, T // 64, D, 64): each 64-token block one contiguous
  (D, 64) tile, its tokens in `layouts.permute_keys` order within each 16.
  The Mosaic kernels read it: it is the B operand of their wgmmas whose 8-bit
  A operand (P, P^T, dS) comes from registers, whose columns arrive in that
  order (pallas_kernels/mosaic/registers.py), and one TMA copy loads a tile.

  The ranks differ, so an array says which layout it is in
  (`layouts.layout_of`); a kernel refuses the one it does not read.
  """

  TOKENS = "tokens"
  REGISTER_B = "register_b"


@dataclasses.dataclass(frozen=True)
class Layouts:
  """The layouts of one call's transposed int8 tensors: `forward` for V8^T
  (the forward's P.V), `backward` for Q8^T, K8^T and dO8^T (the backward's
  dS^T.Q, dS.K and P^T.dO).

  The contract: a backend picks them (`Backend.layouts`) from the inputs'
  shapes, masks and config by the same rules by which it picks the kernels
  that will run (the Mosaic backend: `forward.takes`, `backward_takes`,
  case by case, else its fallback's kernels, which read TOKENS); the
  quantization pass and the backward pre-pass write each tensor once, in its
  layout, straight from the 16-bit inputs, so no transpose, pad or
  permutation runs between the user's arrays and the kernels. The int8
  values and scales are the same in every layout; only their places differ.
  """

  forward: TransposedLayout = TransposedLayout.TOKENS
  backward: TransposedLayout = TransposedLayout.TOKENS


@dataclasses.dataclass(frozen=True)
class Numerics:
  """How P and P^T are quantized: the one choice in which backends' int8
  arithmetic differs (the rest is `numerics.py`'s, the same everywhere).

  `p_block`: the keys of one step of the forward's online softmax, across
  which each row of P is quantized (None: one key block, `block_kv`);
  `unsigned_p`: P in 0..255, else 0..127. `unsigned_p_t`: the backward's P^T
  per key row in 0..255 (`numerics.unsigned_rows`), else 0..127.

  Each backend declares the numerics of the kernels it runs for a call
  (`Backend.reference_numerics`); the reference takes them as its options,
  so it forms the same int8 tensors as those kernels: the tests' oracle.
  """

  p_block: int | None = None
  unsigned_p: bool = False
  unsigned_p_t: bool = False


class Fp8Keys(NamedTuple):
  """The FP8 backward's key side (`Config.fp8`), which the Triton quantization
  pass forms for a backward while it holds each key and value block
  (`Fp8Operands` takes it from there): K' (the smoothed K rounded to the
  inputs' dtype, `QuantizedQKV.k16`'s values) in E4M3 per block_kv rows,
  transposed (Layouts.backward); its block scales per token (B, Hkv, Tk);
  and each block's largest ||V_j|| (B, Hkv, Tk // block_kv)."""

  k8_t: jax.Array
  k_scale: jax.Array
  v_norm: jax.Array


class QuantizedQKV(NamedTuple):
  """Output of the quantization pass; head-major layout (B, H, T, D).

  Q is quantized after folding in `scale * log2(e)` (scores are base-2
  logits) and, with Q-smoothing, after subtracting each block's mean
  `q_mean`. K is quantized after K-smoothing. The `_t` arrays are the same
  int8 values stored transposed, in a `TransposedLayout` (`Layouts`): the
  int8 dots that contract over tokens need their second operand so. Scales
  are stored per token (repeated over the block's rows) so kernels load them
  as row vectors.
  """

  q8: jax.Array  # (B, H, Tq, D) int8
  # The transposed layouts of Q and K feed the backward only: None in a
  # forward that no backward follows (`Backend.quantize`'s for_backward=False).
  q8_t: jax.Array | None  # Layouts.backward; None where unused (`Config.q_per_token`, fp8)
  q_scale: jax.Array  # (B, H, Tq) fp32: each row's, or its block's (`Config.q_per_token`)
  q_mean: jax.Array | None  # (B, H, Tq // block_q, D) fp32, Q-smoothing only
  k8: jax.Array  # (B, Hkv, Tk, D) int8
  # Layouts.backward; None where unused: with FP8 products where `fp8_keys`
  # holds K'^T, which the FP8 dS.K reads in its place.
  k8_t: jax.Array | None
  k_scale: jax.Array  # (B, Hkv, Tk) fp32
  # 8-bit V^T per block_kv rows: int8, or with `Config.fp8` float8_e4m3fn.
  v8_t: jax.Array  # Layouts.forward
  v_scale: jax.Array  # (B, Hkv, Tk) fp32 per token, each block's own
  # `Config.keeps_qk16` only: Q and the smoothed K in the inputs' dtype and
  # layout (B, T, H, D), the second operands of dS.K and dS^T.Q in 16 bits,
  # or the sources of their FP8 copies. With `Config.causal_exact` K is not
  # smoothed (the edge tiles' scores take it as it is, and rows before the
  # end of key block 0 must not meet its mean): the FP8 copy and the 16-bit
  # dS.K subtract `k_mean` themselves.
  q16: jax.Array | None = None
  k16: jax.Array | None = None
  # `Config.causal_exact` only: the first key block's mean m (B, Hkv, D) fp32
  # (`sagebwd.first_block_mean`), which K8 lacks (and each row's q_i . m
  # restores in its 8-bit tiles);
  # with `Config.exact_edges` V in the inputs' dtype and layout (B, T, Hkv, D),
  # the edge tiles' P.V operand.
  k_mean: jax.Array | None = None
  v16: jax.Array | None = None
  # `Config.causal_exact` only, for the backward: per query block, the mean
  # dQ's K is taken less (B, Hkv, Tq // block_q, D) fp32
  # (`sagebwd.key_means_seen`): m, or before the end of key block 0 the mean
  # of its keys up to the block's first row's last visible one.
  k_mean_seen: jax.Array | None = None
  # The portable forward's P.V accumulator start per V block, (B, Hkv,
  # Tk // block_kv, D) int32 (`jax_triton.tiles.shifted_accumulator_start`):
  # the Triton quantization pass forms it while it holds each block, where V8^T
  # is written TOKENS; None elsewhere (the portable forward then forms it).
  v_start: jax.Array | None = None
  # `Config.fp8`, for a backward, where the Triton pass quantized: `Fp8Keys`.
  fp8_keys: Fp8Keys | None = None


class Prepass(NamedTuple):
  """Output of the backward pre-pass, from O and dO (B, Tq, H, D)."""

  delta: jax.Array  # (B, H, Tq) fp32: rowsum(dO * O)
  # psi(dO) per block_q rows, transposed: Layouts.backward (float8_e4m3fn
  # with `Config.fp8`).
  do8_t: jax.Array
  do_scale: jax.Array  # (B, H, Tq) fp32, per token
  # As `QuantizedQKV.v_start`, for the portable dK/dV's P^T.dO; TOKENS only.
  do_start: jax.Array | None = None
  # `Config.fp8` only: ||dO_i|| (B, H, Tq) fp32, dS's row bound's
  # (`numerics.ds_row_bound`), formed while the pre-pass holds each dO row.
  do_norm: jax.Array | None = None
  # `Config.fp8` only: the FP8 backward's operands (`fp8_operands`), formed
  # after the pre-pass from its Delta, dO scales and norms.
  fp8: "Fp8Operands | None" = None


class Fp8Operands(NamedTuple):
  """The FP8 backward's E4M3 second operands and the factors of its first
  ones (`Config.fp8`; `fp8_operands.fp8_operands` forms them). Per token
  (B, H, Tq) or (B, Hkv, Tk) unless said; a "group's largest" is over a
  key/value head's query heads, which dK and dV sum over.

  dV = P^T.dO8: P^T times `p_factor` (448 * the query block's dO scale over
  the group's largest) to E4M3; the sum times `dv_scale` (B, Hkv).
  dK = dS^T.Q': Q' = Q * scale * log2(e) * b_i in E4M3 per block_q rows
  (`q8_t`, transposed); dS^T / b_i times 448 * `q_fold` (Q''s block scale
  over the group's largest; 1 for a block of zeros) to E4M3; the sum times
  `dk_scale` (B, Hkv).
  dQ = dS.K': K' the smoothed K in E4M3 per block_kv rows (`k8_t`,
  transposed, block scales `k_scale`); dS / (b_i * `k_top`) times 448 times
  K''s block scale to E4M3, with `k_top` the largest K' block scale the
  row's block sees; the sum times b_i * k_top / 448.
  `ds_bound`: b_i >= max_j |dS_ij| (`numerics.ds_row_bound`).
  """

  q8_t: jax.Array  # Layouts.backward, float8_e4m3fn
  q_fold: jax.Array
  dk_scale: jax.Array
  k8_t: jax.Array  # Layouts.backward, float8_e4m3fn
  k_scale: jax.Array  # (B, Hkv, Tk)
  k_top: jax.Array
  p_factor: jax.Array
  dv_scale: jax.Array
  ds_bound: jax.Array


class Backend(Protocol):
  """One implementation of SageBwd's stages. Inputs are (B, T, H, D)."""

  def layouts(self, q: jax.Array, k: jax.Array, masks: Masks, config: Config) -> Layouts:
    """The transposed layouts that the kernels this backend runs for these
    inputs read (`Layouts`: the contract)."""
    ...

  def reference_numerics(self, q: jax.Array, k: jax.Array, masks: Masks,
                         config: Config) -> Numerics:
    """How the kernels this backend runs for these inputs quantize P and P^T
    (by the rules `layouts` follows)."""
    ...

  def quantize(self, q: jax.Array, k: jax.Array, v: jax.Array,
               k_mean: jax.Array | None, config: Config, *,
               for_backward: bool = True, layouts: Layouts = Layouts()) -> QuantizedQKV:
    """psi of Q (scaled, optionally smoothed), K - k_mean and V, per block;
    the backward's transposed layouts only `for_backward`; each transposed
    tensor in its `layouts`."""
    ...

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config,
              out_dtype) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """O (B, Tq, H, D), the base-2 log-sum-exp `lse` (B, H, Tq), and with
    `Config.fp8` each row's largest base-2 score (B, H, Tq) (else None): the
    backward's bound on dS (`numerics.ds_row_bound`) takes it."""
    ...

  def prepass(self, o: jax.Array, do: jax.Array, config: Config,
              layout: TransposedLayout = TransposedLayout.TOKENS) -> Prepass:
    """The backward's pre-pass: Delta = rowsum(dO * O) and psi(dO) per
    `block_q` rows, dO8 stored transposed in `layout` (the call's
    `Layouts.backward`), with its per-token scales (and with `Config.fp8`
    ||dO_i||). A backend may borrow another's (the Mosaic backend, its
    fallback's)."""
    ...

  def saturated_rows(self, qkv: QuantizedQKV, v: jax.Array, lse: jax.Array, do: jax.Array,
                     delta: jax.Array, masks: Masks,
                     config: Config) -> tuple[jax.Array, jax.Array]:
    """Delta (the pre-pass's) and lse (the forward's), (B, H, Tq), with the
    rows whose logits saturate recomputed from the backward's own scores and
    dP (`sagebwd_jax.saturated_rows` states the rule); the other rows as given."""
    ...

  def fp8_operands(self, qkv: QuantizedQKV, v: jax.Array, prepass: Prepass,
                   row_max: jax.Array, lse: jax.Array, masks: Masks,
                   config: Config) -> Fp8Operands:
    """`Config.fp8` only: the FP8 backward's operands (`Fp8Operands`) from the
    forward's row maxima and lse and the pre-pass's Delta (as
    `saturated_rows` left it), dO scales and norms, the transposed E4M3
    tensors in the layout of `prepass.do8_t` (`Layouts.backward`)."""
    ...

  def backward(self, qkv: QuantizedQKV, v: jax.Array, lse: jax.Array, do: jax.Array,
               prepass: Prepass, masks: Masks,
               config: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dQ, dK, dV, (B, T, H, D), from the saved residuals (lse and the
    pre-pass's Delta as `saturated_rows` left them), dO and the pre-pass.

    Any float dtype: the op casts them to the inputs' dtype.
    """
    ...
