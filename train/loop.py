"""The training loop: run folder, data, model, optimizer, checkpoints, metrics,
in that order; then the steps."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time

import jax
import numpy as np
from tqdm import tqdm

from train import data, flops, optim, rundir, sharding
from train.checkpoint import Checkpoints
from train.config import Config, check
from train.metrics import MetricsLog
from train.rundir import RunError
from train.step import build_model, count_params, make_steps
from train.stop import Interrupted, Stop
from train.telemetry import make_telemetry


class NonFiniteError(RunError):
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


class _Abandoned(Exception):
  """An evaluation given up between batches: the run is stopping."""


def evaluate(eval_step, params, batches: Batches, cfg: Config,
             stopping=lambda: False) -> float:
  """The mean validation loss over `cfg.eval_batches` batches; _Abandoned as
  soon as `stopping()` is true between batches."""
  losses = []
  for i in range(cfg.eval_batches):
    losses.append(jax.device_get(eval_step(params, batches.val(i))))
    if stopping():
      raise _Abandoned
  return float(np.mean(losses))


def train(cfg: Config, dataset: data.Dataset | None = None, stop: Stop | None = None) -> dict:
  """Runs `cfg` to `cfg.steps` (from its newest good checkpoint with --resume).

  Returns the summary: step, loss, val_loss (the last logged), run_dir,
  tokens_per_s and mfu (this launch's training alone; None if it trained no
  step; mfu None where the devices' peak is unknown) and compile_s. Raises
  RunError (NonFiniteError among them) and ValueError with one-line messages. `dataset`: `cfg`'s data, already loaded (by
  `data.load(cfg.data, cfg.val_fraction, cfg.seq_len)`), for runs that share it.
  `stop`: the signals' stop requests (train/stop.py); once one is made, the
  loop saves the last completed step and raises `stop.Interrupted`.
  """
  check(cfg)
  mesh = sharding.make_mesh(cfg.mesh)  # one device: a mesh of 1, the same code
  sharding.check_config(cfg, mesh)
  main = jax.process_index() == 0  # process 0 alone writes logs, metrics, config
  log = (tqdm.write if cfg.progress else print) if main else (lambda *a, **k: None)

  # The data before the run folder: bad --data leaves no folder behind. The
  # configuration as config.json records it (vocabulary resolved).
  ds = dataset or data.load(cfg.data, cfg.val_fraction, cfg.seq_len)
  vocab = cfg.vocab_size or ds.vocab_size
  if vocab < ds.vocab_size:
    raise ValueError(f"--vocab-size {vocab} is too small for {ds.source}: its tokens "
                     f"need {ds.vocab_size}")
  cfg = dataclasses.replace(cfg, vocab_size=vocab)

  # The run folder: every process resolves it before the first one creates it.
  run_dir = rundir.resolve(cfg)
  sharding.barrier("sagebwd-train: run folder resolved")
  rundir.prepare(cfg, run_dir, main, log)
  if stop is not None:
    stop.run_dir = run_dir
  lock = rundir.lock(run_dir) if main else None
  try:
    return _train(dataclasses.replace(cfg, out=run_dir), mesh, main, log, ds, stop)
  finally:
    if lock is not None:
      os.close(lock)


def _train(cfg: Config, mesh, main: bool, log, ds: data.Dataset, stop: Stop | None) -> dict:
  """`train` once the data is loaded and the run folder (`cfg.out`) settled
  and locked."""
  run_dir = cfg.out
  log(f"run folder: {run_dir}")
  log(f"devices: mesh data={mesh.shape['data']} x model={mesh.shape['model']} over "
      f"{jax.process_count()} process(es), {jax.device_count()} {jax.default_backend()} "
      f"device(s)")

  log(f"data: {ds.source}: {len(ds.train):,} train / {len(ds.val):,} val tokens")
  if cfg.resume:
    rundir.compare_with_saved(cfg, log)
  if main:
    rundir.save_config(cfg)
  batches = Batches(ds, cfg, mesh)

  # Model, optimizer, compiled steps.
  model = build_model(cfg, cfg.vocab_size, mesh)
  tx = optim.optimizer(cfg)
  state, train_step, eval_step = make_steps(model, tx, mesh)
  telemetry = None
  if cfg.telemetry_every:
    telemetry = make_telemetry(model, None if cfg.attention == "full" else cfg.ds_precision)
  del model
  log(f"model: {count_params(state['params']) / 1e6:.2f}M parameters, "
      f"attention={cfg.attention}, qk_norm={cfg.qk_norm}, smooth_k={cfg.smooth_k}, "
      f"smooth_q={cfg.smooth_q}, ds_precision={cfg.ds_precision}, "
      f"quantization={cfg.quantization}, compute {cfg.dtype}")
  n_decay = sum(x.size for x, d in zip(jax.tree.leaves(state["params"]),
                                        jax.tree.leaves(optim.decay_mask(state["params"]))) if d)
  log(f"weight decay {cfg.weight_decay} on {n_decay / 1e6:.2f}M parameters (linear layers' "
      f"matrices; not norms, biases, embedding)")
  log(f"tokens per step: {cfg.tokens_per_step:,} = batch {cfg.batch_size} x "
      f"seq {cfg.seq_len} x grad_accum {cfg.grad_accum}")
  peak = flops.peak_flops(jax.devices(), cfg.peak_tflops)
  log(f"model FLOPs: {flops.flops_per_token(cfg) / 1e6:,.1f}M per token; MFU "
      + (f"against {peak / 1e12:,.0f} TFLOP/s ({jax.device_count()} x "
         f"{peak / 1e12 / jax.device_count():,.0f})" if peak else
         f"not shown: no known peak for {jax.devices()[0].device_kind} (--peak-tflops)"))

  # Checkpoints: with --resume, the newest that restores intact.
  ckpts = Checkpoints(run_dir, cfg.keep, primary=main)
  try:
    start = 0
    if cfg.resume:
      restored = ckpts.restore_newest(state, log)
      if restored is None:
        log(f"no checkpoint in {ckpts.dir} yet: starting from step 0")
      else:
        state, start = restored
        log(f"resumed from step {start}")
        if stop is not None:
          stop.checkpoint = (start, ckpts.dir)
    metrics = MetricsLog(run_dir, start, enabled=main, warn=lambda m: log(f"warning: {m}"))
    try:
      return {**_loop(cfg, state, start, train_step, eval_step, telemetry, batches, ckpts,
                      metrics, log, peak, stop),
              "run_dir": run_dir}
    finally:
      metrics.close()
  finally:
    ckpts.close()


def _stop_requested(stop: Stop | None) -> bool:
  """Whether to stop after this step: a signal here or, with several
  processes, in any of them (they must stop at the same step, since saving
  a checkpoint is collective)."""
  if stop is None:
    return False
  if jax.process_count() == 1:
    return stop.requested
  from jax.experimental import multihost_utils
  anywhere = bool(np.any(multihost_utils.process_allgather(np.int32(stop.requested))))
  if anywhere and stop.signum is None:
    stop.signum = signal.SIGTERM  # another process's signal
  return anywhere


def _loop(cfg: Config, state, start: int, train_step, eval_step, telemetry, batches: Batches,
          ckpts: Checkpoints, metrics: MetricsLog, log, peak: float | None,
          stop: Stop | None = None) -> dict:
  """Steps `start` to `cfg.steps`; the summary: the last logged step, loss and
  val_loss, this launch's tokens/s and MFU (None if it trained no step, MFU
  None without a `peak` FLOP/s) and compile_s. Raises `Interrupted` once
  `stop` asks, with the last completed step saved."""
  due = lambda step, every: step % every == 0 or step == cfg.steps
  # A run stopped during an evaluation or telemetry saved its step without
  # their rows: they are taken here, where the uninterrupted run took them.
  eval_due = start == 0 or (due(start, cfg.eval_every)
                            and metrics.last_eval.get("step") != start)
  telemetry_due = telemetry is not None and (
      start == 0 or (due(start, cfg.telemetry_every)
                     and metrics.last_telemetry.get("step") != start))
  if start >= cfg.steps and not (eval_due or telemetry_due):
    log(f"nothing to train: the run is at step {start} and --steps is {cfg.steps}")
    return {**metrics.summary(), "tokens_per_s": None, "mfu": None, "compile_s": 0.0}
  flops_per_step = flops.flops_per_token(cfg) * cfg.tokens_per_step

  def mfu(seconds_per_step: float) -> float | None:
    return flops_per_step / seconds_per_step / peak if peak else None

  lr_at = optim.schedule(cfg)

  # Compiled before the clock starts: tokens/s counts training alone. Every
  # compilation comes before the first step, where a signal finds nothing
  # new to save (train/stop.py).
  t0 = time.perf_counter()
  train_step = train_step.lower(state, batches.train(start)).compile()
  compile_s = time.perf_counter() - t0
  log(f"compiled the train step in {compile_s:.1f}s")
  eval_step = eval_step.lower(state["params"], batches.val(0)).compile()
  if telemetry is not None:
    t0 = time.perf_counter()
    telemetry_batch = batches.val(0)
    telemetry = telemetry.lower(state["params"], telemetry_batch).compile()
    log(f"compiled the telemetry in {time.perf_counter() - t0:.1f}s")

  stopping = lambda: stop is not None and jax.process_count() == 1 and stop.requested

  def eval_and_log(step: int) -> None:
    val_loss = evaluate(eval_step, state["params"], batches, cfg, stopping)
    metrics.write(step=step, tokens=step * cfg.tokens_per_step, val_loss=val_loss)
    log(f"step {step}: val_loss {val_loss:.4f}")

  def telemetry_and_log(step: int) -> None:
    t0 = time.perf_counter()
    values = jax.device_get(telemetry(state["params"], telemetry_batch))
    metrics.write(step=step, tokens=step * cfg.tokens_per_step,
                  telemetry_s=time.perf_counter() - t0,
                  **{k: [float(x) for x in v] for k, v in values.items()})

  def save(step: int) -> None:
    metrics.sync()  # the rows a checkpoint implies reach the disk before it does
    ckpts.save(step, state)
    if stop is not None:
      stop.checkpoint = (step, ckpts.dir)

  def stop_at(step: int) -> None:
    """Saves `step` (unless saved) and raises Interrupted."""
    stop.phase = "saving"
    if ckpts.latest_step() != step:
      save(step)
    stop.claim_exit()
    raise Interrupted(stop.line(f"at step {step}: saved checkpoint {step} in {ckpts.dir}"),
                      stop.signum, step)

  if eval_due:
    eval_and_log(start)
  if telemetry_due:
    telemetry_and_log(start)
  if stop is not None:
    stop.phase = "training"
  train_time = 0.0
  with tqdm(range(start, cfg.steps), initial=start, total=cfg.steps,
            disable=not (cfg.progress and metrics.enabled), mininterval=1.0,
            dynamic_ncols=True) as bar:
    for step in bar:  # `step` steps are done; this one makes it step + 1
      t0 = time.perf_counter()
      batch = batches.train(step)
      state, m = train_step(state, batch)
      m = {k: float(v) for k, v in jax.device_get(m).items()}  # waits for the step
      dt = time.perf_counter() - t0
      train_time += dt
      if stop is not None:
        stop.longest_step_s = max(stop.longest_step_s, dt)
      done = step + 1
      metrics.write(step=done, tokens=done * cfg.tokens_per_step, **m, lr=float(lr_at(step)),
                    tokens_per_s=cfg.tokens_per_step / dt, step_time=dt,
                    **({"mfu": mfu(dt)} if peak else {}))
      if not all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "param_norm")):
        latest = ckpts.latest_step()
        raise NonFiniteError(
            f"non-finite values at step {done}: loss={m['loss']}, grad_norm={m['grad_norm']}, "
            f"param_norm={m['param_norm']}; stopping. "
            + (f"The latest checkpoint (step {latest}) in {ckpts.dir} is untouched."
               if latest is not None else "No checkpoint was saved."))
      bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{cfg.tokens_per_step / dt:,.0f}",
                      **({"mfu": f"{mfu(dt):.1%}"} if peak else {}), refresh=False)
      if _stop_requested(stop):
        stop_at(done)
      try:
        if due(done, cfg.eval_every):
          eval_and_log(done)
      except _Abandoned:
        stop_at(done)
      if telemetry is not None and due(done, cfg.telemetry_every):
        telemetry_and_log(done)
      if cfg.ckpt_every and due(done, cfg.ckpt_every):
        save(done)
      if _stop_requested(stop):
        stop_at(done)
  trained = cfg.steps - start
  return {**metrics.summary(), "compile_s": compile_s,
          "tokens_per_s": trained * cfg.tokens_per_step / train_time if trained > 0 else None,
          "mfu": mfu(train_time / trained) if trained > 0 else None}
