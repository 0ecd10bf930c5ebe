#!/usr/bin/env bash
# Issue 27's GPU evidence (engine-core processes), one device-tool call per stage on an H100 pair
# (nvidia-h100-x2). Carries .whl (server/bench wheels, pyzmq, msgspec, gguf, nvidia-ml-py) and .dummy
# (header-only GGUFs: SmolLM2 and a Llama-3-8B shape; requests.json sampled by
#  `bench_serving.py --sample-only --num-prompts 1000 --request-rate inf,0.5x,0.9x,inf --warmup-requests 256`).
#   stage smol : SmolLM2 (random weights): offline LLM defaults, engine-core process (cold start) and
#                in-process engine; serve.py warm start + bench_serving (openai client) at inf, 0.5x, 0.9x on
#                the same requests; -dp 2 vs one GPU on 3000 requests; greedy text -dp 2 vs one GPU.
#   stage smol2: the same offline run, then the server at three rates on its requests in the same call,
#                max_num_batched_tokens 2048 vs 8192, greedy -dp 2 vs one GPU in float32.
#   stage v2-v5: session 16 (v5 = the next session's first call: --api-server-count 1 vs 2, float32 greedy).
#   stage big  : llama-3.1-8b (built-in config, dummy weights): 1000 requests on one GPU, then 2000 requests
#                on one GPU vs -dp 2.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
python3 - <<'PY'
import json
r = json.load(open(".dummy/requests.json"))
json.dump(r[256:1256], open("/tmp/req1000.json", "w"))   # = bench_serving's inf run
json.dump(r[256:2256], open("/tmp/req2000.json", "w"))
json.dump(r[256:3256], open("/tmp/req3000.json", "w"))
PY
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "Unable to initialize backend"; }
S=.dummy/smollm2-header.gguf
L=.dummy/llama8b-header.gguf
B="python3 scripts/bench_throughput.py --load-format dummy --no-progress"
start_server() {  # SmolLM2 server on GPU 0, log to $1 (more serve.py flags after it); waits for /health 200 and
  # writes the time to $OUT/serve-start.txt
  local t0=$(date +%s.%N) log=$1
  shift
  CUDA_VISIBLE_DEVICES=0 python3 scripts/serve.py --model $S --load-format dummy --served-model-name smollm2 \
    --port 8000 --no-compile-top-k-top-p --log-stats-interval 5 "$@" > $log 2>&1 &
  SERVER=$!
  until curl -sf localhost:8000/health >/dev/null; do sleep 0.2; kill -0 $SERVER || break; done
  echo "server ready (warm start): $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee $OUT/serve-start.txt
}
case $1 in
smol)
  echo "== offline, 1 GPU: LLM defaults (engine-core process, cold start), then the in-process engine"
  CUDA_VISIBLE_DEVICES=0 timeout 240 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --backend jaxkv-inproc --nvml-busy --output-json $OUT/offline.json 2>&1 | quiet | tee $OUT/offline.txt | grep -v "^engine\|^LLM"
  echo "== server, 1 GPU (warm start), bench_serving with the openai client"
  start_server $OUT/server.log
  timeout 200 python3 scripts/bench_serving.py --requests .dummy/requests.json --num-prompts 1000 \
    --request-rate inf,0.5x,0.9x --warmup-requests 256 --client-processes 6 --markdown \
    --result-json $OUT/serving.json 2>&1 | quiet | tee $OUT/serving.txt | tail -8
  t1=$(date +%s.%N); kill -TERM $SERVER; wait $SERVER; echo "server exit code $? after SIGTERM in $(python3 -c "print(round($(date +%s.%N) - $t1, 1))") s; core processes left: $(pgrep -fc jaxkv.engine.core)" | tee -a $OUT/serve-start.txt
  echo "== data parallel: 3000 requests, one GPU vs -dp 2"
  for dp in 1 2; do
    timeout 150 $B --model $S --requests /tmp/req3000.json --num-prompts 3000 --backend jaxkv -dp $dp \
      --output-json $OUT/dp$dp.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "^done" | tee -a $OUT/dp.txt
  done
  echo "== greedy text, -dp 2 vs one GPU (bf16, 256 prompts x 128 tokens)"
  timeout 120 python3 scripts/dev/compare_greedy.py --model $S --load-format dummy --requests /tmp/req1000.json \
    --num-prompts 256 --max-tokens 128 --a data_parallel_size=1 --b data_parallel_size=2 2>&1 | quiet | grep -v "^engine\|^LLM\|INFO" | tee $OUT/greedy-dp.txt | head -12
  ;;
