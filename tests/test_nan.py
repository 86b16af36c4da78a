"""NaN and infinity in, NaN out (issue 17): every output and gradient element
that jax.nn's attention makes non-finite is NaN here too, on the reference
and on the Pallas kernels (interpret mode; compiled on a GPU). int8 has no
NaN, so a non-finite value travels in its block's scale, and where block
skipping leaves no product to carry it, through `numerics.spread_nan`; the
spread beyond jax.nn's elements stays within the batch row and the key/value
head group (the op's docstring says how far)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import gaussian_qkv, sage, value_and_grads

NAMES = ("O", "dQ", "dK", "dV")
IMPLS = ["reference", "pallas"]
# Two batch rows, two key/value heads of two query heads; three 32-token
# blocks, so causal masking skips blocks.
B, T, H, HKV, D, BLOCK = 2, 96, 4, 2, 16, 32


@functools.partial(jax.jit, static_argnames=("is_causal",))
def _jax_nn(q, k, v, do, is_causal):
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=is_causal,
                         implementation="xla")
  return value_and_grads(fn, q, k, v, do)


def _flat(out):
  return [np.asarray(x, np.float32) for x in (out[0], *out[1])]


def _inputs(where: str, index: tuple[int, ...], value: float):
  q, k, v, do = gaussian_qkv(jax.random.key(0), B, T, T, H, HKV, D, dtype=jnp.float32)
  arrays = dict(q=q, k=k, v=v, do=do)
  arrays[where] = arrays[where].at[index].set(value)
  return arrays["q"], arrays["k"], arrays["v"], arrays["do"]


def _check(implementation, where, index, value, **kw):
  q, k, v, do = _inputs(where, index, value)
  want = _flat(_jax_nn(q, k, v, do, kw.get("is_causal", False)))
  got = _flat(sage(q, k, v, do, implementation=implementation, block_q=BLOCK,
                   block_kv=BLOCK, **kw))
  group = index[2] // (H // HKV) if where in "qdo" else index[2]
  for name, a, b in zip(NAMES, got, want):
    missing = ~np.isfinite(b) & ~np.isnan(a)
    assert not missing.any(), (
        f"{name}: {missing.sum()} elements non-finite in jax.nn but not NaN here, "
        f"first at {np.argwhere(missing)[0]}")
    assert not np.isinf(a).any(), f"{name} has infinities"
    # The spread stays within the batch row and the key/value head group.
    heads = slice(group, group + 1) if name == "dK" or name == "dV" else slice(
        group * (H // HKV), (group + 1) * (H // HKV))
    outside = np.isnan(a).copy()
    outside[0, :, heads] = False
    assert not outside.any(), f"{name}: NaN outside batch row 0, heads {heads}"
  return got


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where,index", [
    ("q", (0, 40, 1, 3)), ("k", (0, 70, 0, 5)), ("v", (0, 70, 1, 2)), ("do", (0, 40, 2, 7)),
    ("q", (0, 10, 0, 0)), ("do", (0, 5, 3, 1))])
def test_nan_in_is_nan_out(implementation, causal, where, index):
  _check(implementation, where, index, np.nan, is_causal=causal)


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("where,value", [("q", np.inf), ("k", -np.inf), ("v", np.inf)])
def test_infinity_in_is_nan_out(implementation, where, value):
  _check(implementation, where, (0, 50, 1, 4), value, is_causal=True)
