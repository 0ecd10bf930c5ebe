#!/usr/bin/env bash
# Session 17's GPU evidence for issues 27, 29 and 30 in three back-to-back device-tool calls on an H100 pair
# (nvidia-h100-x2; carry .whl .dummy .multiturn), the soak on GPU 0 spanning calls a and b:
#   stage a: starts the 10-minute soak (scripts/dev/gpu_soak.sh, SmolLM2 random weights, ShareGPT requests from
#            .dummy/requests.json) detached on GPU 0; on GPU 1: SmolLM2 offline 1000 requests (LLM defaults,
#            engine-core process, and the in-process engine; a second LLM start = warm start), then the server
#            with --api-server-count 1 and 2 at rate inf and 0.9x through the openai client (bench_serving).
#   stage b: on GPU 1 the multi-turn host-tier runs (gpu_multiturn.sh smol, big); waits for the soak to end and
#            copies its output.
#   stage c: both GPUs: SmolLM2 3000 requests one GPU vs -dp 2 (bench_throughput prints each rank's share);
#            Llama-3.1-8B tp=1/2 step times (bench_mesh_step.py); the 16 GB checkpoint's load memory.
#   stage d, e: session 17's second soak with the multi-turn runs beside it, then its end.
#   stage f (next session): GPU 0 the multi-turn runs with one transfer per tensor group (and cProfile of the
#            tier-on run), GPU 1 at the same time offline + server with 1 and 2 API servers + warm start.
#   stage g (next session): issues 27-28 on both GPUs: greedy float32 at JAX_DEFAULT_MATMUL_PRECISION=highest
#            (TF32 GEMMs at the default round by batch), SmolLM2 -dp 2, tp=2 vs tp=1 at 8B and Gemma-3-4B tp=2 /
#            dp=2 vs one GPU.
#   stage i: GPU 1: where the server's CPU goes at rate inf (scripts/dev/proc_cpu.py: CPU seconds per process
#            role, NVML busy, py-spy of the core and API servers) with 1 and 2 API servers, the openai client
#            against aiohttp, 1000 and 3000 requests, beside an offline run; GPU 0 at the same time stage h's
#            two 8B runs one after the other.
#   stage j, k (session 18): the server alone (1 and 2 API servers, 16 client processes) and -dp 2 on 3000-4256
#            requests with the placement A/B; stage l (next): LLM.generate's dispatch window A/B, one GPU and -dp 2.
#   stage m (session 19): vLLM's H100-class defaults (max_num_seqs 1024, 16384 tokens a step) against ours, 8B
#            shape and SmolLM2, 1000 requests, one GPU.
#   stage n (session 19): the placement balancing prompt tokens too, SmolLM2 3000 one GPU vs -dp 2, 8B 4000 -dp 2;
#            stage m's 8B pair.
#   stage o (session 19): stage g without SmolLM2 (8B tp=2 vs tp=1, Gemma-3-4B tp=2 / dp=2, float32 at highest
#            precision), then the 8B tp step table.
#   stage q (session 20): the host tier's loads against the copies inside the pass (SmolLM2 multi-turn, GPU 0) and the
#            8B shape's multi-turn at 128 at once (GPU 1) at the same time; the pinned-pool probe; serve.py's
#            defaults (top-k/top-p compiled ahead), cold and warm start.
#   stage r (session 20): the 8B decode step's top kernels; the pinned-memory probe; SmolLM2 -dp 2 on 8000 requests.
#   stage s (session 20): the host tier staged in pinned memory (its tests compiled, SmolLM2 and 8B multi-turn);
#            the 8B step's kernels with XLA's dot merger off.
#   stage t (session 20): the 8B multi-turn with offloads moved by the writer thread; the 8B batch-1 decode HLO;
#            SmolLM2 -dp 2 on 8000 requests with the 2x and a 1.25x dispatch window.
#   stage h [XLA_FLAG]: Llama-3.1-8B, 1000 requests, an XLA flag on GPU 1 against the default on GPU 0, at
#            once (default flag, for the next session: XLA's dot merger threshold raised so the gate and up
#            projections, 117 MB of weights each, merge into one GEMM like q/k/v).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache NCCL_NVLS_ENABLE=0
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
python3 - <<'PY'
import json
r = json.load(open(".dummy/requests.json"))
json.dump(r[256:1256], open("/tmp/req1000.json", "w"))   # = bench_serving's inf run
json.dump(r[256:3256], open("/tmp/req3000.json", "w"))
PY
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "Unable to initialize backend"; }
S=.dummy/smollm2-header.gguf
B="python3 scripts/bench_throughput.py --load-format dummy --no-progress"
G="python3 scripts/dev/compare_greedy.py --load-format dummy --requests /tmp/req1000.json --dtype float32"
secs() { python3 -c "print(round($(date +%s.%N) - $1, 1))"; }
serve_start() {  # $1: label; then VAR=value ... for the server's environment
  local label=$1; shift
  local t0=$(date +%s.%N)
  env "$@" CUDA_VISIBLE_DEVICES=0 python3 scripts/serve.py --model $S --load-format dummy --served-model-name smollm2 \
    --port 8000 > /tmp/diag/server-$label.log 2>&1 &
  local SERVER=$!
  until curl -sf localhost:8000/health >/dev/null; do sleep 0.1; kill -0 $SERVER 2>/dev/null || break; done
  local ready=$(secs $t0)
  local text=$(curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "prompt": "Hello there", "max_tokens": 12, "temperature": 0}' | python3 -c "import json,sys; print(repr(json.load(sys.stdin)['choices'][0]['text']))")
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20}' > /dev/null
  local info=$(grep -o -e "num_compiles=[0-9]*" -e "executables_loaded=[0-9]*" -e "load_s=[0-9.]*" -e "warmup_s=[0-9.]*" \
    -e "load_breakdown_s={[^}]*}" /tmp/diag/server-$label.log | tr '\n' ' ')
  echo "server defaults, $label: /health after $ready s; greedy $text; $info" | tee -a /tmp/diag/serve-start.txt
  kill -TERM $SERVER; wait $SERVER
}
offline_and_servers() {  # GPU 1: SmolLM2 offline (cold, in-process, warm), then the server with 1 and 2 API servers
  echo "== SmolLM2 offline, GPU 1, 1000 requests: LLM defaults (cold start), in-process engine; LLM again (warm)"
  CUDA_VISIBLE_DEVICES=1 timeout 200 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --backend jaxkv-inproc --nvml-busy --output-json $OUT/offline.json 2>&1 | quiet \
    | grep -e "^jaxkv" -e "start-up" -e nvml -e "^backend" | tee $OUT/offline.txt
  CUDA_VISIBLE_DEVICES=1 timeout 80 $B --model $S --requests /tmp/req1000.json --num-prompts 200 --backend jaxkv \
    2>&1 | quiet | grep -e "^jaxkv " -e "start-up" | tee $OUT/offline-warm.txt
  for n in 1 2; do
    [ $SECONDS -gt 400 ] && { echo "no time left for --api-server-count $n"; break; }
    t0=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=1 python3 scripts/serve.py --model $S --load-format dummy --served-model-name smollm2 \
      --port 8000 --no-compile-top-k-top-p --log-stats-interval 5 --api-server-count $n > /tmp/server$n.log 2>&1 &
    SERVER=$!
    until curl -sf localhost:8000/health >/dev/null; do sleep 0.2; kill -0 $SERVER || break; done
    echo "server --api-server-count $n ready (warm start): $(secs $t0) s" | tee -a $OUT/serve-start.txt
    timeout 130 python3 scripts/bench_serving.py --requests .dummy/requests.json --num-prompts 1000 \
      --request-rate inf,0.9x --warmup-requests 256 --client-processes 8 --markdown 2>&1 | quiet > /tmp/serving$n.txt
    cp /tmp/serving$n.txt $OUT/; tail -4 /tmp/serving$n.txt
    t1=$(date +%s.%N); kill -TERM $SERVER; wait $SERVER
    echo "exit $? after SIGTERM in $(secs $t1) s; processes left: $(pgrep -fc 'serve.py|core_proc')" | tee -a $OUT/serve-start.txt
  done
}
greedy() {  # MODEL PROMPTS TOKENS OUTFILE A B: compare_greedy.py (float32) of LLM options A against B
  timeout ${GREEDY_TIMEOUT:-200} $G --model $1 --num-prompts $2 --max-tokens $3 --a $5 --b $6 2>&1 | quiet \
    | grep -v "^engine\|^LLM\|INFO" | tee -a $OUT/$4 | tail -4
}
greedy_smol_dp() { greedy $S 64 32 greedy-dp-f32.txt data_parallel_size=1,max_num_seqs=64,compile_ahead=off \
                     data_parallel_size=2,max_num_seqs=64,compile_ahead=off; }
