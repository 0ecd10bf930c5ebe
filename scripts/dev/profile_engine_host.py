"""Host cost of one engine step, with a trivial model (no real device work), profiled with cProfile.

    python scripts/dev/profile_engine_host.py [--requests 1000] [--max-num-seqs 256] [--steps 100]
        [--final-only] [--core-outputs] [--logprobs K]
    python scripts/dev/profile_engine_host.py --workload requests-1000.json [--max-admission-delay-steps 8]

``--workload FILE`` (token ids and output lengths, as ``bench_throughput.py --save-requests`` writes them)
runs that whole workload through ``LLM.generate``'s path instead and prints its host wall and CPU time,
host round trips and model steps (no profile): what the engine's host side costs for a real workload,
and how many decode model steps ran with how many requests (the tail of a few long requests is most of
the steps and little of the tokens).

The model is a table lookup (logits = a random ``[vocab, vocab]`` row of the last token), so the time per
step is almost all host Python: scheduling, input preparation, output processing. Prints ms per step and
the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pathlib
import pstats
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv


def _engine(args, model_fn, vocab: int, num_blocks: int) -> jaxkv.LLMEngine:
    table = jax.random.normal(jax.random.key(0), (vocab, vocab))
    caches = [jnp.zeros((2, num_blocks, 1, 16, 8))]
    return jaxkv.LLMEngine(model_fn, table, caches, block_size=16, max_model_len=2048,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096,
                           max_admission_delay_steps=args.max_admission_delay_steps,
                           num_scheduler_steps=args.num_scheduler_steps)


def _record_decode_rows(engine: jaxkv.LLMEngine) -> list[tuple[int, int]]:
    """``(running rows, model steps)`` of every decode loop the engine dispatches from now on."""
    rows: list[tuple[int, int]] = []
    execute = engine.runner.execute_decode

    def recording(sched, *a, **k):
        rows.append((len(sched.scheduled), sched.num_decode_steps))
        return execute(sched, *a, **k)
    engine.runner.execute_decode = recording
    return rows


def print_decode_census(rows: list[tuple[int, int]], loop_len: int,
                        bins=((1, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1 << 30))) -> None:
    """Decode model steps by running rows: how much of the run is the tail, where a few long requests
    decode alone and every kernel is small. Every loop computes ``loop_len`` iterations (the scan has no
    skip), so iterations past a loop's own step count are wasted device work: printed too."""
    total = sum(n for _, n in rows) or 1
    computed = loop_len * len(rows)
    print(f"decode-loop model steps by running rows ({total} steps in {len(rows)} loops; the loops compute "
          f"{computed} iterations, {computed - total} ({(computed - total) / max(computed, 1):.1%}) past every "
          f"row's steps):")
    for lo, hi in bins:
        steps = sum(n for r, n in rows if lo <= r <= hi)
        tokens = sum(n * r for r, n in rows if lo <= r <= hi)
        if steps:
            print(f"  {lo:4d}-{min(hi, 9999):<4d} rows: {steps:6d} steps ({steps / total:6.1%}), {tokens:8d} tokens")


def run_workload(args, model_fn, vocab: int) -> int:
    pairs = json.loads(pathlib.Path(args.workload).read_text())
    engine = _engine(args, model_fn, vocab, args.num_blocks or 16384)
    engine.warmup()
    rows = _record_decode_rows(engine)
    t0, c0 = time.perf_counter(), time.process_time()
    engine.generate([p for p, _ in pairs], [jaxkv.SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0,
                                                                 seed=i) for i, (_, n) in enumerate(pairs)])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = engine.stats
    print(f"{len(pairs)} requests, {st.num_generated_tokens} output tokens: host wall {wall:.2f} s, process CPU "
          f"{cpu:.2f} s, {st.steps} host round trips, {st.model_steps} model steps ({st.decode_steps} in decode "
          f"loops), {1e6 * wall / st.num_generated_tokens:.1f} us wall per output token, "
          f"max_admission_delay_steps {args.max_admission_delay_steps}, num_scheduler_steps {args.num_scheduler_steps}")
    print_decode_census(rows, args.num_scheduler_steps)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--final-only", action="store_true", help="step(final_only=True), as LLM.generate")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--workload", default=None, help="run these requests to the end (see above)")
    p.add_argument("--max-admission-delay-steps", type=int, default=0)
    p.add_argument("--num-scheduler-steps", type=int, default=8, help="most decode steps per host round trip")
    p.add_argument("--num-blocks", type=int, default=None, help="cache blocks (default 4096; 16384 with --workload)")
    p.add_argument("--logprobs", type=int, default=None, help="every request asks for this many logprobs")
    p.add_argument("--core-outputs", action="store_true",
                   help="step_core_outputs() (an engine-core process's step, outputs as sent) instead of step()")
    args = p.parse_args(argv)
    vocab = 128

    def model_fn(table, ids, positions, caches, metadata, logits_indices):
        return table[ids[logits_indices] % vocab], caches

    if args.workload:
        return run_workload(args, model_fn, vocab)

    engine = _engine(args, model_fn, vocab, args.num_blocks or 4096)
    engine.warmup()
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        engine.add_request(str(i), rng.integers(0, vocab, int(rng.integers(4, 300))).tolist(),
                           jaxkv.SamplingParams(max_tokens=int(rng.integers(4, 300)), ignore_eos=True,
                                                logprobs=args.logprobs),
                           final_only=args.final_only)
    step = engine.step_core_outputs if args.core_outputs else lambda: engine.step(final_only=args.final_only)
    for _ in range(30):  # fill the running batch
        step()
    before = engine.stats
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    dt = time.perf_counter() - t0
    after = engine.stats
    print(f"{1e3 * dt / args.steps:.2f} ms per step() over {args.steps} calls ({after.model_steps - before.model_steps} "
          f"model steps), {after.num_running} running, {after.num_waiting} waiting, device {jax.devices()[0].device_kind}")
    pstats.Stats(prof).sort_stats("cumtime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
