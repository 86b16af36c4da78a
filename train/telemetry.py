"""Quantization-error telemetry: each layer's attention, as trained, against
full-precision attention on the same inputs (`--telemetry-every N`).

One jitted function of (params, tokens) runs the model's loss once more, on
one batch, with a zero probe added to each attention layer's q, k, v and
output: the probes' gradients are the live dO of every layer and the dQ, dK,
dV that the model's own attention backward (SageBwd's) returns for it. Each
layer's captured q, k, v and dO are then pushed through exact softmax
attention in fp32, batch row by batch row (so no (B, H, T, T) array exists),
and compared:

- `o_rel_l2`, `dq_rel_l2`, `dk_rel_l2`, `dv_rel_l2`: relative L2 of the
  layer's output and gradients against the exact ones.
- `ds_rel_l2` (SageBwd only): the error the backward's quantization of dS
  alone adds, applied to the exact dS: int8 per query row of each 64-key
  tile (as the dQ kernel quantizes it), or a cast to the inputs' dtype with
  `--ds-precision bf16`. The kernels do not expose the dS they form.
- `max_abs_q`, `max_abs_k`: the largest |q| and |k| fed to attention (after
  QK-norm and RoPE); `max_logit`: the largest scaled logit q.k / sqrt(D)
  that a query sees (causal).

Each is a list with one value per layer. Attention under `--attention full`
is compared the same way (its errors are the 16-bit compute dtype's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pallas_kernels import numerics as nm
from sagebwd_jax.flax.llama import unscanned

DS_TILE = 64  # keys per tile: the op's default block_kv
_HIGHEST = jax.lax.Precision.HIGHEST


def make_telemetry(model: nnx.Module, ds_quantization: str | None):
  """A jitted `telemetry(params, tokens (B, T + 1)) -> {key: (n_layers,) fp32}`.

  `model` is the Llama being trained (its graph and non-parameter state are
  captured; the parameters are the argument); `ds_quantization` is "int8",
  "bf16" or None (full-precision attention: no `ds_rel_l2`).
  """
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)

  def hooked(params, hook):
    """The model with each layer's attention call (`Attention._attend`, which
    runs the op, under shard_map with a mesh) routed through
    hook(layer, attend, q, k, v); a traced copy, rebuilt per call, its layers
    one by one (unscanned)."""
    model = unscanned(nnx.merge(graphdef, params, rest))
    for i, block in enumerate(model.blocks):
      block.attn._attend = functools.partial(hook, i, block.attn._attend)
    return model

  def probed_loss(params, probes, tokens):
    captured = []

    def hook(layer, attend, q, k, v):
      pq, pk, pv, po = probes[layer]
      o = attend(q + pq, k + pk, v + pv)
      captured.append((q, k, v, o))
      return o + po

    logits = hooked(params, hook)(tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()
    return loss, captured

  def probe_shapes(params, tokens):
    """Zero probes shaped like each layer's q, k, v and output."""
    shapes = []

    def hook(layer, attend, q, k, v):
      o = attend(q, k, v)
      shapes.append(tuple(jnp.zeros(x.shape, x.dtype) for x in (q, k, v, o)))
      return o

    hooked(params, hook)(tokens[:, :-1])
    return shapes

  def telemetry(params, tokens):
    probes = jax.eval_shape(probe_shapes, params, tokens)
    probes = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), probes)
    grads, captured = jax.grad(probed_loss, argnums=1, has_aux=True)(params, probes, tokens)
    rows = [_layer(q, k, v, o, dq, dk, dv, do, ds_quantization)
            for (q, k, v, o), (dq, dk, dv, do) in zip(captured, grads)]
    return {key: jnp.stack([row[key] for row in rows]) for key in rows[0]}

  return jax.jit(telemetry)


def _rel_l2(x: jax.Array, ref: jax.Array) -> jax.Array:
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  return _ratio(jnp.sum(jnp.square(x - ref)), jnp.sum(jnp.square(ref)))