serve_diag() {  # NAME API_SERVERS NUM_PROMPTS CLIENT REQUESTS [CLIENT_PROCS]: GPU 1, one server, its rate-inf run under proc_cpu.py
  CUDA_VISIBLE_DEVICES=1 python3 scripts/serve.py --model $S --load-format dummy --served-model-name smollm2 \
    --port 8000 --no-compile-top-k-top-p --api-server-count $2 > /tmp/server-$1.log 2>&1 &
  local server=$!
  until curl -sf localhost:8000/health >/dev/null; do sleep 0.2; kill -0 $server || return; done
  python3 scripts/bench_serving.py --requests .dummy/requests.json --num-prompts 8 --warmup-requests 256 \
    --client-processes 8 > /dev/null 2>&1   # warm-up, not counted
  echo "== $1: --api-server-count $2, $3 requests at rate inf, --client $4"
  PATH=/tmp/site/bin:$PATH python3 scripts/dev/proc_cpu.py --gpu-index 1 ${SPY:+--py-spy /tmp/diag/spy-$1} -- \
    python3 scripts/bench_serving.py --requests $5 --num-prompts $3 --request-rate inf --client $4 \
    --client-processes ${6:-8} --markdown 2>&1 | quiet | grep -v "^|---\|^| rate"
  kill -TERM $server; wait $server
}
case $1 in
a)
  CUDA_VISIBLE_DEVICES=0 REQUESTS=.dummy/requests.json OUT=/tmp/soak-out setsid \
    bash scripts/dev/gpu_soak.sh $S 600 --load-format dummy > /tmp/soak.log 2>&1 < /dev/null &
  offline_and_servers
  tail -3 /tmp/soak.log
  ;;
b)
  CUDA_VISIBLE_DEVICES=1 bash scripts/dev/gpu_multiturn.sh smol 2>&1 | tail -40
  CUDA_VISIBLE_DEVICES=1 timeout $(( 560 - SECONDS > 30 ? 560 - SECONDS : 30 )) bash scripts/dev/gpu_multiturn.sh big 2>&1 | tail -40
  while pgrep -f soak_server.py > /dev/null && [ $SECONDS -lt 585 ]; do sleep 2; done
  cp -r /tmp/soak-out $OUT/; cp /tmp/soak.log $OUT/soak-out/; tail -40 /tmp/soak.log
  ;;
c)
  echo "== SmolLM2, 3000 requests: one GPU vs -dp 2"
  for dp in 1 2; do
    timeout 150 $B --model $S --requests /tmp/req3000.json --num-prompts 3000 --backend jaxkv -dp $dp \
      --output-json $OUT/dp$dp.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" | tee -a $OUT/dp.txt
  done
  timeout 150 python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1,2 --batches 1,64,256 --new-tokens 32 \
    --repeats 1 2>&1 | quiet | tee $OUT/mesh-step-8b.txt | tail -12
  timeout 150 python3 scripts/dev/bench_load_memory.py --size-gb 16 --dir /tmp/ckpt16 2>&1 | tee $OUT/load-memory-16gb.txt | tail -6
  ;;
d)  # the soak again on GPU 0 (its burst check mended), the multi-turn runs with the threaded host-tier copies
  # on GPU 1, the tier-on run once more under cProfile (where the engine thread's time goes); stage e follows
  CUDA_VISIBLE_DEVICES=0 REQUESTS=.dummy/requests.json OUT=/tmp/soak-out setsid \
    bash scripts/dev/gpu_soak.sh $S 600 --load-format dummy > /tmp/soak.log 2>&1 < /dev/null &
  CUDA_VISIBLE_DEVICES=1 bash scripts/dev/gpu_multiturn.sh smol 2>&1 | grep -v "Delay kernel" | tail -8
  CUDA_VISIBLE_DEVICES=1 bash scripts/dev/gpu_multiturn.sh big 2>&1 | grep -v "Delay kernel" | tail -8
  mkdir -p $OUT/prof
  CUDA_VISIBLE_DEVICES=1 timeout $(( 570 - SECONDS > 30 ? 570 - SECONDS : 30 )) python3 -m cProfile -o /tmp/mt.prof \
    scripts/bench_multiturn.py --load-format dummy --conversations .multiturn/conversations.json \
    --model /tmp/smollm2/config.json --num-conversations 150 --max-active 64 --num-gpu-blocks 1536 \
    --kv-offloading-size 8 --modes on 2>&1 | grep -v "Delay kernel" | tail -3
  python3 -c "import pstats; s = pstats.Stats('/tmp/mt.prof'); s.sort_stats('tottime').print_stats(30); s.sort_stats('cumulative').print_stats(45)" > $OUT/prof/multiturn-on-cprofile.txt 2>&1
  grep -A40 "tottime  percall" $OUT/prof/multiturn-on-cprofile.txt | head -40 | cut -c1-150
  ;;
e)  # the soak's end (started by stage d), then greedy float32 -dp 2 vs one GPU (SmolLM2)
  while pgrep -f soak_server.py > /dev/null && [ $SECONDS -lt 400 ]; do sleep 2; done
  cp /tmp/soak.log /tmp/soak-out/; tar -C /tmp -czf $OUT/soak-out.tgz soak-out; tail -45 /tmp/soak.log
  GREEDY_TIMEOUT=$(( 580 - SECONDS )) greedy_smol_dp
  ;;
f)
  (CUDA_VISIBLE_DEVICES=0 bash scripts/dev/gpu_multiturn.sh smol 2>&1 | grep -v "Delay kernel" | tail -6 > $OUT/mt-smol.log
   CUDA_VISIBLE_DEVICES=0 bash scripts/dev/gpu_multiturn.sh big 2>&1 | grep -v "Delay kernel" | tail -6 > $OUT/mt-big.log) &
  MT=$!
  offline_and_servers
  wait $MT; cat $OUT/mt-smol.log $OUT/mt-big.log
  ;;
g)
  export JAX_DEFAULT_MATMUL_PRECISION=highest
  greedy_smol_dp
  greedy llama-3.1-8b 32 16 greedy-tp-f32.txt tensor_parallel_size=1,max_num_seqs=32,max_model_len=2048,compile_ahead=off \
    tensor_parallel_size=2,max_num_seqs=32,max_model_len=2048,compile_ahead=off
  for side in tensor_parallel_size=2 data_parallel_size=2; do
    greedy gemma-3-4b 16 16 greedy-gemma-f32.txt max_num_seqs=16,max_model_len=2048,compile_ahead=off \
      $side,max_num_seqs=16,max_model_len=2048,compile_ahead=off
  done
  ;;
