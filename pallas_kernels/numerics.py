"""The arithmetic rules every SageBwd implementation shares.

The pure-JAX reference calls these functions on tiles of the kernels' shape;
the Mosaic GPU kernels call them where their operands allow (quantization,
P^T's rows, V's folded scales) and restate the rest in their own operand
forms (the forward's softmax step: `folded_softmax_step`), and the Triton
kernels restate them in Triton's language (jax_triton/tiles.py, which names
the rule each helper follows). So the int8 values they form agree bit for bit
(one rounding rule, docs/algorithm.md); the tests hold each restatement to the
reference (tests/test_mosaic.py, tests/test_triton_kernels.py). The kernels round and convert
with fp32 bit tricks (the magic constants below: exact, and cheaper on the
GPU); the reference does not, because XLA:GPU fusions were measured to
miscompile them (wrong int8 under jit on an H200, right op by op). The FP8
products' rules (`Config.fp8`: E4M3 conversion, the dS bound, the FP8
softmax step) sit beside the INT8 ones they replace.

Longer than 400 lines because the rules of both numerics modes, and the
fixed-order sum they share, are one definition each and kept together.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

INT8_MAX = 127.0
# The largest finite float8_e4m3fn: every FP8 operand is scaled to reach it
# (`Config.fp8`), and the kernels' conversion saturates there
# (cvt.rn.satfinite.e4m3x2.f32).
E4M3_MAX = 448.0
UINT8_MAX = 255.0  # P's levels where it is quantized unsigned
LOG2_UINT8_MAX = math.log2(UINT8_MAX)  # the exponent at which unsigned P is 255
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# 1.5 * 2**23: adding it to an fp32 |x| < 2**22 leaves round-half-even(x) in
# the low mantissa bits: one fp32 add instead of a quarter-rate conversion.
ROUND_MAGIC_F32 = 12582912.0
ROUND_MAGIC_I32 = 0x4B400000  # its bits as an int32

# The kernels' floor for a score tile's scale product q_scale * k_scale, which
# is 0 for an all-zero block (whose scores are 0 whatever multiplies them):
# above 0, it keeps masked (-inf) scores -inf through the multiply (-inf * 0
# is NaN), and it moves the scores of a block whose product lies below it by
# less than 127 * 127 * 256 * 2**-100 < 2**-77. The reference masks with a
# select after the multiply and needs none.
SCALE_FLOOR = 2.0**-100


def round_to_int8(x: jax.Array, *, nonnegative: bool = False) -> jax.Array:
  """Clip fp32 values to [-127, 127], round half-to-even, return int8.

  The clip is the algorithm's (docs/algorithm.md), and it also matters for
  exactness: it stands between the scaling multiply and the rounding add, so
  no compiler can contract the two into one FMA that rounds differently on
  one backend than on another. `nonnegative` (P) skips the lower clip.
  """
  x = jnp.minimum(x, INT8_MAX) if nonnegative else jnp.clip(x, -INT8_MAX, INT8_MAX)
  # Via int32: Mosaic GPU has no direct fp32 -> int8 conversion.
  return jnp.round(x).astype(jnp.int32).astype(jnp.int8)


def inverse_scale(amax: jax.Array, levels: float = INT8_MAX) -> jax.Array:
  """levels / amax, and 0 for all-zero tiles so they quantize to zeros (and
  for NaN ones, whose NaN scale carries them)."""
  safe = jnp.where(amax > 0, amax, 1.0)
  return jnp.where(amax > 0, levels / safe, 0.0)


def abs_max(x: jax.Array, axis: int | tuple[int, ...] | None = None, *,
            keepdims: bool = False) -> jax.Array:
  """max |x| of fp32 `x` over `axis`; NaN where any element is NaN or infinite.

  int8 has no NaN, so a non-finite input survives quantization only through
  its group's scale. The maximum is taken on the bits: with the sign bit
  cleared, fp32 bit patterns order as their values, +inf above every finite
  value and NaN above +inf. A float maximum would not do: XLA:CPU's
  vectorized reductions and Triton's `maxnumf` skip NaN.
  """
  bits = lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
  amax = lax.bitcast_convert_type(jnp.max(bits, axis=axis, keepdims=keepdims), jnp.float32)
  return jnp.where(amax < jnp.inf, amax, jnp.nan)


def quantize_tile(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """psi(X) on one tile: symmetric int8 with one fp32 scale for the tile (NaN
  when the tile holds a NaN or an infinity; its int8 values are then
  meaningless, and every product with them is multiplied by the NaN)."""
  amax = abs_max(x)
  return round_to_int8(x * inverse_scale(amax)), amax / INT8_MAX


def quantize_rows(x: jax.Array, *, nonnegative: bool = False) -> tuple[jax.Array, jax.Array]:
  """Per-token int8: one fp32 scale per row of the tile (NaN for a row that
  holds a NaN or an infinity, as `quantize_tile`).

  Used for the first operand of every int8 dot whose rows are tokens of the
  output (P and dS), because a row scale factors out of the product.
  `nonnegative` (P) spares the lower clip.
  """
  row_amax = abs_max(x, axis=-1)
  x8 = round_to_int8(x * inverse_scale(row_amax)[..., None], nonnegative=nonnegative)
  return x8, row_amax / INT8_MAX


def to_e4m3(x: jax.Array) -> jax.Array:
  """fp32 -> float8_e4m3fn, rounded to nearest even and saturated at
  +-E4M3_MAX, as the kernels' cvt.rn.satfinite does (a plain cast would make
  values past 448 NaN); NaN stays NaN."""
  return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def quantize_e4m3(x: jax.Array, axis: int | tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """FP8 E4M3 with one fp32 scale per group: the groups are what remains of
  `x` after reducing over `axis` (scale = amax / E4M3_MAX, kept with its
  reduced axes; NaN for a group that holds a NaN or an infinity).

  E4M3 keeps 3 mantissa bits at every magnitude within 2**-6..448 of its
  scale, so the scale's group sets only the range: FP8 copies of
  probabilities, gradients, keys and values take one scale per block where
  INT8 needs one per row to keep its relative step."""
  amax = abs_max(x, axis=axis, keepdims=True)
  return to_e4m3(x * inverse_scale(amax, E4M3_MAX)), amax / E4M3_MAX


def token_norms(x: jax.Array) -> jax.Array:
  """||x_t|| of each token of (B, T, H, D) as (B, H, T) fp32, the sum over
  channels in `ordered_sum`'s order."""
  return jnp.sqrt(ordered_sum(jnp.square(jnp.swapaxes(x, 1, 2).astype(jnp.float32))))


