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
from pallas_kernels.layouts import backward_layout
from pallas_kernels.types import Backend, Config, Fp8Operands, Masks, Prepass, QuantizedQKV
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


def _first_key_block(k: jax.Array, kv_ids: jax.Array | None,
                     block: int) -> tuple[jax.Array, jax.Array]:
  """Keys 0..block-1 fp32 (B, Hkv, block, D), padding zeroed, and whether
  each is valid (B, 1, block, 1)."""
  keys = jnp.swapaxes(k[:, :block].astype(jnp.float32), 1, 2)
  valid = (jnp.ones((k.shape[0], block), jnp.float32) if kv_ids is None
           else (kv_ids[:, :block] != nm.KV_INVALID_ID).astype(jnp.float32))
  valid = valid[:, None, :, None]
  return keys * valid, valid


def first_block_mean(k: jax.Array, kv_ids: jax.Array | None, block: int) -> jax.Array:
  """Mean of the valid keys of the first `block` ones: (B, Hkv, D) fp32, 0
  where none is valid (`Config.causal_exact`'s K-smoothing).

  K8 lacks it and the 8-bit tiles add back q_i . m, so it only decides what
  the int8 grid spends its range on. A row meets it only in an 8-bit tile,
  a key block the row sees whole, so the row sees past every key of block 0;
  rows that see no whole block (with causality, those before block - 1)
  have edge tiles only (docs/algorithm.md, "Statistics over what each row
  sees"). Padding never enters it.
  """
  keys, valid = _first_key_block(k, kv_ids, block)
  return (nm.ordered_sum(keys, axis=-2)
          / jnp.maximum(nm.ordered_sum(valid, axis=-2), 1.0))


def key_means_seen(k: jax.Array, kv_ids: jax.Array | None, config: Config,
                   q_len: int) -> jax.Array:
  """For each query block, the mean m' that dQ's K is taken less
  (`ScoreTiles.dq_mean`): (B, Hkv, Tq // block_q, D) fp32
  (`Config.causal_exact`).

  The term dQ drops, rowsum(dS) m', is 0 in exact arithmetic (rows of dS
  sum to zero) but not in the 8-bit backward's (Delta comes from the INT8
  O), and K's channel bias would multiply it. m' is `first_block_mean` where
  the block's first row sees all of key block 0: K8 lacks that mean, so the
  8-bit tiles then need no term of their own (and only such query blocks
  have any). A query block before that has edge tiles only, and takes the
  mean of key block 0's valid keys up to its first row's last visible key
  (its position plus the band's right): no row of the block comes before
  them.
  """
  block = config.block_kv
  mean = first_block_mean(k, kv_ids, block)
  num_q = q_len // config.block_q
  _, right = causal_blocks.band(config.causal, config.window)
  # The last visible key of each query block's first row, while inside key block 0.
  early = ([] if right is None else
           [i * config.block_q + right for i in range(num_q)
            if i * config.block_q + right < block - 1])
  rest = jnp.broadcast_to(mean[:, :, None], (*mean.shape[:2], num_q - len(early),
                                             mean.shape[-1]))
  if not early:
    return rest
  keys, valid = _first_key_block(k, kv_ids, block)
  upto = (jnp.arange(block)[None, :] <= jnp.asarray(early)[:, None])[:, :, None]
  total = lambda x: nm.ordered_sum(jnp.where(upto, x[:, :, None], 0.0), axis=-2)
  return jnp.concatenate([total(keys) / jnp.maximum(total(valid), 1.0), rest], axis=2)


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
  means = (functools.partial(first_block_mean, block=config.block_kv) if config.causal_exact
           else key_mean)
  k_mean = means(k, masks.kv_ids) if smooth_k else None
  qkv = backend.quantize(q, k, v, k_mean, config, for_backward=for_backward,
                         layouts=backend.layouts(q, k, masks, config))
  if config.causal_exact:
    # The forward reads them too: the 8-bit tiles' q_i . m takes Q, the edge
    # tiles Q, K and V as they are.
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
  call's `Layouts.backward`.

  With causality or a window, a NaN in dO makes the scale of its whole head
  NaN: jax.nn's dV is then NaN for every key (0 x NaN), while the kernels
  pair a dO block only with the keys it sees.
  """
  pre = backend.prepass(o, do, config, backward_layout(qkv))
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
  nan_kv, nan_q = _nan_head_groups(qkv, lse, pre.do_scale)
  if config.fp8:
    fp8 = backend.fp8_operands(qkv, v, pre, row_max, lse, masks, config)
    pre = pre._replace(fp8=_nan_factors(fp8, nan_kv, nan_q))
  dq, dk, dv = backend.backward(qkv, v, lse, do, pre, masks, config)
  if not config.fp8:
    nan = lambda x, bad: jnp.where(bad[..., None], jnp.nan, x)
    dq, dk, dv = nan(dq, _per_query_head(nan_kv, dq.shape[2])), nan(dk, nan_q), nan(dv, nan_q)
  # q, k and v share one dtype (the op checks it), which o carries too.
  return dq.astype(o.dtype), dk.astype(o.dtype), dv.astype(o.dtype), None


def _nan_head_groups(qkv: QuantizedQKV, lse, do_scale):
  """(B, 1, Hkv) bool each: the head groups whose dQ, and whose dK and dV,
  are NaN, as jax.nn's 0 x NaN (nearly) has them. No kernel pairs a NaN row
  with the blocks that block skipping leaves out (the keys past a window, or
  no query's reach), and the kernels' row maxima (Triton's max skips NaN)
  can miss a NaN column of a dS or P^T tile: a key or value (their scales)
  makes dQ, dK and dV NaN; a query, its lse or a cotangent row (its block's
  scale, `numerics.abs_max`) dK and dV."""
  batch, kv_heads = qkv.k_scale.shape[:2]
  group = lambda bad: jnp.any(bad.reshape(batch, kv_heads, -1), axis=-1)[:, None, :]
  nan_kv = group(jnp.isnan(qkv.k_scale)) | group(jnp.isnan(qkv.v_scale))
  nan_q = nan_kv | group(jnp.isnan(qkv.q_scale) | jnp.isnan(lse) | jnp.isnan(do_scale))
  return nan_kv, nan_q


def _per_query_head(bad, heads: int):
  """(B, 1, Hkv) flags of head groups as (B, 1, H), one per query head."""
  return jnp.repeat(bad, heads // bad.shape[2], axis=2)


def _nan_factors(fp8: Fp8Operands, nan_kv, nan_q) -> Fp8Operands:
  """`_nan_head_groups` carried by the factors that every FP8 backward
  multiplies its sums by after the loop (dK's and dV's, and b_i k_top_i for
  dQ's rows), where x * NaN is NaN: no pass over the gradients."""
  heads = fp8.k_top.shape[1]
  nan = lambda x, bad: jnp.where(bad, jnp.nan, x)
  return fp8._replace(k_top=nan(fp8.k_top, _per_query_head(nan_kv, heads)[:, 0, :, None]),
                      dk_scale=nan(fp8.dk_scale, nan_q[:, 0]),
                      dv_scale=nan(fp8.dv_scale, nan_q[:, 0]))


sagebwd_attention.defvjp(_forward, _backward)
