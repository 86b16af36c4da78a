"""pyproject.toml's dependencies are ranges: a lower bound (what `make test`
installs, DEPS=lowest in the Makefile, so CI checks it) and, where the code
leans on what a minor release may change, an upper bound; this environment
lies within them."""

from __future__ import annotations

import importlib.metadata
import pathlib
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Packages whose internals or unstable APIs the code uses: bounded below their next minor.
BOUNDED = {"jax", "jaxlib", "flax", "triton", "jax-triton"}


def _requirements() -> list[Requirement]:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
  return [Requirement(r) for r in project["dependencies"] + extras]


def test_dependencies_are_ranges_this_environment_satisfies():
  ranged = {}
  for req in _requirements():
    operators = {spec.operator for spec in req.specifier}
    assert "==" not in operators, f"{req}: a range, not a pin"
    if not operators:
      continue
    assert ">=" in operators, f"{req}: a range needs its lower bound (make test installs it)"
    ranged[req.name] = req
    try:
      installed = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
      continue  # an extra this environment does not have (gpu)
    assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed}"
  assert BOUNDED <= set(ranged)
  for name in BOUNDED:
    upper = [spec for spec in ranged[name].specifier if spec.operator == "<"]
    assert upper, f"{ranged[name]}: no upper bound"
