"""The Triton kernels one by one against the pure-JAX reference backend: the
same int8 tensors, the same forward and backward results (CI: Triton's
interpreter; GPU: compiled through jax_triton), and, without a GPU, every
kernel compiled by Triton for Hopper and Ampere from the arguments the op
passes it. The op through these kernels is checked by the behaviour suite
(tests/test_attention_triton.py, tests/test_attention_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernels need the package triton")

from conftest import (CPU, backward_stage, check_quantization_pass, gaussian_qkv,  # noqa: E402
                      kernel_config)
from benchmarks import sass  # noqa: E402
from pallas_kernels.jax_triton.backend import TritonBackend  # noqa: E402
from pallas_kernels.jax_triton.backward_prepass import backward_prepass  # noqa: E402
from pallas_kernels.jax_triton import tiles  # noqa: E402
from pallas_kernels.jax_triton.launch import HOPPER_SHARED_MEMORY, LaunchConfig  # noqa: E402
from pallas_kernels.layouts import REGISTER_B, TOKENS, to_layout  # noqa: E402
from pallas_kernels.types import Layouts, Masks  # noqa: E402
from sagebwd_jax import dot_product_attention, metrics  # noqa: E402
from sagebwd_jax.reference import ReferenceBackend  # noqa: E402
from sagebwd_jax.sagebwd import key_mean  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
TRITON = TritonBackend.tuned(causal=False, interpret=not ON_GPU)
REFERENCE = ReferenceBackend(TRITON)  # with the numerics TRITON declares
# Kernel against reference on the same int8 tensors, fp32 results: contracted
# multiply-adds (and, compiled, the GPU's approximate exp2) move a few P and dS
# roundings (docs/performance-log.md: by how much); a wrong tile, scale or mask is
# off by far more than this.
TOLERANCE = 2e-3


def _masks(q_len: int, kv_len: int) -> Masks:
  rng = np.random.default_rng(0)
  return Masks(jnp.asarray(rng.integers(0, 3, (2, q_len)), jnp.int32),
               jnp.asarray(rng.integers(0, 3, (2, kv_len)), jnp.int32))


@pytest.mark.parametrize("head_dim,smooth_q,smooth_k,ds_precision,layouts", [
    (64, False, True, "int8", Layouts(REGISTER_B, REGISTER_B)),
    (128, True, False, "int8", Layouts()), (64, True, True, "bf16", Layouts())])
def test_quantization_pass_forms_the_reference_int8_tensors(head_dim, smooth_q, smooth_k,
                                                           ds_precision, layouts):
  """int8 tensors and scales as the reference's, in either layout (the
  Mosaic kernels' REGISTER_B: the same values, written permuted in one pass);
  with 16-bit dS, Q per token. Where V8^T is TOKENS the pass also forms the
  portable forward's accumulator start."""
  # Sums (the Q-smoothing means) may add in another order than XLA's.
  ours, ref = check_quantization_pass(TRITON, REFERENCE, head_dim, smooth_q, smooth_k,
                                      sum_atol=1e-6, ds_precision=ds_precision,
                                      layouts=layouts)
  if layouts.forward is REGISTER_B:
    assert ours.v_start is None
  else:
    np.testing.assert_array_equal(ours.v_start, tiles.shifted_accumulator_start(ref.v8_t, 64))


