#!/usr/bin/env bash
# Wheels for a GPU machine that has CUDA torch but cannot reach PyPI (an image with torch,
# transformers, numpy, pytest already in it): the serving dependencies it lacks, at
# requirements.lock's versions, downloaded here into .whl/ (git-ignored). scripts/gpu_check.sh
# installs .whl/*.whl into a scratch folder before it runs anything.
#
#   bash scripts/gpu_wheels.sh            # for Python 3.12 on x86_64 Linux
#   PYVER=3.11 bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PY:-python3}
NAMES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection
pydantic-settings python-dotenv uvicorn sse-starlette gguf platformdirs llguidance"
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
mkdir -p .whl
for name in $NAMES; do
    pin=$(grep -i "^${name}==" requirements.lock || true)
    [ -n "$pin" ] || { echo "gpu_wheels: $name is not in requirements.lock" >&2; exit 1; }
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${platforms[@]}" -d .whl "$pin"
done
ls -l .whl
