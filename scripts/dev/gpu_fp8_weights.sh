#!/usr/bin/env bash
# fp8 weights on one H100 (issue 45 item 2), one device call (nvidia-h100-x1; carry .whl .dummy), logs in $OUT:
#   (a) hlo : scripts/dev/bench_fp8_gemm.py's HLO part: the optimized HLO of one fp8 Linear at the 8B gate_proj shape
#             for M = 1, 256, 8192 (files in $OUT/hlo/), grepped for cuBLASLt's fp8 GEMM (__cublas$lt$matmul$f8) and for
#             f8 -> wide converts (an upcast instead); the same count over a 2-layer 8B-shaped fp8 model (8 to 14: q/k/v and gate/up may be merged);
#             the fp8 Linear's error on the GPU against the dequantize-then-f32-matmul reference.
#   (b) gemm: bf16 vs fp8 GEMM stacks at the 8B layer shapes (8 layers of q/k/v/o/gate/up/down with their own
#             weights), M = 1..8192 rows, bf16 / fp8 (f32 GEMM output, the model's) / fp8-bf16out (bf16 GEMM
#             output), ms per stack, and the CUPTI kernel tables at 16 and 1024 rows
#             (bench_fused_gemm.py's method, torch.profiler).
#   (c) e2e : jaxkv bench throughput, Llama-3.1-8B shape with dummy weights, 1000 requests of
#             .dummy/requests-llama3.json (session 23's vLLM-rule set), --quantization fp8 first, then bf16 (the
#             baseline, rerun on the same card), LLM defaults, --nvml-busy; with .dummy/llama3-tokenizer when carried.
#   (d) kern: the fused SwiGLU + e4m3 kernel's tests compiled (tests/pallas_kernels/test_silu_and_mul_quant_mgpu.py),
#             then a 2-layer 8B fp8 step's kernel table at batch 256 without and with it (JAXKV_FP8_SWIGLU_KERNEL=1;
#             scripts/dev/bench_mesh_step.py), ~3 min; not part of "all".
# Each stage has its own timeout; (c) takes what is left of DEADLINE (default 590) s. Usage:
#   bash scripts/dev/gpu_fp8_weights.sh [all|hlo|gemm|e2e|kern]   (default all; expected ~8-9 min for all)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
. scripts/dev/snapshot.sh  # SNAPSHOT=FILE.tgz: $OUT archived as it goes
if [ -d .whl ] && [ ! -d /tmp/site/zmq ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a $OUT/device.txt
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "Unable to initialize backend" -e "warn_once"; }
stage=${1:-all}

