"""Devices for training: multi-host start-up, the ("data", "model") mesh and
where the state and the batches live on it.

- `--mesh data=N,model=M`: N * M must be the number of devices (of all
  processes). Default: data = every device, model = 1. One device is a mesh
  of 1: the same code runs everywhere.
- Parameters and optimizer state are replicated. A batch is split on "data"
  (each process loads only the rows its devices hold); under jit XLA reduces
  the gradients of the replicated parameters across "data" itself.
- Attention runs under `jax.shard_map` over the mesh, batch on "data" and
  heads on "model" (`sagebwd_jax.sharding`): the kernels refuse arrays
  sharded over automatic mesh axes. Everything else in the model is left to
  XLA's sharding propagation.
- Multi-host: `jax.distributed.initialize` from `--coordinator`,
  `--num-processes`, `--process-id`, or from the environment
  (`JAX_COORDINATOR_ADDRESS`, with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`,
  or what JAX detects itself: SLURM, Open MPI, ...; `--coordinator auto`
  forces that detection).
"""

from __future__ import annotations

import os

import numpy as np

AXES = ("data", "model")


def parse_mesh(spec: str | None, n_devices: int | None = None) -> dict[str, int]:
  """`"data=4,model=2"` -> {"data": 4, "model": 2}; an axis left out takes
  what the other leaves of `n_devices` (data: all of them by default).

  ValueError, naming the problem, for anything else; with `n_devices` the
  product must equal it.
  """
  sizes: dict[str, int] = {}
  if spec is not None and spec.strip():
    for part in spec.split(","):
      name, eq, value = part.strip().partition("=")
      name, value = name.strip(), value.strip()
      if not eq or not name or not value:
        raise ValueError(f"--mesh {spec!r}: expected AXIS=SIZE[,AXIS=SIZE] with axes "
                         f"{AXES}, e.g. 'data=4,model=2'; got the part {part.strip()!r}")
      if name not in AXES:
        raise ValueError(f"--mesh {spec!r}: unknown axis {name!r}; the axes are {AXES}")
      if name in sizes:
        raise ValueError(f"--mesh {spec!r}: axis {name!r} given twice")
      try:
        size = int(value)
      except ValueError:
        raise ValueError(f"--mesh {spec!r}: size of {name!r} must be an integer, "
                         f"got {value!r}") from None
      if size < 1:
        raise ValueError(f"--mesh {spec!r}: size of {name!r} must be >= 1, got {size}")
      sizes[name] = size
  if n_devices is None:
    return sizes
  data, model = sizes.get("data"), sizes.get("model")
  if data is None:
    model = model or 1
    data = n_devices // model if n_devices % model == 0 else None
  elif model is None:
    model = n_devices // data if n_devices % data == 0 else None
  if data is None or model is None or data * model != n_devices:
    given = ",".join(f"{a}={sizes[a]}" for a in AXES if a in sizes)
    raise ValueError(f"--mesh {given}: data x model must equal the number of devices, "
                     f"{n_devices}; e.g. --mesh data={n_devices},model=1")
  sizes = {"data": data, "model": model}
  return {a: sizes[a] for a in AXES}


def make_mesh(spec: str | None, devices=None):
  """The ("data", "model") mesh for `--mesh spec` over `devices` (default all)."""
  import jax
  devices = jax.devices() if devices is None else list(devices)
  sizes = parse_mesh(spec, len(devices))
  shape = tuple(sizes[a] for a in AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, AXES, axis_types=auto)  # topology-aware order
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=auto)


def check_config(cfg, mesh) -> None:
  """ValueError unless the batch and the heads split evenly over the mesh."""
  from sagebwd_jax.sharding import check_split
  check_split(mesh, batch=cfg.batch_size, num_heads=cfg.n_heads,
              num_kv_heads=cfg.n_kv_heads)


def replicated(mesh):
  import jax
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def batch_sharding(mesh, ndim: int, batch_dim: int):
  """Arrays of rank `ndim` split on "data" along `batch_dim`."""
  import jax
  spec = [None] * ndim
  spec[batch_dim] = "data"
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def replicate(tree, mesh):
  """Every leaf as a global array replicated over `mesh` (multi-process safe:
  each process fills its own devices from its own copy, which must agree)."""
  import jax
  sharding = replicated(mesh)

  def put(x):
    x = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(put, tree)


def local_rows(sharding, global_shape: tuple, batch_dim: int) -> slice:
  """The rows along `batch_dim` that this process's devices hold (contiguous)."""
  index_map = sharding.addressable_devices_indices_map(global_shape)
  rows = set()
  for index in index_map.values():
    rows.update(range(*index[batch_dim].indices(global_shape[batch_dim])))
  lo, hi = min(rows), max(rows) + 1
  if len(rows) != hi - lo:
    raise ValueError(f"this process's devices hold non-contiguous batch rows {sorted(rows)}")
  return slice(lo, hi)


def global_batch(local: np.ndarray, sharding, global_shape: tuple):
  """A global array from this process's rows (`local`, see `local_rows`)."""
  import jax
  return jax.make_array_from_process_local_data(sharding, local, global_shape)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, environ=None) -> bool:
  """`jax.distributed.initialize` when asked for; True if it ran.

  Asked for by any of the flags, or by `JAX_COORDINATOR_ADDRESS` in the
  environment (then `JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`, if set, fill the
  missing flags, and JAX detects the rest). `coordinator="auto"` leaves
  everything to JAX's cluster detection (SLURM, Open MPI, Kubernetes, TPU).
  Must run before anything else touches the devices.
  """
  env = os.environ if environ is None else environ
  flags = (coordinator, num_processes, process_id)
  if all(f is None for f in flags) and not env.get("JAX_COORDINATOR_ADDRESS"):
    return False
  if coordinator == "auto":
    coordinator = None
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = int(env["JAX_PROCESS_ID"])
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
  import jax
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)
  return True


def barrier(name: str) -> None:
  """Waits for every process to get here (a no-op with one process)."""
  import jax
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
