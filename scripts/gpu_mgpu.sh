#!/usr/bin/env bash
# Issue 13 on an H100 (jax 0.11.2): the Mosaic GPU paged decode kernel (pallas_kernels/paged_attention_mgpu.py)
# compiled for the first time. One command, < 8 minutes, logs under $OUT:
#   device.txt            GPU, driver, jax version
#   mgpu-tests.txt        tests/pallas_kernels/test_paged_attention_mgpu.py compiled (vs the float64 fuzz
#                         reference, NaN in unowned slots; dispatch + fallback)
#   fuzz-mgpu.txt/.json   pytest -m gpu fuzz restricted to the Mosaic kernel (JAXKV_FUZZ_CLASSES classes x 8
#                         cases, default 24 here; 64 = the full 512-case run, ~3x longer)
#   bench-decode-mgpu.txt/.json  scripts/bench_attention.py --mode decode --quick: Mosaic vs Triton vs JAX's
#                         Pallas paged_attention on the issue-4 grid, bf16 and fp8 (% of copy bandwidth)
# Each stage has its own timeout, so a hang or a compile failure in one still leaves the others' logs.
# Usage (device tool, repository root): OUT=... bash scripts/gpu_mgpu.sh
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_mgpu}
mkdir -p "$OUT"
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "deprecations.warn"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/device.txt"

echo '$ pytest -q tests/pallas_kernels/test_paged_attention_mgpu.py' | tee "$OUT/mgpu-tests.txt"
timeout 150 python -m pytest -q -p no:cacheprovider -x tests/pallas_kernels/test_paged_attention_mgpu.py \
  2>&1 | quiet | tail -60 | tee -a "$OUT/mgpu-tests.txt"

echo "\$ JAXKV_FUZZ_CLASSES=${JAXKV_FUZZ_CLASSES:-24} pytest -m gpu tests/pallas_kernels/test_gpu_fuzz.py -k decode_mgpu" \
  | tee "$OUT/fuzz-mgpu.txt"
JAXKV_FUZZ_CLASSES=${JAXKV_FUZZ_CLASSES:-24} JAXKV_FUZZ_REPORT="$OUT/fuzz-mgpu.json" timeout 180 \
  python -m pytest -q -s -p no:cacheprovider -m gpu tests/pallas_kernels/test_gpu_fuzz.py -k "compiled and decode_mgpu" \
  2>&1 | quiet | grep -e "\[fuzz\]" -e "passed" -e "failed" -e "Error" | tail -40 | tee -a "$OUT/fuzz-mgpu.txt"

echo '$ python scripts/bench_attention.py --mode decode --quick --json bench-decode-mgpu.json' \
  | tee "$OUT/bench-decode-mgpu.txt"
timeout 170 python scripts/bench_attention.py --mode decode --quick --json "$OUT/bench-decode-mgpu.json" \
  2>&1 | quiet | tee -a "$OUT/bench-decode-mgpu.txt"