smol2)
  echo "== offline, 1 GPU: LLM defaults (engine-core process, cold start)"
  CUDA_VISIBLE_DEVICES=0 timeout 200 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --nvml-busy --output-json $OUT/offline.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "^done" -e nvml | tee $OUT/offline.txt
  echo "== server, 1 GPU (warm start), bench_serving with the openai client, same requests"
  start_server /tmp/server.log
  timeout 200 python3 scripts/bench_serving.py --requests .dummy/requests.json --num-prompts 1000 \
    --request-rate inf,0.5x,0.9x --warmup-requests 256 --client-processes 6 --markdown \
    --result-json $OUT/serving.json 2>&1 | quiet > /tmp/serving.txt; tail -8 /tmp/serving.txt | tee $OUT/serving-table.txt
  grep -e "Output token throughput" -e "Failed" -e "error" /tmp/serving.txt | head -12
  t1=$(date +%s.%N); kill -TERM $SERVER; wait $SERVER; echo "server exit code $? after SIGTERM in $(python3 -c "print(round($(date +%s.%N) - $t1, 1))") s; core processes left: $(pgrep -fc jaxkv.engine.core)" | tee -a $OUT/serve-start.txt
  grep -e "Avg prompt" /tmp/server.log | tail -3
  echo "== max_num_batched_tokens 2048 vs 8192, 3000 requests, 1 GPU"
  for t in 2048 8192; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 $B --model $S --requests /tmp/req3000.json --num-prompts 3000 --backend jaxkv \
      --max-num-batched-tokens $t --nvml-busy --output-json $OUT/mbt$t.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" | tee -a $OUT/mbt.txt
  done
  echo "== greedy text, -dp 2 vs one GPU, float32"
  timeout 150 python3 scripts/dev/compare_greedy.py --model $S --load-format dummy --requests /tmp/req1000.json \
    --num-prompts 128 --max-tokens 64 --dtype float32 --a data_parallel_size=1,max_num_seqs=64,compile_ahead=off \
    --b data_parallel_size=2,max_num_seqs=64,compile_ahead=off 2>&1 | quiet | grep -v "^engine\|^LLM\|INFO" | tee $OUT/greedy-dp-f32.txt | head -12
  ;;
ab)  # new code on GPU 0 vs the pre-merge tree (.old = git archive d72f1e2) on GPU 1, at once; then the server on
  # GPU 0 while llama-3.1-8b runs on GPU 1
  (cd .old && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site:$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache-old timeout 240 \
     python3 scripts/bench_throughput.py --load-format dummy --no-progress --model ../$S --requests /tmp/req1000.json \
     --num-prompts 1000 --backend jaxkv 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "host loop" > $OUT/old.txt) &
  OLD=$!
  CUDA_VISIBLE_DEVICES=0 timeout 240 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --nvml-busy --output-json $OUT/offline.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" | tee $OUT/offline.txt
  wait $OLD; echo "-- old tree:"; cat $OUT/old.txt
  (CUDA_VISIBLE_DEVICES=1 timeout 330 $B --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 \
     --backend jaxkv --output-json $OUT/big1000.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "host loop" > $OUT/big.txt) &
  BIG=$!
  start_server /tmp/server.log
  timeout 150 python3 scripts/bench_serving.py --requests .dummy/requests.json --num-prompts 1000 \
    --request-rate inf,0.9x --warmup-requests 256 --client-processes 6 --markdown \
    --result-json $OUT/serving.json 2>&1 | quiet > /tmp/serving.txt; tail -5 /tmp/serving.txt | tee $OUT/serving-table.txt
  kill -TERM $SERVER; wait $SERVER
  grep -e "Avg prompt" /tmp/server.log | tail -4 > $OUT/server-stats.txt
  wait $BIG; echo "-- llama-3.1-8b:"; cat $OUT/big.txt
  ;;
big)
  echo "== llama-3.1-8b (built-in config, dummy weights made on the device), 1000 requests, 1 GPU, LLM defaults"
  CUDA_VISIBLE_DEVICES=0 timeout 330 $B --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --nvml-busy --output-json $OUT/big1000.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "^done" -e nvml -e "host loop" | tee $OUT/big.txt
  echo "== 2000 requests: one GPU vs -dp 2 (per-rank defaults)"
  for dp in 1 2; do
    timeout 200 $B --model llama-3.1-8b --requests /tmp/req2000.json --num-prompts 2000 --backend jaxkv -dp $dp \
      --output-json $OUT/big-dp$dp.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e "^done" | tee -a $OUT/big.txt
  done
  ;;
