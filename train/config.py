"""The run's configuration: one dataclass, named presets, and their checks.

Every field of `Config` is a flag (`--batch-size` for `batch_size`); a preset
fills the fields first and flags given on the command line override it
(train/cli.py). The comment above each field is its `--help` line and the
`# --- ... ---` lines are the help's groups, so the dataclass is the one
place to read (and change) what a flag means. `check` validates every
field, naming the flag and the values it accepts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints


@dataclass
class Config:
  # --- run: where it is written, resuming ---
  # Run name (default: the preset's); without --out the run goes to runs/<name>, or runs/<name>-2, ... when taken.
  name: str = "tiny"
  # Run folder (config.json, metrics.jsonl, checkpoints/, loss.png); default runs/<name>.
  out: str | None = None
  # Continue the run in the folder as its config.json says (flags given override it), from its newest checkpoint that restores, exactly.
  resume: bool = False
  # Start over in a folder that holds a run, deleting its checkpoints and metrics.
  overwrite: bool = False
  # Model initialization and the data order (a batch is a function of seed and step).
  seed: int = 0
  # Show a progress bar.
  progress: bool = True

  # --- model: a Llama (sagebwd_jax.flax.LlamaConfig), head_dim = dim // n_heads ---
  # Vocabulary; default: 256 for text (bytes), the tokens' maximum rounded up to 64 for .bin.
  vocab_size: int | None = None
  # Model width.
  dim: int = 128
  # Transformer blocks.
  n_layers: int = 2
  # Query heads; dim // n_heads must be 64 or 128.
  n_heads: int = 2
  # Key/value heads (GQA); must divide n_heads.
  n_kv_heads: int = 2
  # Hidden width of the SwiGLU feed-forward.
  ffn_dim: int = 384
  # RoPE base.
  rope_theta: float = 10000.0
  # RMSNorm on each head's q and k before RoPE (the SageBwd paper needed it at many tokens per step).
  qk_norm: bool = True
  # Share the token embedding with the output layer.
  tie_embeddings: bool = False
  # sage: SageBwd INT8 (Mosaic on H100/H200, Triton on other GPUs, pure JAX on CPU); full: jax.nn; reference: pure-JAX SageBwd.
  attention: Literal["sage", "full", "reference"] = "sage"
  # Subtract K's per-channel mean before quantizing (sage, reference).
  smooth_k: bool = True
  # Per-block Q-smoothing (sage, reference).
  smooth_q: bool = False
  # Precision of the backward's dS.K and dS^T.Q: int8 (SageBwd's) or bf16 (16-bit; sage, reference).
  ds_precision: Literal["int8", "bf16"] = "int8"
  # Numerics mode: int8 (the paper's) or int8_fp8 (INT8 Q.K^T, FP8 P and dS products; sage, reference).
  quantization: Literal["int8", "int8_fp8"] = "int8"
  # Compute dtype; parameters and optimizer state stay float32.
  dtype: Literal["bfloat16", "float32"] = "bfloat16"
  # Stack the blocks' parameters and run them under jax.lax.scan: the step compiles one block, whatever --n-layers (checkpoints are the same either way).
  scan_layers: bool = False
  # What each block keeps for the backward: none (everything), full (its input: the block runs again), dots (its weight products).
  remat: Literal["none", "full", "dots"] = "none"

  # --- data ---
  # Text files, folders (every text file inside) or one nanoGPT .bin of uint16 tokens; default: this Python's stdlib sources.
  data: list[str] = field(default_factory=list)
  # Share of the data held out for validation.
  val_fraction: float = 0.05
  # Tokens per sequence.
  seq_len: int = 128
  # Sequences per micro-batch (global, over all devices).
  batch_size: int = 8
  # Micro-batches per optimizer step (tokens per step = batch x seq x accum).
  grad_accum: int = 1

  # --- optimisation: AdamW, linear warmup then cosine decay ---
  # Optimizer steps.
  steps: int = 250
  # Peak learning rate.
  lr: float = 3e-3
  # Final learning rate as a fraction of --lr (cosine decay ends at lr x ratio at --steps).
  min_lr_ratio: float = 0.1
  # Linear warmup steps (given --steps alone, the preset's value scales with it).
  warmup: int = 25
  # AdamW decoupled weight decay, on the linear layers' matrices only.
  weight_decay: float = 0.1
  # Adam's first-moment decay.
  beta1: float = 0.9
  # Adam's second-moment decay.
  beta2: float = 0.95
  # Clip the gradient to this global L2 norm.
  grad_clip: float = 1.0

  # --- evaluation and checkpoints ---
  # Evaluate every N steps (and at the start and the end; scales with --steps as --warmup).
  eval_every: int = 50
  # Validation batches per evaluation (the same ones each time).
  eval_batches: int = 8
  # Save a checkpoint every N steps (and at the end; scales with --steps as --warmup); 0: no checkpoints (a resume starts over).
  ckpt_every: int = 125
  # Checkpoints kept (the newest).
  keep: int = 2
  # Every N steps (and at the start and the end) compare each layer's attention with full precision on the first validation batch (train/telemetry.py); 0: off.
  telemetry_every: int = 0

  # --- devices: the mesh and multi-host start-up (train/sharding.py) ---
  # Device mesh 'data=N,model=M' (N x M = all devices): batch split on data, attention heads on model; default data=<all devices>,model=1.
  mesh: str | None = None
  # Multi-host: host:port of process 0's coordinator, or 'auto' (SLURM, Open MPI, ...); default: JAX_COORDINATOR_ADDRESS if set, else one process.
  coordinator: str | None = None
  # Multi-host: number of processes; default: JAX_NUM_PROCESSES or detected.
  num_processes: int | None = None
  # Multi-host: this process's index; default: JAX_PROCESS_ID or detected.
  process_id: int | None = None
  # Peak TFLOP/s of one device, for the model FLOPs utilization (MFU) shown beside tokens/s; default: the GPU's dense BF16 peak (H100 and H200 989, A100 312, train/flops.py), none on a CPU.
  peak_tflops: float | None = None

  @property
  def tokens_per_step(self) -> int:
    return self.batch_size * self.seq_len * self.grad_accum


PRESETS: dict[str, dict[str, Any]] = {
    # CPU demo: byte-level Llama on the stdlib sources, a minute-scale run on a CPU.
    "tiny": dict(),
    # One GPU, an hour-scale run: 131K tokens per step.
    "small": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
                  seq_len=2048, batch_size=16, grad_accum=4, steps=5000, lr=6e-4,
                  warmup=200, eval_every=250, eval_batches=20, ckpt_every=500,
                  keep=3),
    # The SageBwd paper's setting: ~325M-parameter Llama, context 4096, 262K
    # tokens per step (the regime where INT8 attention matches full precision;
    # see docs/algorithm.md). Scale --grad-accum to the GPUs you have.
    "gpu": dict(dim=1024, n_layers=24, n_heads=8, n_kv_heads=8, ffn_dim=2816,
                seq_len=4096, batch_size=8, grad_accum=8, steps=20000, lr=3e-4,
                warmup=1000, eval_every=500, eval_batches=20, ckpt_every=1000,
                keep=3),
}

# Presets sized for GPUs: without one, `python -m train` refuses them unless
# given --allow-cpu (a step of either takes minutes to hours on a CPU).
GPU_PRESETS = ("small", "gpu")

# The values each Literal field takes. The model flags' Literals are
# LlamaConfig's (tests/test_train.py ties them), spelled out because this
# module is read by processes that import no jax (the study's parent), and
# sagebwd_jax imports it.
CHOICES: dict[str, tuple[str, ...]] = {
    name: get_args(kind) for name, kind in get_type_hints(Config).items()
    if get_origin(kind) is Literal}


@dataclass(frozen=True)
class Range:
  """Accepted values of a numeric flag: `lo` and `hi` bounds, either may be open."""
  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False
  hi_open: bool = False

  def __contains__(self, x: float) -> bool:
    return ((self.lo is None or (x > self.lo if self.lo_open else x >= self.lo))
            and (self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)))

  def __str__(self) -> str:
    lo, hi = (f"{x:g}" if isinstance(x, float) else str(x) for x in (self.lo, self.hi))
    if self.hi is None:
      return f"{'>' if self.lo_open else '>='} {lo}"
    return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


POSITIVE, NON_NEGATIVE, AT_LEAST_1 = Range(0, lo_open=True), Range(0), Range(1)
UNIT = Range(0, 1, hi_open=True)  # [0, 1)
RANGES: dict[str, Range] = {
    "seed": Range(0, 2**32 - 1),  # jax.random.key wraps larger seeds onto smaller ones
    "vocab_size": AT_LEAST_1, "dim": AT_LEAST_1, "n_layers": AT_LEAST_1,
    "n_heads": AT_LEAST_1, "n_kv_heads": AT_LEAST_1, "ffn_dim": AT_LEAST_1,
    "rope_theta": POSITIVE, "val_fraction": Range(0, 1, lo_open=True, hi_open=True),
    "seq_len": AT_LEAST_1, "batch_size": AT_LEAST_1, "grad_accum": AT_LEAST_1,
    "steps": AT_LEAST_1, "lr": POSITIVE, "min_lr_ratio": Range(0, 1), "warmup": NON_NEGATIVE,
    "weight_decay": NON_NEGATIVE, "beta1": UNIT, "beta2": UNIT, "grad_clip": POSITIVE,
    "eval_every": AT_LEAST_1, "eval_batches": AT_LEAST_1, "ckpt_every": NON_NEGATIVE,
    "telemetry_every": NON_NEGATIVE,
    "keep": AT_LEAST_1, "num_processes": AT_LEAST_1, "process_id": NON_NEGATIVE,
    "peak_tflops": POSITIVE,
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def flag(name: str) -> str:
  """The command-line flag of a field: `--batch-size` for `batch_size`."""
  return "--" + name.replace("_", "-")


def preset(preset_name: str, /, **overrides) -> Config:
  """The preset's configuration (its `name` too) with `overrides` on top."""
  if preset_name not in PRESETS:
    raise ValueError(f"--preset {preset_name!r}: choose one of {', '.join(PRESETS)}")
  return Config(**{"name": preset_name, **PRESETS[preset_name], **overrides})


