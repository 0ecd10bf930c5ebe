#!/usr/bin/env bash
# Gemma-3-270M on the GPU machine (device tool), for the lead. The GGUF is ~253 MB and one device call
# carries <= 64 MiB, so it travels in 5 git-ignored parts of <= 60 MB over back-to-back calls (the machine
# stays warm between them; /tmp survives) and is joined in /tmp.
#
#   here (CPU):   bash scripts/dev/gpu_gemma.sh split             # -> .gemma1/ .. .gemma5/ (one part each:
#                                                             #    13 MB, 3 x 60 MB, the rest; .gemma1 also
#                                                             #    holds the gguf wheel)
#   device call k = 1..4:  run(command="bash scripts/dev/gpu_gemma.sh keep k", carry=[".gemmak"])
#   device call 5:         run(command="bash scripts/dev/gpu_gemma.sh run", carry=[".gemma5"])
#   or, with a joined file already on the machine:  bash scripts/dev/gpu_gemma.sh bench /tmp/gemma3.gguf
#
# "bench" prints greedy text (bf16, Pallas kernels, hybrid KV-cache groups), the KV blocks per group for a
# long prompt, and decode ms/step at batch 1 and 64 (bf16) from scripts/dev/bench_decode.py; logs go to $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
G=/tmp/gemma3.gguf
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
OUT=${OUT:-/tmp/gemma-out}
mkdir -p "$OUT"
quiet() { grep -v -e "loading weights" -e "DeprecationWarning" -e "warnings.warn" -e "deprecations.warn"; }
stage=${1:?usage: gpu_gemma.sh split|keep K|run|bench PATH}
case $stage in
split)
  src=$(.venv/bin/python -c "from models.gemma3_loader import find_gemma3_gguf; print(find_gemma3_gguf())")
  rm -rf .gemma[1-5]
  # part sizes in bytes (the last part takes the rest): the first one is small so that it can ride along
  # with a call that already carries ~50 MB (the SmolLM2 half in scripts/dev/gpu_run.sh cb2)
  sizes=(${GEMMA_PART_SIZES:-13000000 60000000 60000000 60000000})
  off=0
  for i in 0 1 2 3 4; do
    mkdir -p .gemma$((i + 1))
    if [ $i -lt 4 ]; then n=${sizes[$i]}; else n=$(( $(stat -c %s "$src") - off )); fi
    tail -c +$((off + 1)) "$src" | head -c "$n" > .gemma$((i + 1))/part.$i
    off=$((off + n))
  done
  .venv/bin/pip download -q --no-deps -d .gemma1 "gguf==$(.venv/bin/python -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
  du -sh .gemma[1-5]
  ;;
keep)
  k=${2:?part number}
  ls .gemma$k/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .gemma$k/*.whl
  cp .gemma$k/part.* /tmp/ && ls -l /tmp/part.*
  ;;
run)
  cp .gemma5/part.* /tmp/
  cat /tmp/part.0 /tmp/part.1 /tmp/part.2 /tmp/part.3 /tmp/part.4 > $G
  bash "$0" bench $G
  ;;
bench)
  G=${2:-$G}
  got=$(sha256sum "$G" | cut -d' ' -f1)
  [ "$got" = "$SHA" ] || { echo "sha256 of $G is $got, expected $SHA"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
  {
    echo "\$ python scripts/generate.py --gguf \$G --prompt 'The capital of France is' --max-tokens 32"
    timeout 150 python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-tokens 32
    echo "\$ python scripts/generate.py --gguf \$G --prompt-file docs/prompts/gemma3-long-qa.txt --max-tokens 8 --print-kv-blocks"
    timeout 150 python scripts/generate.py --gguf $G --prompt-file docs/prompts/gemma3-long-qa.txt --max-tokens 8 \
      --max-num-batched-tokens 512 --print-kv-blocks | cut -c1-400
  } 2>&1 | quiet | tee $OUT/gemma3-generate.txt
  echo "\$ python scripts/dev/bench_decode.py --gguf \$G --batches 1,64 --steps-per-sync 1,16" | tee $OUT/gemma3-bench-decode.txt
  timeout 300 python scripts/dev/bench_decode.py --gguf $G --batches 1,64 --steps-per-sync 1,16 2>&1 | quiet | tee -a $OUT/gemma3-bench-decode.txt
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
