"""SageBwd as one `jax.custom_vjp`: docs/algorithm.md, stage by stage.

forward:  K-smoothing -> quantize Q, K, V -> INT8 attention -> residuals
backward: Delta and psi(dO) (Delta recomputed where logits saturate) ->
          [quantization="int8_fp8": the FP8 operands, dS's row bound] ->
          recomputed P -> INT8 dV, dQ, dK (dP in bf16; dQ, dK too with
          ds_precision="bf16"; with "int8_fp8", P.V, dV, dQ, dK in FP8)

Which code runs each stage is the `backend` (Triton or Mosaic GPU kernels, or
the pure-JAX reference); this file only wires the stages together. Sequences
arrive padded to whole blocks, with the true lengths in `masks`.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from pallas_kernels import causal_blocks
from pallas_kernels import numerics as nm
from pallas_kernels.layouts import layout_of
from pallas_kernels.types import Backend, Config, Masks, Prepass, QuantizedQKV
from sagebwd_jax.reference import ReferenceBackend


def key_mean(k: jax.Array, kv_ids: jax.Array | None) -> jax.Array:
  """Mean of K over each sequence's valid tokens: (B, Hkv, D) fp32.

  Subtracting it shifts every score row by a constant, so softmax is
  unchanged, while the int8 grid no longer spends its range on the channel
  bias that K typically carries. Padding never enters the mean.
  """
  k = k.astype(jnp.float32)
  if kv_ids is None:
    return jnp.mean(k, axis=1)
  valid = (kv_ids != nm.KV_INVALID_ID).astype(jnp.float32)
  total = jnp.einsum("bthd,bt->bhd", k, valid)
  return total / jnp.maximum(jnp.sum(valid, axis=1), 1.0)[:, None, None]


def key_block_means(k: jax.Array, kv_ids: jax.Array | None, block: int) -> jax.Array:
  """Mean of K over each `block` keys' valid tokens: (B, Hkv, T // block, D)
  fp32, 0 for a block with none (`Config.causal_exact`).

  A block's mean depends on its own keys only, so a row that sees the whole
  block sees every key its mean depends on; the scores restore q_i . m_b
  exactly (`score_tiles.ScoreTiles`), so the mean only decides what the
  int8 grid spends its range on. Padding never enters it.
  """
  batch, length, heads, dim = k.shape
  k = jnp.swapaxes(k.astype(jnp.float32), 1, 2).reshape(batch, heads, length // block, block,
                                                         dim)
  if kv_ids is None:
    return nm.ordered_sum(k, axis=-2) / block
  valid = (kv_ids != nm.KV_INVALID_ID).astype(jnp.float32).reshape(batch, 1, -1, block)
  total = nm.ordered_sum(k * valid[..., None], axis=-2)
  return total / jnp.maximum(nm.ordered_sum(valid), 1.0)[..., None]


def key_means_seen(k: jax.Array, kv_ids: jax.Array | None, config: Config,
                   q_len: int) -> jax.Array:
  """For each query block, the mean of the valid keys up to the last key its
  first row sees (its position plus the band's right; every key without
  one): (B, Hkv, Tq // block_q, D) fp32 (`Config.causal_exact`).

  dQ takes K less this mean (`ScoreTiles.dq_mean`): the term it drops,
  rowsum(dS) times the mean, is 0 in exact arithmetic (rows of dS sum to
  zero) but not in the 8-bit backward's (Delta comes from the INT8 O), and
  K's channel bias would multiply it. One mean per query block, of keys no
  row of the block comes before, so no row's dQ depends on a later key.
  """
  batch, kv_len, heads, dim = k.shape
  block = config.block_kv
  num_kv = kv_len // block
  valid = (jnp.ones((batch, kv_len), jnp.float32) if kv_ids is None
           else (kv_ids != nm.KV_INVALID_ID).astype(jnp.float32))
  valid = valid.reshape(batch, 1, num_kv, block)
  keys = jnp.swapaxes(k.astype(jnp.float32), 1, 2).reshape(batch, heads, num_kv, block, dim)
  keys = keys * valid[..., None]
  _, right = causal_blocks.band(config.causal, config.window)
  first = jnp.arange(q_len // config.block_q) * config.block_q
  last = (jnp.full_like(first, kv_len - 1) if right is None
          else jnp.minimum(first + right, kv_len - 1))
  last_block = last // block
  # The blocks before the last key's whole, then that block up to it.
  whole = (jnp.arange(num_kv)[None] < last_block[:, None])[None, None, :, :, None]
  partial = (last_block[:, None] * block + jnp.arange(block)[None] <= last[:, None])
  partial = partial[None, None, :, :, None]

  def total(x):  # (B, h, nb, block, d) -> (B, h, nq, d)
    before = nm.ordered_sum(jnp.where(whole, nm.ordered_sum(x, axis=-2)[:, :, None], 0.0),
                            axis=-2)
    return before + nm.ordered_sum(jnp.where(partial, x[:, :, last_block], 0.0), axis=-2)

  return total(keys) / jnp.maximum(total(valid[..., None]), 1.0)


def opaque(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """The arrays, as values XLA cannot fold at compile time.

  A loss may close over constants: `jnp.sum(out)` makes dO a broadcast 1, a
  test fixes dO or the keys. XLA would then evaluate the quantization and
  everything after it that reads only constants while compiling, in its
  slow evaluator (seconds per reduction at T=1024, docs/performance-log.md),
  to save no run time: every stage reads these arrays once anyway.
  """
  return jax.lax.optimization_barrier(arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def sagebwd_attention(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks,
                      config: Config, backend: Backend, smooth_k: bool) -> jax.Array:
  """INT8 attention on block-padded (B, T, H, D) inputs; output like q."""
  # Undifferentiated: no backward reads the transposed int8 layouts.
  return _forward(q, k, v, masks, config, backend, smooth_k, for_backward=False)[0]


def _stage(fn):
  """`fn` (a stage that runs the backend's kernels) as a jit of its own, static
  in the options. A model's identical layers then trace and lower the stage
  once per shape and options (jax reuses a lowered jit within a program), not
  once per call site, and so share one text of each Mosaic GPU kernel, which
  is then compiled once (Mosaic GPU keys compiled kernels on the text, and
  numbers every lowering of a kernel apart in it). The stages return only
  what every caller uses, so that jax's pruning of unused outputs makes no
  second variant of one.

  The pure-JAX reference has no kernels to lower: it stays inline, where XLA
  fuses it with the code around it as before (a jit boundary moves its fp32
  results by float noise against eager execution).
  """
  signature = inspect.signature(fn)
  options = ("config", "backend", "smooth_k", "for_backward", "out_dtype")
  jitted = jax.jit(fn, static_argnames=[n for n in signature.parameters if n in options])

  @functools.wraps(fn)
  def stage(*args, **kwargs):
    backend = signature.bind(*args, **kwargs).arguments["backend"]
    return (fn if isinstance(backend, ReferenceBackend) else jitted)(*args, **kwargs)

  return stage


@_stage
def quantize(q, k, v, masks: Masks, config: Config, backend: Backend,
             smooth_k: bool, for_backward: bool = True) -> QuantizedQKV:
  """K-smoothing and the quantization pass (and, with 16-bit dS, the 16-bit
  operands of dS's products), its transposed tensors in the layouts that the
  kernels the backend will run for this call read (`types.Layouts`).

  A NaN or infinite input gives its block a NaN scale (`numerics.abs_max`).
  One NaN key or value block makes every K or V scale of its batch row and
  key/value head NaN: jax.nn's 0 x NaN makes every output of those heads NaN
  (its masked probabilities multiply V, its masked score gradients K), and
  with causal block skipping no kernel program would pair the later blocks
  with the earlier queries. (K-smoothing's mean spreads a NaN key so anyway.)
  """
  q, k, v = opaque(q, k, v)
  means = (functools.partial(key_block_means, block=config.block_kv) if config.causal_exact
           else key_mean)
  k_mean = means(k, masks.kv_ids) if smooth_k else None
  qkv = backend.quantize(q, k, v, k_mean, config, for_backward=for_backward,
                         layouts=backend.layouts(q, k, masks, config))
  if config.causal_exact:
    # The forward reads them too: the scores' per-block correction takes Q,
    # the edge tiles Q, K and V as they are.
    qkv = qkv._replace(
        q16=q, k16=k, k_mean=k_mean, v16=v if config.exact_edges else None,
        k_mean_seen=(key_means_seen(k, masks.kv_ids, config, q.shape[1])
                     if smooth_k and for_backward else None))
  elif config.keeps_qk16 and for_backward:
    # dS.K and dS^T.Q in 16 bits, or in FP8 from copies the backward makes:
    # their second operands unquantized. K is the smoothed one, as in the
    # int8 product: rows of dS sum to zero only up to the forward's error,
    # and the mean would multiply that remainder.
    k16 = k if k_mean is None else (k.astype(jnp.float32) - k_mean[:, None]).astype(k.dtype)
    qkv = qkv._replace(q16=q, k16=k16)
  return qkv._replace(k_scale=nm.spread_nan(qkv.k_scale), v_scale=nm.spread_nan(qkv.v_scale))


@_stage
def attend(qkv: QuantizedQKV, masks: Masks, config: Config, backend: Backend,
           out_dtype) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The 8-bit forward: the output, the base-2 log-sum-exp (B, H, T) and, with
  FP8 products, the rows' largest scores (else None)."""
  return backend.forward(qkv, masks, config, out_dtype)


def _forward(q, k, v, masks, config, backend, smooth_k, for_backward=True):
  qkv = quantize(q, k, v, masks, config, backend, smooth_k, for_backward)
  o, lse, row_max = attend(qkv, masks, config, backend, q.dtype)
  return o, (qkv, v, o, lse, row_max, masks)


def prepass(qkv: QuantizedQKV, o, do, config: Config, backend: Backend) -> Prepass:
  """The backward's pre-pass: Delta = rowsum(dO * O) and psi(dO), dO8^T in the
  layout of the call's K8^T (`Layouts.backward`).

  With causality or a window, a NaN in dO makes the scale of its whole head
  NaN: jax.nn's dV is then NaN for every key (0 x NaN), while the kernels
  pair a dO block only with the keys it sees.
  """
  pre = backend.prepass(o, do, config, layout_of(qkv.k8_t))
  if config.banded:
    pre = pre._replace(do_scale=nm.spread_nan(pre.do_scale))
  return pre


@_stage
def _backward(config, backend, smooth_k, residuals, do):
  del smooth_k  # rows of dS sum to zero: the smoothing mean has no gradient term
  qkv, v, o, lse, row_max, masks = residuals
  (do,) = opaque(do)
  pre = prepass(qkv, o, do, config, backend)
  new_delta, lse = backend.saturated_rows(qkv, v, lse, do, pre.delta, masks, config)
  pre = pre._replace(delta=new_delta)
  if config.fp8:
    pre = pre._replace(fp8=backend.fp8_operands(qkv, v, do, pre, row_max, lse, masks, config))
  dq, dk, dv = backend.backward(qkv, v, lse, do, pre, masks, config)
  dq, dk, dv = _head_group_nan(qkv, lse, do, dq, dk, dv)
  # q, k and v share one dtype (the op checks it), which o carries too.
  return dq.astype(o.dtype), dk.astype(o.dtype), dv.astype(o.dtype), None


def _head_group_nan(qkv: QuantizedQKV, lse, do, dq, dk, dv):
  """dQ, dK, dV NaN on the head group of a NaN input, as jax.nn's 0 x NaN
  (nearly) has them. No kernel pairs a NaN row with the blocks that block
  skipping leaves out (the keys past a window, or no query's reach), and
  the kernels' row maxima (Triton's max skips NaN) can miss a NaN column of a
  dS or P^T tile: a key or value (their scales) makes dQ, dK and dV NaN; a
  query, its lse or a cotangent row dK and dV."""
  batch, kv_heads = dk.shape[0], dk.shape[2]
  group = lambda bad: jnp.any(bad.reshape(batch, kv_heads, -1), axis=-1)[:, None, :, None]
  bad_kv = group(jnp.isnan(qkv.k_scale)) | group(jnp.isnan(qkv.v_scale))
  bad_do = ~jnp.all(jnp.isfinite(jnp.swapaxes(do, 1, 2)), axis=-1)
  bad_q = bad_kv | group(jnp.isnan(qkv.q_scale) | jnp.isnan(lse) | bad_do)
  nan = lambda x, bad: jnp.where(bad, jnp.nan, x)
  return (nan(dq, jnp.repeat(bad_kv, dq.shape[2] // kv_heads, axis=2)), nan(dk, bad_q),
          nan(dv, bad_q))


sagebwd_attention.defvjp(_forward, _backward)
