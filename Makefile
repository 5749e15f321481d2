# Two entry points: `make up` (run Shoal on this machine) and `make test` (the whole suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DATA   ?= data
UP_ARGS ?=

# llama-cpp-python compiles llama.cpp at install (minutes: README.md); the RPC backend
# lets one model span several machines. GGML_NATIVE=off builds for any x86-64 with AVX2
# rather than for the building CPU's every extension: pip caches the wheel it builds, and a
# native wheel cached on one machine dies with SIGILL on another. --no-cache-dir for the same
# reason: pip's cache key ignores CMAKE_ARGS.
export CMAKE_ARGS ?= -DGGML_RPC=on -DGGML_NATIVE=off
LLAMA_CPP ?= llama-cpp-python>=0.3

.PHONY: up test lint typecheck pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip

$(VENV)/.installed-llama: | $(BIN)/python
	$(BIN)/pip install -q --no-cache-dir '$(LLAMA_CPP)'
	touch $@

$(VENV)/.installed-run: pyproject.toml | $(VENV)/.installed-llama
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/.installed-llama
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed-run

up: $(VENV)/.installed-run
	$(BIN)/shoal up --data-dir $(DATA) $(UP_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

# The dashboard's browser test drives Debian's chromium (no download by playwright).
CHROMIUM ?= /usr/bin/chromium

$(CHROMIUM):
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium \
	  || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium)

pytest: $(VENV)/.installed-test | $(CHROMIUM)
	SHOAL_CHROMIUM=$(CHROMIUM) $(BIN)/pytest -ra

test: lint typecheck pytest

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

clean:
	rm -rf $(VENV) $(DATA) .mypy_cache .ruff_cache .pytest_cache
