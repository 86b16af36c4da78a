"""The layout bars of issue 14, checked on the source: no kernel backend
imports another's folder, the rules they share with the reference import
none, and no module of the packages runs past 400 lines unless its
docstring says why, in a sentence starting with `LONG_REASON`."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("sagebwd_jax", "pallas_kernels", "train", "benchmarks")
MOSAIC, TRITON = "pallas_kernels.mosaic", "pallas_kernels.jax_triton"
BACKENDS = (MOSAIC, TRITON)
MAX_LINES = 400
LONG_REASON = "Longer than 400 lines because"


def module_name(path: pathlib.Path) -> str:
  """The dotted name of the module at `path` (a package's for `__init__.py`)."""
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
  """Absolute names of what `source`, the text of `module`, imports.

  Relative imports are resolved against `module`; `from a import b` yields
  both `a` and `a.b`, since `b` may be a submodule.
  """
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = ".".join(package[:len(package) - node.level + 1])
        base = f"{anchor}.{base}" if base else anchor
      names.add(base)
      names.update(f"{base}.{alias.name}" for alias in node.names)
  return names


def is_within(name: str, package: str) -> bool:
  return name == package or name.startswith(package + ".")


def long_without_reason(source: str) -> bool:
  """More than MAX_LINES lines, and no module docstring stating why."""
  if len(source.splitlines()) <= MAX_LINES:
    return False
  docstring = " ".join((ast.get_docstring(ast.parse(source)) or "").split())
  return LONG_REASON not in docstring


def _sources(*packages: str) -> list[pathlib.Path]:
  return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _crossings(files: list[pathlib.Path], forbidden: tuple[str, ...]) -> list[str]:
  """'<file> imports <module>' for each import by `files` from a `forbidden` package."""
  crossings = []
  for path in files:
    imports = imported_modules(path.read_text(), module_name(path),
                               is_package=path.name == "__init__.py")
    crossings += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(imports)
                  if any(is_within(name, package) for package in forbidden)]
  return crossings


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_do_not_import_each_other(backend):
  files = _sources(backend.replace(".", "/"))
  assert files, f"no modules found under {backend}"
  crossings = _crossings(files, tuple(other for other in BACKENDS if other != backend))
  assert not crossings, "\n".join(crossings)


def test_shared_rules_import_no_backend():
  """`types`, `numerics`, `causal_blocks` and the reference stand on their own."""
  files = sorted((ROOT / "pallas_kernels").glob("*.py")) + [ROOT / "sagebwd_jax/reference.py"]
  crossings = _crossings(files, BACKENDS)
  assert not crossings, "\n".join(crossings)


def test_long_modules_say_why():
  files = _sources(*PACKAGES)
  assert files
  offenders = [f"{path.relative_to(ROOT)}: {len(path.read_text().splitlines())} lines"
               for path in files if long_without_reason(path.read_text())]
  assert not offenders, (f"over {MAX_LINES} lines without '{LONG_REASON} ...' in the "
                         "module docstring:\n" + "\n".join(offenders))


# The checkers themselves, on sources made up for the purpose.

@pytest.mark.parametrize("source,module,is_package,expected", [
    ("import pallas_kernels.mosaic.common as c", "pallas_kernels.jax_triton.forward", False,
     {"pallas_kernels.mosaic.common"}),
    ("from pallas_kernels import mosaic", "pallas_kernels.jax_triton.forward", False,
     {"pallas_kernels", "pallas_kernels.mosaic"}),
    ("from ..mosaic.common import BLOCK", "pallas_kernels.jax_triton.forward", False,
     {"pallas_kernels.mosaic.common", "pallas_kernels.mosaic.common.BLOCK"}),
    ("from .. import mosaic", "pallas_kernels.jax_triton", True,
     {"pallas_kernels", "pallas_kernels.mosaic"}),
    ("from . import common", "pallas_kernels.jax_triton.forward", False,
     {"pallas_kernels.jax_triton", "pallas_kernels.jax_triton.common"}),
    ("def f():\n  import pallas_kernels.mosaic", "pallas_kernels.jax_triton.forward", False,
     {"pallas_kernels.mosaic"}),
])
def test_imported_modules_resolves_every_import_form(source, module, is_package, expected):
  assert imported_modules(source, module, is_package) == expected


def test_long_without_reason():
  body = "x = 1\n" * MAX_LINES
  assert not long_without_reason(body)
  assert long_without_reason(body + "x = 2\n")
  assert long_without_reason('"""A module."""\n' + body)
  wrapped = '"""A module.\n\nLonger than 400\nlines because its kernels share one body.\n"""\n'
  assert not long_without_reason(wrapped + body)
