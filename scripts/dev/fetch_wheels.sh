#!/usr/bin/env bash
# The wheels the GPU machines need (they have no network): .whl/ (git-ignored), carried by every dev script's call
# (`carry: [".whl", ".dummy"]`). The GPU image has jax, flax, numpy, torch, transformers, aiohttp, click, uvloop;
# this fetches the rest for CPython 3.12 on x86_64, each at the version this venv has (so the GPU runs the
# versions the tests ran) or the newest where the venv has none. ~19 MB. Usage (repository root, after the
# README's install): bash scripts/dev/fetch_wheels.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
pkgs="gguf pyzmq msgspec starlette uvicorn httptools pydantic pydantic-core annotated-types typing-inspection
  typing-extensions prometheus_client llguidance outlines-core openai httpx2 httpcore2 truststore jiter distro sniffio httpx httpcore
  anyio h11 idna certifi tqdm jaxtyping wadler-lindig tokenizers safetensors ml_dtypes jinja2 markupsafe jsonschema
  jsonschema-specifications referencing rpds-py attrs py-spy pynvml nvidia-ml-py"
specs=()
for p in $pkgs; do
  v=$($PY -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  specs+=("$p${v:+==$v}")
done
# llguidance's wheels are manylinux_2_31: the GPU image's glibc is newer
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  -d .whl "${specs[@]}"
ls .whl | wc -l
du -sh .whl
