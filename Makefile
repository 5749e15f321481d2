# Two entry points: `make up` (run Shoal on this machine) and `make test` (the whole suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= data
UP_ARGS ?=

# llama-cpp-python compiles llama.cpp at install (minutes: README.md); the RPC backend
# lets one model span several machines. GGML_NATIVE=off builds for any x86-64 with AVX2
# rather than for the building CPU's every extension, so that a wheel built once serves any
# machine. pip's own cache is not used (--no-cache-dir): its key ignores CMAKE_ARGS. The wheel
# is kept in LLAMA_WHEELS under a key of the CMAKE_ARGS instead, so that a new virtualenv (a
# fresh clone, CI) installs it in seconds; a newer llama-cpp-python release is built anew.
# It is built for the machine's accelerator: Metal on macOS, CUDA where nvcc and a usable
# NVIDIA GPU are, Vulkan where its SDK and a GPU are, else the CPU (llamacpp_build.py says
# why). SHOAL_LLAMA_CMAKE_ARGS, when set (even empty: the CPU), replaces what is found.
LLAMA_BUILD_PY := scripts/llamacpp_build.py
ifeq ($(origin SHOAL_LLAMA_CMAKE_ARGS),undefined)
LLAMA_BUILD := $(shell $(PYTHON) $(LLAMA_BUILD_PY))
LLAMA_ACCEL := $(firstword $(LLAMA_BUILD))
LLAMA_ACCEL_ARGS := $(wordlist 2,$(words $(LLAMA_BUILD)),$(LLAMA_BUILD))
LLAMA_WHY := $(PYTHON) $(LLAMA_BUILD_PY) --explain
else
LLAMA_ACCEL := what SHOAL_LLAMA_CMAKE_ARGS says
LLAMA_ACCEL_ARGS := $(SHOAL_LLAMA_CMAKE_ARGS)
LLAMA_WHY := echo "llama.cpp is built as SHOAL_LLAMA_CMAKE_ARGS says"
endif
export CMAKE_ARGS ?= $(strip -DGGML_RPC=on -DGGML_NATIVE=off $(LLAMA_ACCEL_ARGS))
LLAMA_CPP ?= llama-cpp-python>=0.3

.PHONY: up test test-fast lint typecheck pytest bench clean clients

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip

# The marker keeps the CMAKE_ARGS it was built with (`make up` compares them with the machine's).
LLAMA_WHEELS ?= $(HOME)/.cache/shoal/llama-wheels
LLAMA_WHEEL_KEY := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:16])' '$(CMAKE_ARGS)')
LLAMA_WHEEL_DIR := $(LLAMA_WHEELS)/$(LLAMA_WHEEL_KEY)

$(VENV)/.installed-llama: | $(BIN)/python
	@echo "llama.cpp: building for $(LLAMA_ACCEL), CMAKE_ARGS=$(CMAKE_ARGS)"
	@$(LLAMA_WHY)
	mkdir -p '$(LLAMA_WHEEL_DIR)'
	CMAKE_ARGS='$(CMAKE_ARGS)' $(BIN)/pip wheel -q --no-cache-dir --no-deps \
	  --find-links '$(LLAMA_WHEEL_DIR)' -w '$(LLAMA_WHEEL_DIR)' '$(LLAMA_CPP)'
	$(BIN)/pip install -q --no-cache-dir --find-links '$(LLAMA_WHEEL_DIR)' '$(LLAMA_CPP)'
	echo '$(CMAKE_ARGS)' > $@

$(VENV)/.installed-run: pyproject.toml | $(VENV)/.installed-llama
	$(BIN)/pip install -q -e .
	touch $@

# The image engine's PyTorch (the [images] extra, in [test]): this release first, which this
# kind of machine keeps on its disk as a CPU build (1.3 GB with diffusers, about a minute);
# PyPI's newest for Linux is a CUDA build (+5.4 GB, docs/runners.md). Elsewhere it is PyPI's.
TORCH ?= torch==2.13.0

$(VENV)/.installed-test: pyproject.toml | $(VENV)/.installed-llama
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed-run

