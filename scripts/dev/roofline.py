"""The physical bound of an offline throughput run: how many output tokens/s the GPU's memory bandwidth and
matrix throughput allow for a model and a set of requests (issue 28's roofline).

    python scripts/dev/roofline.py --model llama-3.1-8b --requests requests.json --num-prompts 1000 \
        [--max-num-seqs 256] [--bandwidth-tb-s 3.0] [--tflops 798] [--measured TOK_S]

Model: every decode step reads all weights once (bf16) and, for each running sequence, its KV cache; with at
most ``max_num_seqs`` sequences per step the decode phase needs at least ``ceil(output tokens / max_num_seqs)``
steps. Prefill: ``2 * params * prompt tokens`` plus causal attention FLOPs. The bound on time is the decode
bytes over bandwidth plus the prefill FLOPs over peak (they do not overlap in the engine's steps more than the
mixed steps allow, so their sum is a fair bound; either term alone is a looser one). The *scheduled* bound
(:func:`scheduled_bound`) replaces the packed decode term by a continuous-batching schedule's steps, each at
least its bytes or its FLOPs: its step count is at least the longest answer. The *sequential* bound
(:func:`sequential_bound`, session 23) is the one for an engine that runs a step's kernels one after another, as
vLLM and jaxkv do: the GEMMs can hide FLOPs under their own weight reads, but decode attention's KV reads come
on top (another kernel), and prefill goes in chunks within the token budget as seats free (the engine's
schedule, ``sim_token_budget.replay``). Defaults: H100 as measured here (device copy ~3.0 TB/s, bf16 matmul
798 TFLOP/s; KINDS.md); the H200: 4.3 TB/s, 788; the H100's datasheet: 3.35 TB/s, 989.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def model_numbers(config, *, weight_bytes: float = 2, kv_bytes: float = 2) -> dict:
    """Parameters (embedding counted once when tied), their bytes (``weight_bytes`` each: 2 for bf16, 1 for fp8;
    the embedding and LM head stay bf16 with fp8 weights), and KV bytes per token (``kv_bytes`` per element)."""
    h, L, v = config.hidden_size, config.num_layers, config.vocab_size
    attn = h * config.head_size * (config.num_heads + 2 * config.num_kv_heads) + config.num_heads * config.head_size * h
    mlp = 3 * h * config.intermediate_size
    params = L * (attn + mlp) + v * h * (1 if config.tie_word_embeddings else 2)
    kv_per_token = 2 * L * config.num_kv_heads * config.head_size * kv_bytes
    embed = v * h * (1 if config.tie_word_embeddings else 2)
    return dict(params=params, weight_bytes=weight_bytes * (params - embed) + 2 * embed, kv_bytes_per_token=kv_per_token,
                attn_flops_per_pair=4 * L * config.num_heads * config.head_size)


def bound(config, requests, *, max_num_seqs: int, bandwidth: float, flops: float,
          **dtypes) -> dict:
    m = model_numbers(config, **dtypes)
    prompt = sum(len(p) for p, _ in requests)
    output = sum(n for _, n in requests)
    steps = math.ceil(output / max_num_seqs)
    kv_read = m["kv_bytes_per_token"] * sum(len(p) * n + n * (n - 1) / 2 for p, n in requests)
    decode_s = (steps * m["weight_bytes"] + kv_read) / bandwidth
    decode_flops_s = 2 * m["params"] * output / flops
    prefill_flops = 2 * m["params"] * prompt + m["attn_flops_per_pair"] * sum(len(p) ** 2 / 2 for p, _ in requests)
    prefill_s = prefill_flops / flops
    total = max(decode_s, decode_flops_s) + prefill_s
    return dict(params=m["params"], prompt_tokens=prompt, output_tokens=output, decode_steps=steps,
                decode_weight_s=steps * m["weight_bytes"] / bandwidth, decode_kv_s=kv_read / bandwidth,
                decode_flops_s=decode_flops_s, prefill_s=prefill_s, bound_s=total,
                bound_output_tok_s=output / total)


def scheduled_bound(config, requests, *, max_num_seqs: int, bandwidth: float, flops: float,
          **dtypes) -> dict:
    """The decode bound of a continuous-batching schedule: requests admitted in order as slots free (at most
    ``max_num_seqs`` running; prefill taking no step), each decode step costing at least the larger of its
    bytes (all weights + every running sequence's KV) over ``bandwidth`` and its FLOPs over ``flops``. Its step
    count is at least the longest answer, which the packed bound above ignores."""
    m = model_numbers(config, **dtypes)
    queue = [(len(p), n) for p, n in requests if n > 0][::-1]
    running: list[list[int]] = []  # [context tokens, tokens still to generate]
    steps = rows_total = 0
    decode_s = 0.0
    while queue or running:
        while queue and len(running) < max_num_seqs:
            prompt, n = queue.pop()
            running.append([prompt, n])
        rows = len(running)
        kv = m["kv_bytes_per_token"] * sum(c for c, _ in running)
        decode_s += max((m["weight_bytes"] + kv) / bandwidth, 2 * m["params"] * rows / flops)
        steps += 1
        rows_total += rows
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return dict(scheduled_steps=steps, scheduled_decode_s=decode_s, mean_rows=rows_total / max(steps, 1))


def sequential_bound(config, requests, *, max_num_seqs: int, max_num_batched_tokens: int, bandwidth: float,
                     flops: float, order: str = "fcfs", **dtypes) -> dict:
    """The bound of an engine that runs each step's kernels one after another, on the engine's schedule.

    Each step of ``sim_token_budget.replay`` (at most ``max_num_seqs`` requests, ``max_num_batched_tokens``
    tokens a step: every decoding sequence's token, then prefill chunks in order) costs at least
    ``max(weight bytes / bandwidth, 2 * params * tokens / flops)`` (the GEMMs, LM head included) ``+ KV bytes
    the decoding sequences read / bandwidth`` (decode attention) ``+ prefill attention FLOPs / flops``.

    Args:
        requests: ``(prompt token ids, output len)`` pairs, in arrival order.
        order: ``"fcfs"`` (arrival order, vLLM's default) or ``"longest_first"`` (by output length, longest
            first: a makespan heuristic that needs the lengths in advance).

    Returns:
        ``seconds``, ``steps``, ``output_tok_s`` and ``phases``: ``{name: (steps, seconds)}`` by unfinished
        requests at a step's start (``"1-32"``, ``"33-<max_num_seqs - 1>"``, ``">=<max_num_seqs>"``), as
        ``bench_throughput.py`` splits a measured run.

    Raises:
        ValueError: an unknown ``order``.
    """
    from sim_token_budget import replay
    if order not in ("fcfs", "longest_first"):
        raise ValueError(f"order={order!r} is not 'fcfs' or 'longest_first'")
    m = model_numbers(config, **dtypes)
    reqs = [(len(p), n) for p, n in requests if n > 0]
    if order == "longest_first":
        reqs.sort(key=lambda r: -r[1])
    attn = m["attn_flops_per_pair"]
    names = ("1-32", f"33-{max_num_seqs - 1}", f">={max_num_seqs}")
    phases = {k: [0, 0.0] for k in names}
    total = 0.0
    for contexts, chunks, _, unfinished in replay(reqs, budget=max_num_batched_tokens, seats=max_num_seqs):
        tokens = len(contexts) + sum(c for _, c in chunks)
        t = (max(m["weight_bytes"] / bandwidth, 2 * m["params"] * tokens / flops)
             + m["kv_bytes_per_token"] * sum(contexts) / bandwidth
             + sum(attn * c * (done + c / 2) for done, c in chunks) / flops)
        phase = phases[names[0] if unfinished <= 32 else names[1] if unfinished < max_num_seqs else names[2]]
        phase[0] += 1
        phase[1] += t
        total += t
    output = sum(n for _, n in reqs)
    return dict(seconds=total, steps=sum(p[0] for p in phases.values()), output_tok_s=output / total,
                phases={k: tuple(v) for k, v in phases.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model name, GGUF, HF directory, config.json or built-in name")
    p.add_argument("--requests", required=True, help="[[prompt token ids, output len], ...]")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--bandwidth-tb-s", type=float, default=3.0)
    p.add_argument("--tflops", type=float, default=798.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the sequential bound's token budget")
    p.add_argument("--measured", type=float, default=None, help="a run's output tok/s, to compare")
    p.add_argument("--weight-bytes", type=float, default=2, help="bytes per Linear weight (1: fp8 weights)")
    p.add_argument("--kv-bytes", type=float, default=2, help="bytes per KV-cache element (1: fp8 cache)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs sharing each step: bandwidth and FLOP/s times this (all-reduces not counted)")
    args = p.parse_args(argv)
    args.bandwidth_tb_s *= args.tensor_parallel_size
    args.tflops *= args.tensor_parallel_size
    dtypes = dict(weight_bytes=args.weight_bytes, kv_bytes=args.kv_bytes)
    from models import registry
    config = registry.load_config(registry.resolve_model(args.model))
    with open(args.requests) as f:
        requests = [(list(ids), int(n)) for ids, n in json.load(f)[:args.num_prompts]]
    b = bound(config, requests, max_num_seqs=args.max_num_seqs, bandwidth=args.bandwidth_tb_s * 1e12,
              flops=args.tflops * 1e12, **dtypes)
    print(f"{registry.model_name(args.model)}: {b['params'] / 1e9:.2f} B parameters; {len(requests)} requests, "
          f"{b['prompt_tokens']} prompt / {b['output_tokens']} output tokens; {args.bandwidth_tb_s} TB/s, "
          f"{args.tflops} TFLOP/s, max_num_seqs {args.max_num_seqs}")
    print("| part | seconds |\n|---|---|")
    for k in ("decode_weight_s", "decode_kv_s", "decode_flops_s", "prefill_s", "bound_s"):
        print(f"| {k} | {b[k]:.2f} |")
    print(f"bound: {b['bound_output_tok_s']:,.0f} output tok/s ({b['decode_steps']} decode steps at least)")
    if args.measured:
        print(f"measured {args.measured:,.0f} = {args.measured / b['bound_output_tok_s']:.0%} of the bound")
    s = scheduled_bound(config, requests, max_num_seqs=args.max_num_seqs, bandwidth=args.bandwidth_tb_s * 1e12,
                        flops=args.tflops * 1e12, **dtypes)
    total = s["scheduled_decode_s"] + b["prefill_s"]
    print(f"scheduled bound: {s['scheduled_steps']} decode steps of {s['mean_rows']:.1f} rows on average (the longest "
          f"answer: {max(n for _, n in requests)} tokens); decode {s['scheduled_decode_s']:.2f} s + prefill "
          f"{b['prefill_s']:.2f} s = {total:.2f} s: {b['output_tokens'] / total:,.0f} output tok/s")
    # prefill folded into the decode steps (mixed steps read the weights once for both): no faster than all the
    # FLOPs at peak, nor than the schedule's decode steps
    overlapped = max(s["scheduled_decode_s"], b["prefill_s"] + b["decode_flops_s"])
    print(f"scheduled bound with prefill hidden in the decode steps: {overlapped:.2f} s: "
          f"{b['output_tokens'] / overlapped:,.0f} output tok/s")
    if args.measured:
        print(f"measured {args.measured:,.0f} = {args.measured / (b['output_tokens'] / total):.0%} of the scheduled "
              f"bound, {args.measured / (b['output_tokens'] / overlapped):.0%} of the one with prefill hidden")
    for order in ("fcfs", "longest_first"):
        q = sequential_bound(config, requests, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             bandwidth=args.bandwidth_tb_s * 1e12, flops=args.tflops * 1e12, order=order,
                             **dtypes)
        phases = "; ".join(f"{k} unfinished: {n} steps, {sec:.2f} s" for k, (n, sec) in q["phases"].items())
        print(f"sequential bound ({order}, {args.max_num_batched_tokens} tokens a step): {q['seconds']:.2f} s = "
              f"{q['output_tok_s']:,.0f} output tok/s over {q['steps']} steps ({phases})"
              + (f"; measured = {args.measured / q['output_tok_s']:.0%} of it" if args.measured and order == "fcfs"
                 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