h)  # [XLA_FLAG]: Llama-3.1-8B, 1000 requests, the flag on GPU 1 against the default on GPU 0, at once, cold
  FLAG=${2:---xla_gpu_dot_merger_threshold_mb=1024}
  (CUDA_VISIBLE_DEVICES=1 XLA_FLAGS=$FLAG JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache-flag \
     timeout 300 $B --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 --backend jaxkv \
     --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" > $OUT/big-flag.txt) &
  FL=$!
  CUDA_VISIBLE_DEVICES=0 timeout 300 $B --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" | tee $OUT/big-default.txt
  wait $FL; echo "-- $FLAG:"; cat $OUT/big-flag.txt
  ;;
i)
  mkdir -p /tmp/diag
  (for flag in "" "--xla_gpu_dot_merger_threshold_mb=1024"; do
     echo "-- 8B, XLA_FLAGS=$flag"
     CUDA_VISIBLE_DEVICES=0 XLA_FLAGS=$flag JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache0$flag timeout 240 $B --model llama-3.1-8b \
       --requests /tmp/req1000.json --num-prompts 1000 --backend jaxkv --nvml-busy 2>&1 | quiet \
       | grep -e "^jaxkv " -e "start-up" -e nvml
   done > $OUT/big-flag.txt) &
  FL=$!
  CUDA_VISIBLE_DEVICES=1 timeout 200 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml | tee /tmp/diag/offline.txt
  SPY=1 serve_diag asc1 1 1000 openai /tmp/req1000.json
  SPY=1 serve_diag asc2 2 1000 openai /tmp/req1000.json
  SPY=1 serve_diag asc2-aiohttp 2 1000 aiohttp /tmp/req1000.json
  [ $SECONDS -lt 420 ] && SPY=1 serve_diag asc2-3000 2 3000 openai /tmp/req3000.json
  wait $FL; cat $OUT/big-flag.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
j)  # nothing beside: GPU 1 SmolLM2 offline, then the server (1 and 2 API servers, 16 openai client processes);
    # then both GPUs: -dp 2 vs one GPU with the budget-balancing placement, SmolLM2 3000 and 8B 2000 requests
  mkdir -p /tmp/diag
  CUDA_VISIBLE_DEVICES=1 timeout 200 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml | tee /tmp/diag/offline.txt
  serve_diag asc1 1 1000 openai /tmp/req1000.json 16
  serve_diag asc2 2 1000 openai /tmp/req1000.json 16
  echo "== SmolLM2, 3000 requests: one GPU vs -dp 2"
  for dp in 1 2; do
    timeout 150 $B --model $S --requests /tmp/req3000.json --num-prompts 3000 --backend jaxkv -dp $dp \
      --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" -e nvml | tee -a /tmp/diag/dp.txt
  done
  python3 -c "import json; r = json.load(open('.dummy/requests.json')); json.dump(r[256:2256], open('/tmp/req2000.json', 'w'))"
  echo "== Llama-3.1-8B, 2000 requests: one GPU vs -dp 2"
  for dp in 1 2; do
    [ $SECONDS -gt 430 ] && { echo "no time left for 8B -dp $dp"; break; }
    timeout $(( 590 - SECONDS )) $B --model llama-3.1-8b --requests /tmp/req2000.json --num-prompts 2000 --backend jaxkv \
      -dp $dp 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" | tee -a /tmp/diag/dp.txt
  done
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
k)  # -dp 2 vs one GPU on larger batches (a fixed batch's tail is the same seconds at any dp), and the
    # placement A/B (JAXKV_DP_PLACEMENT=count: vLLM's fewest-requests rule vs the output-budget balance)
  mkdir -p /tmp/diag
  python3 -c "import json; r = json.load(open('.dummy/requests.json')); json.dump(r[256:4256], open('/tmp/req4000.json', 'w')); json.dump(r, open('/tmp/req4256.json', 'w'))"
  run() { echo "-- $*"; timeout $(( 590 - SECONDS )) $B --backend jaxkv "$@" 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" | tee -a /tmp/diag/dp-k.txt; }
  run --model $S --requests /tmp/req4256.json --num-prompts 4256 -dp 1
  run --model $S --requests /tmp/req4256.json --num-prompts 4256 -dp 2
  JAXKV_DP_PLACEMENT=count run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 2
  run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 2
  [ $SECONDS -lt 300 ] && run --model llama-3.1-8b --requests /tmp/req4000.json --num-prompts 4000 -dp 1
  [ $SECONDS -lt 480 ] && run --model llama-3.1-8b --requests /tmp/req4000.json --num-prompts 4000 -dp 2
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
l)  # (next session) LLM.generate's dispatch window (2 x max_num_seqs outstanding per rank, the rest sent as
    # requests finish) against every request at once (JAXKV_DISPATCH_WINDOW_PER_SEQ=0), one GPU and -dp 2
  mkdir -p /tmp/diag
  python3 -c "import json; r = json.load(open('.dummy/requests.json')); json.dump(r[256:4256], open('/tmp/req4000.json', 'w'))"
  run() { echo "-- $*"; timeout $(( 590 - SECONDS )) $B --backend jaxkv "$@" 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" | tee -a /tmp/diag/dp-l.txt; }
  run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 1
  JAXKV_DISPATCH_WINDOW_PER_SEQ=0 run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 1
  run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 2
  JAXKV_DISPATCH_WINDOW_PER_SEQ=0 run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 2
  [ $SECONDS -lt 250 ] && run --model llama-3.1-8b --requests /tmp/req4000.json --num-prompts 4000 -dp 1
  [ $SECONDS -lt 420 ] && run --model llama-3.1-8b --requests /tmp/req4000.json --num-prompts 4000 -dp 2
  [ $SECONDS -lt 500 ] && JAXKV_DISPATCH_WINDOW_PER_SEQ=0 run --model llama-3.1-8b --requests /tmp/req4000.json \
    --num-prompts 4000 -dp 2
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
m)  # (session 19) vLLM's H100-class batch defaults (max_num_seqs 1024, max_num_batched_tokens 16384 offline)
    # against ours (256 / 8192), one GPU, one run after another, nothing beside: 8B shape and SmolLM2, 1000 requests
  mkdir -p /tmp/diag
  run() { echo "-- $*"; CUDA_VISIBLE_DEVICES=0 timeout $(( 595 - SECONDS )) $B --backend jaxkv --requests /tmp/req1000.json \
            --num-prompts 1000 --nvml-busy "$@" 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml | tee -a /tmp/diag/defaults-m.txt; }
  run --model llama-3.1-8b --max-num-seqs 256 --max-num-batched-tokens 8192
  run --model llama-3.1-8b --max-num-seqs 1024 --max-num-batched-tokens 16384
  [ $SECONDS -lt 380 ] && run --model llama-3.1-8b --max-num-seqs 512 --max-num-batched-tokens 16384
  [ $SECONDS -lt 480 ] && run --model $S --max-num-seqs 1024 --max-num-batched-tokens 16384
  [ $SECONDS -lt 530 ] && run --model $S --max-num-seqs 256 --max-num-batched-tokens 8192
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
n)  # (session 19) the placement balancing prompt tokens too (rank 0 had 9-10 % more prefill): SmolLM2 3000
    # one GPU vs -dp 2; then vLLM's H100-class batch defaults against ours at 8B (1000 requests, one GPU);
    # then the 8B -dp 2 on 4000 (its one-GPU baseline: stage l)
  mkdir -p /tmp/diag
  python3 -c "import json; r = json.load(open('.dummy/requests.json')); json.dump(r[256:4256], open('/tmp/req4000.json', 'w'))"
  run() { echo "-- $*"; timeout $(( 595 - SECONDS )) $B --backend jaxkv "$@" 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" -e nvml | tee -a /tmp/diag/n.txt; }
  run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 1
  run --model $S --requests /tmp/req3000.json --num-prompts 3000 -dp 2
  [ $SECONDS -lt 300 ] && CUDA_VISIBLE_DEVICES=0 run --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 \
    --max-num-seqs 256 --max-num-batched-tokens 8192 --nvml-busy
  [ $SECONDS -lt 400 ] && CUDA_VISIBLE_DEVICES=0 run --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 \
    --max-num-seqs 1024 --max-num-batched-tokens 16384 --nvml-busy
  [ $SECONDS -lt 490 ] && run --model llama-3.1-8b --requests /tmp/req4000.json --num-prompts 4000 -dp 2 \
    --max-num-seqs 256 --max-num-batched-tokens 8192
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
o)  # (session 19) issue 28's equalities in float32 at JAX_DEFAULT_MATMUL_PRECISION=highest (SmolLM2 -dp 2: session
    # 17, 64/64): Llama-3.1-8B tp=2 vs tp=1, Gemma-3-4B tp=2 and dp=2 vs one GPU; then the 8B tp step table
  mkdir -p /tmp/diag
  export JAX_DEFAULT_MATMUL_PRECISION=highest
  GREEDY_TIMEOUT=170 greedy llama-3.1-8b 32 16 greedy-tp-f32.txt tensor_parallel_size=1,max_num_seqs=32,max_model_len=2048,compile_ahead=off \
    tensor_parallel_size=2,max_num_seqs=32,max_model_len=2048,compile_ahead=off
  for side in tensor_parallel_size=2 data_parallel_size=2; do
    [ $SECONDS -gt 420 ] && { echo "no time left for Gemma-3-4B $side"; break; }
    GREEDY_TIMEOUT=120 greedy gemma-3-4b 16 16 greedy-gemma-f32.txt max_num_seqs=16,max_model_len=2048,compile_ahead=off \
      $side,max_num_seqs=16,max_model_len=2048,compile_ahead=off
  done
  unset JAX_DEFAULT_MATMUL_PRECISION
  [ $SECONDS -lt 480 ] && timeout $(( 590 - SECONDS )) python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1,2 \
    --batches 1,64,256 --new-tokens 32 --repeats 1 2>&1 | quiet | grep -v "^engine\|INFO" | tail -20 | tee $OUT/mesh-step.txt
  ;;
