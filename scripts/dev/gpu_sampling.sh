#!/usr/bin/env bash
# Issues 43 (item 5) and 44 (item 5) on one GPU: SmolLM2 shapes with random weights (.dummy/smollm2-header.gguf),
# ShareGPT requests tokenized by SmolLM2 (.dummy/requests-3000.json, from `jaxkv bench throughput
# --save-requests`), LLM and server defaults. Carry .whl .dummy (and .baseline for STAGE=sampling).
#   STAGE=sampling: 3000 requests: the code before the sampling work (.baseline = `git archive 9d32cad`) and this
#     tree, plain (skipped when .baseline is not carried); this tree with logprobs=5, with penalties (presence 0.5, frequency 0.5, repetition 1.1) on every
#     request, and n=8 over the first 375 prompts (3000 sequences); this tree plain again (the spread).
#     RUNS="plain logprobs5 ..." picks some of them (default all five).
#   STAGE=server: 1000 requests offline (LLM), then `jaxkv serve` (its defaults: two API-server processes on this
#     16-CPU machine) through the openai client: rate inf with 8 client processes after 500 short warm-up
#     requests (CPU per process role by scripts/dev/proc_cpu.py), 0.9x the offline request rate with 4 client processes, rate inf with 8 client
#     processes and response_format json_schema on half of the requests.
#     SERVE_FLAGS: more `jaxkv serve` flags for every server of the stage (e.g. --api-server-count 4);
#     JSON_AB_FLAGS (set, even empty): a fourth server with these flags instead runs the json_schema half again;
#     SERVER_INF_ONLY=1: offline and the first server's rate-inf run only.
#   STAGE=n8-8b: Llama-3.1-8B shapes (dummy weights, .dummy/requests-llama3.json): 1000 distinct prompts, then n=8
#     over the first 125 (1000 sequences sharing their prompt's blocks); output tok/s of each.
# Usage (device tool, repository root): STAGE=sampling bash scripts/dev/gpu_sampling.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
OUT=${OUT:-/tmp/gpu_sampling}
mkdir -p "$OUT"
. scripts/dev/snapshot.sh  # SNAPSHOT=FILE.tgz: $OUT archived as it goes
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "Unable to initialize backend" -e "^INFO" \
  -e "Processed prompts"; }
S=$PWD/.dummy/smollm2-header.gguf
R=$PWD/.dummy/requests-3000.json
B="python3 scripts/bench_throughput.py --model $S --load-format dummy --requests $R --backend jaxkv --no-progress"

if [ "${STAGE:-sampling}" = sampling ]; then
  run() {  # $1: label, $2: timeout, rest: flags
    local label=$1 limit=$2; shift 2
    echo "=== $label: $*" | tee -a "$OUT/sampling.txt"
    timeout "$limit" $B "$@" --output-json "$OUT/$label.json" 2>&1 | quiet | tail -8 | tee -a "$OUT/sampling.txt"
  }
  if [ -d .baseline ]; then
  echo "=== old (9d32cad): plain" | tee -a "$OUT/sampling.txt"
  (cd .baseline && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 scripts/bench_throughput.py --model $S \
     --load-format dummy --requests $R --backend jaxkv --no-progress --num-prompts 3000 \
     --output-json "$OUT/old-plain.json" 2>&1 | quiet | tail -8 | tee -a "$OUT/sampling.txt")
  fi
  runs=" ${RUNS:-plain logprobs5 penalties n8x375 plain-again} "
  [[ $runs == *" plain "* ]] && run new-plain 200 --num-prompts 3000
  [[ $runs == *" logprobs5 "* ]] && run new-logprobs5 200 --num-prompts 3000 --logprobs 5
  [[ $runs == *" penalties "* ]] && run new-penalties 200 --num-prompts 3000 --presence-penalty 0.5 \
    --frequency-penalty 0.5 --repetition-penalty 1.1
  [[ $runs == *" n8x375 "* ]] && run new-n8x375 200 --num-prompts 375 --n 8
  [[ $runs == *" plain-again "* ]] && run new-plain-again 200 --num-prompts 3000
  python3 - "$OUT" <<'PY' | tee -a "$OUT/sampling.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
