"""The Mosaic decode kernel on batches of mixed context lengths: the longest-first deal (``balance``) on and off,
bf16 and the fp8 routes (issue 45). ``bench_attention.py``'s grid gives every sequence the same length, where the
deal can only cost (its two small sort kernels); here the lengths are drawn log-uniformly, where it may pay.

    python scripts/dev/bench_decode_mixed.py [--batches 64,256] [--min-len 64] [--max-len 8192]

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads of 128, block 16), random data and block tables, two
K/V sets rotated, CUPTI device time per call (``bench_attention._timer``: every kernel of the call, the sort
included), GB/s of K/V read (fp8 counted in fp8 bytes) and % of the measured copy bandwidth. Each output is
checked against the float32 reference of its own cache before timing.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import BLOCK_SIZE, DTYPE, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, _timer  # noqa: E402

from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

VARIANTS = {  # name: (fp8 cache, kwargs)
    "bf16 balance": (False, dict(balance=True)), "bf16 no balance": (False, dict(balance=False)),
    "fp8 default balance": (True, dict(balance=True)), "fp8 default no balance": (True, dict(balance=False)),
    "fp8 convert": (True, dict(fp8_route="convert")),
}


def make_sets(rng, lens, num_sets=2):
    pages = -(-np.asarray(lens) // BLOCK_SIZE)
    width, total = int(pages.max()), int(pages.sum())
    sets = []
    for _ in range(num_sets):
        key = jax.random.key(int(rng.integers(2**31)))
        kv = jax.random.normal(key, (2, total, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE), DTYPE)
        q = jax.random.normal(jax.random.fold_in(key, 1), (len(lens), NUM_HEADS, HEAD_SIZE), DTYPE)
        perm = rng.permutation(total)
        tables = np.zeros((len(lens), width), np.int32)
        at = 0
        for s, n in enumerate(pages):
            tables[s, :n] = perm[at:at + n]
            at += n
        sets.append((q, kv, jnp.asarray(tables), jnp.asarray(lens, jnp.int32)))
    return sets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_decode_mixed needs a GPU", file=sys.stderr)
        return 2
    time_calls, how = _timer()
    x = jax.random.normal(jax.random.key(0), (2**30,), jnp.bfloat16)
    copy_gbs = 2 * x.nbytes / statistics.median(time_calls(jax.jit(lambda a: a + 1), [(x,)], 10)) / 1e9
    del x
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  timing: {how}")
    print(f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s; lengths log-uniform in [{args.min_len}, {args.max_len}]")
    rng = np.random.default_rng(0)
    scale = HEAD_SIZE ** -0.5
    for batch in (int(b) for b in args.batches.split(",")):
        lens = np.exp(rng.uniform(np.log(args.min_len), np.log(args.max_len), batch)).astype(np.int32)
        sets16 = make_sets(rng, lens)
        sets8 = [(q, kv.astype(jnp.float8_e4m3fn), t, l) for q, kv, t, l in sets16]
        bytes16 = 2 * int(lens.sum()) * NUM_KV_HEADS * HEAD_SIZE * 2
        row = {}
        for name, (fp8, kw) in VARIANTS.items():
            sets = sets8 if fp8 else sets16
            extra = dict(k_scale=1.0, v_scale=1.0) if fp8 else {}
            fn = jax.jit(functools.partial(paged_attention_mgpu, scale=scale, **extra, **kw))
            q, kv, t, l = sets[0]
            ref = paged_attention_reference(q.astype(jnp.float32), kv.astype(jnp.float32), t, l, scale=scale)
            err = float(jnp.abs(fn(*sets[0]).astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
            if not err < 2e-2:
                print(f"  batch {batch} {name}: WRONG, rel err {err:.2e}")
                continue
            sec = statistics.median(time_calls(fn, sets, args.iters))
            row[name] = sec
            gbs = bytes16 / (2 if fp8 else 1) / sec / 1e9
            print(f"batch {batch:>3} (mean len {lens.mean():.0f}, max {lens.max()}): {name:>24} {sec * 1e6:8.1f} us "
                  f"{gbs:6.0f} GB/s {100 * gbs / copy_gbs:5.1f} %", flush=True)
        if "bf16 balance" in row and "bf16 no balance" in row:
            print(f"  balance speed-up (time without / with): bf16 {row['bf16 no balance'] / row['bf16 balance']:.3f}x"
                  + (f", fp8 {row['fp8 default no balance'] / row['fp8 default balance']:.3f}x"
                     if "fp8 default balance" in row and "fp8 default no balance" in row else ""))
        best16 = min((row[k] for k in ("bf16 balance", "bf16 no balance") if k in row), default=None)
        if best16:
            print("  fp8 speed-up over the faster bf16: " + ", ".join(
                f"{k} {best16 / v:.2f}x" for k, v in row.items() if k.startswith("fp8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
