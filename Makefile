PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
CONFIG ?= configs/default.yaml

.PHONY: install serve test fetch-models lint bench clean

install: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c requirements.lock -e '.[test]'
	@touch $(STAMP)

$(KERNELS): $(STAMP) engine/kernels/build.py $(wildcard engine/kernels/csrc/*)
	$(BIN)/python -m engine.kernels.build
	@touch $(KERNELS)

fetch-models: install
	$(BIN)/specserve models fetch

serve: install fetch-models
	$(BIN)/specserve serve --config $(CONFIG)

test: install
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check engine server tests bench
	$(BIN)/mypy engine server

bench: install fetch-models
	$(BIN)/specserve bench --launch $(CONFIG) --out bench-out

clean:
	rm -rf $(VENV) bench-out