def ds_row_bound(row_max: jax.Array, lse: jax.Array, delta: jax.Array, do_norm: jax.Array,
                 v_norm: jax.Array) -> jax.Array:
  """b_i >= max_j |dS_ij|, per query row (B, H, Tq), from what the forward
  and the pre-pass know: b_i = m_i * (||dO_i|| * max_j ||V_j|| + |Delta_i|).

  dS_ij = P_ij (dP_ij - Delta_i) with |dP_ij| <= ||dO_i|| ||V_j||
  (Cauchy-Schwarz) and P_ij <= m_i = exp2(row_max_i - lse_i), the row's
  largest probability (capped at 1 as `log2_p` caps P). So the FP8 dS
  operands, dS / b_i scaled to E4M3_MAX, need no per-step maximum; without
  m_i the bound is loose by 1 / m_i, which doubles dQ's and dK's error at
  sigma 1 (docs/algorithm.md). `do_norm` (B, H, Tq): ||dO_i|| of dO as the
  backward's dP takes it (the pre-pass's `Prepass.do_norm`); `v_norm` (B, H,
  Tq) the largest ||V_j|| over the keys the row may see
  (`fp8_operands.max_over_seen`); rows that see no key get 0 (lse = +inf).
  """
  m = jnp.exp2(log2_p(row_max - lse))
  return m * (do_norm * v_norm + jnp.abs(delta))


