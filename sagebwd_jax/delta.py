"""Delta, the backward's row term in dS = P * (dP - Delta), where logits saturate.

Exactly, Delta_i = sum_j P_ij dP_ij, so that each row of dS sums to zero. The
pre-pass forms it as rowsum(dO * O), equal in exact arithmetic and one cheap
read of O and dO, but O comes from the INT8 forward (int8 P and V) while
dP = dO . V^T takes V in 16 bits. Where a row's softmax is one-hot, the exact
dS is 0 and that difference, dO . (V - V's int8 value), becomes all of dS,
which dQ = dS.K and dK = dS^T.Q then multiply by |K| and |Q|: the larger the
logits, the larger the error, where the exact gradient is 0.

Rows whose base-2 log-sum-exp exceeds `numerics.SATURATED_LSE` in magnitude
(logits where one key takes the whole row unless keys tie) take instead
sum_j P dP from the backward's own dP, with P normalized over the row in
this pass (its own running maximum and sum), so a one-hot row's weight is
exactly 1 whatever the rounding of the forward's lse. The pass costs two of
the backward's seven products (S and dP once more) and runs only when some
row of the call needs it (`lax.cond`, one for the whole batch under `vmap`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import numerics as nm
from pallas_kernels.batching import batch_folded
from pallas_kernels.types import Config, Masks, QuantizedQKV
from sagebwd_jax.reference import ScoreTiles


def saturated(lse: jax.Array) -> jax.Array:
  """The rows (B, H, Tq) whose Delta `where_saturated` recomputes."""
  return jnp.isfinite(lse) & (jnp.abs(lse) > nm.SATURATED_LSE)


def where_saturated(delta: jax.Array, qkv: QuantizedQKV, v: jax.Array, lse: jax.Array,
                    do: jax.Array, masks: Masks, config: Config) -> jax.Array:
  """`delta` (B, H, Tq), the pre-pass's, with the saturated rows' replaced
  by sum_j P dP (`qkv`'s int8 Q and K: the scores the backward recomputes;
  `v` and `do` (B, T, H, D) as the backward's dP takes them). Under vmap the
  mapped axis joins the batch, so one cond decides for all."""

  def select(delta, qkv, v, lse, do, masks):
    rows = saturated(lse)
    return (jax.lax.cond(
        jnp.any(rows),
        lambda: jnp.where(rows, softmax_weighted_dp(qkv, v, do, masks, config), delta),
        lambda: delta),)

  return batch_folded(select)(delta, qkv, v, lse, do, masks)[0]


def softmax_weighted_dp(qkv: QuantizedQKV, v: jax.Array, do: jax.Array, masks: Masks,
                        config: Config) -> jax.Array:
  """sum_j P_ij dP_ij (B, H, Tq) fp32 over the keys each query sees, P the
  softmax of the int8 scores, dP = dO . V^T with fp32 accumulation; 0 for a
  row that sees no key."""
  tiles = ScoreTiles(qkv, masks, config)
  do_rows = tiles.rows(jnp.swapaxes(do, 1, 2))
  v_heads = jnp.swapaxes(v, 1, 2)

  def kv_step(carry, j):
    m, l, d = carry
    s = tiles.scores(j)
    # HIGHEST: fp32 inputs multiply in fp32 (not TF32 on a GPU), as the
    # kernels' dP does; a one-hot row's dP - Delta then cancels.
    dp = jnp.einsum("bhgiqd,bhkd->bhgiqk", do_rows, tiles.kv_block(v_heads, j, axis=-2),
                    preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp2(m - m_new)
    w = jnp.exp2(s - m_new[..., None])  # 0 where masked: m_new is finite
    return (m_new, alpha * l + jnp.sum(w, axis=-1), alpha * d + jnp.sum(w * dp, axis=-1)), None

  shape = tiles.q_scale.shape
  init = (jnp.full(shape, nm.NOTHING_SEEN, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape, jnp.float32))
  (_, l, d), _ = jax.lax.scan(kv_step, init, jnp.arange(tiles.num_kv_blocks))
  weighted = jnp.where(l > 0, d / jnp.where(l > 0, l, 1.0), 0.0)
  return weighted.reshape(do.shape[0], do.shape[2], do.shape[1])
