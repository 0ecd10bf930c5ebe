"""Compare attention implementations on one prompt: first-token logits and greedy tokens.

    python scripts/dev/compare_impls.py --prompt "..." [--chat] [--dtype float32|bfloat16]
        [--impls reference,pallas_interpret] [--max-new-tokens 4]

Prints, per implementation, the greedy tokens and, against the first implementation, the largest
first-token logit difference and the gap between the two best logits (a gap smaller than the difference
means greedy decoding may legitimately diverge between implementations).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

import jaxkv
import models


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--impls", default="reference,pallas_interpret")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--gguf", default=None)
    args = p.parse_args(argv)
    config, weights, tok = models.load_gguf_checkpoint(args.gguf, progress=False)
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt = tok.encode(text)
    dtype = jnp.dtype(args.dtype)
    model = models.from_weights(config, weights, dtype=dtype)
    first = None
    for impl in args.impls.split(","):
        max_len = len(prompt) + args.max_new_tokens
        engine = models.make_engine(model, attention_impl=impl, block_size=16, num_blocks=-(-max_len // 16),
                                    max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=256,
                                    num_scheduler_steps=4, return_logits=True)
        out = engine.generate([prompt], jaxkv.SamplingParams(max_tokens=args.max_new_tokens,
                                                             temperature=0))[0].outputs[0]
        logits = out.logits[0].astype(np.float64)
        top2 = np.sort(logits)[-2:]
        line = (f"{impl:>17} {args.dtype}: tokens {out.token_ids} {tok.decode(out.token_ids)!r}; "
                f"top-2 first-token logits {top2[1]:.4f} / {top2[0]:.4f} (gap {top2[1] - top2[0]:.4f})")
        if first is None:
            first = logits
        else:
            line += f"; max |diff| vs first impl {np.abs(logits - first).max():.2e}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
