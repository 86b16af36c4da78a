"""The arithmetic rules every SageBwd implementation shares.

The Pallas kernels and the pure-JAX reference call these same functions on
tiles of the same shape, so the int8 values they form agree bit for bit (one
rounding rule, docs/algorithm.md). Each rule has two exact instruction
selections: plain XLA ops (`jnp.round`, conversions), and, with
`bit_tricks=True`, fp32 bit manipulations that Pallas' Triton lowering
accepts (it has no round) and that are often cheaper on the GPU. The kernels
use the tricks where they measured faster; the reference does not, because
XLA:GPU fusions were measured to miscompile them (wrong int8 under jit on an
H200, right op by op).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

INT8_MAX = 127.0
UINT8_MAX = 255.0  # P's levels where it is quantized unsigned
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# 1.5 * 2**23: adding it to an fp32 |x| < 2**22 leaves round-half-even(x) in
# the low mantissa bits. Triton has no round instruction in Pallas' lowering,
# and this is one fp32 add instead of a quarter-rate conversion.
ROUND_MAGIC_F32 = 12582912.0
ROUND_MAGIC_I32 = 0x4B400000  # its bits as an int32


def round_to_int8(x: jax.Array, *, nonnegative: bool = False,
                  bit_tricks: bool = False) -> jax.Array:
  """Clip fp32 values to [-127, 127], round half-to-even, return int8.

  The clip is the algorithm's (docs/algorithm.md), and it also matters for
  exactness: it stands between the scaling multiply and the rounding add, so
  no compiler can contract the two into one FMA that rounds differently on
  one backend than on another.
  With `bit_tricks` the rounded integer is read off the low byte of
  x + 1.5 * 2**23 (whose own low byte is 0). `nonnegative` (P) skips the
  lower clip.
  """
  x = jnp.minimum(x, INT8_MAX) if nonnegative else jnp.clip(x, -INT8_MAX, INT8_MAX)
  if not bit_tricks:  # via int32: Mosaic GPU has no direct fp32 -> int8 conversion
    return jnp.round(x).astype(jnp.int32).astype(jnp.int8)
  return lax.bitcast_convert_type(x + ROUND_MAGIC_F32, jnp.int32).astype(jnp.int8)


def int32_to_float(x: jax.Array, *, bit_tricks: bool = False) -> jax.Array:
  """Exact int32 -> fp32 for |x| < 2**22 (any int8 dot of depth <= 256).

  The bit trick is an integer add and a float subtract instead of a
  quarter-rate conversion instruction. Which is faster depends on the kernel:
  the trick takes two issue slots on the pipe that all of a tile's other
  elementwise work shares; the conversion takes one, on the unit that exp2
  also uses. Each kernel picks per product, by measurement.
  """
  if not bit_tricks:
    return x.astype(jnp.float32)
  biased = lax.bitcast_convert_type(x + ROUND_MAGIC_I32, jnp.float32)
  return biased - ROUND_MAGIC_F32


def inverse_scale(amax: jax.Array) -> jax.Array:
  """127 / amax, and 0 for all-zero tiles so they quantize to zeros."""
  safe = jnp.where(amax > 0, amax, 1.0)
  return jnp.where(amax > 0, INT8_MAX / safe, 0.0)


def quantize_tile(x: jax.Array, *, bit_tricks: bool = False) -> tuple[jax.Array, jax.Array]:
  """psi(X) on one tile: symmetric int8 with one fp32 scale for the tile."""
  amax = jnp.max(jnp.abs(x))
  return round_to_int8(x * inverse_scale(amax), bit_tricks=bit_tricks), amax / INT8_MAX


def quantize_rows(x: jax.Array, row_amax: jax.Array | None = None, *,
                  nonnegative: bool = False, bit_tricks: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
  """Per-token int8: one fp32 scale per row of the tile.

  Used for the first operand of every int8 dot whose rows are tokens of the
  output (P and dS), because a row scale factors out of the product. The
  forward passes `row_amax` = exp2(rowmax(S) - m_new), the largest P of the
  row, so it needs no extra reduction (the clip in `round_to_int8` keeps an
  exp2 that is not perfectly monotone from producing 128). `nonnegative`
  (P) spares the absolute value and the lower clip.
  """
  if row_amax is None:
    row_amax = jnp.max(x if nonnegative else jnp.abs(x), axis=-1)
  x8 = round_to_int8(x * inverse_scale(row_amax)[..., None], nonnegative=nonnegative,
                     bit_tricks=bit_tricks)
  return x8, row_amax / INT8_MAX


def int8_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b.T for int8 a (M, K) and b (N, K): exact int32 accumulation.

  The second operand has its contraction dimension last (contiguous), the
  only layout that reaches the int8 tensor cores through Triton.
  """
  return lax.dot_general(
      a, b, (((a.ndim - 1,), (b.ndim - 1,)), ((), ())),
      preferred_element_type=jnp.int32)