q)  # (session 20) issue 29's loads A/B and issue 27's server warm start with its default compile, both GPUs at once:
    # GPU 1 the 8B shape's multi-turn run at a server's concurrency (gpu_multiturn.sh big-wide: tier off, on);
    # GPU 0 SmolLM2's multi-turn (200 conversations as session 19: off, on = loads beside the steps, on-sync =
    # the copies inside the pass), the pinned-pool probe, then serve.py with its defaults, cold and warm
  mkdir -p /tmp/diag
  (CUDA_VISIBLE_DEVICES=1 BIG_CONVERSATIONS=300 BIG_TIMEOUT=560 bash scripts/dev/gpu_multiturn.sh big-wide > /tmp/diag/big-wide.log 2>&1; cp $OUT/multiturn-big-wide.* /tmp/diag/ 2>/dev/null) &
  BIG=$!
  M="scripts/bench_multiturn.py --load-format dummy --conversations .multiturn/conversations.json --nvml-busy"
  mkdir -p /tmp/smollm2 && sed -n '/^{"architectures"/,/^JSON/p' scripts/dev/gpu_multiturn.sh | grep -v '^JSON' > /tmp/smollm2/config.json
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 $M --model /tmp/smollm2/config.json --num-conversations 200 --max-active 64 \
    --num-gpu-blocks 1536 --kv-offloading-size 8 --modes off,on,on-sync --output-json /tmp/diag/multiturn-smol.json 2>&1 \
    | quiet | grep -v cuda_timer | tee /tmp/diag/multiturn-smol.txt
  echo "== probe_pinned_gather (SmolLM2 shape, 23301-block pool, 256 blocks)"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 scripts/dev/probe_pinned_gather.py 2>&1 | quiet | tail -12 | tee /tmp/diag/probe.txt
  for start in cold warm; do
    [ $SECONDS -gt 470 ] && { echo "no time left for the server's $start start"; break; }
    t0=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=0 python3 scripts/serve.py --model $S --load-format dummy --served-model-name smollm2 \
      --port 8000 > /tmp/diag/server-$start.log 2>&1 &
    SERVER=$!
    until curl -sf localhost:8000/health >/dev/null; do sleep 0.2; kill -0 $SERVER 2>/dev/null || break; done
    echo "server defaults, $start start: /health after $(secs $t0) s" | tee -a /tmp/diag/serve-start.txt
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "smollm2", "prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20}' \
      | head -c 300 | tee -a /tmp/diag/serve-start.txt; echo
    echo "first sampled completion after $(secs $t0) s" | tee -a /tmp/diag/serve-start.txt
    kill -TERM $SERVER; wait $SERVER
  done
  wait $BIG; cat /tmp/diag/big-wide.log | grep -v cuda_timer | tail -12
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
r)  # (session 20) GPU 1: the 8B decode step's kernels (batch 1/64/256, 8 steps a round trip); GPU 0 meanwhile the
    # pinned-memory probe (writable views, threads, uncommitted device arrays, device -> pinned); then, nothing
    # beside, SmolLM2 -dp 2 vs one GPU on 8000 requests (.dummy/requests-8256.json: a rank's share of the work
    # longer than the longest answer's 1,888 sequential steps)
  mkdir -p /tmp/diag
  python3 -c "import json; r = json.load(open('.dummy/requests-8256.json')); json.dump(r[256:8256], open('/tmp/req8000.json', 'w'))"
  (CUDA_VISIBLE_DEVICES=1 timeout 300 python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1 --batches 1,64,256 \
     --new-tokens 32 --repeats 1 --num-scheduler-steps 8 --top-kernels 14 2>&1 | quiet | grep -v "^engine\|INFO" \
     > /tmp/diag/kernels-8b.txt) &
  K=$!
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/dev/probe_pinned_gather.py 2>&1 | quiet | grep -v stack_frame | tee /tmp/diag/probe.txt
  wait $K; cat /tmp/diag/kernels-8b.txt
  run() { echo "-- $*"; timeout $(( 595 - SECONDS )) $B --backend jaxkv "$@" 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" -e nvml | tee -a /tmp/diag/dp-r.txt; }
  run --model $S --requests /tmp/req8000.json --num-prompts 8000 -dp 1
  [ $SECONDS -lt 500 ] && run --model $S --requests /tmp/req8000.json --num-prompts 8000 -dp 2
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
s)  # (session 20) the host tier staged in pinned memory with threaded NumPy copies: its tests compiled on GPU 0, then
    # SmolLM2's multi-turn (off, on) there; GPU 1 at the same time the 8B shape's multi-turn at 128 at once (off, on),
    # then the 8B decode step's kernels with XLA's dot merger off (batch 1 spent 31 % of its step concatenating)
  mkdir -p /tmp/diag /tmp/smollm2
  (CUDA_VISIBLE_DEVICES=1 BIG_CONVERSATIONS=300 BIG_TIMEOUT=330 bash scripts/dev/gpu_multiturn.sh big-wide > /tmp/diag/big-wide.log 2>&1
   cp $OUT/multiturn-big-wide.* /tmp/diag/ 2>/dev/null
   CUDA_VISIBLE_DEVICES=1 XLA_FLAGS=--xla_gpu_dot_merger_threshold_mb=0 timeout $(( 580 - SECONDS )) python3 scripts/dev/bench_mesh_step.py \
     --model llama-3.1-8b --tp 1 --batches 1,64,256 --new-tokens 32 --repeats 1 --num-scheduler-steps 8 --top-kernels 8 2>&1 \
     | quiet | grep -v "^engine\|INFO\|profiler" > /tmp/diag/kernels-8b-nomerge.txt) &
  BIG=$!
  echo '$ pytest tests/jaxkv/core/test_host_kv_pool.py tests/models/test_kv_host_tier.py (GPU 0)'
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/jaxkv/core/test_host_kv_pool.py \
    tests/models/test_kv_host_tier.py 2>&1 | quiet | tail -8 | tee /tmp/diag/tests.txt
  M="scripts/bench_multiturn.py --load-format dummy --conversations .multiturn/conversations.json --nvml-busy"
  sed -n '/^{"architectures"/,/^JSON/p' scripts/dev/gpu_multiturn.sh | grep -v '^JSON' > /tmp/smollm2/config.json
  CUDA_VISIBLE_DEVICES=0 timeout $(( 560 - SECONDS )) python3 $M --model /tmp/smollm2/config.json --num-conversations 200 \
    --max-active 64 --num-gpu-blocks 1536 --kv-offloading-size 8 --modes off,on --output-json /tmp/diag/multiturn-smol.json \
    2>&1 | quiet | grep -v cuda_timer | tee /tmp/diag/multiturn-smol.txt
  wait $BIG; grep -v cuda_timer /tmp/diag/big-wide.log | tail -9; cat /tmp/diag/kernels-8b-nomerge.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
