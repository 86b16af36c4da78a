# The two commands a new user runs: `make train` and `make test`.
PYTHON ?= $(shell (pyenv prefix 3.12 2>/dev/null | sed 's|$$|/bin/python|') || command -v python3.12)
VENV := .venv
VPY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2

.PHONY: venv test train clean

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VPY)
	$(VPY) -m pip install -q -e '.[dev,train]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# `train` runs from the checkout (make's working directory), not from
# site-packages: pyproject.toml installs only sagebwd_jax and pallas_kernels.
train: venv
	$(VPY) -m train --preset tiny

clean:
	rm -rf $(VENV) runs
