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

# `make test` then runs a fast subset on the oldest Ray the package supports, in a second venv: the checks
# that name a moved Ray / RLlib internal, an engine's exact resume and rewind, ranks, the RLlib callback
RAY_OLDEST ?= 2.55.0
OLDEST_VENV ?= .venv-ray-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_TESTS ?= tests/test_ray_internals.py tests/test_rllib_internals.py tests/test_rllib_journal_internals.py \
  tests/test_rllib_replay_journal.py::test_versions_written_append_only_restore_exactly_and_a_restored_buffer_goes_on_alike \
  tests/test_rllib_replay_journal.py::test_a_buffer_filled_before_its_journal_or_changed_behind_add_is_captured_whole \
  tests/test_architecture.py \
  tests/test_engine.py::test_exact_resume_after_killed_learner \
  tests/test_engine.py::test_restore_with_rewind_continues_from_an_older_version \
  tests/test_engine.py::test_small_in_process_states_are_the_bytes_of_their_save \
  tests/test_ranks.py::test_version_commits_when_every_rank_pushed_and_restores_per_rank \
  tests/test_rllib.py::test_storable_roundtrip_keeps_rllib_state_exact \
  tests/test_rllib.py::test_ppo_saved_by_callback_restores_into_fresh_algorithm \
  tests/test_rllib.py::test_a_local_learners_state_is_saved_as_it_was_at_save

# `make test-skyrl`: tests/test_skyrl.py against SkyRL itself, in a venv of its own: skyrl 0.4.0 needs
# Python >= 3.12 and pins ray==2.57.0 (inside ray_ckpt's 2.55-2.60). Its requirements come from
# requirements-skyrl.txt (skyrl's own, less flash-attn, which has no CPU build), then the skyrl wheel
# with --no-deps, then this package (editable) with its test extra, torch and ray held where they are.
# the first of python3.12, python3.13 or pyenv's 3.12.x / 3.13.x that runs (a pyenv shim answers to the name
# python3.12 where that version is installed but not selected, and fails when run)
SKYRL_PYTHON ?= $(shell for p in python3.12 python3.13 $$(pyenv root 2>/dev/null)/versions/3.1[23]*/bin/python3; do \
  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { echo $$p; break; }; done)
SKYRL_VENV ?= .venv-skyrl
SKYRL_PY := $(SKYRL_VENV)/bin/python
SKYRL_VERSION ?= 0.4.0
SKYRL_RAY ?= 2.57.0

.PHONY: test-slow test-all install install-oldest install-skyrl test-skyrl demo test bench clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
	  { echo "ray_ckpt needs Python >= 3.10 (torch 2.13, Ray 2.60); $(PYTHON) is $$($(PYTHON) -V 2>&1). Use: make PYTHON=python3.11 ..." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, from $(or $(TORCH_INDEX),PyPI): the package's bare "torch" is then satisfied
	$(PY) -m pip install -q torch==$(TORCH_VERSION) $(TORCH_SOURCE)
	# the test and verl extras (tests/test_verl.py runs verl itself); torch held at the build installed above
	echo "torch==$(TORCH_VERSION)" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -e ".[test,verl,docs]" -c $(VENV)/constraints.txt
	# OpenRLHF's DeepSpeed path (tests/test_openrlhf.py): DeepSpeed with no op built, then OpenRLHF without its pins
	DS_BUILD_OPS=0 DS_ACCELERATOR=cpu $(PY) -m pip install -q -e ".[openrlhf]" -c $(VENV)/constraints.txt
	$(PY) -m pip install -q --no-deps openrlhf==0.11.2
	$(PY) -c "import torch, ray_ckpt; print('installed torch', torch.__version__, '(CUDA', str(torch.version.cuda) + ')')"
	touch $@

install: $(VENV)/.installed

# the same recipe with Ray held at $(RAY_OLDEST) (and RLlib, for the callback's tests)
$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q torch==$(TORCH_VERSION) $(TORCH_SOURCE)
	echo "torch==$(TORCH_VERSION)" > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_PY) -m pip install -q -e ".[test]" "ray[default,rllib]==$(RAY_OLDEST)" -c $(OLDEST_VENV)/constraints.txt
	touch $@

install-oldest: $(OLDEST_VENV)/.installed

$(SKYRL_VENV)/.installed: pyproject.toml requirements-skyrl.txt
	@test -n "$(SKYRL_PYTHON)" && $(SKYRL_PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 12))' || \
	  { echo "SkyRL needs Python >= 3.12; $(SKYRL_PYTHON) is $$($(SKYRL_PYTHON) -V 2>&1). Use: make SKYRL_PYTHON=/path/to/python3.12 ..." >&2; exit 1; }
	$(SKYRL_PYTHON) -m venv $(SKYRL_VENV)
	$(SKYRL_PY) -m pip install -q --upgrade pip
	$(SKYRL_PY) -m pip install -q torch==$(TORCH_VERSION) $(TORCH_SOURCE)
	printf 'torch==$(TORCH_VERSION)\nray==$(SKYRL_RAY)\n' > $(SKYRL_VENV)/constraints.txt
	$(SKYRL_PY) -m pip install -q -r requirements-skyrl.txt -c $(SKYRL_VENV)/constraints.txt
	$(SKYRL_PY) -m pip install -q --no-deps skyrl==$(SKYRL_VERSION)
	$(SKYRL_PY) -m pip install -q -e ".[test]" -c $(SKYRL_VENV)/constraints.txt
	$(SKYRL_PY) -c "import torch, ray, skyrl, ray_ckpt; print('SkyRL venv: torch', torch.__version__, 'ray', ray.__version__)"
	touch $@

install-skyrl: $(SKYRL_VENV)/.installed

test-skyrl: install-skyrl
	$(SKYRL_PY) -m pytest -q tests/test_skyrl.py --durations=10

demo: install
	$(VENV)/bin/ray-ckpt demo

test: install install-oldest
	$(PY) -m pytest -q -m "not slow" --durations=40
	$(OLDEST_PY) -m pytest -q $(OLDEST_TESTS)

# the tests marked slow: multi-node clusters, Tune experiments, remote learners, whole examples
test-slow: install
	$(PY) -m pytest -q -m slow --durations=10

# what CI runs (.ci/run): all three
test-all: test test-slow test-skyrl

bench: install
	$(PY) benchmarks/save_stall.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(SKYRL_VENV) *.egg-info .pytest_cache
