"""A continuous-batching model of one GPU against ``-dp 2``: where the longest answer bounds the ratio.

    python scripts/dev/sim_dp_tail.py [--requests .dummy/requests.json] [--counts 3000,4000]

Each rank runs ``--max-num-seqs`` sequences at once; a step costs ``fixed + per_seq x running`` ms plus
``prefill`` ms per prompt token admitted in it; each running request makes one token a step; a free seat takes
the next request from one queue shared by the ranks (an ideal dynamic placement). Defaults fitted to SmolLM2 on
an H200 (session 19: 10.02 s one GPU and 5.76 s ``-dp 2`` measured on 3000 requests; the model gives 10.16 and
5.72). A model, not a measurement: it says how much of a ``-dp 2`` run the longest answers' sequential steps
take, which no placement can shorten.
"""

from __future__ import annotations

import argparse
import json


def makespan(requests, ranks: int, seats: int, fixed: float, per_seq: float, prefill: float) -> float:
    """Milliseconds until every ``(prompt_len, output_len)`` request has all its tokens."""
    queue = list(requests)
    running: list[list[int]] = [[] for _ in range(ranks)]
    clock = [0.0] * ranks
    while queue or any(running):
        k = min(range(ranks), key=lambda i: clock[i] if (running[i] or queue) else float("inf"))
        admitted = 0
        while len(running[k]) < seats and queue:
            prompt, out = queue.pop(0)
            running[k].append(out)
            admitted += prompt
        clock[k] += fixed + per_seq * len(running[k]) + prefill * admitted
        running[k] = [n - 1 for n in running[k] if n > 1]
    return max(clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default=".dummy/requests.json", help="[[prompt_ids, output_len], ...]")
    ap.add_argument("--counts", default="3000,4000")
    ap.add_argument("--skip", type=int, default=256, help="the warm-up requests the benchmarks skip")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--fixed-ms", type=float, default=1.2)
    ap.add_argument("--per-seq-ms", type=float, default=0.009)
    ap.add_argument("--prefill-ms", type=float, default=0.0004, help="per prompt token")
    args = ap.parse_args()
    data = [(len(p), o) for p, o in json.load(open(args.requests))]
    for n in (int(c) for c in args.counts.split(",")):
        reqs = data[args.skip:args.skip + n]
        one, two = (makespan(reqs, r, args.max_num_seqs, args.fixed_ms, args.per_seq_ms, args.prefill_ms) / 1e3
                    for r in (1, 2))
        longest = max(o for _, o in reqs)
        share = sum(o for _, o in reqs) / 2 / args.max_num_seqs
        print(f"{len(reqs)} requests: one GPU {one:.2f} s, -dp 2 {two:.2f} s, ratio {one / two:.3f}; longest answer "
              f"{longest} steps, a rank's share {share:.0f} full-batch steps")


if __name__ == "__main__":
    main()