def check(cfg: Config) -> None:
  """ValueError naming the flag and what it accepts, for the first bad field."""
  for f in dataclasses.fields(Config):
    value = getattr(cfg, f.name)
    if value is None and "None" in str(f.type):
      continue
    kind = str(f.type).split(" |")[0]
    if kind == "bool" and not isinstance(value, bool):
      raise ValueError(f"{flag(f.name)} must be true or false, got {value!r}")
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
      raise ValueError(f"{flag(f.name)} must be an integer, got {value!r}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                            or not math.isfinite(value)):
      raise ValueError(f"{flag(f.name)} must be a finite number, got {value!r}")
    if f.name in RANGES and value not in RANGES[f.name]:
      raise ValueError(f"{flag(f.name)} must be {RANGES[f.name]}, got {value}")
    if f.name in CHOICES and value not in CHOICES[f.name]:
      raise ValueError(f"{flag(f.name)} must be one of {', '.join(CHOICES[f.name])}, "
                       f"got {value!r}")
  if not _NAME.fullmatch(cfg.name):
    raise ValueError(f"--name must be letters, digits, '.', '_' or '-' (a folder name), "
                     f"got {cfg.name!r}")
  if not isinstance(cfg.data, list) or not all(isinstance(p, str) for p in cfg.data):
    raise ValueError(f"--data must be a list of paths, got {cfg.data!r}")
  if cfg.warmup > cfg.steps:
    raise ValueError(f"--warmup must be in [0, --steps] = [0, {cfg.steps}], got {cfg.warmup}")
  if cfg.dim % cfg.n_heads or cfg.dim // cfg.n_heads not in (64, 128):
    raise ValueError(f"--dim / --n-heads (head_dim) must be 64 or 128, got --dim {cfg.dim} "
                     f"--n-heads {cfg.n_heads}")
  if cfg.n_heads % cfg.n_kv_heads:
    raise ValueError(f"--n-kv-heads must divide --n-heads ({cfg.n_heads}), got "
                     f"{cfg.n_kv_heads}")
  if cfg.resume and cfg.overwrite:
    raise ValueError("--resume and --overwrite exclude each other: continue the run, or "
                     "start it over")
  if (cfg.process_id is not None and cfg.num_processes is not None
      and cfg.process_id >= cfg.num_processes):
    raise ValueError(f"--process-id must be in [0, --num-processes) = [0, "
                     f"{cfg.num_processes}), got {cfg.process_id}")
  from train.sharding import parse_mesh
  parse_mesh(cfg.mesh)  # the string's form; the device count is checked at start-up


def params_besides_embeddings(cfg: Config) -> int:
  """Parameters of the blocks and the final norm (the embedding and the output
  layer add vocab x dim each; one when tied)."""
  head_dim = cfg.dim // cfg.n_heads
  attention = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.n_kv_heads * head_dim
  block = attention + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim + 2 * head_dim * cfg.qk_norm
  return cfg.n_layers * block + cfg.dim


def describe(name: str) -> str:
  """One line on a preset: its model, its size and its tokens per step."""
  c = preset(name)
  return (f"{name}: dim {c.dim}, {c.n_layers} layers, {c.n_heads} heads of "
          f"{c.dim // c.n_heads} ({c.n_kv_heads} kv), ffn {c.ffn_dim}; "
          f"{params_besides_embeddings(c) / 1e6:.1f}M parameters + 2 x vocab x {c.dim} "
          f"embeddings; {c.tokens_per_step:,} tokens/step = {c.batch_size} x {c.seq_len} "
          f"x {c.grad_accum}; {c.steps:,} steps")


def to_json(cfg: Config) -> str:
  return json.dumps(dataclasses.asdict(cfg), indent=2)
