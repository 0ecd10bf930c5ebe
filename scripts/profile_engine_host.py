"""Host cost of one engine step, with a trivial model (no real device work), profiled with cProfile.

    python scripts/profile_engine_host.py [--requests 1000] [--max-num-seqs 256] [--steps 100]

The model is a table lookup (logits = a random ``[vocab, vocab]`` row of the last token), so the time per
step is almost all host Python: scheduling, input preparation, output processing. Prints ms per step and
the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--final-only", action="store_true", help="step(final_only=True), as LLM.generate")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    vocab = 128

    def model_fn(table, ids, positions, caches, metadata, logits_indices):
        return table[ids[logits_indices]], caches

    engine = jaxkv.LLMEngine(model_fn, jax.random.normal(jax.random.key(0), (vocab, vocab)),
                             [jnp.zeros((2, 4096, 1, 16, 8))], block_size=16, max_model_len=2048,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096)
    engine.warmup()
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        engine.add_request(str(i), rng.integers(0, vocab, int(rng.integers(4, 300))).tolist(),
                           jaxkv.SamplingParams(max_tokens=int(rng.integers(4, 300)), ignore_eos=True))
    for _ in range(30):  # fill the running batch
        engine.step(final_only=args.final_only)
    before = engine.stats
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step(final_only=args.final_only)
    prof.disable()
    dt = time.perf_counter() - t0
    after = engine.stats
    print(f"{1e3 * dt / args.steps:.2f} ms per step() over {args.steps} calls ({after.model_steps - before.model_steps} "
          f"model steps), {after.num_running} running, {after.num_waiting} waiting, device {jax.devices()[0].device_kind}")
    pstats.Stats(prof).sort_stats("cumtime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
