# Quick start on a fresh machine:  make demo   |   make test
#
# `make install` creates $(VENV) and installs torch==$(TORCH_VERSION) FIRST, from $(TORCH_INDEX),
# then this package with its test extra. A bare "torch" requirement resolved from PyPI on Linux is
# the CUDA build (several GB of NVIDIA libraries), so the default index is PyTorch's CPU-only one:
#   make install                                                        # CPU build (default)
#   make TORCH_INDEX=https://download.pytorch.org/whl/cu128 install     # a CUDA 12.8 build
#   make TORCH_INDEX= install                                           # PyPI's default build
# (on an existing venv: `make clean` first; PyPI stays an extra index for torch's dependencies)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYPI_INDEX ?= https://pypi.org/simple
# --retries 1: where the index cannot be reached (a closed network with a local wheel cache) each
# lookup fails over to the cache in seconds instead of retrying five times per package
TORCH_SOURCE := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url $(PYPI_INDEX) --retries 1 --timeout 15)

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
	  { echo "ray_ckpt needs Python >= 3.10 (torch 2.13, Ray 2.60); $(PYTHON) is $$($(PYTHON) -V 2>&1). Use: make PYTHON=python3.11 ..." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, from $(or $(TORCH_INDEX),PyPI): the package's bare "torch" is then satisfied
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(TORCH_SOURCE)
	# the test and verl extras (tests/test_verl.py runs verl itself); torch held at the build installed above
	echo "torch==$(TORCH_VERSION)" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -e ".[test,verl]" -c $(VENV)/constraints.txt
	$(PY) -c "import torch, ray_ckpt; print('installed torch', torch.__version__, '(CUDA', str(torch.version.cuda) + ')')"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/ray-ckpt demo

test: install
	$(PY) -m pytest -q --durations=15

bench: install
	$(PY) benchmarks/save_stall.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
