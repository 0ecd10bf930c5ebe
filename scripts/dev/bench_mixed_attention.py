"""The paged prefill kernel at the continuous-batching engine's mixed-step shapes, on a GPU.

    python scripts/dev/bench_mixed_attention.py [--iters 20]

A mixed step (``jaxkv.worker.model_runner``) attends all rows of the largest request bucket (256, dummy
rows own no token) with ``max_query_len`` = the step's token bucket. The shapes below are what the
1000-request ShareGPT workload produces (docs/perf-notes.md, session 5: buckets 512 to 4096, ~250 decode
rows beside one or a few prefill chunks): SmolLM2's heads (9 query, 3 KV, head size 64), bf16, block 16,
contexts 100-800 tokens. Prints device time per call (CUPTI through torch when importable, else wall
time, as ``bench_attention.py``) and, per shape, the 30-layer total: what one mixed step of SmolLM2
spends in attention. Every output is checked against ``paged_prefill_attention_reference`` first.

``--model-shape llama-8b`` (session 23): Llama-3.1-8B's heads (32 query, 8 KV, head size 128) at the 8B run's mixed
step (a 4096-token bucket, 240 decode rows of 100-800 tokens, 14 prompts of 231 tokens), in four forms: every row on
the prefill kernel; the prefill kernel with the leading decodes removed (``query_start_loc`` past them, as
``jaxkv.attention.dispatch`` runs it); the same prompts in a 16-row batch (the grid without a program per decode row); the
Mosaic decode kernel on the decode rows. Where the prefill kernel's time goes when its rows are decodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/ (bench_attention)
from bench_attention import _timer  # noqa: E402

from pallas_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_reference

ROWS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, NUM_LAYERS = 256, 16, 9, 3, 64, 30
# (token bucket, new tokens of the prefill chunks, decode rows)
SHAPES = [(512, [200], 250), (1024, [700], 250), (2048, [1000, 700], 240), (4096, [3800], 200), (512, [], 250)]


def make_inputs(rng, bucket: int, chunks: list[int], num_decodes: int, *, rows: int = ROWS, heads=None):
    num_heads, num_kv_heads, head_size = heads or (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE)
    q_lens = np.zeros(rows, np.int64)
    ctx = rng.integers(100, 800, rows)
    q_lens[:num_decodes] = 1
    for i, n in enumerate(chunks):
        q_lens[num_decodes + i], ctx[num_decodes + i] = n, 0
    ctx[q_lens == 0] = 0
    seq_lens = (ctx + q_lens).astype(np.int32)
    pages = [-(-int(n) // BLOCK_SIZE) for n in seq_lens]
    tables = np.zeros((rows, max(pages)), np.int32)
    perm = rng.permutation(sum(pages) + 1)
    c = 0
    for s, n in enumerate(pages):
        tables[s, :n] = perm[c:c + n]
        c += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((bucket, num_heads, head_size)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, sum(pages) + 1, num_kv_heads, BLOCK_SIZE, head_size)), jnp.bfloat16)
    return (q, kv, jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(qsl)), int(qsl[-1])


def max_error_vs_reference(out, inputs) -> float:
    """max |kernel - reference| over the real tokens. The reference is dense over ``max_query_len``, so it
    runs per group of rows with equal query length (the decode rows at 1, each chunk alone): one call over
    all 256 rows at the bucket's length would need tens of GiB."""
    q, kv, tables, seq_lens, qsl = (np.asarray(x) if i != 1 else x for i, x in enumerate(inputs))
    q_lens = np.diff(qsl)
    err = 0.0
    for n in sorted(set(int(v) for v in q_lens if v > 0)):
        rows = np.flatnonzero(q_lens == n)
        tok = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in rows])
        sub_qsl = np.arange(len(rows) + 1, dtype=np.int32) * n
        ref = paged_prefill_attention_reference(jnp.asarray(q[tok]), kv, jnp.asarray(tables[rows]),
                                                jnp.asarray(seq_lens[rows]), jnp.asarray(sub_qsl),
                                                scale=0.125, max_query_len=n)
        got = np.asarray(out[jnp.asarray(tok)], np.float32)
        err = max(err, float(np.abs(got - np.asarray(ref, np.float32)).max()))
    return err


