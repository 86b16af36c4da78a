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
