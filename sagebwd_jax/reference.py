"""SageBwd in pure JAX, tile for tile as the kernels compute it; and an oracle.

`ReferenceBackend` is the CPU fallback and the kernels' test oracle. It forms
the same tiles as the kernels (`block_q` query rows by `block_kv` key
rows), calls the same rules from `pallas_kernels.numerics` on them, and so
produces the same int8 tensors. Where the kernels loop, it vectorizes over
the query blocks and scans over key blocks, like the forward and dQ kernels.

`full_precision_attention` is plain softmax attention in fp32 (fp64 under
`jax_enable_x64`): the independent oracle for accuracy.

Longer than 400 lines because the forward and the backward are each one
loop for both numerics modes and `Config.causal_exact`'s 16-bit edge tiles,
as a kernel's loop is: split by mode, they would repeat the loop's frame.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import numerics as nm
from pallas_kernels.fp8_operands import fp8_operands
from pallas_kernels.layouts import arrange, layout_of, to_layout
from pallas_kernels.types import (Backend, Config, Fp8Operands, Layouts, Masks, Numerics,
                                  Prepass, QuantizedQKV, TransposedLayout)
from sagebwd_jax.saturated_rows import where_saturated
from sagebwd_jax.score_tiles import (ScoreTiles, blocks, int8_einsum, sixteen_bit, sum_tiles,
                                     wide_einsum)

_f32 = jnp.float32


def _heads(x: jax.Array) -> jax.Array:
  """(B, T, H, D) -> (B, H, T, D)."""
  return jnp.swapaxes(x, 1, 2)


def _unblock(x: jax.Array) -> jax.Array:
  return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def _quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """psi over every (block, D) tile of x (..., n, block, D)."""
  lead = x.shape[:-2]
  x8, scale = jax.vmap(nm.quantize_tile)(x.reshape(-1, *x.shape[-2:]))
  return x8.reshape(x.shape), scale.reshape(lead)


def _per_token(scale: jax.Array, block: int) -> jax.Array:
  """Block scales (..., n) -> the same scale on each row (..., n * block)."""
  return jnp.repeat(scale, block, axis=-1)


def _transposed(x8: jax.Array) -> jax.Array:
  return jnp.swapaxes(x8, -1, -2)


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
  """The algorithm of docs/algorithm.md in `jnp`; see `pallas_kernels.types.Backend`.

  `numerics` picks how P and P^T are quantized (`types.Numerics`; default: P
  per row of one key block and P^T per key row, both to 0..127), or is a
  backend whose `reference_numerics` for each call the reference then
  follows: `ReferenceBackend(kernels)` forms the int8 tensors of the kernels
  that `kernels` runs, call by call (the kernel backends' test oracle).
  """

  numerics: Numerics | Backend = Numerics()

  def layouts(self, q, k, masks: Masks, config: Config) -> Layouts:
    del q, k, masks, config
    return Layouts()

  def reference_numerics(self, q, k, masks: Masks, config: Config) -> Numerics:
    if isinstance(self.numerics, Numerics):
      return self.numerics
    return self.numerics.reference_numerics(q, k, masks, config)

  def _numerics_of(self, qkv: QuantizedQKV, masks: Masks, config: Config, dtype) -> Numerics:
    """`reference_numerics` of the call whose quantized tensors are `qkv`
    (q and k as the op passed them: (B, T, H, D), `dtype`)."""
    tokens_major = lambda x8: jax.ShapeDtypeStruct(
        (x8.shape[0], x8.shape[2], x8.shape[1], x8.shape[3]), dtype)
    return self.reference_numerics(tokens_major(qkv.q8), tokens_major(qkv.k8), masks, config)

  def quantize(self, q, k, v, k_mean, config: Config, *, for_backward: bool = True,
               layouts: Layouts = Layouts()) -> QuantizedQKV:
    # Scores are base-2 logits: scale * log2(e) goes into Q's scale.
    multiplier = config.scale * nm.LOG2_E
    q_blocks = blocks(_heads(q).astype(_f32), config.block_q)
    q_mean = None
    if config.smooth_q:
      q_mean = nm.ordered_sum(q_blocks, axis=-2) / config.block_q
      q_blocks = q_blocks - q_mean[..., None, :]
      q_mean = q_mean * multiplier
    if config.q_per_token:
      q8, q_scale = nm.quantize_rows(q_blocks)
      q_scale = q_scale.reshape(*q_scale.shape[:-2], -1) * multiplier
    else:
      q8, q_scale = _quantize_blocks(q_blocks)
      q_scale = _per_token(q_scale * multiplier, config.block_q)

    k_blocks = blocks(_heads(k).astype(_f32), config.block_kv)
    if k_mean is not None:  # (B, Hkv, D)
      k_blocks = k_blocks - k_mean[:, :, None, None, :]
    k8, k_scale = _quantize_blocks(k_blocks)
    k8, k_scale = _unblock(k8), _per_token(k_scale, config.block_kv)
    v_blocks = blocks(_heads(v).astype(_f32), config.block_kv)
    if config.fp8:
      # Per block, as INT8's V: the quantization pass forms each scale from
      # the block it holds (no reduction over the head's tokens), and no
      # row's O depends through a scale on a key it does not see.
      v8, v_scale = nm.quantize_e4m3(v_blocks, axis=(-2, -1))
      v_scale = v_scale[..., 0, 0]
    else:
      v8, v_scale = _quantize_blocks(v_blocks)
    v8, v_scale = _unblock(v8), _per_token(v_scale, config.block_kv)

    q8 = _unblock(q8)
    # Per-token Q goes with 16-bit dS, where dK = dS^T.Q is a 16-bit product,
    # and FP8 dS^T.Q takes an FP8 copy of Q: Q8 enters Q.K^T only, and no
    # kernel reads it transposed.
    q8_t = (None if config.q_per_token or config.fp8 or not for_backward
            else _transposed(q8))
    qkv = QuantizedQKV(q8=q8, q8_t=q8_t, q_scale=q_scale, q_mean=q_mean,
                       k8=k8, k8_t=_transposed(k8) if for_backward else None, k_scale=k_scale,
                       v8_t=_transposed(v8), v_scale=v_scale)
    return arrange(qkv, layouts)  # the reference may transpose: it is not timed

  def forward(self, qkv: QuantizedQKV, masks: Masks, config: Config, out_dtype):
    numerics = self._numerics_of(qkv, masks, config, out_dtype)
    qkv = arrange(qkv, Layouts())
    batch, num_heads, q_len, head_dim = qkv.q8.shape
    num_kv_heads, kv_len = qkv.k8.shape[1], qkv.k8.shape[2]
    p_block = numerics.p_block or config.block_kv
    if p_block % config.block_kv or kv_len % p_block:
      raise ValueError(f"p_block={p_block} must be a multiple of block_kv={config.block_kv} "
                       f"that divides the padded key length {kv_len}")
    blocks_per_step = p_block // config.block_kv
    tiles = ScoreTiles(qkv, masks, config)
    shape = (batch, num_kv_heads, num_heads // num_kv_heads, q_len // config.block_q,
             config.block_q)
    heads = lambda x: x.reshape(batch, num_heads, q_len, *x.shape[5:])
    out = lambda o: jnp.swapaxes(heads(o), 1, 2).astype(out_dtype)
    init = (jnp.zeros((*shape, head_dim), _f32), jnp.full(shape, nm.NOTHING_SEEN, _f32),
            jnp.zeros(shape, _f32))

    block = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, axis=-1, keepdims=False)
    v16 = None if qkv.v16 is None else _heads(qkv.v16)

    def folded(x, blocks, edge_value):
      """Each of the step's blocks' V factor, (B, Hkv, 1, 1, 1) or, for
      blocks that are an edge tile of some query block, (B, Hkv, 1, nq, 1)
      with `edge_value` there: the edge tiles' P.V takes V unscaled."""
      factors = []
      for i in blocks:
        edge = tiles.edge(i)
        factor = block(x, i)
        factors.append(factor if edge is None else jnp.where(edge[..., 0], edge_value, factor))
      return factors

    product = wide_einsum if config.fp8 else int8_einsum

    def p_times_v(p, blocks, p8):
      """P.V of the step's keys: `p8` (P to its 8-bit form) times 8-bit V,
      but P rounded to the inputs' dtype times their V in the edge tiles."""
      if not config.exact_edges:
        keys = jax.lax.dynamic_slice_in_dim(qkv.v8_t, blocks[0] * config.block_kv, p_block,
                                            axis=-1)
        return product("bhgiqk,bhdk->bhgiqd", p8(p), keys).astype(_f32)
      pv = 0.0
      for n, i in enumerate(blocks):
        p_block_i = p[..., n * config.block_kv:(n + 1) * config.block_kv]
        keys = tiles.kv_block(qkv.v8_t, i, axis=-1)
        pv_i = product("bhgiqk,bhdk->bhgiqd", p8(p_block_i), keys).astype(_f32)
        edge = tiles.edge(i)
        if edge is not None:
          pv_i = jnp.where(edge, wide_einsum("bhgiqk,bhkd->bhgiqd",
                                             sixteen_bit(p_block_i, out_dtype),
                                             tiles.kv_block(v16, i, axis=-2)), pv_i)
        pv = pv + pv_i
      return pv

    def step_blocks(j):
      return [j * blocks_per_step + i for i in range(blocks_per_step)]

    # (B, Hkv, 1, 1, 1, blocks): each block's factor broadcasts to its tiles' rows.
    log2_v_scale, inv_v_scale = (x[:, :, None, None, None, :] for x in nm.folded_v_scales(
        qkv.v_scale[..., ::config.block_kv], blocks_per_step))

    def v_folds(blocks):
      return folded(log2_v_scale, blocks, 0.0), folded(inv_v_scale, blocks, 1.0)

    if config.fp8:
      def fp8_step(carry, j):
        acc, m, l, row_max = carry
        blocks = step_blocks(j)
        scores = [tiles.block_scores(i) for i in blocks]
        p, alpha, m, l = nm.fp8_softmax_step(scores, *v_folds(blocks), m, l)
        # The rows' largest scores (the dS bound's), unfolded.
        row_max = functools.reduce(jnp.maximum, [t for t, _ in scores], row_max)
        return (acc * alpha[..., None] + p_times_v(p, blocks, nm.to_e4m3), m, l, row_max), None

      init = (*init, init[1])
      (acc, m, l, row_max), _ = jax.lax.scan(fp8_step, init, jnp.arange(kv_len // p_block))
      o, lse = nm.finalize_fp8_rows(acc, m, l)
      return out(o), heads(lse), heads(row_max)

    levels = nm.UINT8_MAX if numerics.unsigned_p else nm.INT8_MAX

    def kv_step(carry, j):
      acc, m, e, l = carry
      blocks = step_blocks(j)
      p, alpha, m, e, l = nm.folded_softmax_step(
          [tiles.block_scores(i) for i in blocks], *v_folds(blocks), m, e, l, levels=levels)
      pv = p_times_v(p, blocks, lambda p: jnp.round(jnp.minimum(p, levels)))
      return (acc * alpha[..., None] + pv, m, e, l), None

    init = (init[0], init[1], jnp.full(shape, -jnp.inf, _f32), init[2])
    (acc, _, e, l), _ = jax.lax.scan(kv_step, init, jnp.arange(kv_len // p_block))
    o, lse = nm.finalize_folded_rows(acc, e, l, levels=levels)
    return out(o), heads(lse), None

  def prepass(self, o, do, config: Config,
              layout: TransposedLayout = TransposedLayout.TOKENS) -> Prepass:
    delta = nm.ordered_sum(_heads(do).astype(_f32) * _heads(o).astype(_f32))
    do_blocks = blocks(_heads(do).astype(_f32), config.block_q)
    if config.fp8:
      do8, do_scale = nm.quantize_e4m3(do_blocks, axis=(-2, -1))
      do_scale = do_scale[..., 0, 0]
    else:
      do8, do_scale = _quantize_blocks(do_blocks)
    do8_t = _transposed(_unblock(do8))
    return Prepass(delta=delta, do8_t=to_layout(do8_t, layout),
                   do_scale=_per_token(do_scale, config.block_q),
                   do_norm=nm.token_norms(do) if config.fp8 else None)

  def saturated_rows(self, qkv: QuantizedQKV, v, lse, do, delta, masks: Masks,
                     config: Config):
    return where_saturated(qkv, v, lse, do, delta, masks, config)

  def fp8_operands(self, qkv: QuantizedQKV, v, prepass: Prepass, row_max, lse,
                   masks: Masks, config: Config) -> Fp8Operands:
    return fp8_operands(qkv, v, prepass, row_max, lse, masks, config, layout_of(prepass.do8_t))

  def backward(self, qkv: QuantizedQKV, v, lse, do, prepass: Prepass, masks: Masks,
               config: Config):
    unsigned_p_t = self._numerics_of(qkv, masks, config, v.dtype).unsigned_p_t
    qkv = arrange(qkv, Layouts())
    batch, num_heads, q_len, head_dim = qkv.q8.shape
    num_kv_heads = qkv.k8.shape[1]
    tiles = ScoreTiles(qkv, masks, config)
    rows = tiles.rows
    delta, lse = rows(prepass.delta[..., None])[..., 0], rows(lse[..., None])[..., 0]
    do8 = rows(_transposed(to_layout(prepass.do8_t, TransposedLayout.TOKENS)))
    do_scale = rows(prepass.do_scale[..., None])[..., 0, 0]
    do_blocks = rows(_heads(do))
    v_heads = _heads(v)
    if config.keeps_qk16:
      q16, k16_heads = rows(_heads(qkv.q16)), _heads(qkv.k16)
    if config.fp8:
      fp8 = _Fp8Tiles.of(prepass.fp8, rows)

    # causal_exact: dQ = dS.(K - m'), m' the query block's `dq_mean` (the
    # rowsum(dS) m' it drops is 0 in exact arithmetic). A query block with
    # 8-bit tiles has m' = m, which K8 lacks: those tiles are dQ's product as
    # it is. The edge tiles run in 16 bits with K - m' rounded to the inputs'
    # dtype.
    dq_mean = tiles.dq_mean()

    def edge_dq(ds, j):
      """dQ's edge tiles (`Config.exact_edges`), 0 elsewhere."""
      k16 = tiles.kv_block(k16_heads, j, axis=-2)[:, :, None]  # (B, Hkv, 1, bk, D)
      if dq_mean is not None:  # one operand per query block
        k16 = sixteen_bit(k16.astype(_f32) - dq_mean[:, :, 0], v.dtype)
      k16 = jnp.broadcast_to(k16, (*k16.shape[:2], ds.shape[3], *k16.shape[3:]))
      edge_dq = wide_einsum("bhgiqk,bhikd->bhgiqd", sixteen_bit(ds, v.dtype), k16)
      return jnp.where(tiles.edge(j), edge_dq, 0.0)

    def k16_block(j):
      """dS.K's second operand in 16 bits: K less m with causal_exact, K as
      `QuantizedQKV.k16` holds it otherwise."""
      k16 = tiles.kv_block(k16_heads, j, axis=-2)
      if qkv.k_mean is None:
        return k16
      return sixteen_bit(k16 - qkv.k_mean[:, :, None, :], v.dtype)

    def without_edges(dq_tiles, j):
      edge = tiles.edge(j)
      return dq_tiles if edge is None else jnp.where(edge, 0.0, dq_tiles)

    def kv_step(carry, j):
      dq, dq_exact = carry
      s = tiles.scores(j)
      log2_p = nm.log2_p(s - lse[..., None])
      p = jnp.exp2(log2_p)
      dp = wide_einsum("bhgiqd,bhkd->bhgiqk", do_blocks, tiles.kv_block(v_heads, j, axis=-2))
      ds = p * (dp - delta[..., None])
      # dV = P^T.dO
      if config.fp8:
        # P^T to E4M3_MAX, with dO's block scale over its head's largest.
        p8_t = nm.to_e4m3(jnp.swapaxes(p, -1, -2) * fp8.p_factor)
        dv = sum_tiles(wide_einsum("bhgikq,bhgiqd->bhgikd", p8_t, do8)) * fp8.dv_scale
      else:  # P^T quantized per key (a row of the dK/dV kernel's tile)
        if unsigned_p_t:
          pq_t, log2_p_scale = nm.unsigned_rows(jnp.swapaxes(log2_p, -1, -2))
          p8_t, p_scale = jnp.round(pq_t), jnp.exp2(log2_p_scale)
          # dS^T from P^T in its 0..255 units: its per-row scale absorbs them.
          ds_t = pq_t * (jnp.swapaxes(dp, -1, -2) - delta[..., None, :])
        else:
          p8_t, p_scale = nm.quantize_rows(jnp.swapaxes(p, -1, -2), nonnegative=True)
          ds_t = jnp.swapaxes(ds, -1, -2)
        dv_tiles = int8_einsum("bhgikq,bhgiqd->bhgikd", p8_t, do8)
        dv = sum_tiles(nm.dequantize(dv_tiles, p_scale[..., None], do_scale[..., None, None]))

      if config.exact_edges:
        dq_exact = dq_exact + edge_dq(ds, j)
      if config.ds_precision == "bf16":  # dS in the inputs' dtype
        ds16 = sixteen_bit(ds, qkv.k16.dtype)
        dq = dq + without_edges(wide_einsum("bhgiqk,bhkd->bhgiqd", ds16, k16_block(j)), j)
        # Q's multiplier, as the int8 Q scale carries it (ln 2 follows below).
        dk_tiles = wide_einsum("bhgikq,bhgiqd->bhgikd", jnp.swapaxes(ds16, -1, -2),
                               q16) * (config.scale * nm.LOG2_E)
        return (dq, dq_exact), (sum_tiles(dk_tiles), dv)

      if config.fp8:
        # dS / b_i to E4M3_MAX, with the other operand's block scale over
        # its head's largest folded in; the row bound and those largest
        # scales multiply the sums after the loop.
        ds_q = nm.to_e4m3(ds * (fp8.dq_factor * tiles.block_scale(fp8.k_scale, j)))
        dq = dq + without_edges(wide_einsum("bhgiqk,bhkd->bhgiqd", ds_q,
                                            tiles.kv_block(fp8.k8, j, axis=-2)), j)
        ds_k = nm.to_e4m3(jnp.swapaxes(ds * (fp8.ds_factor * fp8.q_fold), -1, -2))
        dk = sum_tiles(wide_einsum("bhgikq,bhgiqd->bhgikd", ds_k, fp8.q8)) * fp8.dk_scale
        return (dq, dq_exact), (dk, dv)

      k_scale = tiles.block_scale(qkv.k_scale, j)
      ds8, ds_scale = nm.quantize_rows(ds)
      dq_tiles = int8_einsum("bhgiqk,bhdk->bhgiqd", ds8,
                              tiles.kv_block(qkv.k8_t, j, axis=-1))
      dq = dq + without_edges(nm.dequantize(dq_tiles, ds_scale[..., None], k_scale), j)

      ds8_t, ds_t_scale = nm.quantize_rows(ds_t)
      if unsigned_p_t:
        ds_t_scale = ds_t_scale * p_scale
      dk_tiles = int8_einsum("bhgikq,bhgiqd->bhgikd", ds8_t, tiles.q8)
      dk_tiles = nm.dequantize(dk_tiles, ds_t_scale[..., None],
                               tiles.q_scale[..., :1, None])
      if config.smooth_q:
        dk_tiles = dk_tiles + nm.ordered_sum(ds, axis=-2)[..., None] * tiles.q_mean[..., None, :]
      dk = sum_tiles(dk_tiles)
      return (dq, dq_exact), (dk, dv)

    dq0 = jnp.zeros((*tiles.q8.shape[:-1], head_dim), _f32)
    (dq, dq_exact), (dk, dv) = jax.lax.scan(kv_step, (dq0, dq0),
                                            jnp.arange(tiles.num_kv_blocks))
    if config.fp8 and config.ds_precision == "int8":
      dq = dq * fp8.dq_scale
    if config.exact_edges:
      dq = dq + dq_exact
    # S was formed from Q * scale * log2(e): dQ takes `scale` once, dK ln 2.
    dq = jnp.swapaxes(dq.reshape(batch, num_heads, q_len, head_dim), 1, 2) * config.scale
    # Scan outputs are (key block, B, Hkv, row, D).
    kv_seq = lambda x: jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(batch, -1, num_kv_heads,
                                                                 head_dim)
    dk = kv_seq(dk) * nm.LN_2
    dv = kv_seq(dv)
    return dq, dk, dv


class _Fp8Tiles(NamedTuple):
  """`types.Fp8Operands` in the score tiles' layout (B, Hkv, G, query block,
  row, ...), with the factors the loop multiplies by: `p_factor` for P^T's
  columns; `ds_factor` = E4M3_MAX / b_i (0 where b_i is 0: dS is then 0 too)
  times `q_fold` for dS^T's; `dq_factor` = E4M3_MAX / (b_i * k_top_i) for
  dS's rows, K''s block scale `k_scale` for its columns, and `dq_scale` =
  b_i * k_top_i / E4M3_MAX for dQ's rows after the loop."""

  p_factor: jax.Array
  dv_scale: jax.Array
  q8: jax.Array
  q_fold: jax.Array
  ds_factor: jax.Array
  dk_scale: jax.Array
  k8: jax.Array
  k_scale: jax.Array
  dq_factor: jax.Array
  dq_scale: jax.Array

  @classmethod
  def of(cls, ops: Fp8Operands, rows) -> "_Fp8Tiles":
    """`rows` maps the query side (B, H, Tq, ...) to the tiles' rows."""
    row = lambda x: rows(x[..., None])[..., 0]  # (B, H, Tq) -> (..., query block, row)
    tokens = lambda x8_t: _transposed(to_layout(x8_t, TransposedLayout.TOKENS))
    bound_k_top = row(ops.ds_bound * ops.k_top)
    return cls(
        p_factor=row(ops.p_factor)[..., None, :], dv_scale=ops.dv_scale[..., None, None],
        q8=rows(tokens(ops.q8_t)), q_fold=row(ops.q_fold)[..., None],
        ds_factor=nm.inverse_scale(row(ops.ds_bound), nm.E4M3_MAX)[..., None],
        dk_scale=ops.dk_scale[..., None, None], k8=tokens(ops.k8_t), k_scale=ops.k_scale,
        dq_factor=nm.inverse_scale(bound_k_top, nm.E4M3_MAX)[..., None],
        dq_scale=(bound_k_top / nm.E4M3_MAX)[..., None])


def full_precision_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Exact softmax attention, (B, T, H, D) layout, GQA by head grouping.

  Computes in fp32, or in fp64 when given fp64 inputs (needs
  `jax_enable_x64`). Rows with no visible key give 0, like SageBwd.
  """
  dtype = jnp.float64 if query.dtype == jnp.float64 else _f32
  q, k, v = (x.astype(dtype) for x in (query, key, value))
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
  # (1, 1, Tq, 1) and (1, 1, 1, Tk): the logits' rank, for strict rank promotion.
  q_pos = jnp.arange(q.shape[1])[None, None, :, None]
  kv_pos = jnp.arange(k.shape[1])[None, None, None, :]
  mask = jnp.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
  if is_causal:
    mask &= q_pos >= kv_pos
  if query_seq_lengths is not None:
    mask &= (q_pos < query_seq_lengths[:, None, None, None])
  if key_value_seq_lengths is not None:
    mask &= (kv_pos < key_value_seq_lengths[:, None, None, None])
  if segment_ids is not None:
    q_seg, kv_seg = (segment_ids if isinstance(segment_ids, tuple)
                     else (segment_ids, segment_ids))
    mask &= q_seg[:, None, :, None] == kv_seg[:, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l == 0, 1.0, l)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(query.dtype)