@pytest.mark.parametrize("for_backward", [True, False])
@pytest.mark.parametrize("layouts", [Layouts(), Layouts(REGISTER_B, REGISTER_B)],
                         ids=["tokens", "register_b"])
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (1, 128), (2, 128), (1, 64)])
def test_fp8_quantization_pass_forms_the_reference_tensors(kv_heads, head_dim, layouts,
                                                          for_backward):
  """quantization="int8_fp8": Q8 and K8 as in INT8, V8^T E4M3 per 64-key
  block equal to the reference's bit for bit, its scales (B, Hkv, Tk) to an
  ulp (the pass divides amax by 448 correctly rounded, XLA multiplies by
  1 / 448: tiles.quantize_e4m3); no Q8^T, no K8^T and no accumulator start.
  For a backward, the FP8 backward's key side (`types.Fp8Keys`) as the XLA
  operand pass forms it: K' (the smoothed K rounded to bf16) in E4M3 per
  block, bit for bit, its scales to an ulp, V's largest row norm per block
  to fp32 rounding (another sum order)."""
  ours, ref = check_quantization_pass(
      TRITON, REFERENCE, head_dim, False, True, layouts=layouts, quantization="int8_fp8",
      for_backward=for_backward, shape=(2, 256, 256, 4, kv_heads))
  assert ours.v_start is None and ours.q8_t is None and ours.k8_t is None
  assert ours.v8_t.dtype == jnp.float8_e4m3fn and ours.v_scale.shape == (2, kv_heads, 256)
  assert (ours.fp8_keys is not None) == for_backward
  if not for_backward:
    return
  from pallas_kernels import fp8_operands
  q, k, v, _ = gaussian_qkv(jax.random.key(0), 2, 256, 256, 4, kv_heads, head_dim, sigma=2.0)
  # On the CPU, as check_quantization_pass's reference: XLA:GPU's fp32
  # division is not correctly rounded.
  k, v = jax.device_put((k, v), CPU)
  with jax.default_device(CPU):
    k16 = (k.astype(jnp.float32) - key_mean(k, None)[:, None]).astype(k.dtype)
    k8, k_scale = fp8_operands._e4m3_blocks(jnp.swapaxes(k16, 1, 2).astype(jnp.float32), 64)
  got_k8 = jnp.swapaxes(to_layout(ours.fp8_keys.k8_t, TOKENS), -1, -2)
  np.testing.assert_array_equal(np.asarray(got_k8).view(np.uint8),
                                np.asarray(k8).view(np.uint8))
  np.testing.assert_allclose(ours.fp8_keys.k_scale, k_scale, rtol=1e-6)
  v_rows = jnp.sqrt(jnp.sum(jnp.square(jnp.swapaxes(v, 1, 2).astype(jnp.float32)), axis=-1))
  np.testing.assert_allclose(ours.fp8_keys.v_norm,
                             v_rows.reshape(2, kv_heads, -1, 64).max(axis=-1), rtol=1e-6)


def test_fp8_mode_quantizes_in_triton_and_its_kernels_refuse_it():
  """TritonBackend takes the FP8 mode at quantize, not in its forward; the
  Hopper backend sends FP8 quantization to its (Triton) fallback where V8^T
  is REGISTER_B (its forward runs), else to fp8_fallback (None here: it
  raises)."""
  from pallas_kernels.mosaic.backend import MosaicBackend
  q, k, v, _ = gaussian_qkv(jax.random.key(3), 1, 128, 128, 2, 1, 64)
  config = kernel_config(quantization="int8_fp8")
  triton = TritonBackend.tuned(causal=False, interpret=True)
  qkv = triton.quantize(q, k, v, None, config)
  assert qkv.v8_t.dtype == jnp.float8_e4m3fn
  with pytest.raises(NotImplementedError, match="int8_fp8"):
    triton.forward(qkv, Masks(), config, q.dtype)
  hopper = MosaicBackend(triton)
  register_b = Layouts(forward=REGISTER_B)
  ours = hopper.quantize(q, k, v, None, config, for_backward=False, layouts=register_b)
  direct = triton.quantize(q, k, v, None, config, for_backward=False, layouts=register_b)
  for a, b in zip(ours, direct):
    assert (a is None) == (b is None)
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  with pytest.raises(NotImplementedError, match="fp8_fallback"):
    hopper.quantize(q, k, v, None, config, for_backward=False)


@pytest.mark.parametrize("layout", [TOKENS, REGISTER_B])
def test_backward_prepass_matches_reference_rules(layout):
  _, _, o, do = gaussian_qkv(jax.random.key(1), 2, 128, 128, 2, 2, 64)
  delta, do8_t, do_scale, do_start = backward_prepass(o, do, block_q=64,
                                                      launch=TRITON.dq_launch, layout=layout)[:4]
  expected = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1)
  np.testing.assert_allclose(delta, jnp.swapaxes(expected, 1, 2), rtol=1e-5, atol=1e-5)
  blocks = np.asarray(do, np.float32).reshape(2, 2, 64, 2, 64)  # (B, block, row, H, D)
  amax = np.abs(blocks).max(axis=(2, 4))  # (B, block, H)
  expected8 = np.rint(blocks * (np.float32(127.0) / amax)[:, :, None, :, None]).astype(np.int8)
  expected8 = jnp.asarray(expected8.transpose(0, 3, 4, 1, 2).reshape(2, 2, 64, 128))
  np.testing.assert_array_equal(do8_t, to_layout(expected8, layout))
  np.testing.assert_allclose(do_scale, np.repeat(amax.transpose(0, 2, 1) / 127, 64, axis=-1),
                             rtol=1e-7)
  if layout is TOKENS:  # the portable dK/dV's accumulator start
    np.testing.assert_array_equal(do_start, tiles.shifted_accumulator_start(expected8, 64))
  else:
    assert do_start is None


