"""Read an engine's step trace (``$JAXKV_STEP_TRACE``: one JSON line per host round trip, written when the engine
stops) and say how each burst of work went: round trips, mixed steps and decode loops, rows per model step (the
batch's occupancy), when the requests arrived, and the tail with few requests left.

    JAXKV_STEP_TRACE=/tmp/trace jaxkv serve ...   (or bench throughput); then
    python scripts/dev/step_trace.py /tmp/trace/step-trace-PID.jsonl [--bins 10] [--gap 0.5]

A burst ends where the engine idled longer than ``--gap`` seconds (a benchmark's warm-up, then its timed run).
The requests that arrived during a burst are replayed, in their arrival order and longest output first, through
``sim_token_budget.replay`` (the engine's schedule, one token per step for every running request): how many steps
that order needs. At rate inf a server admits its requests in the order they happened to arrive; offline
``LLM.generate`` in the dataset's. With few requests and one long answer, the order moves the run's length.
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


def order_steps(arrivals: list[dict], *, budget: int, seats: int) -> tuple[int, int]:
    """Steps of the engine's schedule for ``arrivals`` in their order, and longest output first."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sim_token_budget import replay
    reqs = [(a["prompt_tokens"], a["max_tokens"]) for a in arrivals for _ in range(a.get("n", 1))]
    count = lambda rs: sum(1 for _ in replay(rs, budget=budget, seats=seats))  # noqa: E731
    return count(reqs), count(sorted(reqs, key=lambda r: -r[1]))


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


def client_edges(burst: list[dict], arrivals: list[dict], clock: dict, client_json: str) -> list[str]:
    """Where the client's run (``t0_wall`` to ``t0_wall + duration_s``) lies against the engine's last burst: the
    time to its first arrival and after its last round trip (the HTTP path's edges, which offline has not)."""
    with open(client_json) as f:
        run = json.load(f)["runs"][-1]
    if "t0_wall" not in run:
        return [f"{client_json}: no t0_wall (written before session 26)"]
    wall = lambda t: t - clock["perf_counter"] + clock["time"]  # noqa: E731
    t0, t1 = run["t0_wall"], run["t0_wall"] + run["duration_s"]
    first = min((a["arrival"] for a in arrivals if a["arrival"] >= burst[0]["t0"] - 1.0), default=burst[0]["t0"])
    return [f"client run {run['duration_s']:.2f} s: first request at the engine {wall(first) - t0:+.3f} s after the "
            f"client's start, engine burst {burst[-1]['t1'] - burst[0]['t0']:.2f} s, its last round trip ends "
            f"{t1 - wall(burst[-1]['t1']):.3f} s before the client's last response"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="+")
    p.add_argument("--bins", type=int, default=10)
    p.add_argument("--gap", type=float, default=0.5, help="idle seconds that end a burst")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the replay's token budget")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the replay's seats")
    p.add_argument("--client-json", help="a `jaxkv bench serving --result-json` of the same run (its last run): the "
                   "client's start and end against the last burst's first arrival and last round trip")
    args = p.parse_args(argv)
    for path in args.trace:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        records = [r for r in lines if "t0" in r]
        arrivals = [r for r in lines if "arrival" in r]
        clock = next((r["clock"] for r in lines if "clock" in r), None)
        print(f"== {path}: {len(records)} round trips, {len(arrivals)} requests")
        found = bursts(records, args.gap)
        if args.client_json and clock and found:
            print("\n".join(client_edges(found[-1], arrivals, clock, args.client_json)))
        for i, b in enumerate(found):
            print(f"-- burst {i}")
            print("\n".join(describe(b, args.bins)))
            mine = [a for a in arrivals if b[0]["t0"] - args.gap <= a["arrival"] <= b[-1]["t1"]]
            if mine:
                got, best = order_steps(mine, budget=args.max_num_batched_tokens, seats=args.max_num_seqs)
                engine = sum(max(1, r["steps"]) for r in b)
                print(f"the {len(mine)} requests of this burst, replayed: {got} steps in their arrival order, "
                      f"{best} longest output first (the engine ran {engine} model steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
