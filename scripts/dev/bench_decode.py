"""Decode-step benchmark through jaxkv (GPU): ms/step and tokens/s by batch and steps per sync.

    python scripts/dev/bench_decode.py [--model smollm2-135m|gemma3-270m | --gguf PATH] [--batches 1,8,64]
        [--new-tokens 128]

Gemma 3 runs with its hybrid KV-cache groups (five sliding-window groups + one full-attention group).

For each batch size and ``steps_per_sync`` (the engine's ``num_scheduler_steps``: 1 = a host round trip
per step; 16 = a device loop of 16 steps) it generates ``--new-tokens`` tokens per sequence with no stop token and reports the median over
repeats of the decode wall time per step (decode loops that compiled excluded). It also re-runs one
configuration with 4x the cache capacity (``num_blocks``) to check that step time does not depend on it
(the cache is donated and updated in place), and, when torch is importable, reads the device time of one
decode chunk with CUPTI and lists the kernels that take it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
from bench_common import add_workload_args, decode_prompts

import jaxkv
import models
from models.registry import LOAD_FORMATS, blocks_per_sequence, build_model, load_checkpoint


def _sampling(new_tokens: int) -> jaxkv.SamplingParams:
    return jaxkv.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def run_one(model, tok, *, batch, new_tokens, steps_per_sync, prompt_len, capacity_factor=1,
            impl, repeats=3):
    max_model_len = prompt_len + new_tokens
    blocks_per_seq = blocks_per_sequence(model.config, max_model_len, block_size=16,
                                                         max_num_batched_tokens=max(batch * prompt_len, 16))
    make_engine = models.make_engine
    if isinstance(model.config, models.Gemma3Config):
        from models.engine_setup import make_engine
    engine = make_engine(model, attention_impl=impl, block_size=16,
                                num_blocks=blocks_per_seq * batch * capacity_factor,
                                max_model_len=max_model_len, max_num_seqs=batch,
                                max_num_batched_tokens=max(batch * prompt_len, 16),
                                num_scheduler_steps=steps_per_sync, enable_prefix_caching=False)
    prompts = decode_prompts(tok, batch, prompt_len)
    times, outs = [], None
    for _ in range(repeats):
        before = engine.stats
        outs = engine.generate(prompts, _sampling(new_tokens))
        after = engine.stats
        steps = after.decode_steps - before.decode_steps
        if steps:  # decode loops that compiled are excluded from decode_s / decode_steps
            times.append(1e3 * (after.decode_s - before.decode_s) / steps)
    return statistics.median(times), engine, prompts, outs


def cupti_breakdown(engine, prompts, new_tokens):
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    sampling = _sampling(new_tokens)
    engine.generate(prompts, sampling)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, sampling)
    steps = new_tokens  # prefill + decode steps of the profiled call (padding steps included)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total_us = sum(e.device_time_total for e in events)
    top = sorted(events, key=lambda e: -e.device_time_total)[:8]
    return total_us / steps, [(e.key[:60], e.device_time_total / steps, e.count // max(steps, 1))
                              for e in top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, gemma3-270m or a GGUF path")
    p.add_argument("--gguf", default=None, help="a GGUF path (overrides --model)")
    add_workload_args(p, batches="1,8,64")
    p.add_argument("--steps-per-sync", default="1,16")
    p.add_argument("--attention-impl", default=None)
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights, config and tokenizer from the GGUF's metadata (speed only)")
    args = p.parse_args(argv)
    impl = args.attention_impl or jaxkv.default_attention_impl()
    config, weights, tok = load_checkpoint(models.resolve_model(args.gguf or args.model),
                                                           load_format=args.load_format)
    model = build_model(config, weights, dtype=jnp.bfloat16)
    del weights
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  attention={impl}  bf16  "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, no stop token")
    print(f"{'batch':>5} {'steps/sync':>10} {'ms/step':>8} {'tok/s':>9}")
    rows = {}
    for batch in map(int, args.batches.split(",")):
        for sps in map(int, args.steps_per_sync.split(",")):
            ms, engine, prompts, outs = run_one(model, tok, batch=batch, new_tokens=args.new_tokens,
                                                steps_per_sync=sps, prompt_len=args.prompt_len, impl=impl)
            rows[batch, sps] = (ms, engine, prompts, outs)
            print(f"{batch:>5} {sps:>10} {ms:>8.3f} {batch * 1e3 / ms:>9.0f}", flush=True)
    batch, sps = max(rows)[0], max(map(int, args.steps_per_sync.split(",")))
    ms4, *_ = run_one(model, tok, batch=batch, new_tokens=args.new_tokens, steps_per_sync=sps,
                      prompt_len=args.prompt_len, capacity_factor=4, impl=impl)
    print(f"capacity x4 (batch {batch}, steps/sync {sps}): {ms4:.3f} ms/step vs {rows[batch, sps][0]:.3f} "
          f"({100 * (ms4 / rows[batch, sps][0] - 1):+.1f} %)")
    first = rows[min(rows)][3][0]
    print("greedy tokens, batch 1, first 16:", first.outputs[0].token_ids[:16])
    for batch in sorted({b for b, _ in rows}):
        ms, engine, prompts, _ = rows[batch, sps]
        got = cupti_breakdown(engine, prompts, args.new_tokens)
        if got is None:
            break
        per_step, top = got
        print(f"CUPTI batch {batch}, steps/sync {sps}: {per_step / 1e3:.3f} ms device time per step "
              f"(wall {ms:.3f} ms); top kernels (µs/step, launches/step):")
        for name, us, count in top:
            print(f"    {us:8.1f}  {count:3d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