@pytest.mark.parametrize("causal,smooth_q,ids", [(False, False, False), (True, True, True)])
def test_forward_matches_reference_with_unsigned_p(causal, smooth_q, ids):
  q, k, v, _ = gaussian_qkv(jax.random.key(3), 2, 128, 128, 4, 2, 64)
  config = kernel_config(causal=causal, smooth_q=smooth_q)
  masks = _masks(128, 128) if ids else Masks()
  qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
  o, lse, _ = TRITON.forward(qkv, masks, config, jnp.float32)
  o_ref, lse_ref, _ = REFERENCE.forward(qkv, masks, config, jnp.float32)
  assert float(metrics.relative_l2(o, o_ref)) <= TOLERANCE
  seen = np.isfinite(np.asarray(lse_ref))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
  np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(lse_ref)[seen], atol=1e-3)


@pytest.mark.parametrize("sigma", [30.0, 1e3, 1e4])
def test_forward_at_large_logits_matches_reference(sigma):
  """Each score is formed once from the exact distance to its row's largest,
  so exp2 of the largest is exactly 1 however large the logits (issue 17):
  O and lse stay at fp32 rounding from the reference's."""
  q, k, v, _ = gaussian_qkv(jax.random.key(9), 1, 256, 256, 2, 1, 128, sigma=sigma,
                            dtype=jnp.float32)
  config = kernel_config(scale=128**-0.5)
  qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
  o, lse, _ = TRITON.forward(qkv, Masks(), config, jnp.float32)
  o_ref, lse_ref, _ = REFERENCE.forward(qkv, Masks(), config, jnp.float32)
  # O: the GPU's approximate exp2 may flip a few roundings of P; a row whose
  # largest P is not 255 moves lse by its log.
  assert float(metrics.relative_l2(o, o_ref)) <= 1e-3
  assert float(metrics.relative_l2(lse, lse_ref)) <= 1e-6


# dK/dV's programs take 128 keys (four of these 32-key K blocks) where they
# tile T, and 32 at T=192; causal at 256 puts the diagonal in two query blocks.
@pytest.mark.parametrize("causal,smooth_q,ids,heads,seq", [
    (True, False, False, (2, 2), 256), (False, True, True, (4, 1), 128),
    (True, False, True, (2, 1), 192)])
def test_backward_matches_reference_fp32(causal, smooth_q, ids, heads, seq):
  q, k, v, do = gaussian_qkv(jax.random.key(4), 2, seq, seq, *heads, 64, dtype=jnp.float32)
  config = kernel_config(causal=causal, smooth_q=smooth_q, block_kv=32)
  masks = _masks(seq, seq) if ids else Masks()
  qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
  o, lse, _ = REFERENCE.forward(qkv, masks, config, jnp.float32)
  ours = backward_stage(TRITON, qkv, v, o, lse, do, masks, config)
  # The kernels multiply fp32 dO.V^T in fp32; on a GPU, XLA's default would
  # be TF32, whose rounding alone moves dK by about the tolerance here.
  with jax.default_matmul_precision("highest"):
    ref = backward_stage(REFERENCE, qkv, v, o, lse, do, masks, config)
  for name, a, b in zip(("dQ", "dK", "dV"), ours, ref):
    assert a.shape == b.shape, name
    assert float(metrics.relative_l2(a, b)) <= TOLERANCE, name


@pytest.mark.parametrize("causal,window,smooth_q,ids,seq,convert", [
    (True, None, False, True, 256, False), (False, None, True, False, 256, True),
    (True, None, False, False, 192, False), (False, (70, 30), False, False, 256, False),
    (True, (100, 0), False, True, 256, True)])
