#!/usr/bin/env bash
# Issue 45 on an H100 / H200 (jax 0.11.2): the Mosaic fp8 decode routes (paged_attention_mgpu's fp8_route: "convert",
# "qk8", "qk8t") compiled, fuzzed and timed against each other and against bf16 in one process, and the bf16
# kernel's longest-first deal (balance) A/B. Stages (SECTIONS, run in the order given; default "tests bench fuzz
# mixed"), each with its own timeout, so a hang or a compile failure in one still leaves the others' logs. Logs under
# $OUT:
#   device.txt        GPU, driver, jax version
#   tests.txt         tests/pallas_kernels/test_paged_attention_mgpu.py compiled (float64 references; the 32k-token
#                     error-growth test prints each route's error at 1k and 32k tokens)
#   bench.txt/.json   scripts/bench_attention.py --mode decode --mosaic-only --balance-ab: bf16 (with and without the
#                     deal) and each fp8 route, % of copy bandwidth, fp8/bf16 speed-up (BENCH_SHAPES, FP8_VARIANTS)
#   fuzz.txt/.json    pytest -m gpu fuzz of the fp8 routes (JAXKV_FUZZ_CLASSES classes x 8 cases each, default 16)
#   mixed.txt         scripts/dev/bench_decode_mixed.py: mixed context lengths, balance on/off, bf16 and fp8
# Usage (device tool, repository root): OUT=... bash scripts/dev/gpu_fp8.sh
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_fp8}
mkdir -p "$OUT"
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "deprecations.warn"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm --format=csv,noheader
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/device.txt"

tests() {
  echo "\$ pytest -q -s tests/pallas_kernels/test_paged_attention_mgpu.py ${TESTS_K:+-k \"$TESTS_K\"}" | tee "$OUT/tests.txt"
  timeout ${TESTS_TIMEOUT:-240} python -m pytest -q -s -p no:cacheprovider tests/pallas_kernels/test_paged_attention_mgpu.py \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | quiet | grep -v "^SKIPPED" | tail -80 | tee -a "$OUT/tests.txt"
}

bench() {
  SHAPES=${BENCH_SHAPES:-8x4096,8x32768,64x1024,64x4096,256x1024,256x4096}
  echo "\$ bench_attention.py --mode decode --quick --mosaic-only --balance-ab --shapes $SHAPES --fp8-variants ${FP8_VARIANTS:-convert,qk8,qk8t}" \
    | tee "$OUT/bench.txt"
  timeout ${BENCH_TIMEOUT:-300} python scripts/bench_attention.py --mode decode --quick --mosaic-only --balance-ab \
    --shapes "$SHAPES" --fp8-variants "${FP8_VARIANTS:-convert,qk8,qk8t}" --json "$OUT/bench.json" ${BENCH_ARGS:-} \
    2>&1 | quiet | tee -a "$OUT/bench.txt"
}

fuzz() {
  K=${FUZZ_K:-decode_mgpu_qk8t or decode_mgpu_qk8 or decode_mgpu_producer}
  echo "\$ JAXKV_FUZZ_CLASSES=${JAXKV_FUZZ_CLASSES:-16} pytest -m gpu tests/pallas_kernels/test_gpu_fuzz.py -k 'compiled and ($K)'" \
    | tee "$OUT/fuzz.txt"
  JAXKV_FUZZ_CLASSES=${JAXKV_FUZZ_CLASSES:-16} JAXKV_FUZZ_REPORT="$OUT/fuzz.json" timeout ${FUZZ_TIMEOUT:-200} \
    python -m pytest -q -s -p no:cacheprovider -m gpu tests/pallas_kernels/test_gpu_fuzz.py -k "compiled and ($K)" \
    2>&1 | quiet | grep -e "\[fuzz\]" -e "passed" -e "failed" -e "Error" | tail -60 | tee -a "$OUT/fuzz.txt"
}

mixed() {
  echo "\$ scripts/dev/bench_decode_mixed.py" | tee "$OUT/mixed.txt"
  timeout ${MIXED_TIMEOUT:-120} python scripts/dev/bench_decode_mixed.py ${MIXED_ARGS:-} 2>&1 | quiet | tee -a "$OUT/mixed.txt"
}

for section in ${SECTIONS:-tests bench fuzz mixed}; do   # in the order given
  "$section"
done