def ordered_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """The sum over `axis` in one fixed order: a tree of elementwise adds, the
  axis zero-padded to a power of two. The reference's sums that reach an
  output take it.

  A `jnp.sum` is an XLA reduction, and XLA:CPU picks its order (split,
  vectorized, or handed to a library) by the array's whole shape: a batch
  row's sum then rounds one way on one device and another way inside a
  `shard_map` whose devices hold fewer rows. Elementwise adds
  leave XLA no such choice.
  """
  axis = axis % x.ndim
  width = 1 << max(x.shape[axis] - 1, 0).bit_length()
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, width - x.shape[axis])
  x = jnp.pad(x, pad)
  while x.shape[axis] > 1:
    half = x.shape[axis] // 2
    x = lax.slice_in_dim(x, 0, half, axis=axis) + lax.slice_in_dim(x, half, 2 * half, axis=axis)
  return jnp.squeeze(x, axis)


def spread_nan(x: jax.Array, axis: int = -1) -> jax.Array:
  """x with every element along `axis` NaN where any of them is.

  Used on per-token scales and lse, (B, H, T): where block skipping means no
  kernel program pairs a NaN block with some other block, the NaN reaches
  the other blocks' results through this instead (`sagebwd.py`).
  """
  return jnp.where(jnp.any(jnp.isnan(x), axis=axis, keepdims=True), jnp.nan, x)


def dequantize(acc: jax.Array, a_scale: jax.Array, b_scale: jax.Array) -> jax.Array:
  """An int32 product back to fp32: one multiply by the product of scales."""
  return acc.astype(jnp.float32) * (a_scale * b_scale)


# Ids of tokens past a sequence length: they match no id, not even each other.
Q_INVALID_ID = -(2**31)
KV_INVALID_ID = -(2**31) + 1


def tile_mask(q_pos: jax.Array, kv_pos: jax.Array, *, causal: bool,
              window: tuple[int, int] | None = None, q_ids: jax.Array | None = None,
              kv_ids: jax.Array | None = None) -> jax.Array | None:
  """Which (query, key) pairs of a tile may attend: True where allowed.

  Positions and ids of queries are columns (bq, 1) and of keys rows (1, bk);
  `window` (left, right) allows keys q - left .. q + right. Returns None when
  nothing is masked, so callers skip the select.
  """
  rules = []
  if q_ids is not None:
    rules.append(q_ids == kv_ids)
  if causal:
    rules.append(q_pos >= kv_pos)
  if window is not None:
    rules += [kv_pos >= q_pos - window[0], kv_pos <= q_pos + window[1]]
  return functools.reduce(jnp.logical_and, rules) if rules else None


def q_smoothing_bias(k8: jax.Array, k_scale: jax.Array, q_mean: jax.Array) -> jax.Array:
  """q_mean . K_j^T for Q-smoothing, from the int8 K tile: shape (..., bk)."""
  return jnp.sum(k8.astype(jnp.float32) * q_mean[..., None, :], axis=-1) * k_scale


def mean_scores(q16: jax.Array, k_mean: jax.Array, multiplier: float) -> jax.Array:
  """Each row's q_i . m (B, H, Tq) fp32, base 2 (`multiplier`: scale *
  log2 e), from Q in the inputs' dtype (B, Tq, H, D) and the mean m (B, Hkv,
  D) that K8 lacks (`Config.causal_exact`): the one number per row that its
  8-bit tiles add back. For the kernels that meet a query block once per
  key tile (the Triton and Hopper dK/dV) and the Hopper dQ, formed once by
  XLA."""
  batch, q_len, heads, head_dim = q16.shape
  kv_heads = k_mean.shape[1]
  group = heads // kv_heads
  q = q16.reshape(batch, q_len, kv_heads, group, head_dim).astype(jnp.float32)
  # m per group member: (b, k, g) batch dimensions put the product in (B, H,
  # Tq) order, with no transpose after it.
  k_mean = jnp.broadcast_to(k_mean[:, :, None], (batch, kv_heads, group, head_dim))
  means = jnp.einsum("btkgd,bkgd->bkgt", q, k_mean, precision=lax.Precision.HIGHEST)
  return means.reshape(batch, heads, q_len) * multiplier


