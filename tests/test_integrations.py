"""docs/integrations.md: each recipe's adapter, executed from the document,
on a small model against full-precision attention."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from conftest import gaussian_qkv, oracle64, rel_l2, value_and_grads

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _adapter(section: str, name: str):
  """The function `name` defined by the one code block of `section`."""
  text = DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
  (code,) = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
  namespace = {}
  exec(compile(code, str(DOC), "exec"), namespace)
  return namespace[name]


def _packed_segments(batch: int, seq_len: int) -> jax.Array:
  """Two documents and trailing padding (id 0) per row, as MaxText packs them."""
  ids = np.ones((batch, seq_len), np.int32)
  ids[:, seq_len // 3:] = 2
  ids[:, -7:] = 0
  return jnp.asarray(ids)


def _check(got, want):
  for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
    assert rel_l2(a, b) < 0.05, (name, rel_l2(a, b))


def test_maxtext_adapter_on_a_gqa_block_with_packed_documents():
  attend = _adapter("MaxText", "maxtext_sagebwd_attention")
  head_dim = 128
  q, k, v, do = gaussian_qkv(jax.random.key(0), 2, 96, 96, 4, 2, head_dim)
  seg = _packed_segments(2, 96)
  q_scaled = (q.astype(jnp.float32) * head_dim**-0.5).astype(q.dtype)  # MaxText's query scale
  o, grads = value_and_grads(lambda q, k, v: attend(q, k, v, seg), q_scaled, k, v, do)
  want_o, want_grads = oracle64(q_scaled, k, v, do, scale=1.0, is_causal=True,
                                segment_ids=seg)
  _check((o, *grads), (want_o, *want_grads))


def test_levanter_adapter_takes_named_axes_in_any_order():
  attend = _adapter("levanter", "levanter_sagebwd_attention")
  q, k, v, do = gaussian_qkv(jax.random.key(1), 2, 64, 64, 4, 4, 64)
  seg = _packed_segments(2, 64)
  # levanter's names, in an order of its own: (heads, batch, head_size, position).
  perm = (2, 0, 3, 1)
  names = ["heads", "batch", "head_size", "position"]
  kv_names = ["heads", "batch", "head_size", "key_position"]
  named = lambda x: jnp.transpose(x, perm)

  def fn(q, k, v):
    out = attend(named(q), names, named(k), named(v), kv_names, pos="position",
                 key_pos="key_position", heads="heads", head_size="head_size", causal=True,
                 segment_ids=seg)
    assert out.shape == named(q).shape
    return jnp.transpose(out, np.argsort(perm))

  o, grads = value_and_grads(fn, q * 0.125, k, v, do)
  want_o, want_grads = oracle64(q * 0.125, k, v, do, scale=1.0, is_causal=True,
                                segment_ids=seg)
  _check((o, *grads), (want_o, *want_grads))
