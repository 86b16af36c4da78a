"""Every ```python block of README.md runs as written (on the CPU here), and
every command it names is one its script accepts.

A block whose first line is `# needs a GPU` is skipped where JAX has no GPU.
Each block runs alone, in a fresh namespace, as a user would paste it.
Commands (the lines of ```bash blocks, and `python -m ...` or `make ...` in
the text) are parsed by the script's own argument parser, not run: most
need a GPU, data or a run folder. The study's `--list` runs as written.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import runpy
import shlex
import sys

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
NEEDS_GPU = "# needs a GPU"


def _blocks() -> list[tuple[int, str]]:
  """(line number, source) of each ```python block of the README."""
  text = README.read_text()
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)]


BLOCKS = _blocks()


def test_the_readme_has_python_blocks():
  assert len(BLOCKS) >= 4  # the op, two Flax swaps, sharding


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, source):
  if source.startswith(NEEDS_GPU) and jax.default_backend() != "gpu":
    pytest.skip("the block needs a GPU")
  namespace = {"__name__": "__readme__"}
  # Compiled with the README's line numbers, so a traceback points into it.
  exec(compile("\n" * (line - 1) + source, str(README), "exec"), namespace)


USER_FACING = ("README.md", "docs/training.md", "docs/algorithm.md", "docs/integrations.md",
               "docs/README.md", "docs/performance.md", "benchmarks/README.md")
# The project's own history, which a user has no way to look up.
INTERNAL = re.compile(r"\bissue \d+|\bdeleted Pallas|\bthen Pallas|\bSPEC\b", re.IGNORECASE)


def test_user_facing_text_speaks_of_the_code_as_it_is():
  """No internal history in the guides or in `python -m train --help`
  (docs/performance-log.md keeps its dated log); one way to run the commands
  (the activated venv); the first screen says what the op is for today."""
  from train.config import parser
  root = README.parent
  texts = {name: (root / name).read_text() for name in USER_FACING}
  texts["python -m train --help"] = parser().format_help()
  for name, text in texts.items():
    assert not INTERNAL.search(text), (name, INTERNAL.search(text))
  readme = texts["README.md"]
  assert ".venv/bin/python" not in readme and "source .venv/bin/activate" in readme
  first_screen = readme.split("\n## ", 1)[0]
  assert "not yet faster than" in first_screen and "cuDNN" in first_screen


def _commands() -> list[list[str]]:
  """Each command of the README as its words: the lines of its ```bash blocks
  (continuations joined, comments dropped) and the `python -m ...` and
  `make ...` spans of its text."""
  text = README.read_text()
  lines = [line for block in re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
           for line in block.replace("\\\n", " ").splitlines()]
  lines += re.findall(r"`((?:python -m|make) [^`]+)`", text)
  return [words for line in lines if (words := shlex.split(line, comments=True))]


COMMANDS = _commands()
MODULE_COMMANDS = [c for c in COMMANDS if c[:2] == ["python", "-m"] and c[2] != "pytest"
                   and "<" not in c[2]]  # not `python -m benchmarks.<script>`


class _Parsed(Exception):
  """The script's parser accepted its arguments (raised instead of running it)."""


def test_the_readme_names_its_commands():
  assert ["make", "venv"] in COMMANDS and ["make", "train"] in COMMANDS
  assert len(MODULE_COMMANDS) >= 15


# runpy warns that the package imported the module before it runs it again.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
@pytest.mark.parametrize("words", MODULE_COMMANDS, ids=[" ".join(c[2:5]) for c in MODULE_COMMANDS])
def test_readme_command_parses(words, monkeypatch):
  """The script's own parser takes the command's flags as written (it stops
  there: the run itself would need a GPU, data or a run folder)."""
  parse_args, parse_known_args = argparse.ArgumentParser.parse_args, \
      argparse.ArgumentParser.parse_known_args
  depth = [0]  # parse_args calls parse_known_args, subparsers too: stop at the outermost

  def parse(original):
    def wrapper(self, args=None, namespace=None):
      depth[0] += 1
      try:
        result = original(self, args, namespace)
      finally:
        depth[0] -= 1
      if depth[0] == 0:
        raise _Parsed(result)
      return result
    return wrapper

  def no_exit(code):  # `python -m train` ends an error with os._exit
    raise SystemExit(code)

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse(parse_args))
  monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse(parse_known_args))
  monkeypatch.setattr(os, "_exit", no_exit)
  monkeypatch.setattr(sys, "argv", [words[2], *words[3:]])
  monkeypatch.chdir(README.parent)
  with pytest.raises((_Parsed, SystemExit)) as e:
    runpy.run_module(words[2], run_name="__main__", alter_sys=True)
  assert e.type is _Parsed or e.value.code == 0, f"{' '.join(words)}: exit {e.value.code}"


def test_readme_make_targets_exist():
  makefile = (README.parent / "Makefile").read_text()
  targets = set(re.findall(r"^([\w.-]+):", makefile, re.MULTILINE))
  for words in (c for c in COMMANDS if c[0] == "make"):
    for target in (w for w in words[1:] if "=" not in w):
      assert target in targets, f"{' '.join(words)}: no target {target!r} in the Makefile"


def test_readme_study_list_shows_the_committed_runs(capsys, monkeypatch):
  """The second round's `--list`, as written: its 66 committed runs, all done."""
  from train import study
  words = next(c for c in MODULE_COMMANDS if c[2] == "train.study" and "--list" in c)
  monkeypatch.chdir(README.parent)
  study.main(words[3:])
  out = capsys.readouterr().out.splitlines()
  assert not [line for line in out if line.endswith(": absent")]
  assert out[-1] == "66 runs of 11 cells, 865.1M tokens; 0 runs, 0.0M tokens left"


def test_readme_code_map_paths_exist():
  section = README.read_text().split("## Where the code is", 1)[1].split("\n## ", 1)[0]
  paths = re.findall(r"`((?:sagebwd_jax|pallas_kernels|train|benchmarks)/[\w/.]*)`", section)
  assert len(paths) >= 7
  for path in paths:
    assert (README.parent / path).exists(), path
