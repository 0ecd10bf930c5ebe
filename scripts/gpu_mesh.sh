#!/usr/bin/env bash
# Mesh (issue 14) evidence runs for the device tool on nvidia-h200-x2 (2 x H200, one host). Not run yet:
# multi-GPU machines were withheld when this was written. Logs go to $OUT. Each stage fits one call.
#
# NVLink multicast must stay off (the machine's KINDS.md): NCCL_NVLS_ENABLE=0 is exported below for every
# program (XLA's collectives go through NCCL). Never unset it.
#
# GGUF and the ShareGPT sample travel as in scripts/gpu_run.sh (carry .gguf1 = first half + gguf wheel,
# .gguf2 = second half + requests-1000.json); stage `prep` joins them into $G and installs gguf.
#   bash scripts/gpu_mesh.sh prep    (carry .gguf1, .gguf2)
#   bash scripts/gpu_mesh.sh text    greedy SmolLM2 text with dp=2 and dp=1 (must be identical; f32 and
#                                    bf16), tp=2 tokens vs tp=1 of a random-weight Llama (SmolLM2's 9 heads
#                                    do not split over 2 GPUs; Gemma 3 270M, 4q/1kv heads, once the gemma3
#                                    branch is merged and calls jaxkv.parallel.paged_attention_layer)
#   bash scripts/gpu_mesh.sh bench   ShareGPT throughput, 1000 requests: dp=1 (one GPU) then dp=2 (both);
#                                    dp=2 doubles max-num-seqs / max-num-batched-tokens (engine-wide
#                                    limits) so each GPU gets the single-GPU batch; target >= 1.8x
#   bash scripts/gpu_mesh.sh step    decode step time tp=1 vs tp=2 (Llama-3.2-1B shapes, random bf16
#                                    weights), collectives' share of the device time from CUPTI
#   bash scripts/gpu_mesh.sh hlo     the collectives in the compiled tp=2 / dp=2 steps (XLA dump)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
G=/tmp/smollm2.gguf
stage=$1
quiet() { grep -v -e "loading weights" -e "DeprecationWarning" -e "warnings.warn" -e "deprecations.warn"; }
case $stage in
prep)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gguf1/*.whl
  cat .gguf1/gg.part.aa .gguf2/gg.part.ab > $G && cp .gguf2/requests-1000.json /tmp/
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
  nvidia-smi topo -m | tee -a $OUT/device.txt
  ;;
text)
  for dt in float32 bfloat16; do
    for dp in 1 2; do
      echo "\$ python scripts/generate.py --model \$G --dtype $dt --data-parallel-size $dp --prompt 'The capital of France is' --prompt 'Water is' --prompt 'Once upon a time' --max-tokens 32" | tee -a $OUT/mesh-text.txt
      timeout 120 python scripts/generate.py --model $G --dtype $dt --data-parallel-size $dp --prompt "The capital of France is" \
        --prompt "Water is" --prompt "Once upon a time" --max-tokens 32 2>&1 | quiet | tee -a $OUT/mesh-text.txt
    done
  done
  echo '$ python scripts/bench_mesh_step.py --preset llama-1b --tp 1,2 --batches 8 --new-tokens 32 --dtype float32 --no-profile' | tee -a $OUT/mesh-text.txt
  timeout 240 python scripts/bench_mesh_step.py --preset llama-1b --tp 1,2 --batches 8 --new-tokens 32 --dtype float32 --no-profile 2>&1 | quiet | tee -a $OUT/mesh-text.txt
  ;;
bench)
  for dp in 1 2; do
    echo "\$ XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python scripts/bench_throughput.py --model \$G --requests requests-1000.json --num-prompts 1000 --backend jaxkv --data-parallel-size $dp --max-num-seqs $((256 * dp)) --max-num-batched-tokens $((4096 * dp)) --num-gpu-blocks 16384 --no-progress" | tee -a $OUT/mesh-bench.txt
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 280 python scripts/bench_throughput.py --model $G --requests /tmp/requests-1000.json \
      --num-prompts 1000 --backend jaxkv --data-parallel-size $dp --max-num-seqs $((256 * dp)) \
      --max-num-batched-tokens $((4096 * dp)) --num-gpu-blocks 16384 --no-progress \
      --output-json $OUT/mesh-bench-dp$dp.json 2>&1 | quiet | tee -a $OUT/mesh-bench.txt
  done
  ;;
step)
  echo '$ python scripts/bench_mesh_step.py --preset llama-1b --tp 1,2 --batches 1,8,64 --new-tokens 64' | tee $OUT/mesh-step.txt
  timeout 500 python scripts/bench_mesh_step.py --preset llama-1b --tp 1,2 --batches 1,8,64 --new-tokens 64 2>&1 | quiet | tee -a $OUT/mesh-step.txt
  ;;
hlo)
  rm -rf /tmp/hlo && mkdir -p /tmp/hlo
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" timeout 200 python scripts/bench_mesh_step.py \
    --preset llama-1b --tp 2 --batches 8 --new-tokens 8 --repeats 1 --no-profile 2>&1 | quiet | tail -3
  for f in /tmp/hlo/*after_optimizations.txt; do
    n=$(grep -cE "(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(" "$f")
    [ "$n" -gt 0 ] && echo "$(basename $f): $n collectives: $(grep -oE '(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(' "$f" | sort | uniq -c | tr '\n' ' ')"
  done | tee $OUT/mesh-hlo.txt
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
