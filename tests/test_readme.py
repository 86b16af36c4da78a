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
  from train.cli import parser
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
  """Each command of the README as its words, in the README's order: the
  lines of its ```bash blocks (continuations joined, comments dropped) and
  the `python -m ...` and `make ...` spans of its text."""
  text = README.read_text()
  found = []  # (offset, line)
  blocks = list(re.finditer(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE))
  for block in blocks:
    offset = block.start(1)
    for line in block.group(1).split("\n"):
      found.append((offset, line))
      offset += len(line) + 1
  inside = lambda at: any(b.start() <= at < b.end() for b in blocks)
  found += [(m.start(1), m.group(1)) for m in re.finditer(r"`((?:python -m|make) [^`]+)`", text)
            if not inside(m.start())]
  # A line ending in a backslash continues on the next.
  lines, pending = [], ""
  for _, line in sorted(found):
    if line.endswith("\\"):
      pending += line[:-1] + " "
      continue
    lines.append(pending + line)
    pending = ""
  return [words for line in lines if (words := shlex.split(line, comments=True))]


COMMANDS = _commands()
MODULE_COMMANDS = [c for c in COMMANDS if c[:2] == ["python", "-m"] and c[2] != "pytest"
                   and "<" not in c[2]]  # not `python -m benchmarks.<script>`


class _Parsed(Exception):
  """The script's parser accepted its arguments (raised instead of running it)."""


def test_the_readme_names_its_commands():
  assert ["make", "venv"] in COMMANDS and ["make", "train"] in COMMANDS
  assert len(MODULE_COMMANDS) >= 15


def _parse(words: list[str], monkeypatch) -> argparse.Namespace | None:
  """The arguments of `python -m MODULE ...` as the script's own parser reads
  them (the script stops there: the run itself would need a GPU, data or a
  run folder); None where it exits with status 0 instead (`--help`).
  AssertionError where it exits with an error."""
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

  with monkeypatch.context() as m:
    m.setattr(argparse.ArgumentParser, "parse_args", parse(parse_args))
    m.setattr(argparse.ArgumentParser, "parse_known_args", parse(parse_known_args))
    m.setattr(os, "_exit", no_exit)
    m.setattr(sys, "argv", [words[2], *words[3:]])
    m.chdir(README.parent)
    with pytest.raises((_Parsed, SystemExit)) as e:
      runpy.run_module(words[2], run_name="__main__", alter_sys=True)
  assert e.type is _Parsed or e.value.code == 0, f"{' '.join(words)}: exit {e.value.code}"
  if e.type is SystemExit:
    return None
  parsed = e.value.args[0]
  return parsed[0] if isinstance(parsed, tuple) else parsed  # parse_known_args: a pair


# runpy warns that the package imported the module before it runs it again.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
@pytest.mark.parametrize("words", MODULE_COMMANDS, ids=[" ".join(c[2:5]) for c in MODULE_COMMANDS])
def test_readme_command_parses(words, monkeypatch):
  """The script's own parser takes the command's flags as written."""
  _parse(words, monkeypatch)


def test_the_quick_start_starts_no_test_suite():
  """The first block, what a newcomer pastes first: the venv made and
  activated, the demo run; the suite (11 minutes on two cores) is left to
  the text, as one optional command."""
  assert COMMANDS[:3] == [["make", "venv"], ["source", ".venv/bin/activate"], ["make", "train"]]
  block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
  assert "make test" not in block and "pytest" not in block
  assert ["make", "test"] in COMMANDS  # still one command, in the text


