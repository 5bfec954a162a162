#!/usr/bin/env bash
# Download the wheels a GPU machine without a package index needs to run redraft's server and tests beside its own
# torch and triton: the versions installed here, for CPython 3.12 on x86-64 Linux (a typical CUDA image).
#
#   bash scripts/gpu_wheels.sh [DIR]          # default DIR: .whl (keep it out of git: it is in no commit)
#   WHEELS=.whl bash scripts/gpu_bringup.sh   # then, on the GPU machine: installs them into /tmp/site
#
# PY_VERSION=3.11 overrides the target Python. Packages the GPU image already has (numpy, safetensors, tokenizers,
# jinja2, tqdm, prometheus-client, huggingface-hub, httpx, anyio, h11, click, pytest and its plugins) are not
# fetched; add names to EXTRA to fetch more.
set -euo pipefail
DIR=${1:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
NAMES="fastapi starlette pydantic pydantic-core annotated-types typing-inspection opentelemetry-api uvicorn pyzmq
       llguidance openai jiter distro sniffio ${EXTRA:-}"
mkdir -p "$DIR"
specs=()
for name in $NAMES; do
    version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    if [ -z "$version" ]; then
        echo "skip $name: not installed here" >&2
        continue
    fi
    specs+=("$name==$version")
done
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    "${platforms[@]}" -d "$DIR" "${specs[@]}"
ls -1 "$DIR"
du -sh "$DIR"
