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

.PHONY: install serve test fetch-models lint bench llamacpp compare-llamacpp clean

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

# Two workers, each test file on one (its module fixtures, a live server or a loaded model, built
# once): 7 min on a 2-core host where one worker took about twice that.
JOBS ?= 2
test: install
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile tests

lint: install
	$(BIN)/ruff check engine server tests bench specserve tools
	$(BIN)/mypy engine server specserve tools

bench: install fetch-models
	$(BIN)/specserve bench --launch $(CONFIG) --out bench-out

# llama.cpp (llama-cpp-python, the `llamacpp` extra) built from source for this CPU's flags, never
# -march=native nor a wheel cached from another build (docs/PEERS.md).
llamacpp: $(VENV)/.llamacpp

$(VENV)/.llamacpp: $(STAMP)
	CMAKE_ARGS="$$($(BIN)/python -m bench.serving.machine --cmake-args)" \
	  $(BIN)/pip install --no-cache-dir --no-binary llama-cpp-python -c requirements.lock -e '.[llamacpp]'
	@touch $@

# Our speed claims against llama.cpp on the same GGUF file, same threads, same prompts, one run.
compare-llamacpp: install fetch-models llamacpp
	$(BIN)/specserve bench --launch $(CONFIG) --peer llamacpp --categories code,chat \
	  --concurrency 1 --num-prompts 4 --max-tokens 96 --ignore-eos --repeats 2 --out bench-out/llamacpp

clean:
	rm -rf .venv .venv-cuda bench-out