up: $(VENV)/.installed-run
	@$(PYTHON) $(LLAMA_BUILD_PY) --check $(VENV)/.installed-llama --args '$(CMAKE_ARGS)'
	$(BIN)/shoal up --data-dir $(DATA) $(UP_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

# Debian's packages the tests use: chromium for the dashboard's browser test (no download by
# playwright), OpenBLAS for MLX's float32 products (inference/engines/mlx/blas.py).
CHROMIUM ?= /usr/bin/chromium
OPENBLAS ?= /usr/lib/$(shell uname -m)-linux-gnu/libopenblas.so.0
APT_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends

$(CHROMIUM):
	$(APT_INSTALL) chromium || (apt-get update && $(APT_INSTALL) chromium)

$(OPENBLAS):
	$(APT_INSTALL) libopenblas0-pthread || (apt-get update && $(APT_INSTALL) libopenblas0-pthread)

# The coding agents tests/clients runs against `shoal up` (Claude Code, Codex), from the npm
# registry at the versions tests/clients/package.json pins, into a cache directory named after
# that file's content (tests/clients/cli.py computes the same), so that a new version is a new
# directory and a fresh clone reuses the last install.
CLIENTS_PACKAGE := tests/clients/package.json
CLIENTS_DIR ?= $(HOME)/.cache/shoal/clients/$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest()[:16])' $(CLIENTS_PACKAGE))

$(CLIENTS_DIR)/.installed: $(CLIENTS_PACKAGE)
	mkdir -p '$(CLIENTS_DIR)'
	cp $(CLIENTS_PACKAGE) '$(CLIENTS_DIR)/package.json'
	npm install --prefix '$(CLIENTS_DIR)' --no-audit --no-fund --no-save --loglevel=error
	touch $@

clients: $(CLIENTS_DIR)/.installed

# Three workers on two cores: much of the suite waits (on processes starting, a leader elected,
# an ack's deadline), and the tests that use a core run llama.cpp with one thread. A module's
# tests stay in one worker (tests/conftest.py), so its fixtures are made once.
PYTEST_WORKERS ?= 3

pytest: $(VENV)/.installed-test | $(CHROMIUM) $(OPENBLAS) $(CLIENTS_DIR)/.installed
	SHOAL_CHROMIUM=$(CHROMIUM) SHOAL_CLIENTS_DIR='$(CLIENTS_DIR)' $(BIN)/pytest -ra --durations=15 -n $(PYTEST_WORKERS)

# Lint first (a second); then mypy and pytest at once: mypy keeps one core busy for a minute,
# which alone would leave the other idle.
test: lint
	$(MAKE) --no-print-directory --output-sync=line -j2 typecheck pytest

# The inner loop: lint, types and the tests not marked slow (no cluster, no end-to-end run).
test-fast: lint typecheck $(VENV)/.installed-test | $(OPENBLAS)
	$(BIN)/pytest -q -m "not slow" --durations=5

# Benchmarks run as modules from here, where `bench` and `tests` (bench.projector's histories)
# are found.
bench: $(VENV)/.installed-test
	$(BIN)/python -m bench.projector
	$(BIN)/python -m bench.engine_overhead
	$(BIN)/python -m bench.api_overhead
	$(BIN)/python -m bench.constrained
	$(BIN)/python -m bench.dialects
	$(BIN)/python -m bench.placement
	$(BIN)/python -m bench.pipeline
	$(BIN)/python -m bench.soak
	$(BIN)/python -m bench.soak --concurrency 64 --requests 500 --max-queued 16
	$(BIN)/python -m bench.embeddings
	$(BIN)/python -m bench.concurrency
	$(BIN)/python -m bench.unwanted_calls
	$(BIN)/python -m bench.vision
	$(BIN)/python -m bench.mlx_vision
	$(BIN)/python -m bench.mlx_prompt_cache
	$(BIN)/python -m bench.weights
	$(BIN)/python -m bench.longevity
	$(BIN)/python -m bench.cold_start
	$(BIN)/python -m bench.durability

clean:
	rm -rf $(VENV) $(DATA) .mypy_cache .ruff_cache .pytest_cache
