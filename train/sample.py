"""`python -m train.sample RUN [--prompt TEXT] [--tokens N] [--temperature T]`:
what a trained model writes.

Loads the newest checkpoint of the run folder RUN that restores intact (read
only: a training still running there is left alone) and generates one token at
a time with the model's key/value cache (`Llama.prefill`, `Llama.decode`),
attention through the run's own implementation (SageBwd's op for `sage`).
Byte-level runs (text data) print text: the prompt starts a new document, and
a generated end of document (byte 0) stops the text early. Runs on a `.bin` of
tokens take the prompt as token ids and print ids. Past the run's --seq-len
(the positions it was trained on) the context slides: the newest half is read
again and generation goes on.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
import sys
from collections.abc import Iterator

from train.cli import ArgumentParser
from train.rundir import RunError, config_path, saved_config


def load_config(run: str):
  """The run's Config from its config.json; RunError naming the file."""
  from train.config import Config
  path = config_path(run)
  try:
    saved = saved_config(run)
  except RunError as e:
    raise RunError(f"{run!r} is not a run folder: {e}") from e
  if saved is None:
    raise RunError(f"{run!r} is not a run folder: it has no {path}")
  known = {f.name for f in dataclasses.fields(Config)}
  cfg = Config(**{k: v for k, v in saved.items() if k in known})
  if not cfg.vocab_size:
    raise RunError(f"{path} has no vocab_size: the run never started")
  return cfg


def load_model(run: str, cfg, log=lambda message: None):
  """(model, step): `cfg`'s model with the newest checkpoint of `run` that
  restores intact; RunError if none does."""
  from flax import nnx

  from train import optim
  from train.checkpoint import Checkpoints, Corrupt
  from train.step import build_model, make_steps
  if not os.path.isdir(os.path.join(run, "checkpoints")):
    raise RunError(f"{run} has no checkpoints/ (trained with --ckpt-every 0, or stopped "
                   f"before its first checkpoint)")
  model = build_model(cfg, cfg.vocab_size)
  like = make_steps(model, optim.optimizer(cfg))[0]
  ckpts = Checkpoints(run, cfg.keep, read_only=True)
  try:
    for step in sorted(ckpts.manager.all_steps(), reverse=True):
      try:
        state = ckpts.restore(like, step)
      except Corrupt as e:
        log(f"warning: skipping checkpoint {step} in {ckpts.dir}: {e}")
        continue
      nnx.update(model, state["params"])
      return model, step
  finally:
    ckpts.close()
  raise RunError(f"no checkpoint in {ckpts.dir} restores")


def generate(model, prompt: list[int], tokens: int, temperature: float, seed: int
             ) -> Iterator[int]:
  """`tokens` new token ids after `prompt` (not empty), one at a time:
  sampled from softmax(logits / temperature), or the most likely at 0."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  max_len = model.config.max_seq_len
  prefill = nnx.jit(lambda model, ids: model.prefill(ids))
  decode = nnx.jit(lambda model, token, caches, position: model.decode(token, caches, position))

  def pick(logits, key):
    if temperature == 0:
      return jnp.argmax(logits, axis=-1)
    return jax.random.categorical(key, logits / temperature, axis=-1)

  pick = jax.jit(pick)
  key = jax.random.key(seed)
  context = prompt[-max_len:]
  logits, caches = prefill(model, jnp.asarray([context], jnp.int32))
  logits, position = logits[:, -1], len(context)
  for _ in range(tokens):
    key, sub = jax.random.split(key)
    token = int(pick(logits, sub)[0])
    yield token
    context.append(token)
    if position == max_len:  # slide: read the newest half again
      context = context[-(max_len // 2):]
      logits, caches = prefill(model, jnp.asarray([context], jnp.int32))
      logits, position = logits[:, -1], len(context)
    else:
      logits, caches = decode(model, jnp.asarray([[token]], jnp.int32), caches,
                              jnp.int32(position))
      logits, position = logits[:, -1], position + 1


def parse_ids(prompt: str, vocab_size: int) -> list[int]:
  """Token ids from "12 7 345" (spaces or commas); ValueError naming --prompt."""
  try:
    ids = [int(x) for x in prompt.replace(",", " ").split()]
  except ValueError:
    raise ValueError(f"--prompt: a run on a .bin of tokens takes token ids separated by "
                     f"spaces, e.g. '464 3290', got {prompt!r}") from None
  if not ids:
    raise ValueError("--prompt: a run on a .bin of tokens needs token ids to start from, "
                     "e.g. --prompt '464 3290'")
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"--prompt: token ids must be in [0, {vocab_size}), got {bad[:5]}")
  return ids


def main(argv: list[str] | None = None) -> None:
  p = ArgumentParser(prog="python -m train.sample",
                     description="Generate from a trained run's newest checkpoint.",
                     epilog="Guide: docs/training.md")
  p.add_argument("run", help="run folder (with config.json and checkpoints/)")
  p.add_argument("--prompt", default="",
                 help="text to continue (default: none, a new document); token ids "
                      "separated by spaces for a run on a .bin")
  p.add_argument("--tokens", type=int, default=300,
                 help="tokens to generate (bytes for text runs; default 300)")
  p.add_argument("--temperature", type=float, default=0.8,
                 help="softmax temperature; 0 takes the most likely token (default 0.8)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
  args = p.parse_args(argv)
  if args.tokens < 1:
    p.error(f"--tokens must be >= 1, got {args.tokens}")
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
  if not 0 <= args.seed < 2**32:
    p.error(f"--seed must be in [0, 2**32), got {args.seed}")
  from train.data import DOC_SEPARATOR
  try:
    cfg = load_config(args.run)
    text = not any(str(path).endswith(".bin") for path in cfg.data)
    prompt = ([DOC_SEPARATOR, *args.prompt.encode()] if text
              else parse_ids(args.prompt, cfg.vocab_size))
    log = lambda message: print(message, file=sys.stderr)
    model, step = load_model(args.run, cfg, log)
  except (RunError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  log(f"{args.run}: checkpoint of step {step}, attention={cfg.attention}; {args.tokens} "
      f"{'bytes' if text else 'tokens'} at temperature {args.temperature}")
  if text:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(args.prompt)
    for token in generate(model, prompt, args.tokens, args.temperature, args.seed):
      if token == DOC_SEPARATOR:
        break
      sys.stdout.write(decoder.decode(bytes([token])))
      sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
  else:
    print(" ".join(map(str, prompt)), end="", flush=True)
    for token in generate(model, prompt, args.tokens, args.temperature, args.seed):
      print(f" {token}", end="", flush=True)
    print()


if __name__ == "__main__":
  main()
