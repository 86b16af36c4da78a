"""The run's configuration: one dataclass, named presets, and the CLI flags.

Every field of `Config` is a flag (`--batch-size` for `batch_size`); a preset
fills the fields first and flags given on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field


@dataclass
class Config:
  name: str = "tiny"
  # Model (a Llama; see sagebwd_jax.flax.LlamaConfig). head_dim = dim // n_heads.
  vocab_size: int | None = None    # None: 256 for text (bytes), from the tokens for .bin
  dim: int = 128
  n_layers: int = 2
  n_heads: int = 2
  n_kv_heads: int = 2
  ffn_dim: int = 384
  rope_theta: float = 10000.0
  qk_norm: bool = True
  tie_embeddings: bool = False
  attention: str = "sage"          # sage | full | reference
  smooth_k: bool = True
  smooth_q: bool = False
  dtype: str = "bfloat16"          # compute dtype; parameters stay float32
  # Data.
  data: list[str] = field(default_factory=list)  # empty: the Python stdlib sources
  val_fraction: float = 0.05
  seq_len: int = 128
  batch_size: int = 8
  grad_accum: int = 1
  # Optimisation: AdamW, linear warmup then cosine decay to lr * min_lr_ratio.
  steps: int = 250
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup: int = 25
  weight_decay: float = 0.1
  beta1: float = 0.9
  beta2: float = 0.95
  grad_clip: float = 1.0
  # Evaluation, checkpoints, bookkeeping.
  eval_every: int = 50
  eval_batches: int = 8
  ckpt_every: int = 125
  keep: int = 2
  out: str | None = None           # run directory; None: runs/<name>
  resume: bool = False
  seed: int = 0
  progress: bool = True            # tqdm bar
  # Devices (train/sharding.py): the mesh, and multi-host start-up.
  mesh: str | None = None          # "data=N,model=M"; None: data = all devices, model = 1
  coordinator: str | None = None   # host:port of process 0 (or "auto"); None: from the env
  num_processes: int | None = None
  process_id: int | None = None

  @property
  def tokens_per_step(self) -> int:
    return self.batch_size * self.seq_len * self.grad_accum

  @property
  def run_dir(self) -> str:
    return self.out if self.out else f"runs/{self.name}"


PRESETS: dict[str, dict] = {
    # CPU demo: byte-level Llama on the stdlib sources, ~1 minute on 2 cores.
    "tiny": dict(),
    # One GPU, an hour-scale run: ~85M parameters (with a 50K vocabulary),
    # 131K tokens per step.
    "small": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
                  seq_len=2048, batch_size=16, grad_accum=4, steps=5000, lr=6e-4,
                  warmup=200, eval_every=250, eval_batches=20, ckpt_every=500,
                  keep=3),
    # The SageBwd paper's setting: ~325M-parameter Llama, context 4096, 262K
    # tokens per step (the regime where INT8 attention matches full precision;
    # see SPEC.md). Scale --grad-accum to the GPUs you have.
    "gpu": dict(dim=1024, n_layers=24, n_heads=8, n_kv_heads=8, ffn_dim=2816,
                seq_len=4096, batch_size=8, grad_accum=8, steps=20000, lr=3e-4,
                warmup=1000, eval_every=500, eval_batches=20, ckpt_every=1000,
                keep=3),
}


def preset(name: str, **overrides) -> Config:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
  return Config(name=name, **{**PRESETS[name], **overrides})


HELP = {
    "name": "run name; the run folder defaults to runs/<name>",
    "vocab_size": "default: 256 for text (bytes), the tokens' maximum rounded up to 64 for .bin",
    "qk_norm": "RMSNorm on each head's q and k before RoPE (SPEC: needed at large batches)",
    "smooth_k": "subtract K's per-channel mean before quantizing (sage/reference)",
    "smooth_q": "per-block Q-smoothing (sage/reference; off by default)",
    "dtype": "compute dtype; parameters and optimizer state stay float32",
    "seq_len": "tokens per sequence", "batch_size": "sequences per micro-batch",
    "grad_accum": "micro-batches per optimizer step (tokens per step = batch x seq x accum)",
    "lr": "peak learning rate (after --warmup steps, cosine decay to lr x --min-lr-ratio)",
    "warmup": "linear warmup steps", "eval_every": "evaluate every N steps",
    "eval_batches": "validation batches per evaluation (the same ones each time)",
    "ckpt_every": "save a checkpoint every N steps (and at the end)",
    "keep": "checkpoints kept (the most recent)", "out": "run folder (default runs/<name>)",
    "resume": "continue from the run folder's latest checkpoint, exactly",
    "seed": "model init and the data order (batches are a function of seed and step)",
    "mesh": "device mesh 'data=N,model=M' (N x M = all devices of all processes): batch "
            "split on data, attention heads on model; default data=<all devices>,model=1",
    "coordinator": "multi-host: host:port of process 0's coordinator, or 'auto' (SLURM, "
                   "Open MPI, ...); default: JAX_COORDINATOR_ADDRESS if set, else one process",
    "num_processes": "multi-host: number of processes (default: JAX_NUM_PROCESSES or detected)",
    "process_id": "multi-host: this process's index (default: JAX_PROCESS_ID or detected)",
}


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m train",
      description="Pre-train a Llama with SageBwd INT8 attention (or full precision).")
  p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  for f in dataclasses.fields(Config):
    flag, default = _flag(f.name), argparse.SUPPRESS  # absent flags keep the preset
    kw = {"help": HELP[f.name]} if f.name in HELP else {}
    if f.name == "attention":
      p.add_argument(flag, choices=["sage", "full", "reference"], default=default,
                     help="sage: SageBwd INT8 (Hopper backend on H100/H200, Pallas on other "
                          "GPUs, pure JAX elsewhere); "
                          "full: jax.nn full precision; reference: pure-JAX SageBwd")
    elif f.name == "data":
      p.add_argument(flag, nargs="+", default=default, metavar="PATH",
                     help="text files, folders (every text file inside) or one "
                          "nanoGPT .bin of uint16 tokens; default: the stdlib sources")
    elif f.name == "dtype":
      p.add_argument(flag, choices=["bfloat16", "float32"], default=default, **kw)
    elif f.type in ("bool", bool):
      p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kw)
    elif f.type in ("int", "int | None"):
      p.add_argument(flag, type=int, default=default, **kw)
    elif f.type == "float":
      p.add_argument(flag, type=float, default=default, **kw)
    else:
      p.add_argument(flag, default=default, **kw)
  return p


def from_args(argv: list[str] | None = None) -> Config:
  args = vars(parser().parse_args(argv))
  name = args.pop("preset")
  cfg = preset(name, **args)
  check(cfg)
  return cfg


def check(cfg: Config) -> None:
  if cfg.dim % cfg.n_heads or cfg.dim // cfg.n_heads not in (64, 128):
    raise ValueError(f"head_dim = dim // n_heads must be 64 or 128 "
                     f"(dim={cfg.dim}, n_heads={cfg.n_heads})")
  if cfg.n_heads % cfg.n_kv_heads:
    raise ValueError(f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads "
                     f"({cfg.n_kv_heads})")
  for name in ("steps", "seq_len", "batch_size", "grad_accum", "eval_every",
               "eval_batches", "ckpt_every", "keep"):
    if getattr(cfg, name) < 1:
      raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
  from train.sharding import parse_mesh
  parse_mesh(cfg.mesh)  # the string's form; the device count is checked at start-up
  if not 0.0 < cfg.val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {cfg.val_fraction}")
