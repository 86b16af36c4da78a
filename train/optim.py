"""The optimizer: AdamW with warmup + cosine decay, global-norm clipping and a
weight-decay mask.

Weight decay applies to the matrices of the linear layers only: not to norm
gains, biases (any parameter with fewer than 2 dimensions per layer: with
--scan-layers the blocks' carry a leading layer axis) nor to the token
embedding (its rows of rare tokens get few gradients and decay would erase
them; with tied embeddings the output head is left alone as well).
"""

from __future__ import annotations

import jax
import optax

from sagebwd_jax.flax.llama import is_stacked
from train.config import Config


def schedule(cfg: Config) -> optax.Schedule:
  """The learning rate of update `count` (0 for the first): warmup from
  lr / warmup at the first update (not 0: that update would be wasted) to lr
  at update `warmup`, then cosine decay to lr x min_lr_ratio at the last."""
  curve = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup,
      decay_steps=max(cfg.steps, cfg.warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)
  return lambda count: curve(count + 1)


def _keys(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _path_str(path) -> str:
  return "/".join(_keys(path))


def decays(path: str, ndim: int) -> bool:
  """`ndim`: the parameter's dimensions in one layer."""
  return ndim >= 2 and "embed" not in path.lower()


def decay_mask(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: decays(_path_str(path), x.ndim - is_stacked(_keys(path))), params)


def optimizer(cfg: Config) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule(cfg), b1=cfg.beta1, b2=cfg.beta2,
                  weight_decay=cfg.weight_decay, mask=decay_mask),
  )
