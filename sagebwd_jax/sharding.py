"""Running the op on a device mesh: batch on one axis, heads on another.

The kernels refuse arrays sharded over automatic mesh axes, so the op
runs inside `jax.shard_map`: every device sees whole sequences of its own
batch rows and heads. That split is exact: SageBwd's quantization blocks,
K-smoothing mean and softmax statistics never mix batch rows or key/value
heads, so each shard computes exactly what the single device computes for it.

```python
# Auto axes: shard_map then splits the (unsharded) inputs itself.
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
out = sharded_attention(mesh, q, k, v, is_causal=True)  # q (B, T, H, D)
attend = shard_attention(jax.nn.dot_product_attention, mesh)  # any such op
# MaxText-style: the batch over several axes, or q's whole PartitionSpec.
attend = shard_attention(mesh=mesh, batch_axis=("data", "fsdp"), head_axis="tensor")
attend = shard_attention(mesh=mesh, spec=P(("data", "fsdp"), None, "tensor", None))
```

Query heads and key/value heads are both split on the head axis, so GQA
groups stay on one device: the key/value heads must divide by its size.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from sagebwd_jax.api import dot_product_attention

_ARRAY_KWARGS = ("query_seq_lengths", "key_value_seq_lengths", "segment_ids")
MeshAxes = str | tuple[str, ...] | None  # one mesh axis, several (major first), or none


def axis_size(mesh: Mesh, axis: MeshAxes) -> int:
  """Devices along `axis`, or along all of a tuple of axes (1 for None)."""
  if axis is None:
    return 1
  names = axis if isinstance(axis, tuple) else (axis,)
  size = 1
  for name in names:
    if name not in mesh.shape:
      raise ValueError(f"mesh has no axis {name!r}; its axes are {tuple(mesh.axis_names)}")
    size *= mesh.shape[name]
  return size


def check_split(mesh: Mesh, *, batch: int | None, num_heads: int, num_kv_heads: int,
                batch_axis: MeshAxes = "data", head_axis: MeshAxes = "model") -> None:
  """ValueError unless batch and heads divide evenly over their mesh axes."""
  n_data, n_model = axis_size(mesh, batch_axis), axis_size(mesh, head_axis)
  if batch is not None and batch % n_data:
    raise ValueError(f"batch size {batch} is not divisible by the {n_data} devices of "
                     f"mesh axis {batch_axis!r}")
  if num_kv_heads % n_model:
    raise ValueError(f"key/value heads ({num_kv_heads}) must be divisible by the "
                     f"{n_model} devices of mesh axis {head_axis!r}: each device takes "
                     f"whole GQA groups (query heads {num_heads})")
  if num_heads % n_model:
    raise ValueError(f"query heads ({num_heads}) must be divisible by the {n_model} "
                     f"devices of mesh axis {head_axis!r}")


def shard_attention(fn: Callable = dot_product_attention, mesh: Mesh | None = None, *,
                    batch_axis: MeshAxes = "data", head_axis: MeshAxes = "model",
                    spec: P | None = None) -> Callable:
  """`fn(q, k, v, **kwargs)` run under `jax.shard_map` over `mesh`.

  q, k, v are (B, T, H, D) (or unbatched (T, H, D): then only heads split):
  B goes on `batch_axis`, H (query and key/value heads alike) on `head_axis`;
  each is one mesh axis name, a tuple of them (the dimension split over all,
  as in a PartitionSpec: MaxText's `("data", "fsdp")`), or None (not
  split). `spec`, instead of the two, is q's PartitionSpec (B, T, H, D),
  whose T and D entries must be None: sequences and head dims stay whole.
  Mesh axes named by neither see replicated inputs. `query_seq_lengths`,
  `key_value_seq_lengths` and `segment_ids` are split with the batch; other
  keyword arguments are passed through as they are. Works inside or
  outside `jit`, with `grad`.
  """
  if mesh is None:
    raise ValueError("shard_attention needs a mesh")
  if spec is not None:
    batch_axis, head_axis = _axes_of(spec)
  batch_axis, head_axis = _axes("batch_axis", batch_axis), _axes("head_axis", head_axis)
  for axis in (batch_axis, head_axis):
    axis_size(mesh, axis)  # the axes exist

  @functools.wraps(fn)
  def wrapped(query, key, value, *args, **kwargs):
    if args:
      raise TypeError("pass bias/mask by keyword (SageBwd takes neither)")
    unbatched = query.ndim == 3
    check_split(mesh, batch=None if unbatched else query.shape[0],
                num_heads=query.shape[-2], num_kv_heads=key.shape[-2],
                batch_axis=None if unbatched else batch_axis, head_axis=head_axis)
    qkv_spec = (P(None, head_axis, None) if unbatched
                else P(batch_axis, None, head_axis, None))
    arrays = {n: kwargs.pop(n) for n in _ARRAY_KWARGS if kwargs.get(n) is not None}
    array_specs = jax.tree.map(lambda _: P(batch_axis), arrays)

    def local(q, k, v, arrays):
      return fn(q, k, v, **arrays, **kwargs)

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, array_specs),
        out_specs=qkv_spec, check_vma=False)
    # Under jit always: eager shard_map of the op crashed XLA:CPU (jax 0.11.2).
    return jax.jit(mapped)(query, key, value, arrays)

  return wrapped


def sharded_attention(mesh: Mesh, query: jax.Array, key: jax.Array, value: jax.Array, *,
                      batch_axis: MeshAxes = "data", head_axis: MeshAxes = "model",
                      spec: P | None = None, **kwargs) -> jax.Array:
  """`sagebwd_jax.dot_product_attention(query, key, value, **kwargs)` with the
  batch split over `batch_axis` and the heads over `head_axis` of `mesh` (or
  as q's PartitionSpec `spec` says; see `shard_attention`)."""
  return shard_attention(dot_product_attention, mesh, batch_axis=batch_axis,
                         head_axis=head_axis, spec=spec)(query, key, value, **kwargs)


def _axes(name: str, axes) -> MeshAxes:
  """One mesh axis name, a tuple of them (a list too) or None; else TypeError."""
  if axes is None or isinstance(axes, str):
    return axes
  if isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
    return tuple(axes) if axes else None
  raise TypeError(f"{name} must be a mesh axis name, a tuple of them or None; got {axes!r}")


def _axes_of(spec: P) -> tuple[MeshAxes, MeshAxes]:
  """(batch axes, head axes) of q's PartitionSpec (B, T, H, D)."""
  if not isinstance(spec, P):
    raise TypeError(f"spec must be a jax.sharding.PartitionSpec; got {spec!r}")
  entries = tuple(spec) + (None,) * (4 - len(spec))
  if len(entries) != 4 or entries[1] is not None or entries[3] is not None:
    raise ValueError(f"spec must be a PartitionSpec of q's (B, T, H, D) that splits only "
                     f"B and H (T and D stay whole on each device); got {spec}")
  return entries[0], entries[2]
