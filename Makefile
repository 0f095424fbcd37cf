# Two entry points: `make serve` and `make test`. Everything they need is installed here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# `make test` runs the test files on this many pytest-xdist workers, a file's tests on one worker
# (so module and session fixtures are shared as in a plain run); 0 runs them in this process.
TEST_WORKERS ?= 2
# Every package, transitive ones included, at one exact version: what setup installs (`make lock`
# refreshes it). pyproject.toml keeps the ranges for those who install the library.
LOCK := requirements.lock
# The torch build to install first, at the locked version (the lock names torch's public version,
# which a CPU or a CUDA build satisfies). On a GPU machine, a CUDA build, e.g.
# make serve TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= $(shell grep -m1 '^torch==' $(LOCK))

.PHONY: setup serve test stress chromium services model bench bench-peers gpu-check gpu-prepare lock clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml $(LOCK) | $(VENV)/bin/python
	$(PIP) install $$(grep -m1 '^pip==' $(LOCK))
	$(PIP) install $(TORCH)
	$(PIP) install -r $(LOCK)
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PY) -m chatcore.environment --lock $(LOCK)
	touch $(STAMP)

# Resolve pyproject.toml's ranges (with the dev extra) afresh with pip-tools, torch held at the
# version given; then `make setup` installs the new lock. Torch's local label (+cpu) is dropped.
TORCH_VERSION ?= $(shell grep -m1 '^torch==' $(LOCK) | cut -d= -f3)
lock: | $(VENV)/bin/python
	$(PIP) install --quiet "pip-tools>=7.7"
	echo "torch==$(TORCH_VERSION)" | $(VENV)/bin/pip-compile --quiet --upgrade --extra dev --strip-extras \
	  --allow-unsafe --no-emit-index-url --no-emit-find-links --output-file $(LOCK) pyproject.toml -
	sed -i -E 's/^(torch==[0-9.]+)\+[a-z0-9]+/\1/' $(LOCK)

model: $(STAMP)
	$(VENV)/bin/chatcore model fetch

chromium:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends chromium; \
	fi

# PostgreSQL and nginx for the store and cluster tests (Debian's packages; the tests find
# PostgreSQL's binaries on PATH or in /usr/lib/postgresql/<version>/bin).
services:
	@if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then MISSING="nginx"; fi; \
	if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  MISSING="$$MISSING postgresql"; fi; \
	if [ -n "$$MISSING" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends $$MISSING; \
	fi

setup: $(STAMP) model

serve: setup
	$(VENV)/bin/chatcore migrate
	$(VENV)/bin/chatcore serve

test: setup chromium services
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose"; exit 1; fi; \
	exit $$rc

stress: setup
	@CHATCORE_STRESS=1 $(PY) -m pytest -m stress $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no stress tests: failing on purpose"; exit 1; fi; \
	exit $$rc

bench: setup
	$(VENV)/bin/chatcore bench --suite all

# The peers `chatcore bench` compares with, into .venv: llama.cpp's Python binding, built from source for
# this CPU (GGML_NATIVE=ON; about 7 minutes on 2 cores), at the version the anchors used. Not part of
# setup or test; without it the single suite reports llama.cpp as skipped ("run make bench-peers").
# --no-cache-dir: a wheel cached by an earlier build may be for another CPU or flags; -c: what the lock
# pins stays as it is.
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
bench-peers: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PIP) install --no-cache-dir -c $(LOCK) $(LLAMA_CPP_PYTHON)

# The checks that need a CUDA GPU (bench/gpu_check.py, docs/kernels.md); one line and exit 0 where there is
# none. No setup: it runs with .venv's python where there is one, else python3 (a lent GPU machine's image),
# with the wheels gpu-prepare staged for what that lacks.
gpu-check:
	bash bench/gpu_check.sh --out bench/results/gpu-check.json

# Stage into .gpu/ (git-ignored) what a lent GPU machine needs for gpu-check: wheels, the model's config
# and tokenizer, the commit.
gpu-prepare: $(STAMP)
	$(PY) -m chatcore.bench.gpu_prepare --out .gpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