tps = {}
for f in sorted(out.glob("*.json")):
    results = json.loads(f.read_text())["results"]
    r = results[-1]  # the timed pass (a first pass compiled the sampling options' programs)
    tps[f.stem] = r["output_tokens_per_s"]
    first = f" (first pass, compiling: {results[0]['output_tokens_per_s']:.1f})" if len(results) > 1 else ""
    print(f"{f.stem:18s} {r['output_tokens_per_s']:10.1f} out tok/s{first}  {r['num_requests']:5d} requests  "
          f"prompt tokens computed {r.get('prompt_tokens_computed')}  round trips {r.get('round_trips')}  "
          f"model steps {r.get('model_steps')}  {r['elapsed_s']:.2f} s")
plain = tps.get("new-plain")
if plain is None:
    sys.exit()
for k in ("old-plain", "new-logprobs5", "new-penalties", "new-n8x375", "new-plain-again"):
    if k in tps:
        print(f"{k} / new-plain: {tps[k] / plain:.3f}")
if "old-plain" in tps:
    print(f"new-plain / old-plain: {plain / tps['old-plain']:.3f}")
PY
fi

if [ "${STAGE:-}" = n8-8b ]; then  # n=8 where the prefill is a real share of the run: Llama-3.1-8B shapes
  TOK=""
  [ -d .dummy/llama3-tokenizer ] && TOK="--tokenizer .dummy/llama3-tokenizer"
  B8="python3 scripts/bench_throughput.py --model llama-3.1-8b --load-format dummy $TOK \
    --requests .dummy/requests-llama3.json --backend jaxkv --no-progress"
  echo "=== 8B: 1000 distinct prompts" | tee "$OUT/n8.txt"
  timeout 250 $B8 --num-prompts 1000 --output-json "$OUT/8b-plain.json" 2>&1 | quiet | tail -6 | tee -a "$OUT/n8.txt"
  echo "=== 8B: n=8 over the first 125 prompts (1000 sequences)" | tee -a "$OUT/n8.txt"
  timeout 250 $B8 --num-prompts 125 --n 8 --output-json "$OUT/8b-n8.json" 2>&1 | quiet | tail -6 | tee -a "$OUT/n8.txt"
  python3 - "$OUT" <<'PY' | tee -a "$OUT/n8.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
r = {k: json.loads((out / f"8b-{k}.json").read_text())["results"][-1] for k in ("plain", "n8")
     if (out / f"8b-{k}.json").exists()}
for k, v in r.items():
    print(f"{k:6s} {v['output_tokens_per_s']:9.1f} out tok/s  {v['num_requests']} requests  output tokens "
          f"{v['output_tokens']}  prompt tokens computed {v.get('prompt_tokens_computed')}  {v['elapsed_s']:.2f} s")
if len(r) == 2:
    print(f"n8 / plain: {r['n8']['output_tokens_per_s'] / r['plain']['output_tokens_per_s']:.3f}")
PY
fi

if [ "${STAGE:-}" = server ]; then
  python3 - <<'PY'
import json
r = json.load(open(".dummy/requests-3000.json"))
for name, part in (("a", r[:1000]), ("b", r[1000:2000]), ("bc", r[1000:1500] + r[2000:3000]),
                   ("wa", r[2000:2500] + r[:1000])):
    json.dump(part, open(f"/tmp/req-{name}.json", "w"))
