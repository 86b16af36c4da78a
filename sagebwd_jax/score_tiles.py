"""The score tiles of the pure-JAX SageBwd (`reference`, `saturated_rows`):
S[i, j] for every query block i against one key block j, as the kernels form
them from int8 Q and K (the exact int32 product, its scales, Q-smoothing's bias, the
masks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import causal_blocks
from pallas_kernels import numerics as nm
from pallas_kernels.types import Config, Masks, QuantizedQKV

_f32 = jnp.float32


def blocks(x: jax.Array, block: int) -> jax.Array:
  """(..., T, D) -> (..., T // block, block, D)."""
  return x.reshape(*x.shape[:-2], x.shape[-2] // block, block, x.shape[-1])


def int8_einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """An exact int8 product as int32, computed on integer-valued fp32.

  Exact because every sum here is below 127 * 127 * 256 < 2**24; it keeps the
  reference off XLA's int8 GEMM paths, which it only needs to be exact.
  """
  product = jnp.einsum(subscripts, a.astype(_f32), b.astype(_f32),
                       precision=jax.lax.Precision.HIGHEST)
  return product.astype(jnp.int32)


def wide_einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """A product of 16-bit, fp32 or FP8 operands with fp32 products and fp32
  accumulation, as the kernels' dots compute it, on every backend and shape
  (the product of two E4M3 values is exact in fp32, as on the FP8 tensor
  cores).

  The operands are widened to fp32 first (exactly: a 16-bit float is an
  fp32) and multiplied at HIGHEST. Left to XLA, a product of 16-bit operands
  may take an algorithm with 16-bit intermediates, chosen by the shape: the
  same (batch row, head) then rounds one way on one device and another way
  inside a `shard_map` that holds fewer of them.
  """
  return jnp.einsum(subscripts, a.astype(_f32), b.astype(_f32),
                    preferred_element_type=_f32, precision=jax.lax.Precision.HIGHEST)


def sixteen_bit(x: jax.Array, dtype) -> jax.Array:
  """fp32 `x` rounded to `dtype` (the inputs': bf16, fp16 or fp32), the
  first operand of a 16-bit product. Rounded explicitly: XLA may drop an
  f32 -> bf16 -> f32 round trip (excess precision), while the kernels'
  16-bit dots do round."""
  finfo = jnp.finfo(dtype)
  return jax.lax.reduce_precision(x, finfo.nexp, finfo.nmant).astype(dtype)


def sum_tiles(x: jax.Array) -> jax.Array:
  """Tiles (B, Hkv, G, nq, rows, ...) summed over the group and the query
  blocks (axes 2 and 3), in `numerics.ordered_sum`'s fixed order."""
  return nm.ordered_sum(x.reshape(*x.shape[:2], -1, *x.shape[4:]), axis=2)


def group(x: jax.Array, num_kv_heads: int) -> jax.Array:
  """Split the head axis (axis 1) into (kv head, group member)."""
  return x.reshape(x.shape[0], num_kv_heads, x.shape[1] // num_kv_heads, *x.shape[2:])


class ScoreTiles:
  """Score tiles S[i, j] for all query blocks i and one key block j.

  Arrays are laid out (B, Hkv, group, query block, row, ...), so one key block
  broadcasts across the query heads that share it (GQA without copies).

  With `Config.causal_exact` a tile's scores are exact up to quantization:
  K8 lacks the first key block's mean m (`QuantizedQKV.k_mean`), and each
  row's q_i . m, from the 16-bit Q, is added back to its 8-bit tiles (one
  number per row); and the tiles that the band's right edge crosses (`edge`)
  are Q.K^T from the 16-bit Q and K, which no key block's statistic enters.
  """

  def __init__(self, qkv: QuantizedQKV, masks: Masks, config: Config):
    self.num_kv_heads = qkv.k8.shape[1]
    self.config, self.qkv, self.masks = config, qkv, masks
    self.q8 = self.rows(qkv.q8)
    self.q_scale = self.rows(qkv.q_scale[..., None])[..., 0]
    self.q_mean = None if qkv.q_mean is None else group(qkv.q_mean, self.num_kv_heads)
    self.num_kv_blocks = qkv.k8.shape[2] // config.block_kv
    num_q_blocks = qkv.q8.shape[2] // config.block_q
    multiplier = config.scale * nm.LOG2_E  # Q8's scale carries it; the 16-bit Q does not
    q16 = None if qkv.q16 is None else self.rows(jnp.swapaxes(qkv.q16, 1, 2))
    # (B, Hkv, G, nq, bq): q_i . m for every row, base 2.
    self.mean_scores = None
    if qkv.k_mean is not None:
      self.mean_scores = wide_einsum("bhgiqd,bhd->bhgiq", q16, qkv.k_mean) * multiplier
    self.q16 = None
    if config.exact_edges:
      self.q16 = q16
      self.k16 = jnp.swapaxes(qkv.k16, 1, 2)
      self.multiplier = multiplier
      _, right = causal_blocks.band(config.causal, config.window)
      self.edge_start, self.edge_end = causal_blocks.right_edge(
          jnp.arange(num_q_blocks, dtype=jnp.int32), config.block_q, config.block_kv,
          self.num_kv_blocks, right=right)
    # (1, 1, 1, nq, bq, 1): the tiles' rank, so masks broadcast without rank
    # promotion (jax_numpy_rank_promotion="raise" passes).
    self.q_pos = (jnp.arange(num_q_blocks)[:, None] * config.block_q
                  + jnp.arange(config.block_q)[None, :])[None, None, None, :, :, None]

  def rows(self, x: jax.Array) -> jax.Array:
    """Query-side (B, H, Tq, D) -> (B, Hkv, G, query block, row, D): the
    tiles' rows."""
    return group(blocks(x, self.config.block_q), self.num_kv_heads)

  def kv_block(self, x: jax.Array, j, *, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, j * self.config.block_kv, self.config.block_kv,
                                        axis=axis % x.ndim)

  def block_scale(self, scale: jax.Array, j) -> jax.Array:
    """The scale of key block j, from per-token scales, broadcast to tiles."""
    return scale[:, :, j * self.config.block_kv][:, :, None, None, None, None]

  def edge(self, j) -> jax.Array | None:
    """(1, 1, 1, nq, 1, 1) bool: whether tile (i, j) is an edge tile, 16-bit
    (`Config.exact_edges`); None without them."""
    if self.q16 is None:
      return None
    edge = (j >= self.edge_start) & (j < self.edge_end)
    return edge[None, None, None, :, None, None]

  def dq_mean(self) -> jax.Array | None:
    """Each query block's `QuantizedQKV.k_mean_seen` (B, Hkv, 1, nq, 1, D),
    which dQ's K is taken less; None without it."""
    if self.qkv.k_mean_seen is None:
      return None
    return self.qkv.k_mean_seen[:, :, None, :, None, :]

  def _edge_scores(self, j) -> jax.Array:
    """Tiles (i, j) from the 16-bit Q and K, fp32 accumulation, base 2."""
    k16 = self.kv_block(self.k16, j, axis=-2)
    return wide_einsum("bhgiqd,bhkd->bhgiqk", self.q16, k16) * self.multiplier

  def _product(self, j):
    """The int32 products Q8.K8^T of tiles (i, j) (B, Hkv, G, nq, bq, bk), their
    dequantization factor (..., bq, 1), Q-smoothing's bias (..., 1, bk) or
    None, and the mask (True where a query sees a key) or None."""
    config, qkv, masks = self.config, self.qkv, self.masks
    k8 = self.kv_block(qkv.k8, j, axis=-2)
    product = int8_einsum("bhgiqd,bhkd->bhgiqk", self.q8, k8)
    k_scale = self.block_scale(qkv.k_scale, j)
    bias = None
    if self.q_mean is not None:
      bias = nm.q_smoothing_bias(k8[:, :, None, None], k_scale[..., 0], self.q_mean)
      bias = bias[..., None, :]

    kv_pos = (j * config.block_kv + jnp.arange(config.block_kv))[None, None, None, None, None]
    q_ids = kv_ids = None
    if masks.q_ids is not None:
      q_ids = blocks(masks.q_ids[..., None], config.block_q)[:, None, None]
      kv_ids = self.kv_block(masks.kv_ids, j, axis=-1)[:, None, None, None, None, :]
    mask = nm.tile_mask(self.q_pos, kv_pos, causal=config.causal, window=config.window,
                        q_ids=q_ids, kv_ids=kv_ids)
    return product, self.q_scale[..., None] * k_scale, bias, mask

  def scores(self, j) -> jax.Array:
    """Base-2 logits of tiles (i, j), masked with -inf: (B, Hkv, G, nq, bq, bk)."""
    product, scale, bias, mask = self._product(j)
    s = nm.dequantize(product, scale, 1.0)
    s = s if bias is None else s + bias
    s = s if self.mean_scores is None else s + self.mean_scores[..., None]
    edge = self.edge(j)
    s = s if edge is None else jnp.where(edge, self._edge_scores(j), s)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)

  def block_scores(self, j) -> tuple[jax.Array, jax.Array]:
    """`numerics.block_scores` of tiles (i, j): the forward's form of them."""
    product, scale, bias, mask = self._product(j)
    top, from_top = nm.block_scores(product, scale, mask=mask, bias=bias,
                                    row_bias=self.mean_scores)
    edge = self.edge(j)
    if edge is None:
      return top, from_top
    edge_top, edge_from_top = nm.float_block_scores(self._edge_scores(j), mask)
    return jnp.where(edge[..., 0], edge_top, top), jnp.where(edge, edge_from_top, from_top)