def llama8b_forms(time_calls, iters: int) -> None:
    """The 8B mixed step's attention in the four forms of the module docstring, us per call (one layer)."""
    from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu
    rng = np.random.default_rng(0)
    heads, bucket, decodes, chunks = (32, 8, 128), 4096, 240, [231] * 14
    scale = 128 ** -0.5
    args, real = make_inputs(rng, bucket, chunks, decodes, rows=256, heads=heads)
    q, kv, tables, seq_lens, qsl = args
    prefill = jax.jit(lambda *a: paged_prefill_attention(*a, scale=scale, max_query_len=bucket))
    lead = np.arange(256) < decodes
    apart = (q, kv, tables, jnp.where(lead, 0, seq_lens), jnp.maximum(qsl, decodes))
    few = (q[decodes:], kv, tables[decodes:decodes + 16], seq_lens[decodes:decodes + 16],
           qsl[decodes:decodes + 17] - decodes)
    decode = jax.jit(lambda q, kv, t, s: paged_attention_mgpu(q, kv, t, s, scale=scale))
    dec_args = (q[:256], kv, tables, jnp.where(lead, seq_lens, 0))
    full, part = np.asarray(prefill(*args), np.float32), np.asarray(prefill(*apart), np.float32)
    small = np.asarray(prefill(*few), np.float32)
    dec = np.asarray(decode(*dec_args), np.float32)
    err = max(float(np.abs(part[decodes:real] - full[decodes:real]).max()),
              float(np.abs(small[:real - decodes] - full[decodes:real]).max()),
              float(np.abs(dec[:decodes] - full[:decodes]).max()))
    print(f"llama-8b heads, bucket {bucket}, {decodes} decode rows + {len(chunks)} prompts of {chunks[0]}: "
          f"max |difference| between the forms {err:.3g}")
    for name, fn, a in (("every row on the prefill kernel", prefill, args),
                        ("prefill kernel, leading decodes removed (query_start_loc past them)", prefill, apart),
                        ("prefill kernel, the prompts alone in 16 rows", prefill, few),
                        ("Mosaic decode kernel, the decode rows", decode, dec_args)):
        t = statistics.median(time_calls(fn, [a], iters))
        print(f"  {1e6 * t:8.1f} us  {name}", flush=True)
    # the prefill kernel's knobs on the leading-decodes form, and on one 4096-token prompt (a prefill step)
    long_args, _ = make_inputs(rng, bucket, [bucket], 0, rows=16, heads=heads)
    for knobs in (dict(), dict(block_q=64), dict(num_stages=2), dict(block_q=64, num_stages=2)):
        fn = jax.jit(lambda *a, k=tuple(knobs.items()): paged_prefill_attention(*a, scale=scale, max_query_len=bucket,
                                                                               **dict(k)))
        got = np.asarray(fn(*apart), np.float32)
        err = float(np.abs(got[decodes:real] - full[decodes:real]).max())
        t_mixed = statistics.median(time_calls(fn, [apart], iters))
        t_long = statistics.median(time_calls(fn, [long_args], iters))
        print(f"  {knobs or 'tuned defaults'}: leading decodes removed {1e6 * t_mixed:8.1f} us (max |diff| {err:.3g}); "
              f"one 4096-token prompt {1e6 * t_long:8.1f} us", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model-shape", choices=("smollm2", "llama-8b"), default="smollm2")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_mixed_attention needs a GPU", file=sys.stderr)
        return 2
    time_calls, how = _timer()
    if args.model_shape == "llama-8b":
        print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  timing: {how}")
        llama8b_forms(time_calls, args.iters)
        return 0
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  timing: {how}")
    print(f"{'bucket':>6} {'chunks':>12} {'decodes':>7} {'real tokens':>11} {'us/call':>9} {'x30 layers ms':>13}")
    for bucket, chunks, num_decodes in SHAPES:
        inputs, real = make_inputs(rng, bucket, chunks, num_decodes)
        fn = jax.jit(lambda *a, b=bucket: paged_prefill_attention(*a, scale=0.125, max_query_len=b))
        out = fn(*inputs)
        err = max_error_vs_reference(out, inputs)
        if not err < 5e-2:
            raise SystemExit(f"bucket {bucket}: max |kernel - reference| = {err}")
        t = statistics.median(time_calls(fn, [inputs], args.iters))
        print(f"{bucket:>6} {str(chunks):>12} {num_decodes:>7} {real:>11} {1e6 * t:>9.1f} {1e3 * t * NUM_LAYERS:>13.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