def _resolved(name: str, written: list[str], resume: bool) -> str | None:
  """Where `python -m train` without --out writes (train/rundir.py's
  resolve): runs/<name>, or runs/<name>-N past the newest written; with
  --resume the newest written (None: none)."""
  base = f"runs/{name}"
  taken = [1] * (base in written) + [
      int(m.group(1)) for w in written if (m := re.fullmatch(re.escape(base) + r"-(\d+)", w))]
  if resume:
    return None if not taken else base if max(taken) == 1 else f"{base}-{max(taken)}"
  n = max(taken, default=0) + 1
  return base if n == 1 else f"{base}-{n}"


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
def test_every_run_a_command_reads_is_written_by_a_command_before_it(monkeypatch):
  """A README command that reads a run folder (to resume, plot, sample or
  measure it) reads one that a command shown before it writes, or one
  committed in the repository; a placeholder such as RUN aside."""
  from train.config import PRESETS
  written, reads = [], 0
  for words in COMMANDS:
    if words[:2] == ["make", "train"]:
      written.append(_resolved("tiny", written, resume=False))  # its `python -m train --preset tiny`
    if words[:2] != ["python", "-m"] or words[2] == "pytest" or "<" in words[2]:
      continue
    args = _parse(words, monkeypatch)
    if args is None:
      continue
    module, read = words[2], []
    if module == "train":
      name = getattr(args, "name", args.preset if args.preset in PRESETS else "tiny")
      out = getattr(args, "out", None) or _resolved(name, written, getattr(args, "resume", False))
      if getattr(args, "resume", False):
        read = [out]
      elif not args.print_config:
        written.append(out)
    elif module == "train.study":
      (read if args.list else written).append(args.out or f"runs/study-{args.scale}")
    elif module == "train.plot":
      read = args.runs
    elif module in ("train.sample", "benchmarks.telemetry_cost"):
      read = [args.run]
    for run in read:
      if run is None or run.isupper():  # nothing resolved above; a placeholder
        assert run is not None, f"{' '.join(words)}: no run to resume"
        continue
      reads += 1
      committed = not run.startswith("runs/") and (README.parent / run).is_dir()
      assert run in written or committed, (
          f"{' '.join(words)} reads {run}, which no README command before it writes")
  assert reads >= 5  # resume, two plotted runs, sample, the study's --list


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


def _slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading: lower case, punctuation dropped
  (word characters, spaces and hyphens kept), spaces as hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_their_anchors_resolve():
  """Every relative link of the README and the guides names a file of the
  tree, and an anchor in a Markdown file one of its headings (the log's are
  keyed by date and commit: a renamed heading must take its links along)."""
  root = README.parent
  pages = [README, *sorted((root / "docs").glob("*.md")), root / "benchmarks" / "README.md"]
  checked = 0
  for page in pages:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target):
        continue  # https:, mailto:
      path, _, anchor = target.partition("#")
      file = (page.parent / path).resolve() if path else page
      assert file.exists(), f"{page.name}: {target}: no {file}"
      if anchor and file.suffix == ".md":
        headings = re.findall(r"^#+ (.+)$", file.read_text(), re.MULTILINE)
        assert anchor in {_slug(h) for h in headings}, f"{page.name}: {target}: no such heading"
      checked += 1
  assert checked >= 20


# How the work was organized, which a reader of the project cannot resolve
# (issue 56's check, spelled with \s so that this file does not match it).
ORGANIZATION = re.compile(
    r"([a-z]+-)?[a-z]+(th|st|nd|rd)\ssession|device[-\s]time|gpu\ssession|"
    r"session\s(with|has)\sa|sessions?\sof\s[0-9]+|by\ssession|session\sby", re.IGNORECASE)


def test_the_project_speaks_of_itself_not_of_how_the_work_was_organized():
  """No line of the tree (the run files' JSON aside) speaks of the sessions
  the work was done in or of the machines' time limits: a measurement is
  keyed by its date and commit, a time limit is a job's wall-time limit."""
  root = README.parent
  skip = {".git", ".gl", ".venv", "runs", "__pycache__", "build", "dist", ".pytest_cache"}
  found = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
    for name in files:
      path = pathlib.Path(folder, name)
      if path.suffix in (".json", ".jsonl", ".png"):
        continue
      try:
        text = path.read_text()
      except (UnicodeDecodeError, OSError):
        continue
      found += [f"{path.relative_to(root)}:{n}: {line}" for n, line in
                enumerate(text.splitlines(), 1) if ORGANIZATION.search(line)]
  assert not found, "\n".join(found)
