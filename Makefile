PY ?= python3
# TORCH=cuda: torch 2.13.0's CUDA build from PyPI, pinned by requirements-cuda.lock, in a venv of
# its own (.venv-cuda), e.g. `make serve TORCH=cuda CONFIG=configs/cuda.yaml`; see docs/GPU.md.
TORCH ?= cpu
ifeq ($(TORCH),cuda)
VENV := .venv-cuda
LOCK := requirements-cuda.lock
CHECK_TORCH := import torch, sys; sys.exit(0 if torch.version.cuda else 'installed torch ' + torch.__version__ + ' has no CUDA')
else ifeq ($(TORCH),cpu)
VENV := .venv
LOCK := requirements.lock
CHECK_TORCH := import torch
else
$(error TORCH must be cpu or cuda, not $(TORCH))
endif
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels
CONFIG ?= configs/default.yaml

.PHONY: install serve test fetch-models lint bench clean

install: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(LOCK) -e '.[test]'
	$(BIN)/python -c "$(CHECK_TORCH)"
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
	$(BIN)/ruff check engine server tests

bench: install fetch-models
	$(BIN)/specserve bench --launch $(CONFIG) --out bench-out

clean:
	rm -rf .venv .venv-cuda bench-out
