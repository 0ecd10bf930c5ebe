"""Hugging Face transformers baseline for bench_decode.py: the same GGUF, prompts and token counts.

    python scripts/dev/bench_hf_generate.py --gguf PATH [--batches 1,64] [--new-tokens 128]

Loads the GGUF with ``transformers`` (``gguf_file=``, dequantised to bf16), runs greedy ``generate`` with
a static KV cache on the GPU, and reports decode ms/step = (time(N new tokens) - time(1 new token)) /
(N - 1), median of repeats after a warm-up (which compiles). Prints the first 16 greedy tokens at batch 1
to compare with ``bench_decode.py``. Needs torch + transformers (present on the GPU machine); not a
dependency of jaxkv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_common import add_workload_args, decode_prompts

import models


def main(argv=None) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    add_workload_args(p, batches="1,64")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    tok = models.GGUFTokenizer.from_gguf(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(args.gguf),
                                                 gguf_file=os.path.basename(args.gguf),
                                                 dtype=torch.bfloat16).cuda().eval()
    print(f"transformers {transformers.__version__}  torch {torch.__version__}  "
          f"{torch.cuda.get_device_name()}  bf16 static cache, greedy")

    def timed(ids, n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    print(f"{'batch':>5} {'ms/step':>8} {'tok/s':>9}")
    for batch in map(int, args.batches.split(",")):
        ids = torch.tensor(decode_prompts(tok, batch, args.prompt_len), device="cuda")
        timed(ids, args.new_tokens)  # warm-up: compiles for this shape
        timed(ids, 1)
        steps = []
        for _ in range(args.repeats):
            t_full, out = timed(ids, args.new_tokens)
            t_one, _ = timed(ids, 1)
            steps.append(1e3 * (t_full - t_one) / (args.new_tokens - 1))
        ms = statistics.median(steps)
        print(f"{batch:>5} {ms:>8.3f} {batch * 1e3 / ms:>9.0f}", flush=True)
        if batch == 1:
            print("greedy tokens, batch 1, first 16:", out[0, ids.shape[1]:ids.shape[1] + 16].tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