if [ $stage = all ] || [ $stage = hlo ]; then
  echo "== (a) HLO of the fp8 Linear, accuracy on the device ($(date +%T), ${SECONDS} s)" | tee $OUT/hlo.txt
  timeout 150 python3 scripts/dev/bench_fp8_gemm.py --hlo-dir $OUT/hlo --skip-timing 2>&1 | quiet | tee -a $OUT/hlo.txt
  echo "exit ${PIPESTATUS[0]} (0: every checked program has its fp8 GEMM and no upcast of an f8 weight)" | tee -a $OUT/hlo.txt
  grep -cF 'custom_call_target="__cublas$lt$matmul$f8"' $OUT/hlo/*.txt 2>/dev/null | tee -a $OUT/hlo.txt
fi

if [ $stage = all ] || [ $stage = gemm ]; then
  echo "== (b) bf16 vs fp8 GEMM stacks, 8B layer shapes ($(date +%T), ${SECONDS} s)" | tee $OUT/gemm.txt
  timeout 240 python3 scripts/dev/bench_fp8_gemm.py --skip-hlo --rows 1,16,64,256,1024,4096,8192 --layers 8 \
    --variants bf16,fp8,fp8-bf16out --kernel-rows 16,1024 2>&1 | quiet | tee -a $OUT/gemm.txt
fi

if [ $stage = kern ]; then
  echo "== (d) the SwiGLU + e4m3 kernel compiled ($(date +%T), ${SECONDS} s)" | tee $OUT/kern.txt
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_silu_and_mul_quant_mgpu.py 2>&1 \
    | quiet | tail -15 | tee -a $OUT/kern.txt
  for swk in 0 1; do
    echo "== 2-layer 8B fp8 step, batch 256, JAXKV_FP8_SWIGLU_KERNEL=$swk ($(date +%T), ${SECONDS} s)" | tee -a $OUT/kern.txt
    JAXKV_FP8_SWIGLU_KERNEL=$swk timeout 150 python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --num-layers 2 \
      --tp 1 --batches 256 --prompt-len 8 --new-tokens 16 --quantization fp8 --kv-cache-dtype fp8 --top-kernels 30 \
      --repeats 2 2>&1 | quiet | grep -v -i warn | tee -a $OUT/kern.txt
  done
fi

if [ $stage = all ] || [ $stage = e2e ]; then
  TOK=""
  ROOT=$PWD
  [ -d .dummy/llama3-tokenizer ] && TOK="--tokenizer $ROOT/.dummy/llama3-tokenizer"
  B="python3 scripts/bench_throughput.py --load-format dummy --no-progress"
  # E2E_RUNS: which runs, in order (fp8 = fp8 weights, fp8kv = fp8 weights + fp8 KV cache, none = bf16; a -sep
  # suffix keeps the projections separate);
  # E2E_XLA_FLAGS: XLA_FLAGS for every run (an A/B of the flags is two calls); E2E_PROFILE=1: --profile-busy
  # (a second pass, traced, of the in-process engine: the kernel table); E2E_TRACE_RUNS=1 instead traces a window
  # of each timed run (below). GPU memory in use is sampled every 2 s (mem-RUN.csv).
  for q in ${E2E_RUNS:-fp8 none}; do
    left=$(( ${DEADLINE:-590} - SECONDS ))
    if [ $left -lt 60 ]; then echo "== (c) $q: skipped, ${left} s left" | tee -a $OUT/e2e.txt; continue; fi
    # a "-sep" suffix (fp8kv-sep, none-sep): the projections kept separate (JAXKV_FUSED_PROJECTIONS=0), the A/B of
    # models.fused; "-nnq" (fp8kv-nnq): the norms' outputs quantized in their own pass (JAXKV_FP8_NORM_QUANT=0), the
    # A/B of models.quantization.rms_norm_quantize_per_token
    fused=1; [ "${q%-sep}" != "$q" ] && fused=0
    nq=1; [ "${q%-nnq}" != "$q" ] && nq=0
    # "-f32o" (fp8kv-f32o): the fp8 GEMMs write f32, not bf16 (JAXKV_FP8_GEMM_OUT=f32; session 32 A/B: "-b16o")
    go=out; [ "${q%-f32o}" != "$q" ] && go=f32
    # "-base" (fp8kv-base): the same run from .base/, a snapshot of an earlier commit's code (carry it: `rm -rf .base
    # && mkdir .base && git archive REV jaxkv models pallas_kernels scripts | tar -x -C .base`), the A/B of a code
    # change without a switch in the code
    dir=$PWD; [ "${q%-base}" != "$q" ] && dir=$PWD/.base
    # "-swk" (fp8kv-swk): the SwiGLU + down_proj's quantization as one Mosaic GPU kernel (JAXKV_FP8_SWIGLU_KERNEL=1)
    swk=0; [ "${q%-swk}" != "$q" ] && swk=1
    case ${q%-*} in fp8) flag="--quantization fp8";; fp8kv) flag="--quantization fp8 --kv-cache-dtype fp8";; *) flag="";; esac
    echo "== (c) Llama-3.1-8B dummy, .dummy/requests-llama3.json, 1000 requests, LLM defaults, $q: $flag" \
      "XLA_FLAGS=${E2E_XLA_FLAGS:-} ($(date +%T), ${SECONDS} s; timeout $left s)" | tee -a $OUT/e2e.txt
    nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv,noheader -lms 2000 > $OUT/mem-$q.csv &
    SMI=$!
    trace=""
    # E2E_TRACE_RUNS=1: the timed run itself is the in-process engine's, traced over E2E_WINDOW (START:SECONDS) for
    # its kernel table (every run alike: the A/B and the tables in one pass each); E2E_WINDOW=all: the whole run
    # traced from its start (a window's trace starts from a timer thread mid-run: the 70B runs of session 28 on
    # 4xH200 died with it, a segfault and CUDA_ERROR_LAUNCH_FAILED, cause not isolated)
    [ -n "${E2E_TRACE_RUNS:-}" ] && trace="--profile-busy --profile-window ${E2E_WINDOW:-8:4}"
    [ -n "${E2E_TRACE_RUNS:-}" ] && [ "${E2E_WINDOW:-}" = all ] && trace="--profile-busy"
    (cd $dir && PYTHONPATH=/tmp/site:$dir JAXKV_FUSED_PROJECTIONS=$fused JAXKV_FP8_NORM_QUANT=$nq JAXKV_FP8_GEMM_OUT=$go \
      JAXKV_FP8_SWIGLU_KERNEL=$swk \
      JAXKV_ENABLE_MULTIPROCESSING=${E2E_TRACE_RUNS:+0} JAXKV_PROFILE_TOP=${PROFILE_TOP:-25} \
      XLA_FLAGS="${E2E_XLA_FLAGS:-}" timeout $left $B --model llama-3.1-8b $TOK --requests $ROOT/.dummy/requests-llama3.json \
      --num-prompts 1000 --backend jaxkv --nvml-busy $trace $flag) > $OUT/e2e-$q.log 2>&1
    echo "exit $?" >> $OUT/e2e-$q.log
    left=$(( ${DEADLINE:-590} - SECONDS ))
    if [ -n "${E2E_PROFILE:-}" ] && [ $left -gt 90 ]; then  # the kernel table: a traced pass of the in-process engine
      JAXKV_ENABLE_MULTIPROCESSING=0 JAXKV_PROFILE_TOP=25 XLA_FLAGS="${E2E_XLA_FLAGS:-}" timeout $left $B \
        --model llama-3.1-8b $TOK --requests .dummy/requests-llama3.json --num-prompts 1000 --backend jaxkv \
        --profile-busy $flag >> $OUT/e2e-$q.log 2>&1
      echo "exit $? (traced pass)" >> $OUT/e2e-$q.log
    fi
    kill $SMI
    echo "GPU memory used (MiB): max $(cut -d, -f2 $OUT/mem-$q.csv | tr -dc '0-9\n' | sort -n | tail -1)" \
      "of $(head -1 $OUT/mem-$q.csv | cut -d, -f3)" >> $OUT/e2e-$q.log
    grep -e "^jaxkv" -e "start-up" -e nvml -e "host loop" -e "unfinished" -e "quantization" -e "Error" -e "exit " \
      -e "GPU memory" -e "num_gpu_blocks" -e "profile-busy" -e "^ *[0-9.]* s  " $OUT/e2e-$q.log | cut -c1-400 | tee -a $OUT/e2e.txt
  done
fi
echo "done at ${SECONDS} s"