v2)  # session 16: the defaults (max_num_batched_tokens 8192 on GPU), SmolLM2 on GPU 0 (offline with the
  # in-process engine beside it, the server at three rates on the same requests, 3000 requests), Llama-3.1-8B
  # on GPU 1 at the same time (1000 and 2000 requests), then Llama -dp 2 on both
  (CUDA_VISIBLE_DEVICES=1 timeout 330 $B --model llama-3.1-8b --requests /tmp/req1000.json --num-prompts 1000 \
     --backend jaxkv --nvml-busy --output-json $OUT/big1000.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" > $OUT/big.txt
   CUDA_VISIBLE_DEVICES=1 timeout 200 $B --model llama-3.1-8b --requests /tmp/req2000.json --num-prompts 2000 \
     --backend jaxkv --output-json $OUT/big-dp1.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" >> $OUT/big.txt) &
  BIG=$!
  echo "== SmolLM2 offline, 1 GPU, 1000 requests: LLM defaults (engine-core process, cold start), in-process engine"
  CUDA_VISIBLE_DEVICES=0 timeout 240 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --backend jaxkv-inproc --nvml-busy --output-json $OUT/offline.json 2>&1 | quiet | grep -e "^jaxkv" -e "start-up" -e nvml -e "host loop" -e "^backend" | tee $OUT/offline.txt
  start_server /tmp/server.log
  grep -e "start-up\|ready" /tmp/server.log | head -3 | tee -a $OUT/serve-start.txt
  timeout 200 python3 scripts/bench_serving.py --requests .dummy/requests.json --num-prompts 1000 \
    --request-rate inf,0.5x,0.9x --warmup-requests 256 --client-processes 6 --markdown \
    2>&1 | quiet > /tmp/serving.txt; tail -6 /tmp/serving.txt | tee $OUT/serving-table.txt
  grep -e "Failed" /tmp/serving.txt | head -3
  t1=$(date +%s.%N); kill -TERM $SERVER; wait $SERVER; echo "server exit code $? after SIGTERM in $(python3 -c "print(round($(date +%s.%N) - $t1, 1))") s; core processes left: $(pgrep -fc jaxkv.engine.core)" | tee -a $OUT/serve-start.txt
  echo "== SmolLM2 offline, 3000 requests, defaults"
  CUDA_VISIBLE_DEVICES=0 timeout 120 $B --model $S --requests /tmp/req3000.json --num-prompts 3000 --backend jaxkv \
    --nvml-busy --output-json $OUT/smol3000.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml -e "host loop" | tee $OUT/smol3000.txt
  wait $BIG; echo "== llama-3.1-8b, 1 GPU:"; cat $OUT/big.txt
  echo "== llama-3.1-8b, 2000 requests, -dp 2"
  timeout 200 $B --model llama-3.1-8b --requests /tmp/req2000.json --num-prompts 2000 --backend jaxkv -dp 2 \
    --output-json $OUT/big-dp2.json 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" | tee -a $OUT/big.txt
  ;;
v3)  # session 16: where a Llama-3.1-8B step's time goes (in-process engine, JAX profiler trace, top kernels);
  # greedy text tp=2 vs tp=1 at 8B and -dp 2 vs one GPU (SmolLM2), both float32
  echo "== llama-3.1-8b, 1000 requests, in-process engine, --profile-busy (top kernels)"
  CUDA_VISIBLE_DEVICES=0 JAXKV_PROFILE_TOP=25 timeout 210 $B --model llama-3.1-8b --requests /tmp/req1000.json \
    --num-prompts 1000 --backend jaxkv-inproc --profile-busy 2>&1 | quiet | grep -v "^engine\|INFO" | tail -45 | tee $OUT/big-profile.txt
  echo "== greedy text, llama-3.1-8b tp=2 vs tp=1, float32"
  timeout 250 python3 scripts/dev/compare_greedy.py --model llama-3.1-8b --load-format dummy --requests /tmp/req1000.json \
    --num-prompts 32 --max-tokens 16 --dtype float32 \
    --a tensor_parallel_size=1,max_num_seqs=32,max_model_len=2048,compile_ahead=off \
    --b tensor_parallel_size=2,max_num_seqs=32,max_model_len=2048,compile_ahead=off 2>&1 | quiet | grep -v "^engine\|^LLM\|INFO" | tee $OUT/greedy-tp-f32.txt | tail -12
  echo "== greedy text, SmolLM2 -dp 2 vs one GPU, float32"
  timeout 150 python3 scripts/dev/compare_greedy.py --model $S --load-format dummy --requests /tmp/req1000.json \
    --num-prompts 64 --max-tokens 32 --dtype float32 --a data_parallel_size=1,max_num_seqs=64,compile_ahead=off \
    --b data_parallel_size=2,max_num_seqs=64,compile_ahead=off 2>&1 | quiet | grep -v "^engine\|^LLM\|INFO" | tee $OUT/greedy-dp-f32.txt | tail -12
  ;;
