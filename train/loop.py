"""The training loop: data, model, optimizer, checkpoints, metrics, in order."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time

import jax
import numpy as np
from tqdm import tqdm

from train import data, optim, sharding
from train.checkpoint import Checkpoints
from train.config import Config, check
from train.metrics import MetricsLog
from train.step import build_model, count_params, make_steps


class NonFiniteError(RuntimeError):
  """The loss, gradient or parameters stopped being finite."""


class Batches:
  """Global batches on `mesh`, split on "data"; this process loads its rows only."""

  def __init__(self, ds: data.Dataset, cfg: Config, mesh):
    self.ds, self.cfg = ds, cfg
    self.train_shape = (cfg.grad_accum, cfg.batch_size, cfg.seq_len + 1)
    self.val_shape = (cfg.batch_size, cfg.seq_len + 1)
    self.train_sharding = sharding.batch_sharding(mesh, 3, 1)
    self.val_sharding = sharding.batch_sharding(mesh, 2, 0)
    self.train_rows = sharding.local_rows(self.train_sharding, self.train_shape, 1)
    self.val_rows = sharding.local_rows(self.val_sharding, self.val_shape, 0)

  def train(self, step: int) -> jax.Array:
    c = self.cfg
    local = data.train_batch(self.ds, c.seed, step, c.grad_accum, c.batch_size, c.seq_len,
                             self.train_rows)
    return sharding.global_batch(local, self.train_sharding, self.train_shape)

  def val(self, index: int) -> jax.Array:
    c = self.cfg
    local = data.val_batch(self.ds, c.seed, index, c.batch_size, c.seq_len, self.val_rows)
    return sharding.global_batch(local, self.val_sharding, self.val_shape)


def evaluate(eval_step, params, batches: Batches, cfg: Config) -> float:
  losses = [eval_step(params, batches.val(i)) for i in range(cfg.eval_batches)]
  return float(np.mean(jax.device_get(losses)))


def train(cfg: Config) -> dict:
  """Runs `cfg` to `cfg.steps`; returns the last metrics. Raises NonFiniteError."""
  check(cfg)
  mesh = sharding.make_mesh(cfg.mesh)  # one device: a mesh of 1, the same code
  sharding.check_config(cfg, mesh)
  main = jax.process_index() == 0  # process 0 alone writes logs, metrics, config
  run_dir = cfg.run_dir
  os.makedirs(run_dir, exist_ok=True)
  log = (tqdm.write if cfg.progress else print) if main else (lambda *a, **k: None)
  log(f"devices: mesh data={mesh.shape['data']} x model={mesh.shape['model']} over "
      f"{jax.process_count()} process(es), {jax.device_count()} {jax.default_backend()} "
      f"device(s)")

  # Data.
  ds = data.load(cfg.data, cfg.val_fraction, cfg.seq_len)
  vocab = cfg.vocab_size or ds.vocab_size
  if vocab < ds.vocab_size:
    raise ValueError(f"--vocab-size {vocab} is too small for {ds.source}: its tokens "
                     f"need {ds.vocab_size}")
  log(f"data: {ds.source}: {len(ds.train):,} train / {len(ds.val):,} val tokens")
  batches = Batches(ds, cfg, mesh)

  # Model, optimizer, compiled steps.
  model = build_model(cfg, vocab, mesh)
  tx = optim.optimizer(cfg)
  lr_at = optim.schedule(cfg)
  state, train_step, eval_step = make_steps(model, tx, mesh)
  del model
  log(f"model: {count_params(state['params']) / 1e6:.2f}M parameters, "
      f"attention={cfg.attention}, qk_norm={cfg.qk_norm}, smooth_k={cfg.smooth_k}, "
      f"smooth_q={cfg.smooth_q}, compute {cfg.dtype}")
  n_decay = sum(x.size for x, d in zip(jax.tree.leaves(state["params"]),
                                        jax.tree.leaves(optim.decay_mask(state["params"]))) if d)
  log(f"weight decay {cfg.weight_decay} on {n_decay / 1e6:.2f}M parameters (linear layers' "
      f"matrices; not norms, biases, embedding)")
  log(f"tokens per step: {cfg.tokens_per_step:,} = batch {cfg.batch_size} x "
      f"seq {cfg.seq_len} x grad_accum {cfg.grad_accum}")

  # Checkpoints: resume from the latest, or start a fresh run in the folder.
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  if main and not cfg.resume and os.path.exists(ckpt_dir):
    log(f"fresh run: removing the old checkpoints in {ckpt_dir} (use --resume to continue)")
    shutil.rmtree(ckpt_dir)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("sagebwd-train: checkpoint folder ready")
  ckpts = Checkpoints(run_dir, cfg.keep)
  start = 0
  if cfg.resume:
    if ckpts.latest_step() is None:
      raise ValueError(f"--resume: no checkpoint in {ckpt_dir}")
    state = ckpts.restore(state)
    start = int(state["step"])
    log(f"resumed from step {start}")
  metrics = MetricsLog(run_dir, start if cfg.resume else None, enabled=main)
  if main:
    with open(os.path.join(run_dir, "config.json"), "w") as f:
      json.dump(dataclasses.asdict(cfg), f, indent=2)

  def eval_and_log(step: int) -> float:
    val_loss = evaluate(eval_step, state["params"], batches, cfg)
    metrics.write(step=step, tokens=step * cfg.tokens_per_step, val_loss=val_loss)
    log(f"step {step}: val_loss {val_loss:.4f}")
    return val_loss

  if start == 0:
    eval_and_log(0)
  last = {}
  bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (cfg.progress and main),
             mininterval=1.0, dynamic_ncols=True)
  try:
    for step in bar:  # `step` steps are done; this one makes it step + 1
      t0 = time.perf_counter()
      batch = batches.train(step)
      state, m = train_step(state, batch)
      m = {k: float(v) for k, v in jax.device_get(m).items()}  # waits for the step
      dt = time.perf_counter() - t0
      done = step + 1
      last = dict(step=done, tokens=done * cfg.tokens_per_step, **m, lr=float(lr_at(step)),
                  tokens_per_s=cfg.tokens_per_step / dt, step_time=dt)
      metrics.write(**last)
      if not all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "param_norm")):
        raise NonFiniteError(
            f"non-finite values at step {done}: loss={m['loss']}, grad_norm={m['grad_norm']}, "
            f"param_norm={m['param_norm']}; stopping. The last good checkpoint "
            f"(step {ckpts.latest_step()}) in {ckpt_dir} is untouched.")
      bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{last['tokens_per_s']:,.0f}",
                      refresh=False)
      if done % cfg.eval_every == 0 or done == cfg.steps:
        last["val_loss"] = eval_and_log(done)
      if done % cfg.ckpt_every == 0 or done == cfg.steps:
        ckpts.save(done, state)
  finally:
    bar.close()
    ckpts.close()
  return last
