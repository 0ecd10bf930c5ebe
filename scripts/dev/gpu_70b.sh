#!/usr/bin/env bash
# Issue 45 item 4: the Llama-3.1-70B shape (dummy weights) with tensor_parallel_size=TP (default 4: nvidia-h100-x4;
# TP=2 on two GPUs where no x4 is lent: fp8 weights only fit 80 GB cards), one call (carry .whl .dummy): jaxkv bench
# throughput on 1000 requests of .dummy/requests-llama3.json (the vLLM-rule set), LLM defaults, --nvml-busy;
# RUNS (default "bf16 fp8kv"; with TP=2 "fp8kv", plus bf16 on cards of >= 120 GB): fp8kv = fp8 weights + fp8 KV
# cache; MESH_STEP (below): the all-reduces' share of a decode step; PROFILE=1 (default)
# then (or first, PROFILE_FIRST=1) a traced pass of the in-process engine on PROFILE_PROMPTS requests
# (--profile-busy: the kernel table, NCCL all-reduces included). Each run gets what is left of DEADLINE seconds (default 540: leave room under the call's
# limit, which shrinks when little device time is left); XLA_FLAGS passes through. Logs go straight to $OUT, so
# a call cut short still brings back what ran: run it as `bash scripts/dev/gpu_70b.sh` with the tool's $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out70}
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT"
. scripts/dev/snapshot.sh  # SNAPSHOT=FILE.tgz: $OUT archived as it goes
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
TOK=""
[ -d .dummy/llama3-tokenizer ] && TOK="--tokenizer .dummy/llama3-tokenizer"
TP=${TP:-4}
B="python3 scripts/bench_throughput.py --model llama-3.1-70b --load-format dummy $TOK \
  --requests .dummy/requests-llama3.json --backend jaxkv -tp $TP --no-progress"
flags() { [ "${1%%-*}" = fp8kv ] && echo "--quantization fp8 --kv-cache-dtype fp8"; }
# A/B switches named by a run's suffixes (RUNS="fp8kv fp8kv-2shot", MESH_STEP likewise): -2shot sums the row-parallel
# layers as a reduce-scatter + all-gather (JAXKV_TP_ALL_REDUCE=two-shot); -cbc puts collectives into XLA's command
# buffers (+COLLECTIVES: its defaults and them; session 33: the mesh step 1.06-1.10x, the 1000-request run 0.999x
# with 13 GiB more peak memory, so not the engine's default)
with_switches() {  # $1: the run's name; the rest: the command, run in a subshell with the switches set
  local run=$1; shift
  (
    case $run in *-2shot*) export JAXKV_TP_ALL_REDUCE=two-shot;; esac
    case $run in *-cbc*) export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+COLLECTIVES";; esac
    "$@"
  )
}
summary() {
  grep -e "^jaxkv" -e "start-up" -e nvml -e "unfinished" -e "Error" -e "exit " -e "num_gpu_blocks" \
    -e "profile-busy" -e "^ *[0-9.]* s  " "$OUT/70b-$1.log" | cut -c1-400 | tee -a "$OUT/70b.txt"
  grep -o -m1 "memory_gib=[^}]*}" "$OUT/70b-$1.log" | tee -a "$OUT/70b.txt"  # XLA's pool, in use, reserve, temp
}
if [ -z "${RUNS+x}" ]; then  # unset: the defaults; RUNS="" runs none
  RUNS="bf16 fp8kv"
  if [ "$TP" = 2 ]; then
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    RUNS="fp8kv"; [ "$mem" -ge 120000 ] && RUNS="fp8kv bf16"
  fi
