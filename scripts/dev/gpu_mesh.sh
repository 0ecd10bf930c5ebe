#!/usr/bin/env bash
# Mesh (issue 14) evidence runs for the device tool on nvidia-h200-x2 (2 x H200, one host). Logs go to
# $OUT. Each stage fits one call.
#
# NVLink multicast must stay off (the machine's KINDS.md): NCCL_NVLS_ENABLE=0 is exported below for every
# program (XLA's collectives go through NCCL). Never unset it.
#
# Two calls. The throughput runs use random weights (--load-format dummy: the same kernels and schedule;
# the outputs have the dataset's lengths through ignore_eos), so the first call carries only .dummy (the
# header-only GGUF, the request samples, the gguf wheel) and the checkpoint's first half; the second call
# carries the second half for the greedy text.
#   call 1, carry [.dummy, .gguf1]:  bash scripts/dev/gpu_mesh.sh prep1 && bash scripts/dev/gpu_mesh.sh bench
#                                    (prep1 installs the gguf wheel every stage needs: models imports gguf)
#   call 2, carry [.gguf2]:          bash scripts/dev/gpu_mesh.sh prep2 && bash scripts/dev/gpu_mesh.sh text \
#                                      && bash scripts/dev/gpu_mesh.sh step
# Stages:
#   bench   ShareGPT throughput, dp=1 (one GPU) then dp=2 (both), on $N requests (N=4000 then 1000 by
#           default: the 1000-request sample ends in a long tail of few requests that a second replica
#           cannot shorten); dp=2 doubles max-num-seqs / max-num-batched-tokens (engine-wide limits) so
#           each GPU gets the single-GPU batch; target >= 1.8x. BENCH_EXTRA: more bench_throughput flags
#           (e.g. --max-admission-delay-steps 8 --nvml-busy), TAG: a suffix for the JSON names
#   text    greedy SmolLM2 text with dp=2 and dp=1 (must be identical; f32 and bf16). SmolLM2's 9 query
#           heads do not split over 2 GPUs: tp=2's tokens are compared in `step` (random-weight Llama)
#   step    decode step time tp=1 vs tp=2 (Llama-3.2-1B shapes, random bf16 weights), collectives' share
#           of the device time from CUPTI, tp=2 tokens vs tp=1. Session 7: tp 1,2 x batches 8,64 x 64
#           tokens x 3 repeats ran 420 s and printed one row; BATCHES=64 with --new-tokens 32 --repeats 1
#           took 40 s (docs/benchmarks.md)
#   hlo     the collectives in the compiled tp=2 step (XLA dump)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
G=/tmp/smollm2.gguf
stage=$1
quiet() { grep -v -e "loading weights" -e "DeprecationWarning" -e "warnings.warn" -e "deprecations.warn"; }
case $stage in
prep1)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dummy/*.whl
  cp .gguf1/gg.part.aa /tmp/ && cp .dummy/requests-*.json .dummy/smollm2-header.gguf /tmp/
  python3 -c 'import jax, torch; print(jax.devices(), torch.cuda.device_count())' 2>&1 | tail -1 | tee $OUT/device.txt
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/device.txt
  nvidia-smi topo -m | tee -a $OUT/device.txt
  ;;
prep2)
  cat /tmp/gg.part.aa .gguf2/gg.part.ab > $G && ls -la $G
  ;;
text)
  for dt in float32 bfloat16; do
    for dp in 1 2; do
      echo "\$ python scripts/generate.py --model \$G --dtype $dt --data-parallel-size $dp --prompt 'The capital of France is' --prompt 'Water is' --prompt 'Once upon a time' --max-tokens 32" | tee -a $OUT/mesh-text.txt
      timeout 120 python scripts/generate.py --model $G --dtype $dt --data-parallel-size $dp --prompt "The capital of France is" \
        --prompt "Water is" --prompt "Once upon a time" --max-tokens 32 2>&1 | quiet | tee -a $OUT/mesh-text.txt
    done
  done
  ;;
bench)
  for n in ${N:-4000 1000}; do
    for dp in 1 2; do
      D="python scripts/bench_throughput.py --model /tmp/smollm2-header.gguf --load-format dummy --requests /tmp/requests-$n.json --num-prompts $n --backend jaxkv --data-parallel-size $dp --max-num-seqs $((256 * dp)) --max-num-batched-tokens $((4096 * dp)) --num-gpu-blocks 16384 --no-progress --compilation-cache-dir /tmp/jaxcache ${BENCH_EXTRA:-}"
      echo "\$ XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 $D" | tee -a $OUT/mesh-bench.txt
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout ${BENCH_TIMEOUT:-200} $D --output-json $OUT/mesh-bench-n$n-dp$dp${TAG:-}.json 2>&1 | quiet | tail -12 | tee -a $OUT/mesh-bench.txt
    done
  done
  ;;
step)
  echo "\$ python scripts/dev/bench_mesh_step.py --preset llama-1b --tp 1,2 --batches ${BATCHES:-8,64} --new-tokens 64" | tee $OUT/mesh-step.txt
  timeout ${STEP_TIMEOUT:-300} python scripts/dev/bench_mesh_step.py --preset llama-1b --tp 1,2 --batches ${BATCHES:-8,64} --new-tokens 64 2>&1 | quiet | tee -a $OUT/mesh-step.txt
  ;;
hlo)
  rm -rf /tmp/hlo && mkdir -p /tmp/hlo
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" timeout 200 python scripts/dev/bench_mesh_step.py \
    --preset llama-1b --tp 2 --batches 8 --new-tokens 8 --repeats 1 --no-profile 2>&1 | quiet | tail -3
  for f in /tmp/hlo/*after_optimizations.txt; do
    n=$(grep -cE "(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(" "$f")
    [ "$n" -gt 0 ] && echo "$(basename $f): $n collectives: $(grep -oE '(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(' "$f" | sort | uniq -c | tr '\n' ' ')"
  done | tee $OUT/mesh-hlo.txt
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