def test_other_launches_match_reference(causal, window, smooth_q, ids, seq, convert):
  """Every kernel with 128 rows (queries, or dK/dV's keys) per program where
  they tile T, over 64-token quantization blocks: scales are read per token,
  so the results are the 64-row programs'. Q-smoothing (means per Q block)
  and T=192 keep 64 query rows. `convert=False`: the products that start
  from zero by default start biased instead (the same exact values). A
  window's edges off the 64-token grid cross three blocks of a 128-row tile
  (tiles.edge_blocks)."""
  launch = LaunchConfig(interpret=not ON_GPU, num_warps=8, tile_rows=128, convert=convert)
  backend = TritonBackend(launch, launch, launch, launch)
  q, k, v, do = gaussian_qkv(jax.random.key(10), 2, seq, seq, 4, 2, 64, dtype=jnp.float32)
  config = kernel_config(causal=causal, smooth_q=smooth_q, window=window)
  masks = _masks(seq, seq) if ids else Masks()
  qkv = REFERENCE.quantize(q, k, v, key_mean(k, None), config)
  o, lse, _ = backend.forward(qkv, masks, config, jnp.float32)
  ours = backward_stage(backend, qkv, v, o, lse, do, masks, config)
  with jax.default_matmul_precision("highest"):  # not TF32 on a GPU (above)
    o_ref, lse_ref, _ = REFERENCE.forward(qkv, masks, config, jnp.float32)
    ref = backward_stage(REFERENCE, qkv, v, o, lse, do, masks, config)
  assert float(metrics.relative_l2(o, o_ref)) <= TOLERANCE
  for name, a, b in zip(("dQ", "dK", "dV"), ours, ref):
    assert float(metrics.relative_l2(a, b)) <= TOLERANCE, name


def test_tile_rows_only_where_they_tile_and_are_free():
  launch = LaunchConfig(tile_rows=128)
  assert launch.tile_rows_for(256, 64) == 128
  assert launch.tile_rows_for(192, 64) == 64  # 128 does not tile 192
  assert launch.tile_rows_for(256, 64, free=False) == 64  # Q-smoothing's blocks
  assert LaunchConfig().tile_rows_for(256, 32) == 32


def test_shifted_accumulator_start_carries_128_times_the_column_sums():
  x8_t = np.random.default_rng(0).integers(-127, 128, (2, 3, 16, 128)).astype(np.int8)
  start = np.asarray(tiles.shifted_accumulator_start(jnp.asarray(x8_t), 64))
  sums = x8_t.astype(np.int64).reshape(2, 3, 16, 2, 64).sum(-1).transpose(0, 1, 3, 2)
  np.testing.assert_array_equal(start, 0x4B400000 + 128 * sums)


@pytest.mark.parametrize("field,value", [("num_warps", 6), ("num_stages", 0),
                                         ("tile_rows", 96), ("tile_rows", 512)])
def test_launch_config_names_a_bad_field(field, value):
  with pytest.raises(ValueError, match=field):
    LaunchConfig(**{field: value})


def test_tiles_above_128_fall_through_to_the_next_implementation():
  q, k, v, _ = gaussian_qkv(jax.random.key(5), 1, 256, 256, 2, 2, 64)
  with pytest.raises(NotImplementedError, match="tiles up to 128"):
    dot_product_attention(q, k, v, block_q=256, implementation="triton")
  out = dot_product_attention(q, k, v, block_q=256, implementation=("triton", "reference"))
  ref = dot_product_attention(q, k, v, block_q=256, implementation="reference")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_missing_package_names_it(monkeypatch):
  monkeypatch.setitem(sys.modules, "pallas_kernels.jax_triton.backend", None)
  q, k, v, _ = gaussian_qkv(jax.random.key(6), 1, 64, 64, 2, 2, 64)
  with pytest.raises(NotImplementedError, match="need the packages triton"):
    dot_product_attention(q, k, v, implementation="triton")