PY
  timeout 200 $B --requests /tmp/req-a.json --num-prompts 1000 --output-json "$OUT/offline.json" 2>&1 | quiet | tail -5 \
    | tee "$OUT/server.txt"
  RATE=$(python3 -c "import json; r = json.load(open('$OUT/offline.json'))['results'][0]; print(round(0.9 * r['requests_per_s'], 2))")
  echo "0.9x offline request rate: $RATE req/s" | tee -a "$OUT/server.txt"
  start() {  # a fresh server (an empty prefix cache): $1 = log name; server 1 writes its step trace
    local trace=""
    [ "$1" = 1 ] && trace="$OUT/trace-1"
    JAXKV_STEP_TRACE=$trace python3 scripts/serve.py --model $S --load-format dummy --served-model-name smollm2 --port 8000 ${SERVE_FLAGS:-} \
      > "$OUT/server-$1.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 240); do curl -sf localhost:8000/health > /dev/null && break; sleep 0.5; done
  }
  stop() { kill -TERM $SERVER; wait $SERVER; }
  C="python3 scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2 --num-prompts 1000 --gguf $S"
  start 1
  echo "=== the offline requests at rate inf, 8 client processes (CPU by role), 500 warm-up requests first" \
    | tee -a "$OUT/server.txt"
  timeout 150 python3 scripts/dev/proc_cpu.py -- $C --requests /tmp/req-wa.json --warmup-requests 500 \
    --warmup-max-tokens 32 --request-rate inf --client-processes 8 --result-json "$OUT/serve-inf.json" 2>&1 | quiet \
    | tail -22 | tee -a "$OUT/server.txt"
  if [ -z "${SERVER_INF_ONLY:-}" ]; then  # SERVER_INF_ONLY=1: offline and this rate-inf run only (a short call)
  echo "=== other requests at $RATE req/s (0.9x offline), 4 client processes" | tee -a "$OUT/server.txt"
  timeout 150 $C --requests /tmp/req-b.json --request-rate $RATE --client-processes 4 \
    --result-json "$OUT/serve-09x.json" 2>&1 | quiet | tail -14 | tee -a "$OUT/server.txt"
  fi
  stop
  if [ -z "${SERVER_INF_ONLY:-}" ]; then
  start 2
  echo "=== a fresh server, rate inf, 8 client processes, json_schema on half (500 warm-up requests first)" \
    | tee -a "$OUT/server.txt"
  timeout 200 $C --requests /tmp/req-bc.json --request-rate inf --client-processes 8 --json-schema-fraction 0.5 \
    --warmup-requests 500 --warmup-max-tokens 32 --result-json "$OUT/serve-inf-json.json" 2>&1 | quiet | tail -14 \
    | tee -a "$OUT/server.txt"
  stop
  start 3
  echo "=== a fresh server, the same requests unconstrained (the same warm-up)" | tee -a "$OUT/server.txt"
  timeout 200 $C --requests /tmp/req-bc.json --request-rate inf --client-processes 8 \
    --warmup-requests 500 --warmup-max-tokens 32 --result-json "$OUT/serve-inf-c.json" 2>&1 | quiet | tail -14 \
    | tee -a "$OUT/server.txt"
  stop
  if [ -n "${JSON_AB_FLAGS+x}" ]; then  # the json_schema half again on a server with other flags (the A/B)
    SERVE_FLAGS="$JSON_AB_FLAGS" start 4
    echo "=== a fresh server with '$JSON_AB_FLAGS' instead, json_schema on half (the same warm-up)" | tee -a "$OUT/server.txt"
    timeout 200 $C --requests /tmp/req-bc.json --request-rate inf --client-processes 8 --json-schema-fraction 0.5 \
      --warmup-requests 500 --warmup-max-tokens 32 --result-json "$OUT/serve-inf-json-ab.json" 2>&1 | quiet \
      | tail -14 | tee -a "$OUT/server.txt"
    stop
  fi
  fi
  python3 - "$OUT" <<'PY' | tee -a "$OUT/server.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def tps(name):
    f = out / name
    if not f.exists():
        return None
    r = json.loads(f.read_text())
    r = r["runs"][-1] if "runs" in r else r
    return r.get("output_throughput") or r.get("output_tokens_per_s")
off = json.loads((out / "offline.json").read_text())["results"][0]["output_tokens_per_s"]
rows = {k: tps(f"serve-{k}.json") for k in ("inf", "09x", "inf-json", "inf-c", "inf-json-ab")}
print(f"offline {off:.1f} out tok/s")
for k, v in rows.items():
    if v:
        print(f"{k:12s} {v:10.1f} out tok/s  {v / off:.3f}x offline" + (
            f"  {v / rows['inf-c']:.3f}x unconstrained" if "json" in k and rows.get("inf-c") else ""))
PY
  tail -12 "$OUT/server-1.log" > "$OUT/server-log-tail.txt"
  # server 1's timed bursts against the client's clock: where the rate-inf run's time outside the engine goes
  [ -d "$OUT/trace-1" ] && python3 scripts/dev/step_trace.py "$OUT"/trace-1/*.jsonl --bins 8 \
    --client-json "$OUT/serve-inf.json" 2>&1 | tail -24 | tee -a "$OUT/server.txt"
fi
