"""The backward's row terms where logits saturate: Delta, in dS = P * (dP - Delta),
and lse, in P = exp2(S - lse).

Exactly, Delta_i = sum_j P_ij dP_ij, so that each row of dS sums to zero. The
pre-pass forms it as rowsum(dO * O), equal in exact arithmetic and one cheap
read of O and dO, but O comes from the INT8 forward (int8 P and V) while
dP = dO . V^T takes V in 16 bits. Where a row's softmax is one-hot, the exact
dS is 0 and that difference, dO . (V - V's int8 value), becomes all of dS,
which dQ = dS.K and dK = dS^T.Q then multiply by |K| and |Q|: the larger the
logits, the larger the error, where the exact gradient is 0.

Rows whose base-2 log-sum-exp exceeds `numerics.SATURATED_LSE` in magnitude
(logits where one key takes the whole row unless keys tie; for fp16 inputs
`SATURATED_LSE_FP16`, `numerics.saturation_threshold`) take instead
sum_j P dP from the backward's own dP, with P normalized over the row in
this pass (its own running maximum m and sum l), so a one-hot row's weight
is exactly 1 whatever the rounding of the forward's lse; and they take
their lse from the same pass, `numerics.saturated_lse`: m + log2(l), set
just below the top so that the backward's capped exp2 (`numerics.log2_p`)
gives the top key P = 1 however a kernel rounds S * c - lse. The forward's
lse of such a row is off by its rounding (a multiple of 8 at 1e8), more in
the Hopper forward, whose lse sums V-scale-folded terms; exp2 of that error
multiplies every P, and so dS, of the row (the top key's P must be 1 for
dS to vanish).

This is the reference's form (`ReferenceBackend.saturated_rows`): a scan over
key blocks behind one `lax.cond` per call (one for the whole batch under
`vmap`), which costs two of the backward's seven products (S and dP once
more) only when some row needs it. On a GPU a cond blocks the host on its
predicate; the kernel backends run the same rule in one launch whose
programs return at once unless a row of theirs saturates
(`pallas_kernels/jax_triton/saturated_rows.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import numerics as nm
from pallas_kernels.batching import batch_folded
from pallas_kernels.types import Config, Masks, QuantizedQKV
from sagebwd_jax.score_tiles import ScoreTiles, wide_einsum


def saturated(lse: jax.Array, dtype) -> jax.Array:
  """The rows (B, H, Tq) whose Delta and lse `where_saturated` recomputes, for
  inputs of `dtype`."""
  return jnp.isfinite(lse) & (jnp.abs(lse) > nm.saturation_threshold(dtype))


def where_saturated(qkv: QuantizedQKV, v: jax.Array, lse: jax.Array, do: jax.Array,
                    delta: jax.Array, masks: Masks,
                    config: Config) -> tuple[jax.Array, jax.Array]:
  """`delta` and `lse` (B, H, Tq), the pre-pass's and the forward's, with the
  saturated rows' replaced by `recomputed_rows` (`qkv`'s int8 Q and K: the
  scores the backward recomputes; `v` and `do` (B, T, H, D) as the
  backward's dP takes them). Under vmap the mapped axis joins the batch, so
  one cond decides for all."""

  def select(qkv, v, lse, do, delta, masks):
    # Without the barrier XLA:CPU may recompute the forward's lse (a log2)
    # inside the select's fusion, vectorized differently under vmap: the
    # last bit of ~1% of rows then differs from a per-example call.
    lse = jax.lax.optimization_barrier(lse)
    rows = saturated(lse, v.dtype)
    new_delta, new_lse = jax.lax.cond(
        jnp.any(rows), lambda: recomputed_rows(qkv, v, do, masks, config),
        lambda: (jnp.zeros_like(delta), jnp.zeros_like(lse)))
    return jnp.where(rows, new_delta, delta), jnp.where(rows, new_lse, lse)

  return batch_folded(select)(qkv, v, lse, do, delta, masks)


def recomputed_rows(qkv: QuantizedQKV, v: jax.Array, do: jax.Array, masks: Masks,
                    config: Config) -> tuple[jax.Array, jax.Array]:
  """(Delta, lse), each (B, H, Tq) fp32, over the keys each query sees:
  Delta = sum_j P_ij dP_ij, P the softmax of the int8 scores, dP = dO . V^T
  with fp32 accumulation; lse = `numerics.saturated_lse` of the same
  scores' running maximum and sum (base 2).
  A row that sees no key gets Delta 0 and lse +inf (the forward's)."""
  tiles = ScoreTiles(qkv, masks, config)
  do_rows = tiles.rows(jnp.swapaxes(do, 1, 2))
  v_heads = jnp.swapaxes(v, 1, 2)

  def kv_step(carry, j):
    m, l, d = carry
    s = tiles.scores(j)
    # As the backward's dP (fp32 inputs in fp32, not TF32 on a GPU): a one-hot
    # row's dP - Delta then cancels.
    dp = wide_einsum("bhgiqd,bhkd->bhgiqk", do_rows, tiles.kv_block(v_heads, j, axis=-2))
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp2(m - m_new)
    w = jnp.exp2(s - m_new[..., None])  # 0 where masked: m_new is finite
    return (m_new, alpha * l + nm.ordered_sum(w), alpha * d + nm.ordered_sum(w * dp)), None

  shape = tiles.q_scale.shape
  init = (jnp.full(shape, nm.NOTHING_SEEN, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape, jnp.float32))
  (m, l, d), _ = jax.lax.scan(kv_step, init, jnp.arange(tiles.num_kv_blocks))
  seen = l > 0
  weighted = jnp.where(seen, d / jnp.where(seen, l, 1.0), 0.0)
  own_lse = jnp.where(seen, nm.saturated_lse(m, jnp.where(seen, l, 1.0)), jnp.inf)
  heads = lambda x: x.reshape(do.shape[0], do.shape[2], do.shape[1])
  return heads(weighted), heads(own_lse)
