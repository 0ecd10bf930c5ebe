#!/usr/bin/env bash
# The GPU evidence run (device tool, second call): rebuild the GGUF carried in two halves, then run the
# scripts whose output goes into docs/results.md and docs/perf-notes.md. Expects .whl installed into
# /tmp/site and the first half already in /tmp (first call). Writes logs under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cat /tmp/gguf.part.aa .gguf2/gguf.part.ab > /tmp/smollm2.gguf
sha256sum /tmp/smollm2.gguf | tee $OUT/sha256.txt
G=/tmp/smollm2.gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
{
  echo '$ python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-new-tokens 32'
  python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-new-tokens 32 2>&1 | grep -v "loading weights"
  echo '$ python scripts/generate.py --gguf $G --chat --prompt "What is the capital of France?" --prompt "Write a haiku about the sea." --prompt "List three prime numbers." --max-new-tokens 64'
  python scripts/generate.py --gguf $G --chat --prompt "What is the capital of France?" --prompt "Write a haiku about the sea." --prompt "List three prime numbers." --max-new-tokens 64 2>&1 | grep -v "loading weights"
  echo '$ python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-new-tokens 32 --attention-impl reference'
  python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-new-tokens 32 --attention-impl reference 2>&1 | grep -v "loading weights"
} 2>&1 | tee $OUT/generate.txt
echo '$ python scripts/accuracy.py --gguf $G' | tee $OUT/accuracy.txt
python scripts/accuracy.py --gguf $G 2>&1 | tee -a $OUT/accuracy.txt
echo '$ python scripts/bench_attention.py --mode decode' | tee $OUT/bench.txt
timeout 300 python scripts/bench_attention.py --mode decode 2>&1 | grep -v Warning | tee -a $OUT/bench.txt
