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

.PHONY: install serve test fetch-models lint bench llamacpp llama-server compare-llamacpp clean FORCE

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

# llama.cpp's own C++ llama-server, from the llama.cpp vendored in the pinned llama-cpp-python sdist,
# with the `llamacpp` target's CPU switches; no web UI, no HTTPS, nothing fetched at build time.
# The build (about 12 min on 2 cores) stays under $(VENV); the binary lands in $(BIN) and is rebuilt
# only when the pinned version, the CPU switches or these flags change (docs/PEERS.md). Not in CI.
LLAMA_CPP_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' requirements.lock)
LLAMA_SERVER_DIR := $(VENV)/llama-server
LLAMA_SERVER_SRC := $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
LLAMA_SERVER_FLAGS := -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
LLAMA_SERVER_JOBS ?= 2
# The host's cmake, else pip's into the venv.
CMAKE := $(or $(shell command -v cmake 2>/dev/null),$(BIN)/cmake)

llama-server: $(BIN)/llama-server

$(BIN)/cmake: | $(STAMP)
	$(BIN)/pip install --quiet cmake

# Rewritten only when its text changes, so its date says when the build's inputs last changed; the
# bench reads its GGML switches as the binary's build (bench/serving/llama_server.py).
$(LLAMA_SERVER_DIR)/config: FORCE | $(STAMP)
	@mkdir -p $(@D)
	@echo "$(LLAMA_CPP_VERSION) $$($(BIN)/python -m bench.serving.machine --cmake-args) $(LLAMA_SERVER_FLAGS)" > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

$(BIN)/llama-server: $(LLAMA_SERVER_DIR)/config | $(CMAKE)
	$(BIN)/pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(LLAMA_SERVER_DIR)
	tar -xzf $(LLAMA_SERVER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_SERVER_DIR)
	$(CMAKE) -S $(LLAMA_SERVER_SRC) -B $(LLAMA_SERVER_DIR)/build \
	  $$($(BIN)/python -m bench.serving.machine --cmake-args) $(LLAMA_SERVER_FLAGS)
	nice -n 19 $(CMAKE) --build $(LLAMA_SERVER_DIR)/build --target llama-server -j $(LLAMA_SERVER_JOBS)
	install -m 755 $(LLAMA_SERVER_DIR)/build/bin/llama-server $@

# Our speed claims against llama.cpp on the same GGUF file, same threads, same prompts, one run.
compare-llamacpp: install fetch-models llamacpp
	$(BIN)/specserve bench --launch $(CONFIG) --peer llamacpp --categories code,chat \
	  --concurrency 1 --num-prompts 4 --max-tokens 96 --ignore-eos --repeats 2 --out bench-out/llamacpp

clean:
	rm -rf .venv .venv-cuda bench-out
