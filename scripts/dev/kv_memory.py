"""KV-cache blocks of one long Gemma 3 sequence, hybrid groups vs every layer full attention.

    python scripts/dev/kv_memory.py [--tokens 1024 8192 32768] [--block-size 16]
        [--max-num-batched-tokens 2048] [--num-scheduler-steps 1] [--gguf PATH]

Runs the real scheduler and KV-cache manager (no model: the sampled tokens are dummies, which changes
nothing about blocks) for one request whose prompt has N - 8 tokens, chunked-prefilled, then decodes 8
tokens, so it ends with N tokens. Prints, per N, the blocks in use per KV-cache group at the end and the
peak over the run, their total against vLLM's "every layer full attention" layout (one group, a block per
token for all 18 layers = 6 groups' worth of blocks of 3 layers), and the KV bytes in bf16. The config is
Gemma-3-270M's (from ``--gguf`` or the installed package's metadata; built-in values without either).
"""

from __future__ import annotations

import argparse
import sys

from jaxkv import SamplingParams
from jaxkv.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxkv.core.request import Request
from jaxkv.core.scheduler import Scheduler, SchedulerConfig
from models.engine_setup import get_kv_cache_config
from models.gemma3_config import Gemma3Config

GEMMA3_270M = Gemma3Config(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                           num_heads=4, num_kv_heads=1, head_size=256, sliding_window=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-scheduler-steps", type=int, default=1)
    p.add_argument("--gguf", default=None, help="read the config from this GGUF (default: the package's)")
    return p.parse_args(argv)


def load_config(path) -> Gemma3Config:
    if path is None:
        try:
            from models.gemma3_loader import find_gemma3_gguf
            path = find_gemma3_gguf()
        except FileNotFoundError:
            return GEMMA3_270M
    from models import registry
    return registry.load_config(path)


def simulate(config: Gemma3Config, num_tokens: int, *, block_size: int, max_num_batched_tokens: int,
             num_scheduler_steps: int) -> dict:
    """Blocks per group at the end and at the peak for one request grown to ``num_tokens`` tokens."""
    kv_config = get_kv_cache_config(config, block_size=block_size, dtype="bfloat16",
                                    num_blocks=8 * (-(-num_tokens // block_size)) + 16)
    kv = HybridKVCacheManager(kv_config.kv_cache_groups, kv_config.num_blocks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=num_tokens + 1, num_scheduler_steps=num_scheduler_steps),
                      kv)
    decode = 8
    req = Request("r", [7] * (num_tokens - decode), SamplingParams(max_tokens=decode, temperature=0.0,
                                                                   ignore_eos=True),
                  arrival_index=0, seed=0, max_model_len=num_tokens + 1, eos_token_ids=frozenset())
    sched.add_request(req)
    peak = [0] * len(kv_config.kv_cache_groups)
    last = peak
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if req.group_block_ids is not None:
            last = kv.num_blocks_in_use(req)
            peak = [max(a, b) for a, b in zip(peak, last)]
        sched.update_from_output(out, [[7] * max(1, out.num_decode_steps)] * len(out.scheduled))
    return dict(groups=kv_config.kv_cache_groups, last=last, peak=peak, tensors=len(kv_config.kv_cache_tensors),
                page=kv_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes, computed=num_tokens)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = load_config(args.gguf)
    bs = args.block_size
    print(f"Gemma 3 ({config.num_layers} layers: {config.layer_types.count('sliding_attention')} sliding-window "
          f"{config.sliding_window}, {config.layer_types.count('full_attention')} full), block_size={bs}, "
          f"max_num_batched_tokens={args.max_num_batched_tokens}, num_scheduler_steps={args.num_scheduler_steps}")
    rows = []
    for n in args.tokens:
        r = simulate(config, n, block_size=bs, max_num_batched_tokens=args.max_num_batched_tokens,
                     num_scheduler_steps=args.num_scheduler_steps)
        kinds = ["S" if getattr(g.kv_cache_spec, "sliding_window", None) else "F" for g in r["groups"]]
        all_full = len(r["groups"]) * -(-n // bs)  # every layer keeps every token (6 groups of 3 layers)
        total, peak = sum(r["last"]), sum(r["peak"])
        mib = lambda blocks: blocks * r["page"] * r["tensors"] / 2 ** 20  # noqa: E731 (bf16 pages)
        per = " ".join(f"{k}{b}" for k, b in zip(kinds, r["last"]))
        print(f"N={n:>6}: end per group [{per}] total={total} (peak {peak}) | all-full-attention={all_full} | "
              f"ratio={total / all_full:.4f} (3/18 = {3 / 18:.4f}) | {mib(total):.1f} MiB vs "
              f"{mib(all_full):.1f} MiB bf16")
        rows.append((n, r["last"], total, peak, all_full))
    bound = -(-config.sliding_window // bs) + 1
    print(f"sliding-window groups: at most cdiv({config.sliding_window}, {bs}) + 1 = {bound} blocks each while "
          "decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