t)  # (session 20) GPU 1: the 8B multi-turn with the writer thread moving offloads into pinned memory (off, on); GPU 0
    # meanwhile: the optimized HLO of the 8B batch-1 decode loop (what its concatenate fusion, 31 % of the step,
    # concatenates); then, nothing beside, SmolLM2 8000 requests: one GPU, -dp 2, -dp 2 with a 1.25x dispatch window
  mkdir -p /tmp/diag /tmp/dump
  (CUDA_VISIBLE_DEVICES=1 BIG_CONVERSATIONS=300 BIG_TIMEOUT=330 bash scripts/dev/gpu_multiturn.sh big-wide > /tmp/diag/big-wide.log 2>&1
   cp $OUT/multiturn-big-wide.* /tmp/diag/ 2>/dev/null) &
  BIG=$!
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" timeout 200 python3 scripts/dev/bench_mesh_step.py \
    --model llama-3.1-8b --tp 1 --batches 1 --new-tokens 8 --repeats 1 --num-scheduler-steps 8 --no-profile 2>&1 | quiet | tail -2
  python3 - <<'PY' 2>&1 | tee /tmp/diag/concat-fusion.txt
import glob, re
for f in sorted(glob.glob("/tmp/dump/*decode*after_optimizations.txt")):
    text = open(f).read()
    for m in re.finditer(r"^\s*(ROOT )?%?(input_concatenate_fusion_30) = [^\n]*", text, re.M):
        line = m.group(0).strip()
        print(f.split("/")[-1][:60], "|", line[:700])
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        if callee:
            body = re.search(r"^%?" + re.escape(callee.group(1)) + r" [^\n]*\{\n(.*?)^\}", text, re.M | re.S)
            print("   " + (body.group(1)[:3000].replace("\n", "\n   ") if body else "(body not found)"))
PY
  ls /tmp/dump | grep -c after_optimizations
  tar -C /tmp/dump -czf /tmp/diag/hlo-decode.tgz $(cd /tmp/dump && ls | grep decode | grep after_optimizations.txt | head -4)
  wait $BIG; grep -v cuda_timer /tmp/diag/big-wide.log | tail -9
  python3 -c "import json; r = json.load(open('.dummy/requests-8256.json')); json.dump(r[256:8256], open('/tmp/req8000.json', 'w'))"
  run() { echo "-- $*"; timeout $(( 595 - SECONDS )) $B --backend jaxkv "$@" 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" | tee -a /tmp/diag/dp-t.txt; }
  [ $SECONDS -lt 430 ] && run --model $S --requests /tmp/req8000.json --num-prompts 8000 -dp 1
  [ $SECONDS -lt 510 ] && run --model $S --requests /tmp/req8000.json --num-prompts 8000 -dp 2
  [ $SECONDS -lt 550 ] && JAXKV_DISPATCH_WINDOW_PER_SEQ=1.25 run --model $S --requests /tmp/req8000.json --num-prompts 8000 -dp 2
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
u)  # (session 20) the 8B decode step at batches 1-16: where XLA stops folding the k/v projections into a loop fusion
    # (batch 1: a 1 x 4096 x 1024 dot fused with RoPE's concatenate took 31 % of the step)
  mkdir -p /tmp/diag
  CUDA_VISIBLE_DEVICES=0 timeout 280 python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1 --batches 1,2,4,8,16 \
    --new-tokens 24 --repeats 1 --num-scheduler-steps 8 --top-kernels 3 2>&1 | quiet | grep -v "^engine\|INFO\|profiler\|warn_once" \
    | tee /tmp/diag/kernels-8b-small.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
v)  # (session 21) GPU 0: the 8B 1000-request run with decode loops of >= 2 rows against 1 row (JAXKV_MIN_DECODE_ROWS=1),
    # one after the other; GPU 1 meanwhile: an 8B layer stack's GEMMs, separate q/k/v + gate/up weights against fused
    # ones, at the rows a step runs, with XLA's defaults, cuBLAS only and the exhaustive Triton tiling search
  mkdir -p /tmp/diag
  (for flags in "" --xla_gpu_enable_triton_gemm=false --xla_gpu_exhaustive_tiling_search=true; do
     echo "-- XLA_FLAGS=$flags"
     CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$flags" timeout 200 python3 scripts/dev/bench_fused_gemm.py 2>&1 | quiet
   done > /tmp/diag/fused-gemm.txt) &
  FG=$!
  for rows in 2 1; do
    echo "-- JAXKV_MIN_DECODE_ROWS=$rows"
    JAXKV_MIN_DECODE_ROWS=$rows CUDA_VISIBLE_DEVICES=0 timeout $(( 590 - SECONDS )) $B --model llama-3.1-8b \
      --requests /tmp/req1000.json --num-prompts 1000 --backend jaxkv --nvml-busy 2>&1 | quiet \
      | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop"
  done | tee /tmp/diag/big-rows.txt
  wait $FG; cat /tmp/diag/fused-gemm.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
w)  # (session 21) issue 27: the server's start with its defaults and the executable cache (jaxkv/worker/executable_cache.py):
    # cold and warm with only JAX's persistent cache, then the executable cache filled from the persistent cache's
    # executables (re-serialized) and used; greedy text compared across the starts; a cProfile of LLM's warm start.
    # Then, both GPUs: SmolLM2 -dp 2 on 8000 requests with the cores bound to their GPU's NUMA node and without.
  mkdir -p /tmp/diag
  python3 -c "import json; r = json.load(open('.dummy/requests-8256.json')); json.dump(r[256:8256], open('/tmp/req8000.json', 'w'))"
  (nvidia-smi topo -m; lscpu | grep -i -e numa -e "^CPU(s)" -e "Model name"
   python3 -c "from jaxkv.engine.core import gpu_local_cpus as g; print('GPU0 local CPUs', sorted(g('0') or [])); print('GPU1 local CPUs', sorted(g('1') or []))") 2>&1 | tee /tmp/diag/topo.txt
  serve_start cold-persistent-only JAXKV_EXECUTABLE_CACHE=0
  serve_start warm-persistent-only JAXKV_EXECUTABLE_CACHE=0
  serve_start warm-fill-executables
  serve_start warm-executables
  serve_start warm-executables-again
  cat > /tmp/llm_start.py <<'PY'
import time, sys
t0 = time.perf_counter()
from models import LLM
llm = LLM(model=sys.argv[1], load_format="dummy")
print(f"LLM ready after {time.perf_counter() - t0:.2f} s:", {k: llm.engine_info[0].get(k) for k in
      ("num_compiles", "executables_loaded", "load_s", "warmup_s", "load_breakdown_s")}, flush=True)