def safe_row_max(m: jax.Array) -> jax.Array:
  """A row maximum with -inf (nothing seen) replaced by 0, so that
  subtracting it from masked (-inf) scores gives -inf, not NaN."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def block_scores(product: jax.Array, scale: jax.Array, *, mask: jax.Array | None = None,
                 bias: jax.Array | None = None, row_bias: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
  """One key block's base-2 scores S = product * scale (+ bias) (+ row_bias),
  -inf where `mask` is False, as the row maxima `top` (..., rows) and
  `S - top` (..., rows, keys), the forms `folded_softmax_step` takes.

  `product` is the int32 Q8.K8^T tile, `scale` its dequantization factor
  (broadcastable to (..., rows, 1)), `bias` Q-smoothing's (..., 1, keys),
  `row_bias` (..., rows) the score each row gives K's mean
  (`Config.causal_exact`), which K8 lacks: the same for every key of the
  row, so it moves `top` only, one add per row, and `S - top` stays exact.
  Without a bias, S - top is the exact int32 difference times `scale`: one
  rounding, so the row's largest score gives exactly 0, however a compiler
  fuses or contracts the arithmetic. (Formed as S - max(S), the two uses of S
  can round differently: XLA:CPU contracts S's multiply into the subtraction
  in one fusion and not in the other, which moved P by 2^4 at logits near
  1e8.) With a bias S ends in an addition, which nothing contracts.
  The conversions are instructions: the difference may exceed the 2**22 of
  `int32_to_float`'s bit trick.
  """
  if bias is not None:
    top, from_top = float_block_scores(product.astype(jnp.float32) * scale + bias, mask)
  else:
    lowest = jnp.iinfo(jnp.int32).min
    top_int = jnp.max(product if mask is None else jnp.where(mask, product, lowest), axis=-1)
    top = top_int.astype(jnp.float32) * (scale if jnp.ndim(scale) == 0 else scale[..., 0])
    from_top = (product - top_int[..., None]).astype(jnp.float32) * scale
    if mask is not None:
      top = jnp.where(top_int == lowest, -jnp.inf, top)
      from_top = jnp.where(mask, from_top, -jnp.inf)
  return top if row_bias is None else top + row_bias, from_top


def float_block_scores(s: jax.Array, mask: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  """`block_scores` of fp32 scores `s` (..., rows, keys): a 16-bit product's,
  or an int8 one's with a bias. S ends in an addition or a product's one
  rounding, which S - top then reads once."""
  s = s if mask is None else jnp.where(mask, s, -jnp.inf)
  top = jnp.max(s, axis=-1)
  return top, s - safe_row_max(top)[..., None]


def log2_p(s_minus_lse: jax.Array) -> jax.Array:
  """The backward's exponent of P = exp2(S - lse), at most 0: P <= 1 holds
  exactly, and the cap keeps a saturated row's top key at P = 1 whatever
  the kernel's rounding (`SATURATED_MARGIN`). NaN stays NaN."""
  return jnp.minimum(s_minus_lse, 0.0)


def saturation_threshold(dtype) -> float:
  """The |lse| (base 2) above which a row takes the backward's own Delta and
  lse, for inputs of `dtype`: `SATURATED_LSE_FP16` for fp16, else
  `SATURATED_LSE`."""
  return SATURATED_LSE_FP16 if jnp.dtype(dtype) == jnp.float16 else SATURATED_LSE


def saturated_lse(m: jax.Array, l: jax.Array) -> jax.Array:
  """A saturated row's lse from its running maximum m and sum l (base 2):
  m + log2(l), less `SATURATED_MARGIN` * |m|."""
  return m + jnp.log2(l) - SATURATED_MARGIN * jnp.abs(m)


