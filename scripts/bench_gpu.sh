#!/usr/bin/env bash
# A short `specserve bench` sweep on a CUDA machine that has nothing but this repository:
# installs .venv-cuda (`make install TORCH=cuda`: torch 2.13.0's CUDA build, requirements-cuda.lock),
# fetches the bundled Qwen2.5-Coder pair, launches the server on the GPU and writes the same
# outputs as the CPU run (results.json, report.md, PNG plots) to $OUT. Aim: under 8 minutes.
# scripts/gpu_check.sh is the first check to run on a new GPU (docs/GPU.md).
#
#   bash scripts/bench_gpu.sh                 # defaults below
#   OUT=gpu-out NUM_PROMPTS=8 bash scripts/bench_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-bench-out-gpu}
VENV=.venv-cuda
CONFIG=${CONFIG:-configs/cuda.yaml}
CATEGORIES=${CATEGORIES:-code,chat,summarization}
CONCURRENCY=${CONCURRENCY:-1,8,32}
NUM_PROMPTS=${NUM_PROMPTS:-4}
MAX_TOKENS=${MAX_TOKENS:-128}
PEERS=${PEERS:-hf,hf-assisted,hf-prompt-lookup}
PY=${PY:-python3}

started=$(date +%s)
stage() { echo "== [$(($(date +%s) - started))s] $*" >&2; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

stage "installing $VENV (make install TORCH=cuda; a no-op once installed)"
make install TORCH=cuda PY="$PY" >&2
"$VENV/bin/python" -c "import torch, sys; ok = torch.cuda.is_available(); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', ok); sys.exit(0 if ok else 1)"

stage "fetching the bundled models (cached after the first run)"
"$VENV/bin/specserve" models fetch

stage "bench: $CATEGORIES at concurrency $CONCURRENCY, $NUM_PROMPTS prompts, $MAX_TOKENS tokens"
"$VENV/bin/specserve" bench \
    --launch "$CONFIG" --device cuda --dtype bfloat16 \
    --categories "$CATEGORIES" --concurrency "$CONCURRENCY" \
    --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" \
    --peers "$PEERS" --out "$OUT" "$@"

stage "done: $OUT/report.md"
