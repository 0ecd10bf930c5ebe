"""Greedy tokens with tensor parallelism equal those of one device (same model, same dummy seed).

    python scripts/check_tp_equal.py --model llama-3.1-8b --load-format dummy --dtype float32 -tp 2
    python scripts/check_tp_equal.py --model gemma-3-4b --load-format dummy --dtype float32 -tp 2
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/check_tp_equal.py \\
        --model tiny/config.json --load-format dummy -tp 2          # CPU smoke test

Runs ``LLM`` once with ``tensor_parallel_size=1`` and once with ``-tp N``, each in its own process (each
sizes its KV cache from the memory it finds), on the same fixed batch of token-id prompts (lengths 3..300,
greedy, ``ignore_eos``), and compares the generated token ids. Use ``--dtype float32``: in bfloat16 the
all-reduce's different summation order can flip a near-tie of random-weight logits, which is rounding, not a
bug. Prints one line per prompt and ``equal: N/N``; exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(args) -> None:
    import numpy as np

    import models
    from jaxkv import SamplingParams

    t0 = time.perf_counter()
    llm = models.LLM(args.model, load_format=args.load_format, dtype=args.dtype, tensor_parallel_size=args.child_tp,
                     max_model_len=args.max_model_len, max_num_seqs=args.num_prompts,
                     num_gpu_blocks=args.num_gpu_blocks, attention_impl=args.attention_impl, seed=args.seed)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = llm.config.vocab_size
    lens = np.linspace(3, min(300, args.max_model_len - args.max_tokens - 1), args.num_prompts).astype(int)
    prompts = [rng.integers(0, vocab, n).tolist() for n in lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    json.dump(dict(tokens=[o.outputs[0].token_ids for o in outs], load_s=load_s,
                   generate_s=time.perf_counter() - t0, mesh=None if llm.mesh is None else dict(llm.mesh.shape)),
              open(args.out, "w"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--attention-impl", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child-tp", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_tp is not None:
        child(args)
        return 0
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, args.tensor_parallel_size):
            out = os.path.join(tmp, f"tp{tp}.json")
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child-tp", str(tp),
                   "--out", out]
            r = subprocess.run(cmd, check=False)
            if r.returncode:
                raise SystemExit(f"error: the tp={tp} run failed (exit {r.returncode})")
            runs[tp] = json.load(open(out))
            print(f"tp={tp}: mesh {runs[tp]['mesh']}, load {runs[tp]['load_s']:.1f} s, "
                  f"generate {runs[tp]['generate_s']:.1f} s", flush=True)
    a, b = runs[1]["tokens"], runs[args.tensor_parallel_size]["tokens"]
    equal = 0
    for i, (x, y) in enumerate(zip(a, b)):
        first = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        equal += first is None
        print(f"prompt {i}: " + ("equal" if first is None else f"differs from token {first}: {x[first:first + 4]} vs "
                                                                f"{y[first:first + 4]}"))
    print(f"equal: {equal}/{len(a)} ({args.model}, {args.dtype}, tp=1 vs tp={args.tensor_parallel_size})")
    return 0 if equal == len(a) else 1


if __name__ == "__main__":
    sys.exit(main())