PY
  for i in 1 2; do CUDA_VISIBLE_DEVICES=0 JAXKV_ENABLE_MULTIPROCESSING=0 timeout 120 python3 /tmp/llm_start.py $S 2>&1 | grep "LLM ready" | tee -a /tmp/diag/serve-start.txt; done
  CUDA_VISIBLE_DEVICES=0 JAXKV_ENABLE_MULTIPROCESSING=0 timeout 120 python3 -m cProfile -s cumtime /tmp/llm_start.py $S 2>&1 \
    | grep -e "LLM ready" -e "ncalls" -e "^ *[0-9]" | head -60 > /tmp/diag/llm-warm-profile.txt
  head -3 /tmp/diag/llm-warm-profile.txt
  run() { echo "-- $*"; env "${@:2}" timeout $(( 595 - SECONDS )) $B --backend jaxkv --model $S --requests /tmp/req8000.json \
            --num-prompts 8000 $1 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" -e nvml -e "bound to" | tee -a /tmp/diag/dp-w.txt; }
  run "-dp 1"
  [ $SECONDS -lt 480 ] && run "-dp 2"
  [ $SECONDS -lt 530 ] && run "-dp 2" JAXKV_NUMA_AFFINITY=0
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
x)  # (session 21) GPU 0: the server's and LLM's warm start with every program in JAX's persistent cache (small ones too:
    # the minimum compile time is 0 now also when JAX_COMPILATION_CACHE_DIR is set), then why the executable cache's
    # loads are slow (scripts/dev/probe_exe_load.py); GPU 1 meanwhile: JAX's Mosaic GPU Hopper matmul against XLA on
    # the 8B projections at 256 rows
  mkdir -p /tmp/diag
  (CUDA_VISIBLE_DEVICES=1 timeout 400 python3 scripts/dev/bench_mgpu_matmul.py --rows 256 2>&1 | quiet > /tmp/diag/mgpu-matmul.txt) &
  MM=$!
  echo "JAX cache entries before the first start: $(ls /tmp/jaxcache 2>/dev/null | wc -l)"
  serve_start first
  serve_start warm
  serve_start warm-again
  cat > /tmp/llm_start.py <<'PY'
import time, sys
t0 = time.perf_counter()
from models import LLM
llm = LLM(model=sys.argv[1], load_format="dummy")
print(f"LLM ready after {time.perf_counter() - t0:.2f} s:", {k: llm.engine_info[0].get(k) for k in
      ("num_compiles", "executables_loaded", "load_s", "warmup_s", "load_breakdown_s")}, flush=True)
PY
  for i in 1 2 3; do CUDA_VISIBLE_DEVICES=0 timeout 120 python3 /tmp/llm_start.py $S 2>&1 | grep "LLM ready" | tee -a /tmp/diag/serve-start.txt; done
  serve_start fill-executables JAXKV_EXECUTABLE_CACHE=1
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/dev/probe_exe_load.py /tmp/jaxcache/jaxkv-executables --limit 6 2>&1 | quiet | tee /tmp/diag/exe-load.txt
  wait $MM; cat /tmp/diag/mgpu-matmul.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
y)  # (session 21) GPU 0: the server's and LLM's start with the executable cache loading its programs on threads (as JAX's
    # persistent cache is read by the warm-up's compile threads), against JAX's persistent cache alone, same call
  mkdir -p /tmp/diag
  cat > /tmp/llm_start.py <<'PY'
import time, sys
t0 = time.perf_counter()
from models import LLM
llm = LLM(model=sys.argv[1], load_format="dummy")
print(f"LLM ready after {time.perf_counter() - t0:.2f} s:", {k: llm.engine_info[0].get(k) for k in
      ("num_compiles", "executables_loaded", "load_s", "warmup_s", "load_breakdown_s")}, flush=True)
PY
  echo "JAX cache entries before the first start: $(ls /tmp/jaxcache 2>/dev/null | wc -l)"
  serve_start first-with-executables JAXKV_EXECUTABLE_CACHE=1
  serve_start warm-executables JAXKV_EXECUTABLE_CACHE=1
  serve_start warm-persistent-only JAXKV_EXECUTABLE_CACHE=0
  serve_start warm-executables-again JAXKV_EXECUTABLE_CACHE=1
  serve_start warm-persistent-only-again JAXKV_EXECUTABLE_CACHE=0
  for e in 1 1 1 0 0; do CUDA_VISIBLE_DEVICES=0 JAXKV_EXECUTABLE_CACHE=$e timeout 150 python3 /tmp/llm_start.py $S 2>&1 | grep "LLM ready" \
    | sed "s/^/JAXKV_EXECUTABLE_CACHE=$e /" | tee -a /tmp/diag/serve-start.txt; done
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
z)  # (session 21) SmolLM2 -dp 2 against one GPU on 8000 requests, twice, interleaved (one GPU, -dp 2, one GPU, -dp 2)
  mkdir -p /tmp/diag
  python3 -c "import json; r = json.load(open('.dummy/requests-8256.json')); json.dump(r[256:8256], open('/tmp/req8000.json', 'w'))"
  run() { echo "-- $*"; timeout $(( 395 - SECONDS )) $B --backend jaxkv --model $S --requests /tmp/req8000.json \
            --num-prompts 8000 "$@" 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "per rank" | tee -a /tmp/diag/dp-z.txt; }
  run -dp 1
  run -dp 2
  [ $SECONDS -lt 320 ] && run -dp 1
  [ $SECONDS -lt 355 ] && run -dp 2
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
z2)  # (session 21) the executable cache with both GPUs visible and one rank (dp=1): LLM cold (fills it), then warm
    # (loads it); greedy tokens of 16 ShareGPT prompts compared (stage z's second one-GPU run had failed there)
  mkdir -p /tmp/diag
  cat > /tmp/llm_tokens.py <<'PY'
import json, sys, time
t0 = time.perf_counter()
from models import LLM
from jaxkv import SamplingParams
llm = LLM(model=sys.argv[1], load_format="dummy")
info = llm.engine_info[0]
print(f"{sys.argv[2]}: ready after {time.perf_counter() - t0:.2f} s, executables_loaded={info.get('executables_loaded')}, "
      f"warmup_s={info.get('warmup_s')}", flush=True)
prompts = [r[0] for r in json.load(open(".dummy/requests.json"))[:16]]
out = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
json.dump([o.outputs[0].token_ids for o in out], open(f"/tmp/diag/tokens-{sys.argv[2]}.json", "w"))
PY
  for tag in cold warm; do timeout 150 python3 /tmp/llm_tokens.py $S $tag 2>&1 | grep -e "ready after" -e Error | tee -a /tmp/diag/z2.txt; done
  python3 -c "import json; a, b = (json.load(open(f'/tmp/diag/tokens-{t}.json')) for t in ('cold', 'warm')); print('greedy tokens equal:', a == b, len(a), 'prompts')" | tee -a /tmp/diag/z2.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
