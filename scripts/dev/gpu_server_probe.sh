#!/usr/bin/env bash
# Issue 44 item 5: where a server run at rate inf loses against offline (one GPU call, ~4 min). SmolLM2 shapes
# with random weights, ShareGPT requests (.dummy/requests-3000.json); carry .whl (with py-spy) and .dummy.
#   1. offline LLM on requests 0..999 (the reference);
#   2. a fresh server (defaults), 500 warm-up requests (2000..2499, 32 tokens), then requests 0..999 at rate inf
#      through 8 openai client processes, under scripts/dev/proc_cpu.py with py-spy on the core and API servers;
#   3. variants (VARIANTS below): the admission order fixed to the dataset's (priority), the processes placed by
#      role. The server's engine counters (round trips, model steps, phase seconds) beside each.
# Usage (device tool, repository root): bash scripts/dev/gpu_server_probe.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/server_probe}
mkdir -p "$OUT"
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
lscpu | grep -e "^CPU(s)" -e "Thread(s) per core" -e "Core(s) per socket" -e "Model name" | tee -a "$OUT/device.txt"
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "Unable to initialize backend" -e "^INFO" \
  -e "Processed prompts"; }
S=$PWD/.dummy/smollm2-header.gguf
python3 - <<'PY'
import json
r = json.load(open(".dummy/requests-3000.json"))
json.dump(r[:1000], open("/tmp/req-a.json", "w"))
json.dump(r[2000:2500] + r[:1000], open("/tmp/req-wa.json", "w"))
PY
# CPU sets by physical core: E = 2 cores for the engine core, A = 2 for the API servers, C = the rest
read -r E A C < <(python3 - <<'PY'
import os, collections
cores = collections.defaultdict(list)
for c in sorted(os.sched_getaffinity(0)):
    t = f"/sys/devices/system/cpu/cpu{c}/topology"
    key = (open(f"{t}/physical_package_id").read().strip(), open(f"{t}/core_id").read().strip())
    cores[key].append(c)
groups = list(cores.values())
fmt = lambda gs: ",".join(str(c) for g in gs for c in g)
print(fmt(groups[:2]), fmt(groups[2:4]), fmt(groups[4:]))
PY
)
echo "CPU sets: engine core $E, API servers $A, clients $C" | tee -a "$OUT/device.txt"

echo "=== offline, requests 0..999" | tee "$OUT/probe.txt"
JAXKV_STEP_TRACE=$OUT/trace-offline timeout 200 python3 scripts/bench_throughput.py --model $S --load-format dummy --requests /tmp/req-a.json \
  --backend jaxkv --no-progress --num-prompts 1000 --output-json "$OUT/offline.json" 2>&1 | quiet | tail -4 \
  | tee -a "$OUT/probe.txt"
start() {  # a fresh server: $1 = log name, then more serve flags
  local name=$1; shift
  JAXKV_STEP_TRACE=$OUT/trace-$name python3 scripts/serve.py --model $S --load-format dummy --served-model-name smollm2 \
    --port 8000 "$@" > "$OUT/server-$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 240); do curl -sf localhost:8000/health > /dev/null && break; sleep 0.5; done
}
stop() { kill -TERM $SERVER; wait $SERVER; }
C_ARGS="scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2 --num-prompts 1000 --gguf $S \
  --requests /tmp/req-wa.json --warmup-requests 500 --warmup-max-tokens 32 --request-rate inf --client-processes 8"

# VARIANTS (default "default priority default2 priority2"): default (no placement), priority* (the server with
# --scheduling-policy priority and the client's --priority-by-order: admission in the dataset's order, as offline),
# *apiN* (N API-server processes instead of the default; with priority* both), nice (the engine core at nice -10),
# core (the engine core alone on E), server (core on E, API servers on A,
# clients anywhere), all (and the clients on C); any other name: no placement (repeats); py-spy on the first.
# Every engine writes its step trace (scripts/dev/step_trace.py replays its arrival order).
place() {  # $1: variant
  case $1 in
    nice) for pid in $(pgrep -f "jaxkv.engine.core"); do renice -n -10 -p "$pid" > /dev/null; done;;
    core) for pid in $(pgrep -f "jaxkv.engine.core"); do taskset -a -p -c "$E" "$pid" > /dev/null; done;;
    server|all)
      for pid in $(pgrep -f "models.entrypoints.openai.server") $(pgrep -f "scripts/serve.py"); do
        taskset -a -p -c "$A" "$pid" > /dev/null
      done
      for pid in $(pgrep -f "jaxkv.engine.core"); do taskset -a -p -c "$E" "$pid" > /dev/null; done;;
  esac
}
spy="--py-spy $OUT/spy"
for v in ${VARIANTS:-default priority default2 priority2}; do
  prio=""; serve_flags=""
  case $v in priority*) prio="--priority-by-order"; serve_flags="--scheduling-policy priority";; esac
  [[ $v =~ api([0-9]+) ]] && serve_flags="$serve_flags --api-server-count ${BASH_REMATCH[1]}"
  start "$v" $serve_flags
  place "$v"
  pin=""; [ "$v" = all ] && pin="taskset -c $C"
  echo "=== $v: rate inf, 8 openai client processes ${spy:+(py-spy)} $serve_flags $prio" | tee -a "$OUT/probe.txt"
  timeout 150 $pin python3 scripts/dev/proc_cpu.py $spy -- python3 $C_ARGS $prio --result-json "$OUT/inf-$v.json" \
    2>&1 | quiet | tail -9 | tee -a "$OUT/probe.txt"
  stop
  spy=""
done
python3 - "$OUT" <<'PY' | tee -a "$OUT/probe.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
o = json.loads((out / "offline.json").read_text())["results"][-1]
off = o["output_tokens_per_s"]
print(f"offline {off:.0f} out tok/s, {o['elapsed_s']:.2f} s, round trips {o.get('round_trips')}, model steps "
      f"{o.get('model_steps')}, host {o.get('host_s', 0):.2f} s (schedule {o.get('schedule_s', 0):.2f}, execute "
      f"{o.get('execute_s', 0):.2f}, update {o.get('update_s', 0):.2f}), device wait {o.get('wait_s', 0):.2f} s")
for f in sorted(out.glob("inf-*.json")):
    r = json.loads(f.read_text())["runs"][0]
    print(f"{f.stem:14s} {r['output_throughput']:8.0f} out tok/s = {r['output_throughput'] / off:.3f}x offline, "
          f"{r['duration_s']:.2f} s, server {r.get('server')}")
PY
for d in "$OUT"/trace-*; do  # the timed burst of each engine: round trips, occupancy, arrivals, tail
  echo "=== step trace $(basename $d)" | tee -a "$OUT/probe.txt"
  python3 scripts/dev/step_trace.py "$d"/*.jsonl --bins 8 | tail -12 | tee -a "$OUT/probe.txt"
done
for f in "$OUT"/spy/*.txt; do  # collapsed stacks -> the top frames by own samples, per process
  [ -f "$f" ] && python3 - "$f" <<'PY' > "${f%.txt}.top.txt"
import collections, sys
own, total = collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); total += n
    frames = stack.split(";")
    own[frames[-1]] += n
print(f"{total} samples")
for frame, n in own.most_common(40):
    print(f"{100 * n / total:5.1f} %  {frame}")
PY
done
ls -la "$OUT"/spy 2>/dev/null | head