@pytest.mark.skipif(ON_GPU, reason="the GPU runs them compiled")
@pytest.mark.parametrize("op_kwargs", [
    dict(head_dim=128),
    dict(head_dim=64, is_causal=True, smooth_q=True,
         segment_ids=jnp.stack([jnp.arange(128) // 48, jnp.arange(128) // 80])),
    dict(head_dim=128, is_causal=True, ds_precision="bf16"),
    dict(head_dim=64, is_causal=True, causal_exact=True),
    dict(head_dim=64, is_causal=True, causal_exact=True, smooth_k=False),
    dict(head_dim=128, is_causal=True, causal_exact=True, smooth_q=True, ds_precision="bf16",
         local_window_size=(100, 0), block_q=32,
         segment_ids=jnp.stack([jnp.arange(128) // 48, jnp.arange(128) // 80]))])
def test_kernels_compile_for_hopper_and_ampere(op_kwargs):
  """Triton compiles every kernel launch of the op, as jax_triton would on a
  GPU, for sm_90 and sm_80: the compiled path's only check without a GPU."""
  op_kwargs = dict(op_kwargs)
  q, k, v, _ = gaussian_qkv(jax.random.key(7), 2, 128, 128, 4, 2, op_kwargs.pop("head_dim"))
  loss = lambda q, k, v: dot_product_attention(q, k, v, implementation="triton",
                                               **op_kwargs).astype(jnp.float32).sum()
  launches = sass.triton_launches(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  # quantize (Q, K and V at once); forward; prepass; saturated rows; dK/dV; dQ
  assert len(launches) == 6
  for captured in launches:
    for arch in (90, 80):
      assert captured.compile(arch), (captured.name, arch)


@pytest.mark.parametrize("layouts", [Layouts(), Layouts(REGISTER_B, REGISTER_B)],
                         ids=["tokens", "register_b"])
def test_fp8_quantization_pass_compiles_for_hopper(layouts):
  """Triton compiles the FP8 pass, one launch, for sm_90, as jax_triton
  would on a GPU, V converting to E4M3 with the instruction whose rounding
  the interpreter's conversion follows."""
  q, k, v, _ = gaussian_qkv(jax.random.key(7), 2, 128, 128, 4, 2, 128)
  config = kernel_config(quantization="int8_fp8")
  launches = sass.triton_launches(
      lambda q, k, v: TRITON.quantize(q, k, v, key_mean(k, None), config, layouts=layouts),
      q, k, v)
  assert [launch.name for launch in launches] == ["sagebwd_triton_quantize"]
  assert launches[0].compile(90)
  assert "cvt.rn.satfinite.e4m3x2.f32" in launches[0].compiled(90).asm["ptx"]


def test_forward_alone_writes_no_transposed_layouts():
  """The transposed int8 Q and K feed the backward only: a forward that no
  gradient follows leaves them out of the quantization pass (V's transposed
  layout is the forward's own operand), a differentiated one writes them."""
  q, k, v, _ = gaussian_qkv(jax.random.key(7), 1, 128, 128, 2, 2, 64)
  attn = lambda q, k, v: dot_product_attention(q, k, v, implementation="triton")
  loss = lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum()
  for fn, expected in ((attn, [(False, False)]),
                       (jax.grad(loss, argnums=(0, 1, 2)), [(True, True)])):
    quantized = [(launch.constants["Q_TRANSPOSED"], launch.constants["K_TRANSPOSED"])
                 for launch in sass.triton_launches(fn, q, k, v)
                 if launch.name == "sagebwd_triton_quantize"]
    assert quantized == expected


@pytest.mark.skipif(ON_GPU, reason="a compile-only check")
@pytest.mark.parametrize("causal", [False, True])
def test_forward_keeps_three_programs_per_sm(tmp_path, causal):
  """The forward at its default launch (4 warps, 64 x 64 tiles) fits three
  programs per SM in registers: one 128-thread warpgroup per program hides
  its latencies only with others beside it (docs/performance-log.md: what two
  programs cost)."""
  try:
    sass.tool("cuobjdump")
  except SystemExit as e:
    pytest.skip(str(e))
  q, k, v, _ = gaussian_qkv(jax.random.key(7), 1, 4096, 4096, 2, 2, 128)
  attn = lambda q, k, v: dot_product_attention(q, k, v, implementation="triton",
                                               is_causal=causal)
  (forward,) = [launch for launch in sass.triton_launches(attn, q, k, v)
                if launch.name == "sagebwd_triton_forward"]
  cubin = tmp_path / "forward.cubin"
  cubin.write_bytes(forward.compile(90))
  registers, stack = sass.resources(str(cubin))
  assert stack == 0 and sass.programs_per_sm(registers, 32 * forward.num_warps) >= 3, registers


@pytest.mark.parametrize("block_q,block_kv,dtype,ds_precision", [
    (64, 64, jnp.bfloat16, "int8"), (128, 64, jnp.bfloat16, "int8"),
    (64, 128, jnp.bfloat16, "int8"), (128, 128, jnp.bfloat16, "int8"),
    (64, 64, jnp.float32, "int8"), (128, 128, jnp.float32, "int8"),
    (128, 128, jnp.bfloat16, "bf16")])
def test_every_launch_fits_hopper_shared_memory(block_q, block_kv, dtype, ds_precision):
  """Each kernel of forward+backward at its default launch, compiled for
  sm_90, asks for no more shared memory than an H200 program has: dK/dV at 3
  pipeline stages with 128-query steps once asked for 298 KB and failed at
  launch (LaunchConfig.fitted now drops stages)."""
  shape = jax.ShapeDtypeStruct((1, 256, 2, 128), dtype)
  loss = lambda q, k, v: dot_product_attention(
      q, k, v, implementation="triton", is_causal=True, block_q=block_q,
      block_kv=block_kv, ds_precision=ds_precision).astype(jnp.float32).sum()
  for launch in sass.triton_launches(jax.grad(loss, argnums=(0, 1, 2)), shape, shape, shape):
    assert launch.shared_memory(90) <= HOPPER_SHARED_MEMORY, launch.name  # launch.py's


def test_shared_memory_is_the_compiled_kernels():
  """`TritonLaunch.shared_memory` runs Triton's passes up to the allocation
  only; the cubins of the forward and the backward ask the same."""
  shape = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  loss = lambda q, k, v: dot_product_attention(q, k, v, implementation="triton").sum()
  for launch in sass.triton_launches(jax.grad(loss, argnums=(0, 1, 2)), shape, shape, shape):
    assert launch.shared_memory(90) == launch.compiled(90).metadata.shared > 0, launch.name


def test_fitted_keeps_the_stages_that_fit(monkeypatch):
  """Stages are dropped, down to one, until fixed + stages * per-stage bytes
  (plus Triton's slack) fit the device's limit, found by compute capability."""
  from pallas_kernels.jax_triton import launch as launch_module
  monkeypatch.setattr(launch_module.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(launch_module.jax, "devices",
                      lambda: [type("Gpu", (), {"compute_capability": "8.9"})()])
  launch_module.shared_memory_limit.cache_clear()
  try:
    assert launch_module.shared_memory_limit() == 101376  # an RTX 4090 / L40S
    three = LaunchConfig(num_stages=3)
    room = 101376 - launch_module.SHARED_MEMORY_SLACK
    assert three.fitted(fixed_bytes=room - 3 * 1000, stage_bytes=1000) == three
    assert three.fitted(fixed_bytes=room - 3 * 1000 + 1, stage_bytes=1000).num_stages == 2
    assert three.fitted(fixed_bytes=room, stage_bytes=1000).num_stages == 1
    with pytest.raises(ValueError, match="stage_bytes"):
      three.fitted(fixed_bytes=0, stage_bytes=0)
  finally:
    launch_module.shared_memory_limit.cache_clear()


# Compiled on a GPU (run through the device tool).
@pytest.mark.gpu
def test_gpu_kernels_match_reference():
  test_quantization_pass_forms_the_reference_int8_tensors(128, True, False, "int8", Layouts())
  test_quantization_pass_forms_the_reference_int8_tensors(64, False, True, "int8",
                                                          Layouts(REGISTER_B, REGISTER_B))
  test_forward_matches_reference_with_unsigned_p(True, True, True)
  test_backward_matches_reference_fp32(False, True, True, (4, 1), 128)
  test_forward_at_large_logits_matches_reference(1e4)


_TORCH_PROBE = """
import importlib.abc, sys, types
attempts = []
class Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name == "torch":
      attempts.append(name)
    return None
sys.meta_path.insert(0, Finder())
fake = types.ModuleType("torch") if sys.argv[1] == "imported" else None
if fake is not None:
  sys.modules["torch"] = fake
from pallas_kernels.jax_triton import launch
launch._specializer_without_torch()
from triton._C.libtriton import native_specialize_impl
assert native_specialize_impl(None, 64, False, True, True) == ("i32", "D")
assert attempts == [], attempts
assert sys.modules.get("torch") is fake, sys.modules.get("torch")
"""


@pytest.mark.parametrize("torch_state", ["not_imported", "imported"])
def test_triton_specializer_is_initialized_without_importing_torch(torch_state):
  """jax_triton specializes kernel arguments with Triton's native
  specializer, whose first call in a process imports torch where it is
  installed (seconds of the op's first compile); the launch initializes it
  with torch hidden, leaves no trace of that in `sys.modules` (a later
  `import torch` works), and leaves an imported torch alone. A fresh
  process: the specializer initializes once per process."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  subprocess.run([sys.executable, "-c", _TORCH_PROBE, torch_state], check=True, env=env,
                 cwd=root)