v4)  # session 16: Llama-3.1-8B with XLA's Triton GEMM fusions (default) on GPU 0 vs cuBLAS only
  # (--xla_gpu_enable_triton_gemm=false) on GPU 1, at once, cold; then greedy SmolLM2 -dp 2 vs 1 in float32
  # (the A/B is gpu_evidence.sh's stage h since session 17: big-default.txt / big-flag.txt = the logs'
  # s16-run4-big-triton.txt / s16-run4-big-cublas.txt)
  bash scripts/dev/gpu_evidence.sh h --xla_gpu_enable_triton_gemm=false
  echo "== greedy text, SmolLM2 -dp 2 vs one GPU, float32"
  timeout 220 python3 scripts/dev/compare_greedy.py --model $S --load-format dummy --requests /tmp/req1000.json \
    --num-prompts 64 --max-tokens 32 --dtype float32 --a data_parallel_size=1,max_num_seqs=64,compile_ahead=off \
    --b data_parallel_size=2,max_num_seqs=64,compile_ahead=off 2>&1 | quiet | grep -v "^engine\|^LLM\|INFO\|^\*\|slow_op\|Very slow\|^$" | tee $OUT/greedy-dp-f32.txt | tail -12
  ;;
v5)  # next session: the server at rate inf with one and with two API-server processes (httptools + uvloop now
  # in .whl) against the offline engine on the same requests; warm start with the per-shape dummy init; greedy
  # float32 -dp 2 vs one GPU (SmolLM2) and tp=2 vs tp=1 (llama-3.1-8b)
  CUDA_VISIBLE_DEVICES=0 timeout 200 $B --model $S --requests /tmp/req1000.json --num-prompts 1000 \
    --backend jaxkv --nvml-busy 2>&1 | quiet | grep -e "^jaxkv " -e "start-up" -e nvml | tee $OUT/offline.txt
  for n in 1 2; do
    start_server /tmp/server$n.log --api-server-count $n
    cp $OUT/serve-start.txt $OUT/serve-start-asc$n.txt
    timeout 150 python3 scripts/bench_serving.py --requests .dummy/requests.json --num-prompts 1000 \
      --request-rate inf,0.9x --warmup-requests 256 --client-processes 8 --markdown 2>&1 | quiet > /tmp/serving.txt
    tail -4 /tmp/serving.txt | tee $OUT/serving-asc$n.txt
    kill -TERM $SERVER; wait $SERVER; echo "exit $? ; processes left: $(pgrep -fc 'serve.py|core_proc')"
  done
  timeout 150 python3 scripts/dev/compare_greedy.py --model $S --load-format dummy --requests /tmp/req1000.json \
    --num-prompts 64 --max-tokens 32 --dtype float32 --a data_parallel_size=1,max_num_seqs=64,compile_ahead=off \
    --b data_parallel_size=2,max_num_seqs=64,compile_ahead=off 2>&1 | quiet | grep -v "^engine\|^LLM\|INFO" | tee $OUT/greedy-dp-f32.txt | tail -6
  timeout 200 python3 scripts/dev/compare_greedy.py --model llama-3.1-8b --load-format dummy --requests /tmp/req1000.json \
    --num-prompts 32 --max-tokens 16 --dtype float32 \
    --a tensor_parallel_size=1,max_num_seqs=32,max_model_len=2048,compile_ahead=off \
    --b tensor_parallel_size=2,max_num_seqs=32,max_model_len=2048,compile_ahead=off 2>&1 | quiet | grep -v "^engine\|^LLM\|INFO" | tee $OUT/greedy-tp-f32.txt | tail -6
  ;;
esac
ls -la /tmp/jaxcache | head -3; du -sh /tmp/jaxcache
