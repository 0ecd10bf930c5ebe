# Gemma 3 270M decode step (random weights from the header GGUF), Triton vs Mosaic decode kernel, 1k-token prompts.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dummy/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for impl in pallas pallas_mosaic; do
  echo "\$ python scripts/bench_decode.py --gguf .dummy/gemma3-header.gguf --load-format dummy --batches 1,64 --steps-per-sync 16 --prompt-len 1024 --new-tokens 64 --attention-impl $impl"
  timeout 230 python scripts/bench_decode.py --gguf .dummy/gemma3-header.gguf --load-format dummy --batches 1,64 \
    --steps-per-sync 16 --prompt-len 1024 --new-tokens 64 --attention-impl $impl 2>&1 \
    | grep -v -e "loading weights" -e "Warning" -e "warn" | head -12
done
