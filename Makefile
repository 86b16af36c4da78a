# The two commands a new user runs: `make train` and `make test`.
PYTHON ?= $(shell (pyenv prefix 3.12 2>/dev/null | sed 's|$$|/bin/python|') || command -v python3.12)
VENV := .venv
VPY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2
# DEPS=lowest (the default, what CI runs): every dependency at the lower bound
# of its range in pyproject.toml, the versions the suite is known to pass with.
# DEPS=newest: the newest versions the ranges allow (`make test DEPS=newest`).
DEPS ?= lowest

.PHONY: venv test train clean

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# The lower bound of every range in pyproject.toml, as pip constraints.
$(VENV)/lowest.txt: pyproject.toml | $(VPY)
	$(VPY) -c 'import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  reqs = p["dependencies"] + sum(p["optional-dependencies"].values(), []); \
	  print("\n".join(sorted({f"{m[1]}=={m[2]}" for r in reqs \
	                          if (m := re.match(r"([\w.-]+)\s*>=\s*([\w.]+)", r))})))' > $@

$(VENV)/.installed-lowest: pyproject.toml $(VENV)/lowest.txt | $(VPY)
	$(VPY) -m pip install -q -e '.[dev,train]' -c $(VENV)/lowest.txt
	rm -f $(VENV)/.installed-*
	touch $@

$(VENV)/.installed-newest: pyproject.toml | $(VPY)
	$(VPY) -m pip install -q --upgrade --upgrade-strategy eager -e '.[dev,train]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(VENV)/.installed-$(DEPS)

test: venv
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# `train` runs from the checkout (make's working directory), not from
# site-packages: pyproject.toml installs only sagebwd_jax and pallas_kernels.
train: venv
	$(VPY) -m train --preset tiny

clean:
	rm -rf $(VENV) runs
