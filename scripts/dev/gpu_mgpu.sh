#!/usr/bin/env bash
# Issue 13 on an H100 (jax 0.11.2): the Mosaic GPU paged decode kernel (pallas_kernels/paged_attention_mgpu.py)
# and prefill kernel (pallas_kernels/paged_prefill_attention_mgpu.py) compiled for the first time. Two sections,
# decode (< 8 minutes) and prefill (< 6.5 minutes); both run by default, SECTIONS=decode or SECTIONS=prefill runs
# one (one device-tool command is at most 10 minutes: run them as two commands). Logs under $OUT:
#   device.txt            GPU, driver, jax version
#   mgpu-tests.txt        tests/pallas_kernels/test_paged_attention_mgpu.py compiled (vs the float64 fuzz
#                         reference, NaN in unowned slots; dispatch + fallback)
#   fuzz-mgpu.txt/.json   pytest -m gpu fuzz restricted to the Mosaic kernel (JAXKV_FUZZ_CLASSES classes x 8
#                         cases, default 24 here; 64 = the full 512-case run, ~3x longer)
#   bench-decode-mgpu.txt/.json  scripts/bench_attention.py --mode decode --quick: Mosaic vs Triton vs JAX's
#                         Pallas paged_attention on the issue-4 grid, bf16 and fp8 (% of copy bandwidth)
#   mgpu-prefill-tests.txt  tests/pallas_kernels/test_paged_prefill_attention_mgpu.py compiled (P from registers,
#                         and P through shared memory; one and two consumer warpgroups; dispatch + fallback;
#                         JAXKV_MGPU_FUZZ random fuzz classes, default 24)
#   bench-prefill-mgpu.txt  scripts/bench_attention.py --mode prefill --quick: Triton vs Mosaic vs cuDNN TF/s
#                         (batch 1/8 x 512/2048/8192), then a 512-token chunk over a 4k / 16k cached context
# Each stage has its own timeout, so a hang or a compile failure in one still leaves the others' logs.
# PREFILL_BENCH_ARGS / DECODE_BENCH_ARGS add bench_attention.py flags (e.g. --breakdown: each kernel's time per
# call); DECODE_SKIP_TESTS=1 runs only the decode bench;
# PREFILL_TESTS_FROM=N runs the prefill tests from the N-th collected id on.
# Usage (device tool, repository root): SECTIONS=prefill OUT=... bash scripts/dev/gpu_mgpu.sh
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_mgpu}
mkdir -p "$OUT"
. scripts/dev/snapshot.sh  # SNAPSHOT=FILE.tgz: $OUT archived as it goes
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "deprecations.warn"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/device.txt"

SECTIONS=${SECTIONS:-decode prefill}
if [[ " $SECTIONS " == *" decode "* ]]; then
if [ -z "${DECODE_SKIP_TESTS:-}" ]; then
echo '$ pytest -q tests/pallas_kernels/test_paged_attention_mgpu.py' | tee "$OUT/mgpu-tests.txt"
timeout 150 python -m pytest -q -p no:cacheprovider -x tests/pallas_kernels/test_paged_attention_mgpu.py \
  2>&1 | quiet | tail -60 | tee -a "$OUT/mgpu-tests.txt"

echo "\$ JAXKV_FUZZ_CLASSES=${JAXKV_FUZZ_CLASSES:-24} pytest -m gpu tests/pallas_kernels/test_gpu_fuzz.py -k decode_mgpu" \
  | tee "$OUT/fuzz-mgpu.txt"
JAXKV_FUZZ_CLASSES=${JAXKV_FUZZ_CLASSES:-24} JAXKV_FUZZ_REPORT="$OUT/fuzz-mgpu.json" timeout 180 \
  python -m pytest -q -s -p no:cacheprovider -m gpu tests/pallas_kernels/test_gpu_fuzz.py -k "compiled and decode_mgpu" \
  2>&1 | quiet | grep -e "\[fuzz\]" -e "passed" -e "failed" -e "Error" | tail -40 | tee -a "$OUT/fuzz-mgpu.txt"
fi

echo '$ python scripts/bench_attention.py --mode decode --quick --json bench-decode-mgpu.json' \
  | tee "$OUT/bench-decode-mgpu.txt"
timeout ${DECODE_BENCH_TIMEOUT:-170} python scripts/bench_attention.py --mode decode --quick --json "$OUT/bench-decode-mgpu.json" ${DECODE_BENCH_ARGS:-} \
  2>&1 | quiet | tee -a "$OUT/bench-decode-mgpu.txt"
fi

if [[ " $SECTIONS " == *" prefill "* ]]; then
# Prefill (~4 min): the compiled tests first (a failure there is the first thing to read), then the bench;
# the bench reports a failing or wrong Mosaic variant and goes on with the others.
echo "\$ JAXKV_MGPU_FUZZ=${JAXKV_MGPU_FUZZ:-24} pytest -q tests/pallas_kernels/test_paged_prefill_attention_mgpu.py" \
  | tee "$OUT/mgpu-prefill-tests.txt"
# PREFILL_TESTS_FROM=N: only the N-th collected test id on (a call cut short before them; ids hold spaces)
ids=(tests/pallas_kernels/test_paged_prefill_attention_mgpu.py)
if [ -n "${PREFILL_TESTS_FROM:-}" ]; then
  mapfile -t ids < <(python -m pytest --co -q -p no:cacheprovider tests/pallas_kernels/test_paged_prefill_attention_mgpu.py \
    2>/dev/null | grep :: | tail -n +"$PREFILL_TESTS_FROM")
  echo "${#ids[@]} test ids from number $PREFILL_TESTS_FROM" | tee -a "$OUT/mgpu-prefill-tests.txt"
fi
JAXKV_MGPU_FUZZ=${JAXKV_MGPU_FUZZ:-24} timeout ${PREFILL_TESTS_TIMEOUT:-200} python -m pytest -q -p no:cacheprovider \
  "${ids[@]}" ${PREFILL_TESTS_K:+-k "$PREFILL_TESTS_K"} \
  2>&1 | quiet | tail -80 | tee -a "$OUT/mgpu-prefill-tests.txt"

echo "\$ python scripts/bench_attention.py --mode prefill --quick ${PREFILL_BENCH_ARGS:-}" | tee "$OUT/bench-prefill-mgpu.txt"
timeout ${PREFILL_BENCH_TIMEOUT:-180} python scripts/bench_attention.py --mode prefill --quick --iters 10 ${PREFILL_BENCH_ARGS:-} \
  2>&1 | quiet | tee -a "$OUT/bench-prefill-mgpu.txt"
if [ -n "${PREFILL_TESTS_AFTER_K:-}" ]; then  # more compiled tests after the bench (e.g. the rest of the file)
  echo "\$ pytest -q tests/pallas_kernels/test_paged_prefill_attention_mgpu.py -k '$PREFILL_TESTS_AFTER_K'" \
    | tee "$OUT/mgpu-prefill-tests-after.txt"
  timeout ${PREFILL_TESTS_AFTER_TIMEOUT:-150} python -m pytest -q -p no:cacheprovider \
    tests/pallas_kernels/test_paged_prefill_attention_mgpu.py -k "$PREFILL_TESTS_AFTER_K" \
    2>&1 | quiet | tail -40 | tee -a "$OUT/mgpu-prefill-tests-after.txt"
fi
fi
