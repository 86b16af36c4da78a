"""Every ```python block of README.md runs as written (on the CPU here).

A block whose first line is `# needs a GPU` is skipped where JAX has no GPU.
Each block runs alone, in a fresh namespace, as a user would paste it.
"""

from __future__ import annotations

import pathlib
import re

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
               "docs/README.md", "benchmarks/README.md")
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
