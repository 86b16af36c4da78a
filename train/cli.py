"""The command lines: `python -m train`'s flags as a Config, and the argument
parser every command line of train/ and benchmarks/ uses.

`parser` builds train's flags from `Config` (train/config.py): each field's
comment is its `--help` line, the `# --- ... ---` lines its groups. `parse`
reads them onto a preset, or with --resume onto the saved run's
configuration. argparse answers a flag error with the usage first (28 lines
for train's flags), which pushes the line naming the mistake out of sight:
`ArgumentParser`'s error is that line and a pointer to `--help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from typing import Any

from train.config import (CHOICES, GPU_PRESETS, PRESETS, RANGES, Config, check, describe,
                          flag, preset)


class ArgumentParser(argparse.ArgumentParser):

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message}\n"
                 f"{self.prog} --help lists every flag and the values it takes\n")


def field_docs() -> tuple[dict[str, str], dict[str, str]]:
  """(help line of each field, group of each field), read from the comments
  in `Config`'s source."""
  helps, groups, comment, group = {}, {}, [], ""
  for line in inspect.getsource(Config).splitlines():
    line = line.strip()
    if m := re.fullmatch(r"# --- (.+) ---", line):
      group, comment = m.group(1), []
    elif line.startswith("# "):
      comment.append(line[2:])
    elif (m := re.match(r"(\w+): ", line)) and comment:
      helps[m.group(1)], groups[m.group(1)], comment = " ".join(comment), group, []
  return helps, groups


def _limits(name: str) -> str:
  """' (accepted values; default, and the presets' values where they differ)'."""
  default = getattr(Config(), name)
  notes = [str(RANGES[name])] if name in RANGES else []
  if name != "name" and default not in (None, []):  # those fields' help says the default
    notes.append(f"default {default}"
                 + "".join(f", {p} {v[name]}" for p, v in PRESETS.items() if name in v))
  return f" ({'; '.join(notes)})" if notes else ""


def parser() -> argparse.ArgumentParser:
  presets = "\n".join("  " + describe(name) for name in PRESETS)
  p = ArgumentParser(
      prog="python -m train", formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Pre-train a Llama with SageBwd INT8 attention (or full precision).\n"
                  "A preset sets every flag; flags given override it. Defaults below "
                  "are the tiny preset's, then the other presets' where they differ.",
      epilog=f"presets:\n{presets}\n\nGuide: docs/training.md")
  # Python 3.12's argparse takes "-3e-3" for an option and says "expected one
  # argument"; read it as a number so the range check can name what is wrong.
  p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.I)
  helps, groups = field_docs()
  sections = {}
  for f in dataclasses.fields(Config):
    title, _, description = groups[f.name].partition(": ")
    if title not in sections:
      sections[title] = p.add_argument_group(title, description or None)
    g = sections[title]
    if f.name == "name":
      g.add_argument("--preset", default="tiny", choices=list(PRESETS),
                     help="the settings to start from (listed at the end; default tiny)")
      g.add_argument("--print-config", action="store_true",
                     help="print the resolved configuration as JSON and exit")
      g.add_argument("--compile-cache", metavar="DIR", default=None,
                     help="jax's persistent compilation cache: compiled steps are kept "
                          "here, so a second run or a resume of the same model starts "
                          "without compiling them again (default $JAX_COMPILATION_CACHE_DIR "
                          "where set, else ~/.cache/sagebwd-jax/jax-cache; 'none': off; "
                          "safe for runs sharing it at the same time)")
    kind = str(f.type).split(" |")[0]
    kw = dict(default=argparse.SUPPRESS,  # absent flags keep the preset's value
              help=helps[f.name].rstrip(".") + _limits(f.name))
    if f.name in CHOICES:
      kw["choices"] = CHOICES[f.name]
    if kind == "bool":
      g.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kw)
    elif kind == "list[str]":
      g.add_argument(flag(f.name), nargs="+", metavar="PATH", **kw)
    else:
      g.add_argument(flag(f.name), type={"int": int, "float": float}.get(kind, str), **kw)
  sections["devices"].add_argument(
      "--allow-cpu", action="store_true",
      help=f"run the {' and '.join(GPU_PRESETS)} presets where jax sees no GPU; without it "
           f"they stop at once there, with the step time they would take")
  return p


# The fields a preset sets for its own --steps. Given --steps alone they scale with it
# (a 10-step smoke run keeps the preset's warmup share, evaluations and checkpoints).
SCHEDULE_FIELDS = ("warmup", "eval_every", "ckpt_every", "telemetry_every")


def scale_schedule(cfg: Config, preset_steps: int, given) -> tuple[Config, str | None]:
  """`cfg` with each schedule field not in `given` (the flags the user gave)
  scaled from the preset's `preset_steps` to `cfg.steps`, and a line saying
  what changed (None when nothing did)."""
  if "steps" not in given or cfg.steps == preset_steps:
    return cfg, None
  changed = {}
  for name in SCHEDULE_FIELDS:
    value = getattr(cfg, name)
    if name in given or not value:  # 0 switches checkpoints or telemetry off
      continue
    scaled = round(value * cfg.steps / preset_steps)
    changed[name] = (value, scaled if name == "warmup" else max(1, scaled))
  if not changed:
    return cfg, None
  cfg = dataclasses.replace(cfg, **{n: new for n, (_, new) in changed.items()})
  return cfg, (f"--steps {cfg.steps} (the preset's {preset_steps}): "
               + ", ".join(f"{flag(n)} {new} (from {old})" for n, (old, new) in changed.items())
               + "; give them to choose other values")


# The flags that are not fields of Config (config.json does not record them).
OPTIONS = ("print_config", "compile_cache", "allow_cpu")


def parse(argv: list[str] | None = None) -> tuple[Config, str, dict[str, Any]]:
  """(the configuration the flags ask for, --preset's name, the OPTIONS given).

  Prints to stderr which schedule fields followed --steps (`scale_schedule`);
  with --resume, the saved run's configuration, the flags given on top
  (`rundir.resumed_config`). ValueError, naming the flag, for anything out
  of range; rundir.RunError for a run folder that cannot be resumed."""
  args = vars(parser().parse_args(argv))
  options = {k: args.pop(k) for k in OPTIONS}
  name = args.pop("preset")
  cfg, note = scale_schedule(preset(name, **args), preset(name).steps, given=args)
  if args.get("resume") and not args.get("overwrite"):  # with both, check() says which
    from train.rundir import resumed_config
    cfg, note = resumed_config(cfg, given=args), None
  check(cfg)
  if note:
    print(note, file=sys.stderr)
  return cfg, name, options


def from_args(argv: list[str] | None = None) -> tuple[Config, bool]:
  """(the configuration the flags ask for, whether --print-config was given)."""
  cfg, _, options = parse(argv)
  return cfg, options["print_config"]
