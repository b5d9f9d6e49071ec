# Two commands do all set-up on a fresh machine (Python >= 3.11 and the package registries):
#   make demo   -> creates .venv, installs, runs the default training job
#   make test   -> creates .venv, installs with the dev extra, runs the test suite
#   make typecheck -> mypy over src/nonstop (the dev extra installs it)
# torch is installed first and pinned, so pip never resolves an unpinned (CUDA) torch here.
# GPU users: install your own torch build into .venv first, then `make demo TORCH=`.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: demo test test-all typecheck bench venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH),$(PIP) install -q "$(TORCH)")
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/nonstop train

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

test-all: $(VENV)/.installed
	$(PY) -m pytest -q

# mypy over src/nonstop, configured in pyproject.toml ([tool.mypy]).
typecheck: $(VENV)/.installed
	$(PY) -m mypy

bench: $(VENV)/.installed
	$(PIP) install -q -e ".[bench]"
	$(PY) bench/vs_trl.py

clean:
	rm -rf $(VENV) runs .nonstop_cache