aa)  # (session 22, one GPU) an 8B layer stack's GEMMs in PyTorch (cuBLAS in a CUDA graph, what a vLLM-like engine gets)
    # against JAX at the rows a step runs; JAX with every layer on layer 0's weights (L2); XLA GEMM flags at 128-512
    # rows; then the 8B 1000-request run with the defaults on this GPU
  mkdir -p /tmp/diag
  R=2,64,128,256,512,1024,8192
  (echo "-- torch"; timeout 120 python3 scripts/dev/bench_fused_gemm.py --impl torch --rows $R 2>&1 | quiet
   echo "-- jax"; timeout 150 python3 scripts/dev/bench_fused_gemm.py --rows $R 2>&1 | quiet
   echo "-- jax, shared weights"; timeout 90 python3 scripts/dev/bench_fused_gemm.py --rows 128,256,512 --shared-weights \
     --variants separate 2>&1 | quiet
   echo "-- torch, shared weights"; timeout 60 python3 scripts/dev/bench_fused_gemm.py --impl torch --rows 128,256,512 \
     --shared-weights --variants separate 2>&1 | quiet
   for flags in --xla_gpu_autotune_level=0 --xla_gpu_enable_cublaslt=true --xla_gpu_enable_split_k_autotuning=false \
       --xla_gpu_single_wave_autotuning=false; do
     echo "-- jax XLA_FLAGS=$flags"
     XLA_FLAGS="$flags" timeout 60 python3 scripts/dev/bench_fused_gemm.py --rows 128,256,512 --variants separate 2>&1 | quiet | tail -4
   done) | tee /tmp/diag/gemm-stack.txt
  echo "== 8B, 1000 requests, LLM defaults" | tee /tmp/diag/big.txt
  timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 --backend jaxkv \
    --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" | tee -a /tmp/diag/big.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ab)  # (session 22, one GPU) the kernels of the 8B GEMM stack at 256 and 512 rows: PyTorch (cuBLAS), JAX with XLA's
    # defaults, JAX with cuBLAS only; JAX without command buffers (timing)
  mkdir -p /tmp/diag
  K="scripts/dev/bench_fused_gemm.py --rows 256,512 --variants separate --kernel-rows 256,512 --top-kernels 14"
  (echo "-- torch"; timeout 120 python3 $K --impl torch 2>&1 | quiet
   echo "-- jax"; timeout 120 python3 $K 2>&1 | quiet
   echo "-- jax, XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"
   XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 120 python3 $K 2>&1 | quiet
   echo "-- jax, XLA_FLAGS=--xla_gpu_enable_command_buffer="
   XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 90 python3 scripts/dev/bench_fused_gemm.py --rows 256,512 \
     --variants separate 2>&1 | quiet) | grep -v "profiler.py\|_warn_once" | tee /tmp/diag/gemm-kernels.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ac)  # (session 22, one GPU) the Mosaic decode kernel's balanced deal (longest first, snake): its tests compiled, the
    # kernel at the 8B run's decode batches (in order / balanced / equal lengths), then the 8B 1000-request run with
    # the balanced deal (the default) and in batch order (JAXKV_MGPU_DECODE_BALANCE=0), one after the other
  mkdir -p /tmp/diag
  timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/pallas_kernels/test_paged_attention_mgpu.py 2>&1 \
    | quiet | tail -8 | tee /tmp/diag/mgpu-tests.txt
  timeout 150 python3 scripts/dev/bench_decode_balance.py --requests /tmp/req1000.json 2>&1 | quiet \
    | grep -v "profiler.py\|_warn_once" | tee /tmp/diag/decode-balance.txt
  for bal in 1 0; do
    echo "== 8B, 1000 requests, LLM defaults, JAXKV_MGPU_DECODE_BALANCE=$bal" | tee -a /tmp/diag/big-balance.txt
    JAXKV_MGPU_DECODE_BALANCE=$bal timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests /tmp/req1000.json \
      --num-prompts 1000 --backend jaxkv --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml \
      | tee -a /tmp/diag/big-balance.txt
  done
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ad)  # (session 22, one GPU) the 8B engine's decode step kernels at 256 and 64 rows (prompts of 32 tokens, 64 new
    # tokens; prefill kernels show ~1 call a step), to set beside stage ab's PyTorch GEMM stack on the same GPU
  mkdir -p /tmp/diag
  timeout 400 python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1 --batches 256,64 --prompt-len 32 \
    --new-tokens 64 --repeats 1 --num-scheduler-steps 8 --top-kernels 22 2>&1 | quiet \
    | grep -v "^engine\|INFO\|profiler\|warn_once" | tee /tmp/diag/kernels-8b-256.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ae)  # (session 22, one GPU) XLA's dot merger off (--xla_gpu_dot_merger_threshold_mb=0): the 8B decode kernels at
    # 256 rows, then the 8B 1000-request run with it and with the defaults, one after the other
  mkdir -p /tmp/diag
  XLA_FLAGS=--xla_gpu_dot_merger_threshold_mb=0 timeout 150 python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b \
    --tp 1 --batches 256 --prompt-len 32 --new-tokens 64 --repeats 1 --num-scheduler-steps 8 --top-kernels 10 2>&1 \
    | quiet | grep -v "^engine\|INFO\|profiler\|warn_once" | tee /tmp/diag/kernels-8b-256-nomerge.txt
  for flags in --xla_gpu_dot_merger_threshold_mb=0 ""; do
    echo "== 8B, 1000 requests, LLM defaults, XLA_FLAGS=$flags" | tee -a /tmp/diag/big-merge.txt
    XLA_FLAGS="$flags" timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests /tmp/req1000.json \
      --num-prompts 1000 --backend jaxkv --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml \
      | tee -a /tmp/diag/big-merge.txt
  done
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
af)  # (session 23, one GPU) the 8B 1000-request run with the defaults on the usual requests (SmolLM2-tokenized) and
    # on vLLM's sampling rule with Llama 3's own tokenizer (.dummy/requests-llama3.json: bench_throughput.py
    # --tokenizer .dummy/llama3-tokenizer --save-requests, seed 0); then the latter in-process under the profiler:
    # device time by kernel over the whole run
  mkdir -p /tmp/diag
  for req in /tmp/req1000.json .dummy/requests-llama3.json; do
    echo "== 8B, $req, LLM defaults" | tee -a /tmp/diag/big.txt
    timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests $req --num-prompts 1000 --backend jaxkv \
      --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" -e "unfinished" \
      | tee -a /tmp/diag/big.txt
  done
  echo "== 8B, .dummy/requests-llama3.json, in-process, --profile-busy" | tee /tmp/diag/big-profile.txt
  JAXKV_PROFILE_TOP=60 timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests .dummy/requests-llama3.json \
    --num-prompts 1000 --backend jaxkv-inproc --profile-busy 2>&1 | quiet | grep -v "INFO\|warn_once" \
    | tee -a /tmp/diag/big-profile.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ag)  # (session 23, one GPU; the split was reverted after stage ah measured it level) a mixed step's one-token rows on
    # the Mosaic decode kernel (jaxkv.attention.dispatch._decode_rows_apart, commit 2c272b6):
    # the op test compiled; the 8B run (vLLM's rule, Llama 3 tokens) with it and without (JAXKV_MIXED_DECODE_APART=0),
    # one after the other; its kernel profile; then XLA's exhaustive Triton GEMM tiling search at 256 and 64 rows
  mkdir -p /tmp/diag
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/jaxkv/attention/test_dispatch.py -k decode_rows_apart -rs \
    2>&1 | quiet | tail -6 | tee /tmp/diag/apart-tests.txt
  for apart in 1 0; do
    echo "== 8B, .dummy/requests-llama3.json, LLM defaults, JAXKV_MIXED_DECODE_APART=$apart" | tee -a /tmp/diag/big-apart.txt
    JAXKV_MIXED_DECODE_APART=$apart timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b \
      --requests .dummy/requests-llama3.json --num-prompts 1000 --backend jaxkv --nvml-busy 2>&1 | quiet \
      | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" | tee -a /tmp/diag/big-apart.txt
  done
  echo "== the same, in-process, --profile-busy (apart)" | tee /tmp/diag/big-profile-apart.txt
  JAXKV_PROFILE_TOP=24 timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests .dummy/requests-llama3.json \
    --num-prompts 1000 --backend jaxkv-inproc --profile-busy 2>&1 | quiet | grep -e "  [0-9]" -e "done:" -e "busy" \
    | tee -a /tmp/diag/big-profile-apart.txt
  for flags in "" --xla_gpu_exhaustive_tiling_search=true; do
    echo "== 8B decode step kernels, XLA_FLAGS=$flags" | tee -a /tmp/diag/kernels-tiling.txt
    XLA_FLAGS="$flags" timeout $(( 595 - SECONDS )) python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1 \
      --batches 256,64 --prompt-len 32 --new-tokens 64 --repeats 1 --num-scheduler-steps 8 --top-kernels 8 2>&1 \
      | quiet | grep -v "^engine\|INFO\|profiler\|warn_once" | tee -a /tmp/diag/kernels-tiling.txt
  done
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ah)  # (session 23, one GPU) stage ag again after the fix (the packed step inputs 256-byte aligned): the op test compiled;
    # the 8B run with the decode rows apart and without; its kernel profile; XLA's exhaustive GEMM tiling search
  mkdir -p /tmp/diag
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/jaxkv/attention/test_dispatch.py \
    tests/jaxkv/worker/test_step_input_packing.py -rs > /tmp/diag/apart-tests.txt 2>&1; echo "pytest rc $?" >> /tmp/diag/apart-tests.txt
  tail -5 /tmp/diag/apart-tests.txt
  for apart in 1 0; do
    echo "== 8B, .dummy/requests-llama3.json, LLM defaults, JAXKV_MIXED_DECODE_APART=$apart" | tee -a /tmp/diag/big-apart.txt
    JAXKV_MIXED_DECODE_APART=$apart timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b \
      --requests .dummy/requests-llama3.json --num-prompts 1000 --backend jaxkv --nvml-busy > /tmp/diag/run-$apart.log 2>&1
    grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" -e "Error" /tmp/diag/run-$apart.log | tee -a /tmp/diag/big-apart.txt
  done
  echo "== the same, in-process, --profile-busy (apart)" | tee /tmp/diag/big-profile-apart.txt
  JAXKV_PROFILE_TOP=24 timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests .dummy/requests-llama3.json \
    --num-prompts 1000 --backend jaxkv-inproc --profile-busy 2>&1 | quiet | grep -e "  [0-9]" -e "done:" -e "busy" \
    -e Error | tee -a /tmp/diag/big-profile-apart.txt
  for flags in "" --xla_gpu_exhaustive_tiling_search=true; do
    echo "== 8B decode step kernels, XLA_FLAGS=$flags" | tee -a /tmp/diag/kernels-tiling.txt
    XLA_FLAGS="$flags" timeout $(( 595 - SECONDS )) python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1 \
      --batches 256,64 --prompt-len 32 --new-tokens 64 --repeats 1 --num-scheduler-steps 8 --top-kernels 8 2>&1 \
      | quiet | grep -v "^engine\|INFO\|profiler\|warn_once" | tail -22 | tee -a /tmp/diag/kernels-tiling.txt
  done
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ai)  # (session 23, one GPU) XLA's block-level fusion rewriter (Triton fusions of a reduction and its elementwise users:
    # the RMSNorm's reduce and apply in one kernel) at the 8B decode step's 256 and 64 rows, then the 8B run (vLLM's
    # rule, Llama 3 tokens) with it and without, one after the other
  mkdir -p /tmp/diag
  BL=--xla_gpu_experimental_enable_fusion_block_level_rewriter=true
  for flags in "" $BL; do
    echo "== 8B decode step kernels, XLA_FLAGS=$flags" | tee -a /tmp/diag/kernels-blocklevel.txt
    XLA_FLAGS="$flags" timeout 150 python3 scripts/dev/bench_mesh_step.py --model llama-3.1-8b --tp 1 \
      --batches 256 --prompt-len 32 --new-tokens 64 --repeats 1 --num-scheduler-steps 8 --top-kernels 16 2>&1 \
      | quiet | grep -v "^engine\|INFO\|profiler\|warn_once" | tail -40 | tee -a /tmp/diag/kernels-blocklevel.txt
  done
  for flags in $BL ""; do
    echo "== 8B, .dummy/requests-llama3.json, LLM defaults, XLA_FLAGS=$flags" | tee -a /tmp/diag/big-blocklevel.txt
    XLA_FLAGS="$flags" timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests .dummy/requests-llama3.json \
      --num-prompts 1000 --backend jaxkv --nvml-busy > /tmp/diag/run-bl-${flags:+on}.log 2>&1
    grep -e "^jaxkv " -e "start-up" -e nvml -e "Error" /tmp/diag/run-bl-${flags:+on}.log | tee -a /tmp/diag/big-blocklevel.txt
  done
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
aj)  # (session 23, one GPU) a mixed step's leading one-token rows on the Mosaic decode kernel, the rest on the Triton
    # prefill kernel with query_start_loc starting past them (jaxkv.attention.dispatch._leading_decodes_apart; the scheduler puts
    # them first): the tests compiled; the 8B run (vLLM's rule, Llama 3 tokens) with it and without
    # (JAXKV_MIXED_DECODES_APART=0), one after the other; the kernel profile of a run with it
  mkdir -p /tmp/diag
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/jaxkv/attention/test_dispatch.py \
    tests/pallas_kernels/test_paged_prefill_kernel.py -rs > /tmp/diag/tests.txt 2>&1; echo "pytest rc $?" >> /tmp/diag/tests.txt
  tail -4 /tmp/diag/tests.txt
  for apart in 1 0; do
    echo "== 8B, .dummy/requests-llama3.json, LLM defaults, JAXKV_MIXED_DECODES_APART=$apart" | tee -a /tmp/diag/big.txt
    JAXKV_MIXED_DECODES_APART=$apart timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b \
      --requests .dummy/requests-llama3.json --num-prompts 1000 --backend jaxkv --nvml-busy > /tmp/diag/run-$apart.log 2>&1
    grep -e "^jaxkv " -e "start-up" -e nvml -e "Error" /tmp/diag/run-$apart.log | tee -a /tmp/diag/big.txt
  done
  echo "== the same, in-process, --profile-busy (apart)" | tee /tmp/diag/big-profile.txt
  JAXKV_PROFILE_TOP=30 timeout $(( 595 - SECONDS )) $B --model llama-3.1-8b --requests .dummy/requests-llama3.json \
    --num-prompts 1000 --backend jaxkv-inproc --profile-busy 2>&1 | quiet | grep -e "  [0-9]" -e "done:" -e "busy" \
    -e Error | tee -a /tmp/diag/big-profile.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
