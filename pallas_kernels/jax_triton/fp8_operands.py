"""The FP8 backward's operands (`pallas_kernels.fp8_operands`, `Config.fp8`)
in one Triton launch beside the quantization pass, each 16-bit input read
once, each large output written once, in the layout the backward's kernels
read:

1. keys: the Triton quantization pass formed them for the backward
   (`types.Fp8Keys`: K' in E4M3 transposed, its block scale per token, each
   block's largest ||V_j||);
2. XLA on small arrays: each query block's largest ||V_j|| over the key
   blocks it sees (the bound b_i needs it before Q' can be scaled);
3. queries, one program per (query block, batch, head): b_i from the
   forward's row maxima and lse, and the pre-pass's Delta and ||dO_i||
   (`Prepass.do_norm`: dO is not read again); Q' = Q * scale *
   log2(e) * b_i in E4M3 transposed and its block scale per token;
4. XLA on small arrays: the group maxima and factors (`fp8_operands.assemble`).

Sequences' ids (masks) are not taken: they would move which key blocks a
query block sees and zero padding's V; the XLA pass forms those cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import numerics as nm
from pallas_kernels.batching import batch_folded
from pallas_kernels.fp8_operands import assemble, check_norms, max_over_seen, seen_key_blocks
from pallas_kernels.jax_triton import tiles
from pallas_kernels.jax_triton.launch import LaunchConfig
from pallas_kernels.jax_triton.quantize import check_register_blocks, transposed_shape
from pallas_kernels.layouts import check_layout
from pallas_kernels.types import (Config, Fp8Operands, Masks, Prepass, QuantizedQKV,
                                  TransposedLayout)


@triton.jit
def _query_kernel(q_ptr, do_norm_ptr, row_max_ptr, lse_ptr, delta_ptr, v_max_ptr, q8_t_ptr,
                  q_scale_ptr, bound_ptr, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr, MULTIPLIER: tl.constexpr, REGISTER_B: tl.constexpr):
  t, head, rows, tokens = tiles.program_block(T, H, D, BLOCK, REGISTER_B)
  stats = head * T + rows
  # numerics.ds_row_bound: b = m * (||dO_i|| * max_j ||V_j|| + |Delta_i|).
  m = tl.exp2(tiles.at_most_zero(tl.load(row_max_ptr + stats) - tl.load(lse_ptr + stats)))
  bound = m * (tl.load(do_norm_ptr + stats) * tl.load(v_max_ptr + stats)
               + tl.abs(tl.load(delta_ptr + stats)))
  tl.store(bound_ptr + stats, bound)
  # The XLA pass's order: Q times scale * log2(e), then times b, then its
  # block's inverse scale; each product rounds once.
  q = tl.load(q_ptr + tokens).to(tl.float32) * MULTIPLIER
  q8, scale = tiles.quantize_e4m3(q * bound[:, None])
  tiles.store_transposed(q8_t_ptr, q8, rows, head, t, T, D, BLOCK, REGISTER_B)
  tl.store(q_scale_ptr + stats, tl.full((BLOCK,), scale, tl.float32))


def fp8_operands(qkv: QuantizedQKV, v: jax.Array, prepass: Prepass, row_max: jax.Array,
                 lse: jax.Array, masks: Masks, config: Config, layout: TransposedLayout,
                 launch: LaunchConfig) -> Fp8Operands:
  """`pallas_kernels.fp8_operands.fp8_operands` (its arguments, and `launch`)
  without masks, the key side from `qkv.fp8_keys`. The values are the XLA
  pass's but for the last bit of b_i (the platform's exp2), of the scales
  amax / 448 (XLA under jit multiplies by 1 / 448; these divide) and the few
  E4M3 values of Q' that b_i's last bit moves by one step
  (tests/test_fp8_operands.py)."""
  if masks.q_ids is not None or masks.kv_ids is not None:
    raise NotImplementedError(
        "masks: the Triton FP8 operand pass takes no sequence ids (masks.q_ids, "
        "masks.kv_ids); pallas_kernels.fp8_operands.fp8_operands forms them with masks")
  if config.causal_exact:
    raise NotImplementedError(
        "causal_exact: the Triton FP8 operand pass neither takes K's first block mean off "
        "K' nor leaves the edge blocks out of its bounds; "
        "pallas_kernels.fp8_operands.fp8_operands forms them")
  if qkv.q16 is None or qkv.fp8_keys is None:
    raise ValueError("qkv.q16 or qkv.fp8_keys is None: the Triton FP8 operands are formed "
                     "from Q in the inputs' dtype (Config.keeps_qk16) and the key side the "
                     "Triton quantization pass forms for a backward (types.Fp8Keys)")
  check_norms(prepass)
  check_register_blocks(layout, config.block_q, config.block_kv)
  register_b = layout is TransposedLayout.REGISTER_B
  f32 = jnp.float32

  def queries(q, do_norm, row_max, lse, delta, v_max):
    batch, q_len, heads, head_dim = q.shape
    out_shape = [
        jax.ShapeDtypeStruct(transposed_shape(batch, heads, head_dim, q_len, layout),
                             jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((batch, heads, q_len), f32),
        jax.ShapeDtypeStruct((batch, heads, q_len), f32)]
    return tuple(launch.call(
        _query_kernel, [q, do_norm, row_max, lse, delta, v_max], out_shape,
        grid=(q_len // config.block_q, batch, heads), name="sagebwd_triton_fp8_queries",
        T=q_len, H=heads, D=head_dim, BLOCK=config.block_q,
        MULTIPLIER=config.scale * nm.LOG2_E, REGISTER_B=register_b))

  k8_t, k_scale, v_norm = qkv.fp8_keys
  check_layout("qkv.fp8_keys.k8_t", k8_t, layout)
  _, heads, q_len = prepass.delta.shape
  seen = seen_key_blocks(masks, config, q_len, v.shape[1])
  v_max = max_over_seen(v_norm, seen, heads, config.block_q)
  q8_t, q_scale, ds_bound = batch_folded(queries)(qkv.q16, prepass.do_norm, row_max, lse,
                                                  prepass.delta, v_max)
  return assemble(q8_t, q_scale, k8_t, k_scale, prepass.do_scale, ds_bound, seen, config)
