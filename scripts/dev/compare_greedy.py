"""Greedy text of two LLM configurations on the same prompts (e.g. -dp 2 vs one GPU, -tp 2 vs -tp 1).

    python scripts/dev/compare_greedy.py --model M [--load-format dummy] --requests R.json --num-prompts 64 \
        --a "data_parallel_size=1" --b "data_parallel_size=2" [--dtype bfloat16] [--max-tokens 64]

Each side runs in its own engine-core process(es), one after the other; prints how many completions are
identical and the first difference of each that is not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def parse_kv(text: str) -> dict:
    out = {}
    for part in filter(None, text.split(",")):
        k, v = part.split("=", 1)
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def run(args, overrides: dict) -> list[list[int]]:
    from jaxkv import SamplingParams
    from models import LLM
    prompts = [{"prompt_token_ids": ids} for ids, _ in json.load(open(args.requests))[:args.num_prompts]]
    t0 = time.perf_counter()
    with LLM(args.model, load_format=args.load_format, dtype=args.dtype, **overrides) as llm:
        ready = time.perf_counter() - t0
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
    print(f"{overrides}: ready in {ready:.1f} s, {sum(len(o.outputs[0].token_ids) for o in outs)} tokens", flush=True)
    return [o.outputs[0].token_ids for o in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", required=True, help="[[prompt token ids, output len], ...] (bench_serving)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--a", default="", help="LLM keyword arguments of side A: k=v,k=v")
    p.add_argument("--b", default="", help="LLM keyword arguments of side B")
    args = p.parse_args(argv)
    a, b = run(args, parse_kv(args.a)), run(args, parse_kv(args.b))
    same = sum(x == y for x, y in zip(a, b))
    print(f"identical greedy completions: {same}/{len(a)} ({args.dtype}, {args.max_tokens} tokens each)")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            print(f"  prompt {i}: first difference at token {k} of {len(x)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