def unsigned_rows(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """P = exp2(a) per row, scaled to 0..255 against the row's largest (P^T of
  the Hopper dK/dV tile, unsigned 8-bit).

  `a`: (..., rows, cols) base-2 exponents, -inf where masked. Returns (pq, log2
  of the row scale): pq = exp2(a - top) * 255, unrounded fp32 (round it for the
  8-bit value; its fp32 form also forms dS), with P = pq * exp2(log2 scale).
  Formed from the exponent rather than by dividing P by its row maximum, so
  the kernels spend one add per score; rows with nothing visible give 0.
  """
  top = safe_row_max(jnp.max(a, axis=-1)) - LOG2_UINT8_MAX
  return jnp.exp2(a - lax.broadcast_in_dim(top, a.shape, tuple(range(a.ndim - 1)))), top


# The forward with V's block scale folded into P (every forward: one key block
# per step and 0..127 in the portable kernels, two and 0..255 in the Hopper
# one): P is quantized per row of each step's tile of keys against E, the
# row's largest folded score, and the accumulators are kept in units of
# exp2(E) / levels.
# E never falls below the running maximum minus this, so the factor that moves
# the accumulators to a new E, exp2(E_old - E_new), stays far inside fp32.
E_FLOOR_BELOW_MAX = 60.0
# Base-2 logits above which the backward takes Delta = sum_j P dP instead of
# rowsum(dO * O), and its own lse (sagebwd_jax/saturated_rows.py). There fp32
# holds an exponent to 2**-8 or coarser, more than P's int8 step
# (log2(1 + 1/255)), and a row's largest score is far from its next one
# unless they tie, so the row is one-hot; training with QK-norm stays below
# 2**6.
SATURATED_LSE = 2.0**15
# The same for fp16 inputs, from base-2 logits of 2**6, the top of QK-norm
# training's range. Below 2**15 a row can be one-hot too (a causal row that
# sees few keys, logits in the hundreds), and its rowsum(dO * O) is then off
# by dO . (V - V's int8 value): with V near fp16's range, dQ = dS.K and dK
# overflow fp16 to Inf where the exact gradient is small. bf16
# keeps 2**15: there the same error stays finite, and every row the pass
# takes costs two more products (docs/algorithm.md, "Saturating logits").
SATURATED_LSE_FP16 = 2.0**6
# How far below its largest score a saturated row's lse is set, relative to
# that score: P = exp2(min(S - lse, 0)) in every backward, so the row's top
# key gets P = 1 exactly. Each kernel rounds S * c - lse its own way (an FMA
# or a multiply, c's product in another order): up to 2 ulp of |S|, 2**-22
# relative, and at 1e8 that is 2**30 in P (docs/algorithm.md, "Saturating
# logits"). Twice that, plus those 2 ulp, stays below one step of the int8
# scores (|S| / |Q8.K8|) while |Q8.K8| < 2**20.2: always at D=64 (127**2 * 64
# = 2**20), so no lower key reaches the cap.
SATURATED_MARGIN = 2.0**-21
# The running maximum's start: finite, so rows that have seen no key yet get
# finite exponents (their accumulators are 0 whatever the factor).
NOTHING_SEEN = -1e30


def folded_v_scales(v_block_scale: jax.Array, blocks_per_step: int
                    ) -> tuple[jax.Array, jax.Array]:
  """log2 and reciprocal of each V block's scale (..., num_blocks) as folded
  into P. An all-zero block (scale 0) takes the largest scale of its step (or
  1): its int8 values are 0, so P.V does not depend on it, while the row sum of
  P must still count its keys. A NaN scale stays NaN."""
  steps = v_block_scale.reshape(*v_block_scale.shape[:-1], -1, blocks_per_step)
  partner = jnp.max(steps, axis=-1, keepdims=True)
  safe = jnp.where(steps == 0, jnp.where(partner > 0, partner, 1.0), steps)
  safe = safe.reshape(v_block_scale.shape)
  return jnp.log2(safe), 1.0 / safe


def folded_softmax_step(blocks: Sequence[tuple[jax.Array, jax.Array]],
                        log2_v_scales: Sequence[jax.Array],
                        inv_v_scales: Sequence[jax.Array],
                        m: jax.Array, e: jax.Array, l: jax.Array, *, levels: float):
  """One step of the online softmax with P = levels * exp2(S + log2 sV - E).

  `blocks`: the step's key blocks, each `block_scores`' (top, S - top), base-2
  scores; `log2_v_scales`, `inv_v_scales`: each block's V scale
  (`folded_v_scales`), broadcastable to its `top`. `m` starts at
  NOTHING_SEEN, `e` at -inf, `l` at 0. Returns (P, alpha, m, e, l): P fp32,
  the blocks' keys concatenated, before its clip to `levels` and rounding
  (the caller's); alpha the factor for the old accumulators; l the row sums
  of unfolded P in units of exp2(e) / levels. P.V (int8 V) in these units is
  accumulated as acc * alpha + round(min(P, levels)).V.

  The exponent is (S - the block's max) + (the block's folded max - E): with
  one block per step the second term is exactly 0, so exp2 of the row's
  largest score is exactly 1 and its P exactly `levels`, whatever the
  rounding of log2 sV or of S, and whether or not a compiler contracts the
  addition into the multiply that formed S - max (the sum is then that
  product's one rounding either way; eager and jitted runs agree). The row
  sums are taken before the clip, so a NaN score reaches them on every
  platform (min and max skip NaN in Triton).
  """
  folded_tops = [top + lsv for (top, _), lsv in zip(blocks, log2_v_scales)]
  top = functools.reduce(jnp.maximum, folded_tops)
  m_new = jnp.maximum(m, top)
  e_new = jnp.maximum(top, m_new - E_FLOOR_BELOW_MAX)
  alpha = jnp.exp2(e - e_new)
  ps, row_sums = [], []
  for (_, from_top), folded_top, inv in zip(blocks, folded_tops, inv_v_scales):
    p = levels * jnp.exp2(from_top + (folded_top - e_new)[..., None])
    ps.append(p)
    row_sums.append(ordered_sum(p) * inv)
  l_new = alpha * l + functools.reduce(jnp.add, row_sums)
  p = ps[0] if len(ps) == 1 else jnp.concatenate(ps, axis=-1)
  return p, alpha, m_new, e_new, l_new


def fp8_softmax_step(blocks: Sequence[tuple[jax.Array, jax.Array]],
                     log2_v_scales: Sequence[jax.Array], inv_v_scales: Sequence[jax.Array],
                     m: jax.Array, l: jax.Array):
  """One step of the online softmax for FP8 P.V: P = E4M3_MAX * exp2(S +
  log2 sV - m), m the running row maximum of the folded scores, so the
  largest P of a row is exactly E4M3_MAX and no P exceeds it; no per-step
  scale: P's FP8 conversion needs none, so the fp32 accumulator runs across
  steps and is only rescaled by alpha.

  V's E4M3 scale sV is per key block, folded into P as the INT8 forward
  folds it: `log2_v_scales` and `inv_v_scales` as `folded_softmax_step`
  takes them, l the row sums of P / sV, and O = acc / l (per (row, block)
  terms only: the exponent's constant and the row sum's factor).

  `blocks`: each key block's `block_scores` (top, S - top). `m` starts at
  NOTHING_SEEN, `l` at 0. Returns (P, alpha, m, l): P fp32, the blocks'
  keys concatenated, before its FP8 conversion; l the row sums of that P
  (unconverted) over sV, which `finalize_fp8_rows` divides by.
  """
  tops = [t + lsv for (t, _), lsv in zip(blocks, log2_v_scales)]
  m_new = jnp.maximum(m, functools.reduce(jnp.maximum, tops))
  alpha = jnp.exp2(m - m_new)
  # (t - m_new) is -inf for a block whose row sees no key, and m_new finite.
  ps = [E4M3_MAX * jnp.exp2(from_top + (t - m_new)[..., None])
        for t, (_, from_top) in zip(tops, blocks)]
  sums = [ordered_sum(p) * inv for p, inv in zip(ps, inv_v_scales)]
  l_new = alpha * l + functools.reduce(jnp.add, sums)
  p = ps[0] if len(ps) == 1 else jnp.concatenate(ps, axis=-1)
  return p, alpha, m_new, l_new


def finalize_fp8_rows(acc: jax.Array, m: jax.Array, l: jax.Array):
  """O = acc / l and the base-2 log-sum-exp from `fp8_softmax_step`'s
  state. Rows that saw no key give O = 0 and lse = +inf."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, m + jnp.log2(l_safe) - math.log2(E4M3_MAX))
  return acc / l_safe[..., None], lse


def finalize_folded_rows(acc: jax.Array, e: jax.Array, l: jax.Array, *, levels: float):
  """O = acc / l and the base-2 log-sum-exp from `folded_softmax_step`'s
  units; rows that saw no key give O = 0 and lse = +inf, so the backward's
  exp2(S - lse) is 0 there, not NaN."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, e + jnp.log2(l_safe) - math.log2(levels))
  return acc / l_safe[..., None], lse
