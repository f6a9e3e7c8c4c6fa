#!/usr/bin/env bash
# The first thing to run on a GPU: one prepared check of the CUDA path, under 8 minutes on one
# GPU once installed. Writes everything under $OUT (default gpu-check-out), at most 8 files:
#   report.md   each step's result and time          env.txt     nvidia-smi, torch, the device
#   tests.txt   the gpu-marked tests (pytest -m gpu)  kernels.md  dense vs int4/int8 by M
#   shapes.md   forward costs at the bundled pair's shapes (random bf16 weights) and the bound
#   bench.tgz   `specserve bench` on the bundled pair (code, chat; c = 1, 8; spec vs plain),
#               only where the bundled models are already in the cache
#
#   bash scripts/gpu_check.sh                # on a CUDA machine
#   bash scripts/gpu_check.sh --device cpu   # the dry run: the same steps, small shapes, no GPU
#
# Python: $PY if set; else a python3 whose torch sees a GPU (an image with CUDA torch, no network
# needed); else `make install TORCH=cuda` (.venv-cuda, requirements-cuda.lock). Wheels in .whl/
# (scripts/gpu_wheels.sh makes them) are installed first for a machine that cannot reach PyPI.
# Exit status: the number of failed steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --device=*) DEVICE=${1#*=}; shift ;;
        -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
REPORT="$OUT/report.md"
started=$(date +%s)
failures=0
echo "# gpu_check on $DEVICE, $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$REPORT"

note() { echo "$*" | tee -a "$REPORT" >&2; }
# step NAME SECONDS COMMAND...: run with a time limit, record ok / FAILED and the time taken.
step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== [$((t0 - started))s] $name" >&2
    if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a program
        timeout "$limit" bash -c "$(declare -f "$1"); $*"
    else
        timeout "$limit" "$@"
    fi
    rc=$?
    if [ $rc -eq 0 ]; then
        note "- $name: ok ($(($(date +%s) - t0)) s)"
    else
        note "- $name: FAILED, exit $rc ($(($(date +%s) - t0)) s)"
        failures=$((failures + 1))
    fi
}

choose_python() {
    if [ -n "${PY:-}" ]; then return; fi
    if [ "$DEVICE" = cpu ]; then
        if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
    elif python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        PY=python3
    else
        make install TORCH=cuda >&2 && PY=.venv-cuda/bin/python
    fi
}

install_carried_wheels() {
    compgen -G ".whl/*.whl" >/dev/null || return 0
    local site=${TMPDIR:-/tmp}/specserve-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl && export PYTHONPATH="$site:$PYTHONPATH"
}

gpu_env() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    else
        echo "nvidia-smi: not found"
    fi >"$OUT/env.txt" 2>&1
}

gpu_tests() {
    # exit 0 when every selected test passed or was skipped (the dry run skips them all)
    local files=(tests/engine/gpu/test_gpu_cuda.py tests/engine/model/test_model.py tests/engine/model/test_quant.py)
    [ "$DEVICE" = cpu ] && files=(tests/engine/gpu/test_gpu_cuda.py)  # the dry run: collect, skip, quickly
    "$PY" -m pytest -q -m gpu -p no:cacheprovider "${files[@]}" >"$OUT/tests.txt" 2>&1
    local rc=$?
    tail -3 "$OUT/tests.txt" >&2
    return $rc
}

models_cached() {
    "$PY" -c "import sys; from engine.model import bundled as b; \
sys.exit(0 if all(b.model_path(n).exists() for n in \
('qwen2.5-coder-1.5b-instruct', 'qwen2.5-coder-0.5b-instruct')) else 1)" 2>/dev/null
}

serve_bench() {
    "$PY" -m specserve bench --launch configs/cuda.yaml --categories code,chat \
        --concurrency 1,8 --num-prompts 4 --max-tokens 128 --out "$OUT/bench" >&2
    local rc=$?
    tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
    return $rc
}

# The dry run checks what the bench step would launch: its config and the bench command line.
dry_bench() {
    "$PY" -c "from specserve.cli import build_parser; from server.settings import Settings
Settings.load('configs/cuda.yaml')
build_parser().parse_args(['bench', '--launch', 'configs/cuda.yaml', '--categories', 'code,chat',
    '--concurrency', '1,8', '--num-prompts', '4', '--max-tokens', '128', '--out', 'x'])"
}

choose_python || { note "- python: no CUDA torch and make install TORCH=cuda failed"; exit 1; }
export PY OUT DEVICE PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" != cpu ]; then  # wheels carried for an offline GPU image (scripts/gpu_wheels.sh)
    install_carried_wheels || note "- carried wheels (.whl): install failed"
fi
if ! version=$("$PY" -c "import engine.core.llm_engine, server.settings, torch; \
print('torch', torch.__version__)" 2>>"$REPORT"); then
    note "- imports: FAILED (a dependency is missing: carry wheels, see scripts/gpu_wheels.sh)"
    exit 1
fi
note "python: $PY ($version)"

step "nvidia-smi" 30 gpu_env
step "gpu tests" 240 gpu_tests
# env (torch, the device), kernels (dense vs int4/int8 by M), shapes (the pair's forward costs)
step "env, kernels, pair shapes" 360 "$PY" -m bench.gpu_check all --device "$DEVICE" \
    --out-dir "$OUT" --report "$REPORT"
if [ "$DEVICE" = cpu ]; then
    step "bench (dry run: config and flags only)" 60 dry_bench
elif models_cached; then
    step "bench on the bundled pair" 330 serve_bench
else
    note "- bench on the bundled pair: skipped (not in the cache; specserve models fetch)"
fi
note "done in $(($(date +%s) - started)) s, $failures failed step(s); results in $OUT"
exit $failures
