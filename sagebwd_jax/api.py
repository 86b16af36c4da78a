"""`dot_product_attention`: SageBwd behind the signature of jax.nn's.

This module pads sequences to whole blocks and head dims to a kernel's, builds
the masks and tries the implementations in order; `arguments.py` checks the
arguments, `implementations.py` says which implementations run here,
`sagebwd.py` holds the algorithm and `residual.py` the optional log-sum-exp.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import numerics as nm
from pallas_kernels.types import Backend, Config, DsPrecision, Masks, Quantization
from sagebwd_jax import arguments, implementations, residual
from sagebwd_jax.implementations import Implementation
from sagebwd_jax.sagebwd import sagebwd_attention

SegmentIds = jax.Array | tuple[jax.Array, jax.Array]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | jax.Array | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: SegmentIds | None = None,
    smooth_k: bool = True,
    smooth_q: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    implementation: Implementation | Backend | Sequence[Implementation | Backend] | None = None,
    return_residual: bool = False,
    ds_precision: DsPrecision = "int8",
    quantization: Quantization = "int8",
    causal_exact: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """SageBwd attention: INT8 forward and backward, drop-in for jax.nn's.

  Args:
    query: (B, Tq, H, D) or (Tq, H, D); bf16, fp16 or fp32; D <= 256. D of
      64, 128 or 256 runs as is; a smaller D is zero-padded to the next of
      these inside the op (zero channels change no score and no output).
    key: (B, Tk, Hkv, D) with H a multiple of Hkv (GQA/MQA); same dtype.
    value: like `key`.
    bias: None or an all-zero array (checked, so it must be concrete): an
      arbitrary additive bias cannot be folded into int8 scores. Use the
      structured masks below.
    mask: None or an all-True boolean array (checked, so concrete): a dense
      mask cannot be honoured tile by tile; use `is_causal`, sequence lengths
      or `segment_ids`.
    scale: multiplies Q.K^T; default 1/sqrt(D) of the caller's D. A Python
      float (any finite value, negative and zero included) goes into the int8
      scales exactly; a traced scale is multiplied into `query` first, which
      rounds it once more to query's dtype.
    is_causal: query i sees keys j <= i (top-left aligned, as jax.nn).
    query_seq_lengths: (B,) int; query rows past the length output 0, and
      neither they nor their cotangent can change any other output or
      gradient (they are zeroed before quantization and their cotangent is
      dropped), whatever they hold, NaN included.
    key_value_seq_lengths: (B,) int; keys past the length are masked and
      zeroed before quantization, and get zero gradients.
    local_window_size: sliding-window attention, as jax.nn: (left, right)
      lets query i see keys i - left .. i + right (an int w means (w, w)),
      besides `is_causal` and the other masks; the kernels skip the key
      blocks outside the window.
    segment_ids: (B, T) int when Tq == Tk, or a pair (q_ids (B, Tq),
      kv_ids (B, Tk)); a query sees only keys with its own id. A query row
      that sees no key at all outputs 0, never NaN.
    smooth_k: subtract the per-channel mean of K before quantizing
      (docs/algorithm.md); exact for softmax, essential for accuracy.
    smooth_q: per-block Q-smoothing with its fp32 bias (off by default).
    block_q, block_kv: quantization block sizes (powers of two >= 16): one
      int8 scale per block of rows, so results depend on them. Default 64
      (`arguments.DEFAULT_BLOCK`), or the smallest power of two >= 32 that
      covers a shorter sequence.
    implementation: a name or a sequence of names tried in order: a backend
      that cannot take the case raises NotImplementedError (with the reason)
      and the next one is tried. "triton" (the portable GPU kernels in
      Triton through jax_triton, `pip install sagebwd-jax[gpu]`; Triton's
      interpreter on a machine without a GPU; its forward quantizes P per
      row of each key block to 0..255, docs/algorithm.md), "mosaic" (the Hopper
      kernels in Mosaic GPU where they take the case, the Triton kernels
      for the rest; needs an sm_90 GPU and the Triton packages; its forward
      quantizes P per 128-key row to 0..255, docs/algorithm.md), "reference"
      (pure JAX, the kernels' arithmetic); and, as last
      resorts, "cudnn" and "xla": these are NOT SageBwd but full-precision
      attention by `jax.nn.dot_product_attention` ("cudnn" takes only bf16
      and fp16 on a GPU, and no segment_ids or smoothing options apply).
      None: ("mosaic", "triton") on a Hopper GPU, "triton" on other GPUs,
      "reference" without a GPU. A name may also be a backend object
      (`pallas_kernels.types.Backend`): the kernels with other launches
      (`TritonBackend`, `MosaicBackend`), or `ReferenceBackend(numerics)`,
      the reference quantizing P as `numerics` says (a
      `pallas_kernels.types.Numerics`, or a backend whose kernels' it then
      follows call by call: the tests' oracle for that backend).
    return_residual: also return the log-sum-exp of the scores (natural
      log, jax.nn's layout (B, Tq, H) or (Tq, H), the output's dtype; -inf
      for rows that see no key). Unlike jax.nn's (a stopped gradient), it
      has a gradient, computed in INT8 like the output's (an extra forward
      and backward, only when the loss uses it); "cudnn" and "xla" return
      jax.nn's.
    ds_precision: "int8" (default): the backward's dQ = dS.K and
      dK = dS^T.Q are INT8 products, dS quantized per token. "bf16": those
      two run in 16 bits, like dP (dS, Q and the smoothed K in the inputs'
      dtype, fp32 accumulation), so four of the seven products are INT8,
      and Q is quantized per token (free once Q8 enters only Q.K^T): dQ and
      dK lose the INT8 dS error, and every output some of the scores', at
      the cost of the two products' speed and of saving Q and K for the
      backward. The Hopper backend then runs its portable kernels.
    quantization: the numerics mode. "int8" (default): the paper's, six of
      the seven products in INT8. "int8_fp8": Q.K^T stays INT8 with
      K-smoothing; P.V, P^T.dO, dS.K and dS^T.Q take FP8 E4M3 operands with
      fp32 accumulation and scales known before each loop (V per block_kv
      keys, dS against a per-row bound; docs/algorithm.md), the FP8 tensor
      cores' form; dO.V^T stays 16-bit. About 2x the INT8 mode's error at
      sigma 1 and 1.03-1.38x of it from sigma 3 (README, Accuracy). With
      ds_precision="bf16", dS.K and dS^T.Q run in 16 bits instead. Its
      kernels: the Hopper forward and backward ("mosaic", with the Triton
      passes around them); what they do not take runs in "reference" (pure
      JAX), and "triton" raises NotImplementedError. The default is then
      ("mosaic", "reference") on an H100/H200 and "reference" elsewhere.
    causal_exact: with `is_causal` (or a `local_window_size`), no output
      row, nor its dQ, then depends on a key or value after the last key
      the row sees (with `is_causal`: on no later token), as in exact
      attention. K is smoothed by the mean of its first block_kv keys, and
      each row's score of that mean is added back exactly; the tiles that
      the causal edge crosses run in 16 bits; with
      quantization="int8_fp8", the backward's bounds are taken over what
      each row sees (docs/algorithm.md). Without causality or a window it
      changes nothing. "reference", "triton" (the Triton kernels in the
      INT8 mode) and "mosaic" (the Hopper kernels in both modes) implement
      it; the default is then "reference" on every device.

  Returns:
    The attention output, shaped and typed like `query` (and the residual
    with `return_residual`). Its gradient is SageBwd's quantized backward (a
    `jax.custom_vjp`).

  NaN or an infinity in the valid tokens of `query`, `key`, `value` or the
  output's cotangent comes out as NaN in every output and gradient element
  that jax.nn's makes non-finite (the reference and the Triton kernels;
  tests/test_nan.py). int8 has no NaN: a block's scale carries it, so it
  spreads further, within its batch row and key/value head group: a query
  makes its whole `block_q`-row block of the output and of dQ NaN and its
  head group's whole dK and dV; a key or a value makes the whole output and all
  gradients of its head group NaN (K-smoothing's mean carries a key that
  far anyway, and jax.nn's 0 x NaN nearly so); a cotangent row makes its
  head group's whole dK and dV NaN. Query rows that see no key still
  output 0.
  """
  unbatched = arguments.check_qkv(query, key, value)
  arguments.check_trivial("bias", bias, lambda x: not np.any(x), "all zeros",
                 "an additive bias cannot enter int8 scores")
  arguments.check_trivial("mask", mask, np.all, "all True",
                 "a dense boolean mask cannot be honoured tile by tile; express it with "
                 "is_causal, query_seq_lengths/key_value_seq_lengths or segment_ids")
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  batch, q_len, num_heads, _ = query.shape
  kv_len = key.shape[1]
  quantization = arguments.quantization(quantization)
  window = arguments.window(local_window_size)
  # Without causality or a window every row sees every key (ids aside): no
  # key comes after a row's last, and head-wide statistics stay, which
  # measured as accurate or more (docs/algorithm.md).
  causal_exact = (arguments.flag("causal_exact", causal_exact)
                  and (bool(is_causal) or window is not None))
  names = implementations.resolve(implementation, quantization, causal_exact)
  implementations.check_no_auto_sharding(names, query, key, value)
  q_lengths = arguments.lengths("query_seq_lengths", query_seq_lengths, batch, q_len)
  kv_lengths = arguments.lengths("key_value_seq_lengths", key_value_seq_lengths, batch,
                                 kv_len)
  q_seg, kv_seg = arguments.segments(segment_ids, batch, q_len, kv_len)
  scale = arguments.scale(scale)
  config = Config(
      scale=_kernel_scale(scale, query.shape[-1]), causal=bool(is_causal),
      smooth_q=bool(smooth_q),
      block_q=arguments.block("block_q", block_q, arguments.DEFAULT_BLOCK, q_len),
      block_kv=arguments.block("block_kv", block_kv, arguments.DEFAULT_BLOCK, kv_len),
      ds_precision=arguments.ds_precision(ds_precision),
      window=window, quantization=quantization, causal_exact=causal_exact)
  case = _Case(config, scale, bool(smooth_k), q_lengths, kv_lengths, q_seg, kv_seg)

  # Tokens past a length are zeroed before anything reads them, so they
  # cannot set an int8 block's scale or carry a NaN into valid rows; the
  # output's select drops their cotangent, so dO's blocks never see it.
  q_valid = arguments.valid(q_lengths, q_len)
  kv_valid = arguments.valid(kv_lengths, kv_len)
  query = arguments.zero_invalid(query, q_valid)
  key = arguments.zero_invalid(key, kv_valid)
  value = arguments.zero_invalid(value, kv_valid)

  if batch == 0:
    out, lse = jnp.zeros(query.shape, query.dtype), jnp.zeros((0, q_len, num_heads), query.dtype)
  else:
    out, lse = _first_that_takes(names, query, key, value, case, return_residual)
  out = arguments.zero_invalid(out, q_valid)
  if not return_residual:
    return out[0] if unbatched else out
  return (out[0], lse[0]) if unbatched else (out, lse)


class _Case(NamedTuple):
  """One call's checked options: the kernels' static `Config`, and besides it
  the caller's scale (jax.nn's fallbacks take it as given), K-smoothing
  (an op-level step) and the per-call arrays that become `Masks`."""

  config: Config
  scale: float | jax.Array | None
  smooth_k: bool
  q_lengths: jax.Array | None
  kv_lengths: jax.Array | None
  q_seg: jax.Array | None
  kv_seg: jax.Array | None


def _kernel_scale(scale: float | jax.Array | None, head_dim: int) -> float:
  """`Config.scale`: 1/sqrt(D) of the caller's D by default, |scale| for a
  Python float (`_sage` negates Q for a negative one: exact, psi is
  symmetric), 1 for a traced scale (Config is static: `_sage` multiplies it
  into Q's values)."""
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  return 1.0 if isinstance(scale, jax.Array) else abs(scale)


def _first_that_takes(names: tuple[str | Backend, ...], query, key, value, case: _Case,
                      return_residual: bool) -> tuple[jax.Array, jax.Array | None]:
  """Runs the first implementation in `names` that does not raise
  NotImplementedError; raises one listing every reason if none takes it."""
  reasons = []
  for name in names:
    try:
      if name in implementations.FULL_PRECISION:
        return _full_precision(name, query, key, value, case, return_residual)
      return _sage(name, query, key, value, case, return_residual)
    except NotImplementedError as e:
      reasons.append(f"{implementations.label(name)!r}: {e}")
  raise NotImplementedError("no implementation takes this case; " + "; ".join(reasons))


def _sage(name: str | Backend, query, key, value, case: _Case, return_residual: bool):
  batch, q_len, _, head_dim = query.shape
  kv_len = key.shape[1]
  config = case.config
  backend = implementations.backend(name, config.causal) if isinstance(name, str) else name
  if config.causal_exact and not implementations.has_causal_exact(backend):
    raise NotImplementedError(
        f"causal_exact=True: {implementations.label(backend)} does not compute its "
        "statistics (the first key block's K mean, the 16-bit edge tiles); "
        "implementation='mosaic', 'triton' or 'reference' does")
  block_q, block_kv = config.block_q, config.block_kv
  if (implementations.runs_kernels(backend) and implementations.on_gpu()
      and min(block_q, block_kv) < arguments.MIN_DEFAULT_BLOCK):
    raise NotImplementedError(
        f"block_q={block_q}, block_kv={block_kv}: the compiled kernels give a wrong dQ with "
        f"tiles below {arguments.MIN_DEFAULT_BLOCK} (a known bug); use "
        f"block_q, block_kv >= {arguments.MIN_DEFAULT_BLOCK}")

  if isinstance(case.scale, jax.Array):
    # Config is static: a traced scale goes into Q's values instead.
    query = (query.astype(jnp.float32) * case.scale).astype(query.dtype)
  elif case.scale is not None and case.scale < 0:
    query = -query  # exact: psi is symmetric

  padded_dim = next(d for d in arguments.KERNEL_HEAD_DIMS if d >= head_dim)
  pad = lambda x, n, d: jnp.pad(x, [(0, 0), (0, n), (0, 0), (0, d)])
  q_pad, kv_pad, d_pad = -q_len % block_q, -kv_len % block_kv, padded_dim - head_dim
  query = pad(query, q_pad, d_pad)
  key, value = pad(key, kv_pad, d_pad), pad(value, kv_pad, d_pad)
  masks = Masks()  # padded query rows need no mask: they are sliced off
  if (case.q_lengths is not None or case.kv_lengths is not None or case.q_seg is not None
      or kv_pad):
    masks = Masks(
        arguments.token_ids(case.q_seg, case.q_lengths, batch, q_len, q_len + q_pad,
                            nm.Q_INVALID_ID),
        arguments.token_ids(case.kv_seg, case.kv_lengths, batch, kv_len, kv_len + kv_pad,
                   nm.KV_INVALID_ID))

  out = sagebwd_attention(query, key, value, masks, config, backend, case.smooth_k)
  out = out[:, :q_len, :, :head_dim]
  lse = None
  if return_residual:
    lse = residual.log_sum_exp(query, key, value, masks, config, backend, case.smooth_k)
    lse = residual.residual(lse[:, :q_len], out.dtype)
  return out, lse


def _full_precision(name: str, query, key, value, case: _Case, return_residual: bool):
  """jax.nn.dot_product_attention as a last resort: full precision, not SageBwd."""
  if name == "cudnn":
    if not implementations.on_gpu():
      raise NotImplementedError(f"cuDNN attention needs a GPU; computations go to "
                                f"{implementations.platform()}")
    if query.dtype not in (jnp.bfloat16, jnp.float16):
      raise NotImplementedError(f"cuDNN attention takes bf16 or fp16, not {query.dtype}")
    if case.q_seg is not None:
      raise NotImplementedError("cuDNN attention through jax.nn takes no segment_ids")
  mask = None
  if case.q_seg is not None:
    mask = (case.q_seg[:, :, None] == case.kv_seg[:, None, :])[:, None]
  result = jax.nn.dot_product_attention(
      query, key, value, mask=mask, scale=case.scale, is_causal=case.config.causal,
      query_seq_lengths=case.q_lengths, key_value_seq_lengths=case.kv_lengths,
      local_window_size=case.config.window, implementation=name,
      return_residual=return_residual)
  return result if return_residual else (result, None)
