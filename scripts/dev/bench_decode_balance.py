"""The Mosaic decode kernel at the context lengths an 8B ShareGPT run decodes, items dealt in batch order
against longest first in a snake (``paged_attention_mgpu(balance=...)``), and against equal lengths of the same
total (the balanced ideal).

    python scripts/dev/bench_decode_balance.py --requests /tmp/req1000.json [--every 100]

The batches: the engine's schedule (``max_num_seqs`` 256, 8192 tokens a step; as
``scripts/dev/sim_token_budget.py``) replayed over the requests, the decoding sequences' context lengths taken
every ``--every`` steps (batches of >= 8 sequences). Llama-3.1-8B's attention shape: 32 query heads, 8 KV heads,
head size 128, bf16, block size 16, random block tables. CUPTI device time per call (``bench_attention._timer``)
and GB/s of K/V read; outputs of the two deals compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_attention import BLOCK_SIZE, DTYPE, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, _timer  # noqa: E402
from sim_token_budget import replay  # noqa: E402  (scripts/dev, this script's folder)

from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402


def decode_batches(requests, *, seats=256, budget=8192, every=100, min_rows=8):
    """``[(step, [context length of each decoding sequence])]`` of the engine's schedule (sim_token_budget)."""
    return [(step, [c + 1 for c in contexts])   # the new token's K/V is read too
            for step, (contexts, _, _, _) in enumerate(replay(requests, budget=budget, seats=seats))
            if step % every == 0 and len(contexts) >= min_rows]


def make_inputs(rng, lens):
    pages = [-(-n // BLOCK_SIZE) for n in lens]
    width, num_blocks = max(pages), sum(pages)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(lens), width), np.int32)
    at = 0
    for i, p in enumerate(pages):
        tables[i, :p] = perm[at:at + p]
        at += p
    key = jax.random.key(int(rng.integers(2**31)))
    kv = jax.random.normal(key, (2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE), DTYPE)
    q = jax.random.normal(jax.random.fold_in(key, 1), (len(lens), NUM_HEADS, HEAD_SIZE), DTYPE)
    return q, kv, jnp.asarray(tables), jnp.asarray(np.asarray(lens, np.int32))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", required=True, help="[[prompt_ids, output_len], ...]")
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    reqs = [(len(pr), o) for pr, o in json.load(open(a.requests))]
    time_calls, how = _timer()
    print(f"device {jax.devices()[0].device_kind}; {how}; 32/8 heads of 128, bf16, block 16")
    print(f"{'step':>5} {'seqs':>5} {'mean':>6} {'max':>6} {'in order us':>12} {'balanced us':>12} {'equal us':>9} "
          f"{'speedup':>8} {'GB/s bal':>9}")
    rng = np.random.default_rng(0)
    fns = {b: jax.jit(lambda q, kv, t, n, b=b: paged_attention_mgpu(q, kv, t, n, scale=0.08, balance=b))
           for b in (False, True)}
    ratios = []
    for step, lens in decode_batches(reqs, every=a.every):
        inputs = make_inputs(rng, lens)
        same = bool(jnp.array_equal(fns[False](*inputs), fns[True](*inputs)))
        t = {b: statistics.median(time_calls(fns[b], [inputs], a.iters)) * 1e6 for b in (False, True)}
        mean = int(round(np.mean(lens)))
        equal = make_inputs(rng, [mean] * len(lens))
        t_eq = statistics.median(time_calls(fns[True], [equal], a.iters)) * 1e6
        kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_SIZE * 2
        ratios.append(t[False] / t[True])
        print(f"{step:>5} {len(lens):>5} {mean:>6} {max(lens):>6} {t[False]:>12.1f} {t[True]:>12.1f} {t_eq:>9.1f} "
              f"{t[False] / t[True]:>7.2f}x {kv_bytes / t[True] / 1e3:>9.0f}" + ("" if same else "  OUTPUTS DIFFER"),
              flush=True)
    print(f"geomean speedup {float(np.exp(np.mean(np.log(ratios)))):.3f}x over {len(ratios)} batches")


if __name__ == "__main__":
    main()
