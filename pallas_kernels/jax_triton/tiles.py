"""Triton helpers the kernels share: numerics.py's rules on tiles, the score
tile of every kernel, masks and block bounds.

An int8 product reaches fp32 exactly (|product| < 2**22 for tiles up to 128
and D up to 256) one of two ways. The products that could start from zero
(the scores, dS.K, dS^T.Q; `int8_product`) take the launch's choice,
`CONVERT`: a zero start (free in wgmma) and one conversion instruction per
element (I2FP on sm_90, on the unit that also runs exp2), or a start at
0x4B400000 (a MOV per element), whose int32 result read as fp32 is
1.5 * 2**23 + the product, and one subtraction. The products of unsigned P
(P.V, P^T.dO) always take the biased start, since it also carries P's shift
(below). Rounding adds 1.5 * 2**23 and keeps the low byte
(numerics.round_to_int8's bit trick).

Unsigned P (0..255) enters the signed int8 products as P - 128
(`unsigned_byte`: the rounding add's constant is 1.5 * 2**23 - 128, so its low
byte is P - 128), and the 128 * X that this drops comes back through the
accumulator's start, 0x4B400000 plus 128 times the column sums of the other
operand's block (`shifted_accumulator_start`), so the product still reads as
fp32 1.5 * 2**23 + P.X exactly.

Longer than 400 lines because it is the one module the Triton kernels share:
with `Config.causal_exact` the rows' mean term and the 16-bit edge tiles
joined the rules every kernel applies the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import numerics as nm
from pallas_kernels.jax_triton.interpreter import device_function

MAGIC_F32 = tl.constexpr(nm.ROUND_MAGIC_F32)
MAGIC_I32 = tl.constexpr(nm.ROUND_MAGIC_I32)
INT8_MAX = tl.constexpr(nm.INT8_MAX)
E4M3_MAX = tl.constexpr(nm.E4M3_MAX)
LOG2_UINT8_MAX = tl.constexpr(nm.LOG2_UINT8_MAX)
UINT8_MAX = tl.constexpr(nm.UINT8_MAX)
P_SHIFT = tl.constexpr(128)
SCALE_FLOOR = tl.constexpr(nm.SCALE_FLOOR)


@device_function
def int8_product(a8, b8, CONVERT: tl.constexpr):
  """a8 (M, K) . b8 (N, K)^T as exact fp32 (module docstring: `CONVERT`)."""
  if CONVERT:
    return tl.dot(a8, tl.trans(b8), out_dtype=tl.int32).to(tl.float32)
  start = tl.full((a8.shape[0], b8.shape[0]), MAGIC_I32, tl.int32)
  return exact_float(tl.dot(a8, tl.trans(b8), acc=start, out_dtype=tl.int32))


@device_function
def exact_float(acc):
  """The fp32 value of an int8 product accumulated from 0x4B400000."""
  return acc.to(tl.float32, bitcast=True) - MAGIC_F32


@device_function
def low_byte(x):
  """The int8 in the low byte of an fp32 that had 1.5 * 2**23 (or that minus a
  constant) added: round-half-even of the value added to."""
  return x.to(tl.int32, bitcast=True).to(tl.int8)


@device_function
def unsigned_byte(p):
  """Rounded P in 0..255 as the int8 P - 128 (module docstring)."""
  return low_byte(p + (MAGIC_F32 - P_SHIFT))


def shifted_accumulator_start(x8_t: jax.Array, block: int) -> jax.Array:
  """The accumulator start of `unsigned_byte` P times int8 X, per block of
  `block` tokens of X given (B, H, D, T): (B, H, T // block, D) int32. The
  quantization pass and the pre-pass form it in-kernel (`block_start`);
  this is for int8 tensors that another backend quantized."""
  batch, heads, head_dim, length = x8_t.shape
  blocks = x8_t.reshape(batch, heads, head_dim, length // block, block)
  sums = jnp.sum(blocks, axis=-1, dtype=jnp.int32)  # int32 under jax_enable_x64 too
  return jnp.swapaxes(nm.ROUND_MAGIC_I32 + P_SHIFT.value * sums, 2, 3)


def accumulator_start(start: jax.Array | None, x8_t: jax.Array, block: int) -> jax.Array:
  """`start` where the quantization pass or the pre-pass formed it, else
  `shifted_accumulator_start` of X8^T (TOKENS)."""
  return shifted_accumulator_start(x8_t, block) if start is None else start


@device_function
def block_start(x8):
  """`shifted_accumulator_start` of one int8 block (tokens, D): (D,) int32."""
  return MAGIC_I32 + P_SHIFT * tl.sum(x8.to(tl.int32), axis=0)


@device_function
def inverse_scale(amax, LEVELS: tl.constexpr):
  """LEVELS / amax, and 0 for all-zero tiles (numerics.inverse_scale)."""
  return tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, LEVELS, tl.float32),
                                           tl.where(amax > 0, amax, 1.0)), 0.0)


@device_function
def abs_max(x, axis):
  """max |x| along `axis` (None: all), NaN where any element is NaN or
  infinite (numerics.abs_max: on the bits, since Triton's float maximum
  skips NaN)."""
  bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=axis)
  amax = bits.to(tl.float32, bitcast=True)
  return tl.where(amax < float("inf"), amax, float("nan"))


@device_function
def quantize_rows(x, amax):
  """Per-token int8 of a tile against its row maxima |x| `amax`, one scale per
  row (numerics.quantize_rows): (int8 tile, row scales). `abs_max` carries
  NaN as the reference does; the dS loops take tl.max, which skips a NaN
  column (sagebwd.py carries those to the head group's gradients).

  numerics' clip to +-127 is left out: |x| <= amax and 127 / amax is
  correctly rounded, so |x * (127 / amax)| <= 127 (1 + 2**-23) < 127.5, which
  rounds to at most 127: a clip would only cost the dS loops instructions.
  """
  return low_byte(x * inverse_scale(amax, INT8_MAX)[:, None] + MAGIC_F32), amax / INT8_MAX


@device_function
def quantize_tile(x):
  """psi of a tile, one scale for it (numerics.quantize_tile): (int8, scale)."""
  amax = abs_max(x, None)
  y = tl.clamp(x * inverse_scale(amax, INT8_MAX), -INT8_MAX, INT8_MAX)
  return low_byte(y + MAGIC_F32), amax / INT8_MAX


@device_function
def to_e4m3(x):
  """fp32 -> E4M3 rounded to nearest even, saturated at +-448, NaN kept
  (numerics.to_e4m3). Hopper's conversion (cvt.rn.satfinite) saturates by
  itself; the clamp keeps the rule whatever conversion Triton picks for
  another target."""
  y = tl.clamp(x, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
  return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@device_function
def quantize_e4m3(x):
  """E4M3 of a tile, one scale for it (numerics.quantize_e4m3): (E4M3 tile,
  scale). The scale is the rule's amax / 448 correctly rounded (a plain `/`
  compiles to an approximate division); XLA under jit multiplies by 1 / 448
  instead, which can land an ulp away."""
  amax = abs_max(x, None)
  return to_e4m3(x * inverse_scale(amax, E4M3_MAX)), tl.math.div_rn(amax, E4M3_MAX)


@device_function
def row_norms(x):
  """||x_i|| of each row of a tile, fp32 (`numerics.token_norms`: the
  pre-pass's ||dO_i||, the quantization pass's ||V_j||): the square root
  correctly rounded, as XLA's; the sum in Triton's order, within fp32
  rounding of numerics.ordered_sum's."""
  x = x.to(tl.float32)
  return tl.sqrt_rn(tl.sum(x * x, axis=1))


@device_function
def score_tile(a8, b8, a_scale, b_scale, b_bias, SMOOTH_Q: tl.constexpr,
               CONVERT: tl.constexpr):
  """Base-2 scores of one tile as (x, c): S = x * c, x the int8 product as
  fp32 (`int8_product`: an integer, so differences of x within a tile are
  exact and a kernel forms its exp2 argument with one multiply-add, or one
  add and one), or with Q-smoothing S = x (c = 1).

  a8 (M, D) and b8 (N, D) are the int8 rows of the tile's two sides (Q and K,
  or K and Q for a transposed tile), with scales a_scale, b_scale (scalars
  or vectors along the tile's sides). With Q-smoothing, S gets a per-key bias
  `b_bias` ((1, N) or (M, 1), the side of the keys), which no scale can
  carry: then x is S (numerics.dequantize plus the bias).
  """
  x = int8_product(a8, b8, CONVERT)
  c = a_scale * b_scale
  if SMOOTH_Q:  # c shaped like the scales (every return's types agree)
    return x * c + b_bias, tl.zeros_like(c) + 1.0
  return x, tl.maximum(c, SCALE_FLOOR, propagate_nan=tl.PropagateNan.ALL)  # a NaN scale carries NaN


@device_function
def query_tile(q8_ptr, q_scale_ptr, q_mean_ptr, q_ids_ptr, b, q_head, i, rows,
               TQ: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, IDS: tl.constexpr,
               SMOOTH_Q: tl.constexpr):
  """Query block i's side of `key_block_scores` (`rows`, its tokens): Q8,
  Q's per-token scales (a column), Q-smoothing's block mean (0.0 without it)
  and the rows' segment ids (a column; 0 without them)."""
  q8 = tl.load(q8_ptr + q_head * TQ * D + rows[:, None] * D + tl.arange(0, D)[None, :])
  q_scale = tl.load(q_scale_ptr + q_head * TQ + rows)[:, None]
  q_mean = (tl.load(q_mean_ptr + (q_head * (TQ // BLOCK_Q) + i) * D + tl.arange(0, D))
            if SMOOTH_Q else 0.0)
  q_ids = tl.load(q_ids_ptr + b * TQ + rows)[:, None] if IDS else 0
  return q8, q_scale, q_mean, q_ids


@device_function
def key_block_scores(q8, q_scale, q_mean, q_pos, q_ids, k8_ptr, k_scale_ptr, kv_ids_ptr, j,
                     D: tl.constexpr, BLOCK_KV: tl.constexpr, LEFT: tl.constexpr,
                     RIGHT: tl.constexpr, IDS: tl.constexpr, SMOOTH_Q: tl.constexpr,
                     CONVERT: tl.constexpr):
  """`score_tile` of a query block (rows) against key block j (columns),
  `masked`; returns (x, c, keys, k_scale). The forward and dQ loop over key
  blocks with it."""
  keys = j * BLOCK_KV + tl.arange(0, BLOCK_KV)
  k8 = tl.load(k8_ptr + keys[:, None] * D + tl.arange(0, D)[None, :])
  k_scale = tl.load(k_scale_ptr + j * BLOCK_KV)
  bias = q_smoothing_bias(k8, k_scale, q_mean)[None, :] if SMOOTH_Q else 0.0
  x, c = score_tile(q8, k8, q_scale, k_scale, bias, SMOOTH_Q, CONVERT)
  kv_ids = tl.load(kv_ids_ptr + keys)[None, :] if IDS else 0
  x = masked(x, q_pos, keys[None, :], q_ids, kv_ids, LEFT, RIGHT, IDS)
  return x, c, keys, k_scale


@device_function
def row_top(x, c, SMOOTH_Q: tl.constexpr):
  """The row maxima of a (masked) `score_tile` (x, c: a scalar or a column)
  as (x's, S's), each (rows,): -inf where a row sees no key; S's top is
  rounded once, as numerics.block_scores' top."""
  x_top = tl.max(x, axis=1)
  if SMOOTH_Q:
    return x_top, x_top
  # A sum over the column's one key, not a reshape: the sum keeps x_top's row
  # layout, the reshape's layout conversion held registers that cost a
  # program per SM (docs/performance-log.md).
  return x_top, tl.sum(x_top[:, None] * c, axis=1)


@device_function
def from_top(x, x_top):
  """x minus its row's top: exact without Q-smoothing (integers), one
  rounding with it (numerics.block_scores' S - top); -inf stays -inf in a row
  that sees no key."""
  return x - tl.where(x_top > float("-inf"), x_top, 0.0)[:, None]


@device_function
def scores(x, c, SMOOTH_Q: tl.constexpr):
  """S from `score_tile`'s x and c."""
  return x if SMOOTH_Q else x * c


@device_function
def log2_p(x, c, lse, SMOOTH_Q: tl.constexpr):
  """The backward's exp2 argument min(S - lse, 0) (numerics.log2_p) from
  `score_tile`'s x and c (`lse` broadcastable to x): one multiply-add, one
  rounding, one minimum that keeps a NaN."""
  if SMOOTH_Q:
    a = x - lse
  else:
    a = x * c - lse
  return at_most_zero(a)


@device_function
def at_most_zero(s_minus_lse):
  """numerics.log2_p's cap: min(S - lse, 0), keeping a NaN."""
  return tl.minimum(s_minus_lse, 0.0, propagate_nan=tl.PropagateNan.ALL)


@device_function
def q_smoothing_bias(k8, k_scale, q_mean):
  """q_mean . K^T for the keys of a tile (numerics.q_smoothing_bias): (N,)."""
  return tl.sum(k8.to(tl.float32) * q_mean[None, :], axis=1) * k_scale


@device_function
def sixteen_bit(x, INPUTS: tl.constexpr):
  """fp32 `x` rounded to the inputs' dtype (`INPUTS`, its name), still fp32:
  the first operand of a 16-bit product, as score_tiles.sixteen_bit rounds
  it. To bfloat16 by the bits, to nearest even: the interpreter's
  conversion truncates (and its inputs arrive as fp32, launch.py)."""
  if INPUTS == "bfloat16":
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    y = bits.to(tl.float32, bitcast=True)
  elif INPUTS == "float16":
    y = x.to(tl.float16).to(tl.float32)
  else:
    y = x
  return y


@device_function
def mean_scores(q16, k_mean, MULTIPLIER: tl.constexpr):
  """q_i . m, base 2, for each row of `q16` (the 16-bit Q) and the mean m
  (D,) fp32 that K8 lacks (`Config.causal_exact`): (rows,), each row's one
  number for all its 8-bit tiles."""
  return tl.sum(q16 * k_mean[None, :], axis=1) * MULTIPLIER


@device_function
def edge_scores(a16, b16, MULTIPLIER: tl.constexpr, DOT_PRECISION: tl.constexpr):
  """Base-2 scores of an edge tile (`Config.exact_edges`) from the 16-bit
  rows of its two sides (Q and K, or K and Q), fp32 accumulation."""
  return tl.dot(a16, tl.trans(b16), input_precision=DOT_PRECISION) * MULTIPLIER


@device_function
def edge_key_block(q16, q_pos, q_ids, k16_ptr, kv_ids_ptr, j, HKV: tl.constexpr,
                   D: tl.constexpr, BLOCK_KV: tl.constexpr, LEFT: tl.constexpr,
                   RIGHT: tl.constexpr, IDS: tl.constexpr, MULTIPLIER: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
  """Key block j of an edge tile, rows of Q against it: the masked 16-bit
  scores, its 16-bit K and the tokens' offsets (for V at the same places)."""
  keys = j * BLOCK_KV + tl.arange(0, BLOCK_KV)
  tokens = keys[:, None] * HKV * D + tl.arange(0, D)[None, :]
  k16 = tl.load(k16_ptr + tokens)
  kv_ids = tl.load(kv_ids_ptr + keys)[None, :] if IDS else 0
  s = masked(edge_scores(q16, k16, MULTIPLIER, DOT_PRECISION), q_pos, keys[None, :], q_ids,
             kv_ids, LEFT, RIGHT, IDS)
  return s, k16, tokens


@device_function
def right_edge(i, TILE_Q: tl.constexpr, BLOCK_KV: tl.constexpr, NK: tl.constexpr,
               RIGHT: tl.constexpr):
  """causal_blocks.right_edge: the key blocks [start, end) that the band's
  right edge crosses for query tile i, 16-bit tiles with
  `Config.exact_edges`."""
  _, _, start, end = kv_range(i, TILE_Q, BLOCK_KV, NK, None, RIGHT)
  return start, end


@device_function
def token_offsets(b, rows, h, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
  """Offsets of tokens `rows` of head h, batch b, in a (B, T, H, D) array (the
  op's q, k, v, o, dO layout): (len(rows), D)."""
  return (b * T + rows[:, None]) * H * D + h * D + tl.arange(0, D)[None, :]


@device_function
def block_tokens(t, BLOCK: tl.constexpr, REGISTER_B: tl.constexpr):
  """The tokens of block t, in order or, for a REGISTER_B layout
  (types.TransposedLayout), in its order: position 4c + 2h + e of each 16
  holds token 8h + 2c + e (layouts.permute_keys). A quantization kernel loads
  its block's rows so, which leaves every value and scale as it was (a
  block's scale is a maximum) and its transposed store contiguous."""
  p = tl.arange(0, BLOCK)
  if REGISTER_B:
    p = p - p % 16 + 8 * ((p % 4) // 2) + 2 * ((p % 16) // 4) + p % 2
  return t * BLOCK + p


@device_function
def program_block(T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                  REGISTER_B: tl.constexpr):
  """The block of a program on the grid (T // BLOCK, B, H) over a (B, T, H, D)
  array: (t, head = b * H + h, its tokens `block_tokens`, their offsets
  `token_offsets`)."""
  t = tl.program_id(0)
  b = tl.program_id(1).to(tl.int64)
  h = tl.program_id(2)
  rows = block_tokens(t, BLOCK, REGISTER_B)
  return t, b * H + h, rows, token_offsets(b, rows, h, T, H, D)


@device_function
def store_transposed(x8_t_ptr, x8, rows, head, t, T: tl.constexpr, D: tl.constexpr,
                     BLOCK: tl.constexpr, REGISTER_B: tl.constexpr):
  """Stores block t of 8-bit rows `x8` (BLOCK, D; int8 or E4M3, the array's
  dtype), row i token rows[i] (`block_tokens`), of head `head` into a
  transposed array in its layout: (heads, D, T), or REGISTER_B (heads,
  T // BLOCK, D, BLOCK), one contiguous tile."""
  dims = tl.arange(0, D)
  if REGISTER_B:
    offsets = ((head * (T // BLOCK) + t) * D + dims[:, None]) * BLOCK + tl.arange(0, BLOCK)[None, :]
  else:
    offsets = head * D * T + dims[:, None] * T + rows[None, :]
  tl.store(x8_t_ptr + offsets, tl.trans(x8))


@device_function
def masked(x, q_pos, kv_pos, q_ids, kv_ids, LEFT: tl.constexpr, RIGHT: tl.constexpr,
           IDS: tl.constexpr):
  """x with -inf where a query may not see a key (numerics.tile_mask): other
  ids, or keys outside q_pos - LEFT ..  q_pos + RIGHT (None: unbounded; a
  tile inside the band passes None for both). Positions and ids are
  broadcastable to x: queries along one axis, keys along the other."""
  if IDS:
    x = tl.where(q_ids == kv_ids, x, float("-inf"))
  if RIGHT is not None:
    x = tl.where(kv_pos <= q_pos + RIGHT, x, float("-inf"))
  if LEFT is not None:
    x = tl.where(kv_pos >= q_pos - LEFT, x, float("-inf"))
  return x


@device_function
def kv_range(i, TILE_Q: tl.constexpr, BLOCK_KV: tl.constexpr, NK: tl.constexpr,
             LEFT: tl.constexpr, RIGHT: tl.constexpr):
  """causal_blocks.kv_range: key blocks [start, full_start) and [full_end,
  end) masked, [full_start, full_end) whole (all NK whole with no band).
  Triton's integer division truncates toward 0, as lax.div there."""
  start = 0
  full_start = 0
  full_end = NK
  end = NK
  if RIGHT is not None:
    full_end = tl.minimum((i * TILE_Q + RIGHT) // BLOCK_KV, NK)
    end = tl.minimum(((i + 1) * TILE_Q + RIGHT + BLOCK_KV - 1) // BLOCK_KV, NK)
  if LEFT is not None:
    start = _clip((i * TILE_Q - LEFT) // BLOCK_KV, 0, end)
    full_start = _clip(((i + 1) * TILE_Q - LEFT + BLOCK_KV - 2) // BLOCK_KV, start, end)
    full_end = _clip(full_end, full_start, end)
  return start, full_start, full_end, end


@device_function
def q_range(j, BLOCK_Q: tl.constexpr, TILE_KV: tl.constexpr, NQ: tl.constexpr,
            LEFT: tl.constexpr, RIGHT: tl.constexpr):
  """causal_blocks.q_range (at least one side bounded): query blocks [start,
  full_start) and [full_end, end) masked, [full_start, full_end) whole."""
  start = 0
  full_start = 0
  full_end = NQ
  end = NQ
  if RIGHT is not None:
    start = _clip((j * TILE_KV - RIGHT) // BLOCK_Q, 0, NQ)
    full_start = _clip(((j + 1) * TILE_KV + BLOCK_Q - 2 - RIGHT) // BLOCK_Q, 0, NQ)
  if LEFT is not None:
    end = _clip(((j + 1) * TILE_KV + LEFT + BLOCK_Q - 1) // BLOCK_Q, start, NQ)
    full_start = _clip(full_start, start, end)
    full_end = _clip((j * TILE_KV + LEFT) // BLOCK_Q, full_start, end)
  return start, full_start, full_end, end


@device_function
def _clip(x, lo, hi):
  return tl.minimum(tl.maximum(x, lo), hi)


@device_function
def edge_block(s: tl.constexpr, FIRST: tl.constexpr, first_start, first_stop, second_start,
               second_stop):
  """Straight-line step s of a band's two masked runs, [first_start,
  first_stop) taking the first FIRST steps (`edge_blocks` of its edge) and
  [second_start, second_stop) the rest: (block, whether it lies in its run)."""
  block = first_start + s
  inside = block < first_stop
  if s >= FIRST:
    block = second_start + (s - FIRST)
    inside = block < second_stop
  return block, inside


@triton.constexpr_function
def edge_blocks(own: int, other: int, offset: int | None) -> int:
  """The most blocks of `other` tokens that one edge of the band crosses
  beside a block of `own` (`kv_range`'s and `q_range`'s masked runs): 0 on
  an unbounded side."""
  if offset is None:
    return 0
  return -(-own // other) + (offset % other != 0)
