"""The model and the compiled steps.

The flax nnx model is split once into a graph definition (static), its
parameters (what we train) and any other state (constant here). The train
state is then a plain pytree `{"params", "opt", "step"}` and the steps are
ordinary `jax.jit` functions of it: the state is donated, so its buffers are
updated in place.

With a mesh (train/sharding.py) the state is replicated over it and the
steps take batches split on "data": jit's partitioner computes each device's
share and all-reduces the gradients; attention runs under shard_map inside
the model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from train.config import Config


def build_model(cfg: Config, vocab_size: int, mesh=None) -> nnx.Module:
  """The Llama of the run: each `LlamaConfig` field that `cfg` has a flag of
  the same name for takes the flag's value (dtype by its name), the rest
  LlamaConfig's defaults; `vocab_size` resolved, the run's `seq_len` as the
  longest sequence."""
  from sagebwd_jax.flax import Llama, LlamaConfig
  flags = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(LlamaConfig)
           if hasattr(cfg, f.name)}
  mcfg = LlamaConfig(**{**flags, "vocab_size": vocab_size, "max_seq_len": cfg.seq_len,
                        "dtype": getattr(jnp, cfg.dtype)})
  return Llama(mcfg, rngs=nnx.Rngs(cfg.seed), mesh=mesh)


def make_steps(model: nnx.Module, tx: optax.GradientTransformation, mesh=None):
  """Initial train state, jitted train_step(state, batch), jitted eval_step(params, batch).

  With `mesh`, the state is replicated over it (and stays so after each step)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, tokens):  # tokens (B, T + 1): next-token cross-entropy
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()

  def train_step(state, batch):  # batch (grad_accum, B, T + 1)
    params = state["params"]

    def micro_step(grad_sum, tokens):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
      return jax.tree.map(jnp.add, grad_sum, grads), loss

    zeros = jax.tree.map(jnp.zeros_like, params)
    grad_sum, losses = jax.lax.scan(micro_step, zeros, batch)
    grads = jax.tree.map(lambda g: g / batch.shape[0], grad_sum)
    updates, opt = tx.update(grads, state["opt"], params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": losses.mean(), "grad_norm": optax.tree.norm(grads),
               "param_norm": optax.tree.norm(params)}
    return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

  state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
  if mesh is None:
    return state, jax.jit(train_step, donate_argnums=0), jax.jit(loss_fn)
  from train.sharding import replicate, replicated
  state = replicate(state, mesh)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  return (state,
          jax.jit(train_step, donate_argnums=0,
                  out_shardings=(state_shardings, replicated(mesh))),
          jax.jit(loss_fn, out_shardings=replicated(mesh)))


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
