"""Paged decode attention benchmark on a GPU: our Pallas kernel vs JAX's Pallas paged_attention.

    python scripts/bench_attention.py --mode decode [--quick]

Shape (issue 4's grid): 32 query heads, 8 KV heads, head_size 128, bf16, block_size 16, random block
tables, all sequences the same length. GB/s = K+V bytes read (2 * sum(seq_lens) * num_kv_heads *
head_size * itemsize) / median per-call device time. Device time is the sum of every GPU kernel the call
launches (read with torch.profiler / CUPTI when torch is importable; otherwise wall-clock per call,
dispatch included, and the table says so). K/V sets rotate so they are not served from L2. Every output
is checked against the float32 reference before timing.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

GRID = [(1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 1024), (64, 4096), (256, 1024), (256, 4096)]
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, jnp.bfloat16
L2_BYTES = 50 * 2**20


def _timer():
    """Returns ``time_calls(fn, inputs, iters) -> list[seconds per call]`` and its description."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        torch = None
    if torch is None:
        def wall(fn, inputs, iters):
            times = []
            for i in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*inputs[i % len(inputs)]))
                times.append(time.perf_counter() - t0)
            return times
        return wall, "wall-clock per call (dispatch included)"

    def cupti(fn, inputs, iters, reps=5):
        per_call = []
        for _ in range(reps):
            jax.block_until_ready(fn(*inputs[0]))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                outs = [fn(*inputs[i % len(inputs)]) for i in range(iters)]
                jax.block_until_ready(outs)
            total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
            if total_us == 0:
                raise RuntimeError("CUPTI recorded no kernel: rerun without torch for wall-clock timing")
            per_call.append(total_us * 1e-6 / iters)
        return per_call
    return cupti, "CUPTI device time per call (all kernels of the call)"


def _make_inputs(rng, batch, ctx, num_sets):
    pages_per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * pages_per_seq
    sets = []
    for _ in range(num_sets):
        key = jax.random.key(int(rng.integers(2**31)))
        kv = jax.random.normal(key, (2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE), DTYPE)
        q = jax.random.normal(jax.random.fold_in(key, 1), (batch, NUM_HEADS, HEAD_SIZE), DTYPE)
        tables = jnp.asarray(rng.permutation(num_blocks).reshape(batch, pages_per_seq).astype(np.int32))
        sets.append((q, kv, tables, jnp.full((batch,), ctx, jnp.int32)))
    return sets


def _to_jax_layout(q, kv, tables, lens):
    # jax.experimental.pallas.ops.gpu.paged_attention: k/v [num_kv_heads, total_pages, page_size, D]
    return q, kv[0].transpose(1, 0, 2, 3), kv[1].transpose(1, 0, 2, 3), tables, lens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("decode",), default="decode")
    p.add_argument("--quick", action="store_true", help="fewer variants")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_attention needs a GPU", file=sys.stderr)
        return 2
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    time_calls, how = _timer()
    rng = np.random.default_rng(0)
    scale = HEAD_SIZE ** -0.5
    # copy ceiling: read + write of a 2 GiB buffer
    x = jax.random.normal(jax.random.key(0), (2**30,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + 1)
    t = statistics.median(time_calls(copy, [(x,)], 10))
    copy_gbs = 2 * x.nbytes / t / 1e9
    del x
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  timing: {how}")
    print(f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s")

    ours = {"ours auto": dict(), "ours s=1 p=8": dict(num_splits=1, pages_per_compute_block=8)}
    if not args.quick:
        ours.update({f"ours s={s} p={pp}": dict(num_splits=s, pages_per_compute_block=pp)
                     for s in (4, 16) for pp in (4, 8)})
    peers = {"jax default": dict()}
    if not args.quick:
        peers.update({f"jax k={k} p={pp}": dict(k_splits=k, pages_per_compute_block=pp)
                      for k in (1, 4, 16) for pp in (4, 16)})

    rows = []
    for batch, ctx in GRID:
        kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2
        num_sets = max(2, min(4, -(-3 * L2_BYTES // kv_bytes)))
        inputs = _make_inputs(rng, batch, ctx, num_sets)
        ref = paged_attention_reference(*(a.astype(jnp.float32) if a.dtype == DTYPE else a
                                          for a in inputs[0]), scale=scale) if batch * ctx <= 2**18 else None
        results = {}
        variants = [(n, functools.partial(paged_attention, scale=scale, **kw), inputs) for n, kw in ours.items()]
        jax_inputs = [_to_jax_layout(*s) for s in inputs]
        # JAX's kernel applies no softmax scale: the caller scales q (one tiny fused op, timed too)
        variants += [(n, jax.jit(lambda q, *rest, kw=kw: jax_pa.paged_attention(q * scale, *rest, **kw)),
                      jax_inputs) for n, kw in peers.items()]
        for name, fn, ins in variants:
            try:
                out = fn(*ins[0])
            except Exception as e:  # a peer's parameter combination may not apply to this shape
                results[name] = None
                print(f"  {batch=} {ctx=} {name}: skipped ({type(e).__name__}: {str(e)[:80]})")
                continue
            if ref is not None:
                err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
                if not err < 2e-2:
                    raise SystemExit(f"{name} {batch=} {ctx=}: rel err {err:.2e} > 2e-2")
            t = statistics.median(time_calls(fn, ins, args.iters))
            results[name] = kv_bytes / t / 1e9
        rows.append((batch, ctx, results))
        best_ours = max((v for k, v in results.items() if k.startswith("ours") and v), default=0)
        best_jax = max((v for k, v in results.items() if k.startswith("jax") and v), default=0)
        print(f"batch {batch:>3} ctx {ctx:>5}: ours auto {100 * results['ours auto'] / copy_gbs:5.1f}% "
              f"best {100 * best_ours / copy_gbs:5.1f}% | jax default {100 * (results['jax default'] or 0) / copy_gbs:5.1f}% "
              f"best {100 * best_jax / copy_gbs:5.1f}%  (% of copy bandwidth)", flush=True)

    names = list(ours) + list(peers)
    print("\nGB/s per kernel variant")
    print("batch   ctx " + " ".join(f"{n:>15}" for n in names))
    for batch, ctx, res in rows:
        print(f"{batch:>5} {ctx:>5} " + " ".join(f"{res[n]:>15.0f}" if res.get(n) else f"{'-':>15}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
