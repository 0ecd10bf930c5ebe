"""``jaxkv generate``: text through jaxkv's paged KV cache (``models.LLM``): SmolLM2-135M-Instruct or
Gemma-3-270M (GGUF), any GGUF path, or a Hugging Face checkpoint directory (docs/models.md).

    jaxkv generate [--model smollm2-135m|gemma3-270m|HF_DIR|GGUF | --gguf PATH]
        [--load-format auto|dummy] [-tp N]
        --prompt "The capital of France is" [--prompt ...] [--prompt-file F] [--max-tokens N]
        [--chat] [--temperature T] [--top-p P] [--top-k K] [--seed S]
        [--attention-impl pallas|pallas_interpret|reference] [--max-num-seqs N]
        [--max-num-batched-tokens N] [--num-scheduler-steps N] [--no-enable-prefix-caching]
        [--print-kv-blocks]

``--print-kv-blocks`` prints, after generation, the KV-cache blocks each request held per KV-cache group
at its largest (Gemma 3: five sliding-window groups and one full-attention group).

On a GPU the attention runs the Pallas kernels; on CPU it falls back to the XLA reference. Prompts run
together with continuous batching, in an engine-core process (``-dp N``: N of them) as ``LLM`` runs by
default; ``--print-kv-blocks`` needs the engine in this process and runs it there. Prints each completion,
then one summary line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.sampling_params import SamplingParams
from models.entrypoints.engine_args import EngineArgs, llm_kwargs_from_cli
from models.entrypoints.llm import LLM
from models.registry import blocks_per_sequence, load_config, load_model_tokenizer, resolve_model

log = logging.getLogger("generate")


class KVBlockProbe:
    """Records, after every engine step, the blocks each live request holds per KV-cache group: the
    largest count seen per request and group, and the count after its last step. vLLM has no such print;
    it reads the KV-cache manager's per-group block lists (``Request.group_block_ids``, or ``block_ids``
    for one group)."""

    def __init__(self, engine):
        self.engine = engine
        self.peak: dict[str, dict] = {}
        step = engine.step

        def probed_step(*a, **kw):
            out = step(*a, **kw)
            self._record()
            return out

        engine.step = probed_step

    def _record(self):
        kv = self.engine.kv_cache_manager
        for req in self.engine.scheduler.running:
            if req.group_block_ids is not None:
                used = kv.num_blocks_in_use(req)
            else:
                used = [len(req.block_ids)]
            p = self.peak.setdefault(req.request_id, {"blocks": [0] * len(used), "tokens": 0})
            p["blocks"] = [max(a, b) for a, b in zip(p["blocks"], used)]
            p["tokens"] = max(p["tokens"], req.num_computed_tokens)
            p["last"] = list(used)

    def report(self, *, block_size: int) -> str:
        groups = self.engine.kv_cache_groups
        kinds = [("sliding" if getattr(g.kv_cache_spec, "sliding_window", None) and
                  type(g.kv_cache_spec).__name__ == "SlidingWindowSpec" else "full") for g in groups] or ["full"]
        sizes = [len(g.layer_names) for g in groups] or [None]
        lines = []
        for rid, p in self.peak.items():
            per = ", ".join(f"g{i}({k}{'' if n is None else f', {n} layers'})={b}/{last}"
                            for i, (k, n, b, last) in enumerate(zip(kinds, sizes, p["blocks"], p["last"])))
            total, total_last = sum(p["blocks"]), sum(p["last"])
            all_full = -(-p["tokens"] // block_size) * max(len(groups), 1)
            lines.append(f"kv blocks (peak/at the last step) request {rid}, {p['tokens']} tokens: {per}; "
                         f"total {total}/{total_last} (every layer full attention: {all_full}; "
                         f"{total / all_full:.3f}/{total_last / all_full:.3f} of it)")
        return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxkv generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument("--prompt-file", action="append", default=[],
                   help="a file whose text is one prompt (long prompts); repeatable")
    p.add_argument("--print-kv-blocks", action="store_true",
                   help="print the KV-cache blocks in use per group (largest over the run, per request)")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    p.add_argument("--repeat", type=int, default=1,
                   help="generate the batch this many times with one engine (shows prefix caching)")
    # the seed also seeds the requests' sampling; the batch sizes the engine when these are not given:
    # max_model_len = longest prompt + --max-tokens, max_num_seqs = the prompts, blocks for all of them
    EngineArgs.add_cli_args(p, seed=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"error: {e}") from None


def run(args: argparse.Namespace) -> int:
    # check what can be checked before the weights load
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    engine = EngineArgs.from_cli_args(args)
    if engine.block_size not in PallasAttentionBackend.supported_block_sizes:
        raise ValueError(f"--block-size={engine.block_size} not supported; choose one of "
                         f"{PallasAttentionBackend.supported_block_sizes}")
    for f in args.prompt_file:
        with open(f, encoding="utf-8") as fh:
            args.prompt.append(fh.read())
    if not args.prompt:
        raise ValueError("give at least one --prompt or --prompt-file")
    if any(not p for p in args.prompt):
        raise ValueError(f"prompts[{[bool(p) for p in args.prompt].index(False)}] is empty")

    # the sizes depend on the prompts: tokenize with the model's tokenizer first (no weights; the GGUF
    # reader is shared with the weight loader)
    path = resolve_model(engine.model)
    config = load_config(path)
    tok = load_model_tokenizer(path, engine.tokenizer, config)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
             for p in args.prompt]
    # chat prompts carry their BOS in the template; plain prompts get it from the tokenizer
    token_ids = [tok.encode(t, add_special_tokens=not args.chat) for t in texts]
    dp = args.data_parallel_size or 1
    max_model_len = engine.max_model_len or max(len(t) for t in token_ids) + args.max_tokens
    max_num_seqs = args.max_num_seqs or len(texts)
    max_num_batched_tokens = engine.max_num_batched_tokens or max(256, max_num_seqs)
    # the engine's own KV-cache groups (hybrid for sliding-window models at any tensor_parallel_size)
    blocks_per_seq = blocks_per_sequence(config, max_model_len, block_size=engine.block_size,
                                         max_num_batched_tokens=max_num_batched_tokens)
    num_blocks = engine.num_gpu_blocks or (blocks_per_seq * -(-len(texts) // dp)  # per dp rank
                                           * (2 if engine.enable_prefix_caching else 1))
    mp = None if not args.print_kv_blocks else False  # the probe reads the engine's own state
    llm = LLM(**llm_kwargs_from_cli(args, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, num_gpu_blocks=num_blocks,
                                    **({} if mp is None else {"enable_multiprocessing": mp})))
    info = llm.engine_info[0]
    impl = info["attention_impl"]
    if engine.attention_impl is None and not info["device"].startswith("gpu"):
        log.info("attention: no GPU (%s): using the XLA reference attention instead of the Pallas kernel "
                 "(--attention-impl pallas_interpret runs the kernel in the interpreter)", info["device"])
    prompts = [{"prompt": t, "prompt_token_ids": ids} for t, ids in zip(texts, token_ids)]
    for _ in range(args.repeat - 1):  # earlier rounds: compile, fill the prefix cache
        llm.generate(prompts, sampling, use_tqdm=False)
    probe = KVBlockProbe(llm.engine) if args.print_kv_blocks else None
    t0 = time.perf_counter()
    done = llm.generate(prompts, sampling, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.get_engine_stats()[0]
    llm.shutdown()

    for prompt, out in zip(args.prompt, done):
        c = out.outputs[0]
        print(f"--- prompt: {prompt!r} ({len(out.prompt_token_ids)} tokens, finish: {c.finish_reason})")
        print(c.text)
    if probe is not None:
        print(probe.report(block_size=engine.block_size))
    generated = sum(len(o.outputs[0].token_ids) for o in done)
    if stats["decode_steps"]:
        timing = (f"decode_tok/s={stats['decode_tokens'] / stats['decode_s']:.1f} "
                  f"({1e3 * stats['decode_s'] / stats['decode_steps']:.2f} ms/step over "
                  f"{stats['decode_steps']} steps that did not compile)")
    else:
        timing = "decode_tok/s=n/a (every decode loop compiled)"
    print(f"summary: prompts={len(done)} prompt_tokens={sum(len(o.prompt_token_ids) for o in done)} "
          f"cached_prompt_tokens={sum(o.num_cached_tokens for o in done)} "
          f"generated_tokens={generated} {timing} "
          f"wall_tok/s={generated / wall:.1f} (incl. compile) compiles={stats['num_compiles']} "
          f"attention={impl} dtype={llm.dtype} kv_cache_dtype={info['kv_cache_dtype']} "
          f"device={info['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