def dequantize(acc: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *,
               bit_tricks: bool = False) -> jax.Array:
  """An int32 product back to fp32: one multiply by the product of scales."""
  return int32_to_float(acc, bit_tricks=bit_tricks) * (a_scale * b_scale)


def float_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b.T in the inputs' dtype with fp32 accumulation (dO.V^T)."""
  return lax.dot_general(
      a, b, (((a.ndim - 1,), (b.ndim - 1,)), ((), ())),
      preferred_element_type=jnp.float32)


# Ids of tokens past a sequence length: they match no id, not even each other.
Q_INVALID_ID = -(2**31)
KV_INVALID_ID = -(2**31) + 1


def tile_mask(q_pos: jax.Array, kv_pos: jax.Array, *, causal: bool,
              q_ids: jax.Array | None = None,
              kv_ids: jax.Array | None = None) -> jax.Array | None:
  """Which (query, key) pairs of a tile may attend: True where allowed.

  Positions and ids of queries are columns (bq, 1) and of keys rows (1, bk).
  Returns None when nothing is masked, so callers skip the select.
  """
  mask = None
  if q_ids is not None:
    mask = q_ids == kv_ids
  if causal:
    after = q_pos >= kv_pos
    mask = after if mask is None else jnp.logical_and(mask, after)
  return mask


def q_smoothing_bias(k8: jax.Array, k_scale: jax.Array, q_mean: jax.Array) -> jax.Array:
  """q_mean . K_j^T for Q-smoothing, from the int8 K tile: shape (..., bk)."""
  return jnp.sum(k8.astype(jnp.float32) * q_mean[..., None, :], axis=-1) * k_scale


def safe_row_max(m: jax.Array) -> jax.Array:
  """The running max with -inf (nothing seen yet) replaced by 0.

  exp2(S - m) then gives 0 for masked (-inf) scores instead of NaN.
  """
  return jnp.where(m == -jnp.inf, 0.0, m)


def online_softmax_step(s: jax.Array, m: jax.Array, l: jax.Array, *,
                        bit_tricks: bool = False):
  """One key tile of the forward's online softmax over base-2 scores `s`.

  Returns (P8, P scale per row, correction alpha for the old accumulator,
  new running max, new running sum). P is quantized per token with the row
  maximum exp2(rowmax(S) - m_new), known without another pass over P.
  """
  m_tile = jnp.max(s, axis=-1)
  m_new = jnp.maximum(m, m_tile)
  m_safe = safe_row_max(m_new)
  alpha = jnp.exp2(m - m_safe)
  p = jnp.exp2(s - m_safe[..., None])
  l = alpha * l + jnp.sum(p, axis=-1)
  p8, p_scale = quantize_rows(p, jnp.exp2(m_tile - m_safe), nonnegative=True,
                              bit_tricks=bit_tricks)
  return p8, p_scale, alpha, m_new, l