def _ratio(err2: jax.Array, ref2: jax.Array) -> jax.Array:
  """sqrt(err2 / ref2); 0 when both are 0."""
  return jnp.sqrt(jnp.where(ref2 > 0, err2 / jnp.where(ref2 > 0, ref2, 1.0),
                            jnp.where(err2 > 0, jnp.inf, 0.0)))


def _layer(q, k, v, o, dq, dk, dv, do, ds_quantization) -> dict[str, jax.Array]:
  """One layer's errors; q, o, dq, do (B, T, H, D), k, v, dk, dv (B, T, Hkv, D)."""
  o32, (dq32, dk32, dv32), max_logit, (ds_err2, ds_ref2) = jax.lax.map(
      lambda row: exact_attention(*row, ds_quantization=ds_quantization), (q, k, v, do))
  result = {"o_rel_l2": _rel_l2(o, o32), "dq_rel_l2": _rel_l2(dq, dq32),
            "dk_rel_l2": _rel_l2(dk, dk32), "dv_rel_l2": _rel_l2(dv, dv32),
            "max_abs_q": jnp.max(jnp.abs(q)).astype(jnp.float32),
            "max_abs_k": jnp.max(jnp.abs(k)).astype(jnp.float32),
            "max_logit": jnp.max(max_logit)}
  if ds_quantization is not None:
    result["ds_rel_l2"] = _ratio(jnp.sum(ds_err2), jnp.sum(ds_ref2))
  return result


def exact_attention(q, k, v, do, *, ds_quantization: str | None = None):
  """Causal softmax attention and its gradients for one batch row, in fp32.

  q, do (T, H, D), k, v (T, Hkv, D) -> (O, (dQ, dK, dV), the largest
  visible logit, (sum of squared errors of dS's quantization, sum of dS^2)).
  """
  dtype = q.dtype
  q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
  seq, heads, head_dim = q.shape
  group = heads // k.shape[1]
  k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
  scale = head_dim ** -0.5
  logits = jnp.einsum("qhd,khd->hqk", q, k, precision=_HIGHEST) * scale
  causal = (jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :])[None]
  logits = jnp.where(causal, logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  o = jnp.einsum("hqk,khd->qhd", p, v, precision=_HIGHEST)
  dp = jnp.einsum("qhd,khd->hqk", do, v, precision=_HIGHEST)
  delta = jnp.swapaxes(jnp.sum(do * o, axis=-1), 0, 1)  # (H, T)
  ds = p * (dp - delta[..., None])
  dq = jnp.einsum("hqk,khd->qhd", ds, k, precision=_HIGHEST) * scale
  dk = jnp.einsum("hqk,qhd->khd", ds, q, precision=_HIGHEST) * scale
  dv = jnp.einsum("hqk,qhd->khd", p, do, precision=_HIGHEST)
  sum_group = lambda x: x.reshape(seq, heads // group, group, head_dim).sum(axis=2)
  ds_err2 = jnp.zeros((), jnp.float32)
  if ds_quantization is not None:
    ds_err2 = jnp.sum(jnp.square(_quantized_ds(ds, ds_quantization, dtype) - ds))
  return (o, (dq, sum_group(dk), sum_group(dv)), jnp.max(logits),
          (ds_err2, jnp.sum(jnp.square(ds))))


def _quantized_ds(ds: jax.Array, ds_quantization: str, dtype) -> jax.Array:
  """dS (H, Tq, Tk) as the backward's dS.K takes it, back in fp32."""
  if ds_quantization == "bf16":
    # Not a cast there and back, which XLA may drop (excess precision).
    finfo = jnp.finfo(dtype)
    return jax.lax.reduce_precision(ds, finfo.nexp, finfo.nmant)
  keys = ds.shape[-1]
  tiles = jnp.pad(ds, ((0, 0), (0, 0), (0, -keys % DS_TILE)))
  tiles = tiles.reshape(*ds.shape[:-1], -1, DS_TILE)
  ds8, row_scale = nm.quantize_rows(tiles)
  return (ds8.astype(jnp.float32) * row_scale[..., None]).reshape(*ds.shape[:-1], -1)[..., :keys]
