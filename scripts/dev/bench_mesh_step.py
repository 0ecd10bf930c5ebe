"""Decode step time of a random-weight Llama on a ``(dp, tp)`` mesh, and the collectives' share of it.

    python scripts/dev/bench_mesh_step.py --tp 1,2 [--batches 8,64] [--preset llama-1b | --model llama-3.1-8b]
        [--dtype bfloat16]

For each ``tp`` (``dp`` = 1) it builds the model's engine on ``make_mesh(tp, 1)``, generates
``--new-tokens`` tokens for each of ``batch`` prompts (no stop token) and reports the median decode
wall time per step over repeats (decode loops that compiled excluded; the engine's ``decode_s /
decode_steps``, as scripts/dev/bench_decode.py). With torch importable (GPU machine) it then records one
``generate`` with CUPTI and splits the device time into collectives (NCCL kernels: all-reduce etc.) and
the rest, per step and per GPU. The greedy tokens of every ``tp`` are compared with ``tp=1``'s (bf16:
a differing reduction order may flip near-ties; the share of equal tokens is printed).

With ``--model`` the dummy weights are made in each ``tp``'s shards (:func:`models.registry.build_model`, fused),
so a model larger than one GPU runs at the ``tp`` it fits (``--model llama-3.1-70b --tp 2 --quantization fp8
--kv-cache-dtype fp8`` on two H200s: the all-reduces' share of a 70B decode step, issue 45 item 4).

Random weights because SmolLM2-135M's 9 query heads do not split over 2 ranks. Presets (all shapes
divisible by 2 and 4): ``llama-1b`` (Llama-3.2-1B shapes: 16 layers, hidden 2048, 32/8 heads of 64,
MLP 8192, vocab 32000) and ``tiny`` (CPU smoke runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxkv
import models
from jaxkv.parallel.mesh import make_mesh
from models.decoder_config import LlamaConfig
from models.llama import LlamaForCausalLM

PRESETS = {
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, head_size=64, rope_theta=500000.0, max_position_embeddings=4096),
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_size=32, max_position_embeddings=1024),
}


def collective_share(engine, prompts, sampling, steps, top_kernels=0):
    """(device µs per step over all GPUs, of which collectives, the top NCCL kernels) from CUPTI, or None
    without torch; with ``top_kernels`` it also prints the kernels taking the most device time per step."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    engine.generate(prompts, sampling)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, sampling)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    # XLA runs small all-reduces as its own kernels, named after the HLO op: the partitioner's "all-reduce...",
    # and shard_map's psum (models.parallel.row_parallel) "psum_..._fusion" (70B fp8 on 4xH200, session 31)
    coll = sum(e.device_time_total for e in events
               if any(k in e.key.lower() for k in ("nccl", "allreduce", "all_reduce", "all-reduce", "psum")))
    top = sorted((e for e in events if "nccl" in e.key.lower()), key=lambda e: -e.device_time_total)[:3]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top_kernels]:
        print(f"    {e.device_time_total / steps:9.1f} us/step {100 * e.device_time_total / total:5.1f} % "
              f"{e.count / steps:6.1f} calls/step  {e.key[:90]}")
    return total / steps, coll / steps, [(e.key[:50], e.device_time_total / steps) for e in top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    p.add_argument("--model", default=None,
                   help="a built-in config name (llama-3.1-8b, qwen3-8b, ...; models/hf_config.py), a config.json, an "
                        "HF directory or a GGUF, with on-device dummy weights; overrides --preset")
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    p.add_argument("--batches", default="8,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="1: one host round trip per step")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=("fp8",), default=None, help="online fp8 weights (with --model)")
    p.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8 (default: the model's dtype)")
    p.add_argument("--attention-impl", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--top-kernels", type=int, default=0, help="print the N kernels with the most device time")
    p.add_argument("--num-layers", type=int, default=None,
                   help="keep only the first N decoder layers (a step's kernels per layer: calls/step / N; with "
                        "XLA_FLAGS=--xla_dump_to=DIR the optimized HLO stays small enough to read)")
    args = p.parse_args(argv)
    impl = args.attention_impl or jaxkv.default_attention_impl()
    if args.quantization and not args.model:
        p.error("--quantization needs --model")
    if args.model:
        from models import registry
        config = registry.load_config(registry.resolve_model(args.model))
        if args.num_layers:
            config = dataclasses.replace(config, num_layers=args.num_layers)

        def model_for(mesh):  # made in the mesh's shards (a model larger than one device never sits on one), fused
            return registry.build_model(config, None, dtype=jnp.dtype(args.dtype), seed=0, mesh=mesh,
                                        quantization=args.quantization)
    else:
        config = LlamaConfig(**{**PRESETS[args.preset], **({"num_layers": args.num_layers} if args.num_layers else {})})
        preset = LlamaForCausalLM(config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
        model_for = lambda mesh: preset  # noqa: E731  (make_engine shards it)
    cache_dtype = None
    if args.kv_cache_dtype:
        from jaxkv.kv_cache.dtypes import resolve_kv_cache_dtype
        cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, jnp.dtype(args.dtype))
    rng = np.random.default_rng(0)
    sampling = jaxkv.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  jax {jax.__version__}  "
          f"model={args.model or args.preset} {args.dtype} quantization={args.quantization} "
          f"kv_cache_dtype={args.kv_cache_dtype or args.dtype} attention={impl} "
          f"num_scheduler_steps={args.num_scheduler_steps}")
    rows, ref = [], {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [list(rng.integers(0, config.vocab_size, args.prompt_len)) for _ in range(batch)]
        max_len = args.prompt_len + args.new_tokens
        for tp in (int(t) for t in args.tp.split(",")):
            mesh = None if tp == 1 else make_mesh(tp, 1)
            model = model_for(mesh)
            engine = models.make_engine(model, attention_impl=impl, block_size=16, cache_dtype=cache_dtype,
                                        num_blocks=-(-max_len // 16) * batch, max_model_len=max_len,
                                        max_num_seqs=batch, max_num_batched_tokens=max(batch * args.prompt_len, 16),
                                        num_scheduler_steps=args.num_scheduler_steps,
                                        enable_prefix_caching=False, mesh=mesh)
            times = []
            for _ in range(args.repeats):
                before = engine.stats
                outs = engine.generate(prompts, sampling)
                after = engine.stats
                if after.decode_steps > before.decode_steps:
                    times.append(1e3 * (after.decode_s - before.decode_s) / (after.decode_steps - before.decode_steps))
            tokens = [o.outputs[0].token_ids for o in outs]
            if tp == 1:
                ref[batch] = tokens
            same = (f"{np.mean([a == b for x, y in zip(tokens, ref[batch]) for a, b in zip(x, y)]):.3f}"
                    if batch in ref else "-")  # -: tp=1 not run in this process
            prof = None if args.no_profile else collective_share(engine, prompts, sampling, args.new_tokens,
                                                                    args.top_kernels)
            ms = statistics.median(times) if times else float("nan")
            rows.append((batch, tp, ms, same, prof))
            line = f"batch {batch:4d} tp {tp}: {ms:7.3f} ms/step  tokens equal to tp=1: {same}"
            if prof:
                total, coll, top = prof
                line += (f"  device {total / tp:7.1f} us/step/GPU, collectives {coll / tp:6.1f} "
                         f"({100 * coll / total:4.1f} %)  {top}")
            print(line, flush=True)
            del engine, model
    print("\nbatch  tp  ms/step  speedup-vs-tp1  collective-share")
    base = {b: ms for b, tp, ms, _, _ in rows if tp == 1}
    for b, tp, ms, _, prof in rows:
        share = f"{100 * prof[1] / prof[0]:.1f} %" if prof else "n/a (no torch)"
        speedup = f"{base[b] / ms:10.2f}x" if b in base else f"{'-':>11}"
        print(f"{b:5d} {tp:3d} {ms:8.3f} {speedup}    {share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