ak)  # (session 23, one GPU) stage aj's tests compiled, one file at a time with its own time limit (the interpreter
    # variants are skipped on a GPU)
  mkdir -p /tmp/diag
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/jaxkv/attention/test_dispatch.py -k "leading" -rs \
    > /tmp/diag/tests-routing.txt 2>&1; echo "pytest rc $?" >> /tmp/diag/tests-routing.txt
  tail -5 /tmp/diag/tests-routing.txt
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_paged_prefill_kernel.py -rs \
    > /tmp/diag/tests-prefill.txt 2>&1; echo "pytest rc $?" >> /tmp/diag/tests-prefill.txt
  tail -5 /tmp/diag/tests-prefill.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
al)  # (session 23, one GPU) where the Triton prefill kernel's time goes in the 8B run's mixed steps: the kernel at the
    # 8B heads with every row, with the leading decodes removed, with the prompts alone in 16 rows; the Mosaic decode
    # kernel on the decode rows
  mkdir -p /tmp/diag
  timeout 240 python3 scripts/dev/bench_mixed_attention.py --model-shape llama-8b 2>&1 | quiet \
    | grep -v "profiler.py\|_warn_once" | tee /tmp/diag/mixed-forms.txt
  tar -C /tmp -czf $OUT/diag.tgz diag
  ;;
*) echo "stage: a | b | c | d | e | f | g | h | i | j | k | l | m | n | o | q | r | s | t | u | v | w | x | y | z | z2 | aa | ab | ac | ad | ae | af | ag | ah | ai | aj | ak | al"; exit 2 ;;
esac
