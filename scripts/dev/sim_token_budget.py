"""A step-level cost model of the Llama-3.1-8B offline run on an H200: how the token budget of a step
(``max_num_batched_tokens``) moves prefill into memory-bound decode steps, and what that predicts.

    python scripts/dev/sim_token_budget.py --requests /tmp/req1000.json --budgets 512,1024,2048,4096,8192

Schedule (the engine's, device time only): at most ``--max-num-seqs`` requests run; every step decodes one token
of each running request whose prefill is done, and fills the rest of the budget with prefill chunks of waiting or
partly prefilled requests in arrival order (a request joins when a seat is free); a request whose prompt
completes in a step samples its first token there. Cost of a step with ``T`` tokens, ``R`` logits rows and
``K`` KV tokens read:

* GEMMs: session 21's measured 32-layer stack (``bench_fused_gemm.py``, H200, separate weights), interpolated in
  ``T`` (3.62 ms at 2 tokens ... 161.3 ms at 8192; linear between measured points);
* LM head: the larger of its weight read and its FLOPs, ``R`` rows;
* attention: decode KV bytes at ``--attention-bw-share`` of the bandwidth (62 % measured, session 16) and prefill
  FLOPs at ``--prefill-attention-tflops``;
* everything else (norms, RoPE, the cache write, sampling): ``--other-ms`` a step plus ``--other-us-per-token``.

Caveat (session 22): that JAX stack merged and concatenated the gate/up weights on every call, which the engine's
step does not, so ``GEMM_MS`` overstates the engine's GEMMs at 256-1,024 rows (the H100's engine step: 218 us of GEMMs
a layer at 256 rows; the stack, 9.15 ms / 32 = 286 us) and ``--other-ms`` absorbs the difference.

``--other-ms`` is calibrated so that the 8192-token run takes its measured 23.67 s (8,694.7 output tok/s, 1,888
model steps, session 21); with 0.6 ms the model gave 21.20 s. A model, not a measurement.
"""

from __future__ import annotations

import argparse
import bisect
import json

# session 21, stage v (docs/benchmarks.md): ms per 32-layer projection stack by tokens, H200
GEMM_MS = {2: 3.620, 16: 3.785, 64: 4.668, 128: 5.569, 256: 8.400, 512: 12.886, 8192: 161.349}


def gemm_ms(tokens: int) -> float:
    xs = sorted(GEMM_MS)
    t = max(tokens, xs[0])
    i = min(bisect.bisect_left(xs, t), len(xs) - 1)
    if xs[i] == t or i == 0:
        return GEMM_MS[xs[i]] * (t / xs[i] if t > xs[-1] else 1.0)
    a, b = xs[i - 1], xs[i]  # linear between measured points (time grows with tokens once compute-bound)
    return GEMM_MS[a] + (t - a) / (b - a) * (GEMM_MS[b] - GEMM_MS[a])


def replay(requests, *, budget: int, seats: int):
    """The schedule above, step by step: yields ``(contexts, chunks, completed, unfinished)``: the context length
    of each decoding sequence before this step's token, ``(tokens already prefilled, chunk)`` of each prefill
    chunk, how many prompts complete (and sample their first token) in the step, and how many requests are not
    finished when it starts (waiting ones included: ``bench_throughput.py``'s "time by unfinished requests")."""
    waiting = list(requests)[::-1]
    prefilling: list[list[int]] = []  # [prompt, done, output]
    decoding: list[list[int]] = []  # [context, remaining]
    while waiting or prefilling or decoding:
        while waiting and len(prefilling) + len(decoding) < seats:
            p, o = waiting.pop()
            prefilling.append([p, 0, o])
        unfinished = len(waiting) + len(prefilling) + len(decoding)
        room, chunks, finished = budget - len(decoding), [], []
        for r in prefilling:
            if room <= 0:
                break
            chunk = min(room, r[0] - r[1])
            chunks.append((r[1], chunk))
            r[1] += chunk
            room -= chunk
            if r[1] == r[0]:
                finished.append(r)
        yield [c for c, _ in decoding], chunks, len(finished), unfinished
        for r in decoding:
            r[0] += 1
            r[1] -= 1
        decoding = [r for r in decoding if r[1] > 0]
        for r in finished:
            prefilling.remove(r)
            if r[2] > 1:
                decoding.append([r[0] + 1, r[2] - 1])


def simulate(requests, *, budget: int, seats: int, args) -> dict:
    """Seconds and steps of the schedule above for ``(prompt_len, output_len)`` requests."""
    kv_bytes = 2 * 32 * 8 * 128 * 2  # per token: K and V, 32 layers, 8 KV heads of 128, bf16
    parts = dict(gemm=0.0, lm_head=0.0, attention=0.0, other=0.0)  # ms
    steps, out_tokens = 0, 0
    for contexts, chunks, completed, _ in replay(requests, budget=budget, seats=seats):
        tokens = len(contexts) + sum(chunk for _, chunk in chunks)
        rows = len(contexts) + completed
        attn_flops = sum(4 * 32 * 32 * 128 * chunk * (done + chunk / 2) for done, chunk in chunks)
        lm_head = max(1.05e9 / (args.bandwidth_tb_s * 1e12), 2 * 4096 * 128256 * rows / (args.tflops * 1e12)) * 1e3
        attn = sum(contexts) * kv_bytes / (args.attention_bw_share * args.bandwidth_tb_s * 1e12) * 1e3
        attn += attn_flops / (args.prefill_attention_tflops * 1e12) * 1e3
        parts["gemm"] += gemm_ms(tokens)
        parts["lm_head"] += lm_head
        parts["attention"] += attn
        parts["other"] += args.other_ms + args.other_us_per_token * tokens / 1e3
        steps += 1
        out_tokens += rows
    return dict(seconds=sum(parts.values()) / 1e3, steps=steps, output_tokens=out_tokens,
                parts_s={k: round(v / 1e3, 2) for k, v in parts.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", required=True, help="[[prompt_ids, output_len], ...]")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--budgets", default="512,1024,2048,4096,8192")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.3)
    ap.add_argument("--tflops", type=float, default=600.0, help="LM head GEMM rate")
    ap.add_argument("--attention-bw-share", type=float, default=0.62)
    ap.add_argument("--prefill-attention-tflops", type=float, default=250.0)
    ap.add_argument("--other-ms", type=float, default=1.9, help="calibrated: the 8192 run's measured 23.67 s")
    ap.add_argument("--other-us-per-token", type=float, default=1.0)
    ap.add_argument("--measured", type=float, default=8694.7, help="the measured run at 8192 (tok/s)")
    args = ap.parse_args()
    reqs = [(len(p), o) for p, o in json.load(open(args.requests))[:args.num_prompts]]
    print(f"{len(reqs)} requests, {sum(o for _, o in reqs)} output tokens, longest answer {max(o for _, o in reqs)}")
    for budget in (int(b) for b in args.budgets.split(",")):
        r = simulate(reqs, budget=budget, seats=args.max_num_seqs, args=args)
        tok_s = r["output_tokens"] / r["seconds"]
        note = f" (measured {args.measured:,.1f})" if budget == 8192 else ""
        print(f"max_num_batched_tokens {budget:5d}: {r['steps']} steps, {r['seconds']:.2f} s, {tok_s:,.0f} output tok/s"
              f"{note}; seconds {r['parts_s']}")


if __name__ == "__main__":
    main()
