# specserve: OpenAI-compatible speculative-decoding server.
#
# CPU (default):  docker build -t specserve .
# Bake the bundled models (~1.6 GB) into the image:
#                 docker build --build-arg FETCH_MODELS=1 -t specserve .
# CUDA:           docker build --build-arg TORCH=cuda \
#                   --build-arg BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 -t specserve:cuda .
#                 (torch 2.13.0's CUDA 13.0 build from PyPI, pinned by requirements-cuda.lock,
#                 as `make install TORCH=cuda`; needs an NVIDIA driver >= 580; docs/GPU.md)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG FETCH_MODELS=0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECSERVE_CACHE=/models

# CUDA base images come without Python; python:*-slim already has it. g++: torch.compile's
# C++ code generation (draft_compile); without it the draft runs eagerly.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-dev python3-venv ca-certificates; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --create-home --shell /usr/sbin/nologin specserve \
    && mkdir -p /models && chown specserve:specserve /models

WORKDIR /app

# Dependencies first (their layer survives source edits): torch from the PyTorch CPU index, or
# (TORCH=cuda) PyTorch's CUDA build from PyPI with requirements-cuda.lock's nvidia-* pins;
# everything else pinned by requirements.lock (its torch line names the CPU wheel, so drop it).
# vllm-router too: the same image runs the router in front of replicas (compose, deploy/k8s).
COPY pyproject.toml requirements.lock requirements-cuda.lock ./
RUN if [ "${TORCH}" = "cuda" ]; then \
        pip install -c requirements-cuda.lock "torch==${TORCH_VERSION}" \
        && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'no CUDA build')"; \
    else \
        pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; \
    fi \
    && grep -v '^torch==' requirements.lock > /tmp/constraints.txt \
    && python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/deps.txt \
    && pip install -c /tmp/constraints.txt -r /tmp/deps.txt \
    && pip install -c /tmp/constraints.txt vllm-router

COPY README.md ./
COPY engine ./engine
COPY server ./server
COPY bench ./bench
COPY specserve ./specserve
COPY tools ./tools
COPY configs ./configs
COPY heads ./heads
RUN pip install --no-deps . && rm -rf build *.egg-info

USER specserve

# Models live in /models (SPECSERVE_CACHE): baked in here, or a mounted volume that the
# server fills on first start (`bundled:` models are fetched when missing).
RUN if [ "${FETCH_MODELS}" = "1" ]; then specserve models fetch; fi

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"

CMD ["specserve", "serve", "--config", "configs/default.yaml", "--host", "0.0.0.0"]
