# Quick start: `make demo` (set up and run the main job), `make test` (set up and pass the tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test tools lint typecheck clean setup

setup: $(STAMP)

# torch is pinned and installed first so pip takes the CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,hf,sklearn,plot]'
	$(BIN)/python -m pip install --quiet -e '.[fuzz]' || echo "atheris did not install: crossdc bench fuzz runs its built-in engine"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/crossdc demo --report runs/demo-report.json

# promtool, prometheus and systemd-analyze, which some deploy tests check against: installed with
# apt-get where we are root, else one line says which checks are skipped and how to enable them.
# Never fails.
tools:
	@bash .ci/tools || true

test: $(STAMP) tools
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
