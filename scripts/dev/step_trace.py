"""Read an engine's step trace (``$JAXKV_STEP_TRACE``: one JSON line per host round trip, written when the engine
stops) and say how each burst of work went: round trips, mixed steps and decode loops, rows per model step (the
batch's occupancy), when the requests arrived, and the tail with few requests left.

    JAXKV_STEP_TRACE=/tmp/trace jaxkv serve ...   (or bench throughput); then
    python scripts/dev/step_trace.py /tmp/trace/step-trace-PID.jsonl [--bins 10] [--gap 0.5]

A burst ends where the engine idled longer than ``--gap`` seconds (a benchmark's warm-up, then its timed run).
"""

from __future__ import annotations

import argparse
import json


def bursts(records: list[dict], gap: float) -> list[list[dict]]:
    out: list[list[dict]] = []
    for r in records:
        if out and r["t0"] - out[-1][-1]["t1"] <= gap:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def describe(burst: list[dict], bins: int) -> list[str]:
    t_start, t_end = burst[0]["t0"], burst[-1]["t1"]
    span = t_end - t_start
    steps = sum(max(1, r["steps"]) for r in burst)
    gen = sum(r["generated"] for r in burst)
    mixed = sum(1 for r in burst if r["steps"] == 0)
    first_arrivals = burst[0]["arrivals"]
    final = burst[-1]["arrivals"]
    ramp = next((r["t1"] - t_start for r in burst if r["arrivals"] >= final), span)
    tail = sum(r["t1"] - r["t0"] for r in burst if r["running"] + r["waiting"] < 32)
    lines = [f"{span:.2f} s, {len(burst)} round trips ({mixed} mixed, {len(burst) - mixed} decode loops), "
             f"{steps} model steps, {gen} tokens = {gen / max(steps, 1):.1f} per model step; requests added "
             f"{final - first_arrivals} (all in after {ramp:.2f} s); {tail:.2f} s with < 32 requests left"]
    lines.append(f"{'from s':>7} {'trips':>6} {'mixed':>6} {'steps':>6} {'tok/step':>8} {'running':>8} "
                 f"{'waiting':>8} {'added':>6}")
    edges = [t_start + span * i / bins for i in range(bins + 1)]
    edges[-1] = t_end + 1.0
    added_before = first_arrivals
    for lo, hi in zip(edges, edges[1:]):
        part = [r for r in burst if lo <= r["t0"] < hi]
        if not part:
            continue
        st = sum(max(1, r["steps"]) for r in part)
        g = sum(r["generated"] for r in part)
        lines.append(f"{lo - t_start:7.2f} {len(part):6d} {sum(r['steps'] == 0 for r in part):6d} {st:6d} "
                     f"{g / max(st, 1):8.1f} {sum(r['running'] for r in part) / len(part):8.1f} "
                     f"{sum(r['waiting'] for r in part) / len(part):8.1f} "
                     f"{part[-1]['arrivals'] - added_before:6d}")
        added_before = part[-1]["arrivals"]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="+")
    p.add_argument("--bins", type=int, default=10)
    p.add_argument("--gap", type=float, default=0.5, help="idle seconds that end a burst")
    args = p.parse_args(argv)
    for path in args.trace:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        print(f"== {path}: {len(records)} round trips")
        for i, b in enumerate(bursts(records, args.gap)):
            print(f"-- burst {i}")
            print("\n".join(describe(b, args.bins)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