def unsigned_rows(a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """P = exp2(a) per row, scaled to 0..255 against the row's largest (P^T of
  the Hopper dK/dV tile, unsigned 8-bit).

  `a`: (..., rows, cols) base-2 exponents, -inf where masked. Returns (pq, log2
  of the row scale): pq = exp2(a - top) * 255, unrounded fp32 (round it for the
  8-bit value; its fp32 form also forms dS), with P = pq * exp2(log2 scale).
  Formed from the exponent rather than by dividing P by its row maximum, so
  the kernels spend one add per score; rows with nothing visible give 0.
  """
  top = safe_row_max(jnp.max(a, axis=-1)) - math.log2(UINT8_MAX)
  return jnp.exp2(a - lax.broadcast_in_dim(top, a.shape, tuple(range(a.ndim - 1)))), top


def finalize_rows(acc: jax.Array, m: jax.Array, l: jax.Array):
  """O = acc / l and the base-2 log-sum-exp; rows that saw no key give O = 0
  and lse = +inf, so the backward's exp2(S - lse) is 0 there, not NaN."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, safe_row_max(m) + jnp.log2(l_safe))
  return acc / l_safe[..., None], lse


# The forward with V's block scale folded into P (the Hopper forward; the
# reference with `unsigned_p` or `p_block`): P is quantized per row of each
# step's tile of keys against E, the row's largest folded score, and the
# accumulators are kept in units of exp2(E) / levels.
# E never falls below the running maximum minus this, so the factor that moves
# the accumulators to a new E, exp2(E_old - E_new), stays far inside fp32.
E_FLOOR_BELOW_MAX = 60.0
# The running maximum's start: finite, so rows that have seen no key yet get
# finite exponents (their accumulators are 0 whatever the factor).
NOTHING_SEEN = -1e30


def folded_v_scales(v_block_scale: jax.Array, blocks_per_step: int
                    ) -> tuple[jax.Array, jax.Array]:
  """log2 and reciprocal of each V block's scale (..., num_blocks) as folded
  into P. An all-zero block (scale 0) takes the largest scale of its step (or
  1): its int8 values are 0, so P.V does not depend on it, while the row sum of
  P must still count its keys."""
  steps = v_block_scale.reshape(*v_block_scale.shape[:-1], -1, blocks_per_step)
  partner = jnp.max(steps, axis=-1, keepdims=True)
  safe = jnp.where(steps > 0, steps, jnp.where(partner > 0, partner, 1.0))
  safe = safe.reshape(v_block_scale.shape)
  return jnp.log2(safe), 1.0 / safe


def folded_softmax_step(s: jax.Array, log2_v_scale: jax.Array, inv_v_scale: jax.Array,
                        m: jax.Array, e: jax.Array, l: jax.Array, *, levels: float):
  """One step of the online softmax with P = round(levels * exp2(S + log2 sV - E)).

  `s`: (..., rows, keys) base-2 scores of the step, -inf where masked, its keys
  in whole V blocks; `log2_v_scale`, `inv_v_scale`: (..., blocks), each V
  block's scale (`folded_v_scales`). `m` starts at NOTHING_SEEN, `e` at -inf,
  `l` at 0. Returns (P, alpha, m, e, l): P integer-valued fp32 in
  [0, levels], alpha the factor for the old accumulators, l the row sums of
  unfolded P in units of exp2(e) / levels. P.V (int8 V) in these units is
  accumulated as acc * alpha + P.V.
  """
  blocks = log2_v_scale.shape[-1]
  s = s.reshape(*s.shape[:-1], blocks, s.shape[-1] // blocks)
  block_top = jnp.max(s, axis=-1)
  folded_top = block_top + log2_v_scale[..., None, :]
  top = jnp.max(folded_top, axis=-1)
  m_new = jnp.maximum(m, top)
  e_new = jnp.maximum(top, m_new - E_FLOOR_BELOW_MAX)
  alpha = jnp.exp2(e - e_new)
  # The exponent as (S - the block's max) + (the block's folded max - E): with
  # one block per step the second term is exactly 0, so P does not depend on
  # how log2 sV rounds (compiled and eager runs agree).
  log2_levels = math.log2(levels)
  offset = folded_top - e_new[..., None] + log2_levels
  from_top = s - jnp.where(block_top == -jnp.inf, 0.0, block_top)[..., None]
  p = jnp.exp2(jnp.minimum(from_top + offset[..., None], log2_levels))
  # Unfolded row sums block by block (as the kernels sum a tile's row).
  l_new = alpha * l + jnp.sum(jnp.sum(p, axis=-1) * inv_v_scale[..., None, :], axis=-1)
  return jnp.round(p).reshape(*p.shape[:-2], -1), alpha, m_new, e_new, l_new


def finalize_folded_rows(acc: jax.Array, e: jax.Array, l: jax.Array, *, levels: float):
  """`finalize_rows` for `folded_softmax_step`'s units: O and the base-2 lse."""
  empty = l == 0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, jnp.inf, e + jnp.log2(l_safe) - math.log2(levels))
  return acc / l_safe[..., None], lse