fi
traced() {  # kernel table (NCCL all-reduces included): a traced pass of the in-process engine over the first
  # PROFILE_PROMPTS requests (default 200) of the first run's configuration, traced for PROFILE_WINDOW (default 10:3: 3 s
  # from 10 s into the run; the whole run over 4 GPUs overflowed CUPTI's event buffer); limited to $1 seconds
  local run=${RUNS%% *} left=$(( DEADLINE - SECONDS ))
  [ "$1" -lt "$left" ] && left=$1
  if [ "${PROFILE:-1}" = 1 ] && [ $left -gt 120 ]; then
    echo "== traced pass: $run, ${PROFILE_PROMPTS:-200} requests ($(date +%T), ${SECONDS} s; timeout $left s)" \
      | tee -a "$OUT/70b.txt"
    JAXKV_ENABLE_MULTIPROCESSING=0 JAXKV_PROFILE_TOP=30 timeout $left $B --num-prompts "${PROFILE_PROMPTS:-200}" \
      --profile-busy --profile-window "${PROFILE_WINDOW:-10:3}" $(flags $run) > "$OUT/70b-$run-traced.log" 2>&1
    echo "exit $? (traced pass)" >> "$OUT/70b-$run-traced.log"
    summary "$run-traced"
  fi
}
# TRACE_RUNS=1: no separate traced pass; each timed run is the in-process engine's with --profile-busy over
# PROFILE_WINDOW (the A/B and both kernel tables in one call, each run traced alike).
[ "${TRACE_RUNS:-0}" = 1 ] && PROFILE=0
# PROFILE_FIRST=1: the traced pass first (its compiles fill the persistent cache the same configuration's timed
# run then loads from), limited to PROFILE_FIRST_S seconds (default 240); else after the A/B runs
[ "${PROFILE_FIRST:-0}" = 1 ] && traced "${PROFILE_FIRST_S:-240}"
for run in $RUNS; do
  left=$(( DEADLINE - SECONDS ))
  if [ $left -lt 90 ]; then echo "== $run: skipped, ${left} s left" | tee -a "$OUT/70b.txt"; continue; fi
  echo "== Llama-3.1-70B dummy, tp=$TP, 1000 requests, LLM defaults, $run: $(flags $run) XLA_FLAGS=${XLA_FLAGS:-}" \
    "($(date +%T), ${SECONDS} s; timeout $left s)" | tee -a "$OUT/70b.txt"
  # each GPU's memory in use every 5 s: its peak less XLA's pool (memory_gib's limit) is what lives outside the pool
  # (NCCL, CUDA context, kernel modules), the room a larger pool must leave
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 5 > "$OUT/70b-$run-nvsmi.csv" 2>/dev/null &
  NVSMI=$!
  if [ "${TRACE_RUNS:-0}" = 1 ]; then  # the timed runs themselves traced for a window (in-process engine, both alike)
    JAXKV_ENABLE_MULTIPROCESSING=0 JAXKV_PROFILE_TOP=30 with_switches $run timeout $left $B --num-prompts 1000 \
      --nvml-busy --profile-busy --profile-window "${PROFILE_WINDOW:-10:3}" $(flags $run) > "$OUT/70b-$run.log" 2>&1
  else
    with_switches $run timeout $left $B --num-prompts 1000 --nvml-busy $(flags $run) > "$OUT/70b-$run.log" 2>&1
  fi
  echo "exit $?" >> "$OUT/70b-$run.log"
  kill $NVSMI 2>/dev/null
  summary "$run"
  awk -F', ' '$2 > m[$1] {m[$1] = $2} END {for (g in m) printf "GPU %s peak memory.used %d MiB\n", g, m[g]}' \
    "$OUT/70b-$run-nvsmi.csv" | sort | tee -a "$OUT/70b.txt"
done
[ "${PROFILE_FIRST:-0}" = 1 ] || traced 100000
# MESH_STEP="fp8kv bf16" (any of them): the all-reduces' share of a decode step from CUPTI, per configuration,
# scripts/dev/bench_mesh_step.py at tp=$TP (dummy weights made in their shards), batches MESH_BATCHES (64,256);
# RUNS="" PROFILE=0 MESH_STEP=... runs only this. MESH_ARGS passes more options (MESH_ARGS="--num-layers 20": a
# shorter model, the same layers, for A/Bs of a layer's kernels and all-reduces in less device time).
for run in ${MESH_STEP:-}; do
  left=$(( DEADLINE - SECONDS ))
  if [ $left -lt 60 ]; then echo "== mesh step $run: skipped, ${left} s left" | tee -a "$OUT/70b.txt"; continue; fi
  echo "== decode step and its all-reduces, tp=$TP, $run ($(date +%T), ${SECONDS} s; timeout $left s)" | tee -a "$OUT/70b.txt"
  with_switches $run timeout $left python3 scripts/dev/bench_mesh_step.py --model llama-3.1-70b --tp $TP \
    --batches "${MESH_BATCHES:-64,256}" --new-tokens 32 --repeats 2 --top-kernels 12 $(flags $run) ${MESH_ARGS:-} \
    > "$OUT/70b-mesh-$run.log" 2>&1
  echo "exit $?" >> "$OUT/70b-mesh-$run.log"
  grep -e "^batch" -e "^ *[0-9]* *$TP " -e "us/step" -e "Error" -e "^exit" "$OUT/70b-mesh-$run.log" | cut -c1-300 \
    | tee -a "$OUT/70b.txt"
done
echo "done at ${SECONDS} s" | tee -a "$OUT/70b.txt"
