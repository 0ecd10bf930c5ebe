"""The Pallas prefill / chunked-prefill / mixed-batch kernel vs a float64 token loop.

Interpret mode on CPU; compiled (Pallas-Triton) when run on a GPU: ``pytest`` this file there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning
from pallas_kernels.paged_attention import paged_attention as decode_attention
from pallas_kernels.paged_prefill_attention import (
    _query_tiles,
    _tile_kv_range,
    num_query_tiles,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from tests.conftest import TOLERANCE, PagedBatch, decode_attention_loop, rel_err
from tests.conftest import prefill_attention_loop as prefill_loop

# Interpret mode on CPU (CI); on a GPU the same tests run the compiled Pallas-Triton kernel.
INTERPRET = jax.default_backend() != "gpu"
NUM_PAD_TOKENS = 3  # tokens past query_start_loc[-1]: they belong to no sequence, their output is 0


def make_batch(rng, context_lens, query_lens, *, num_heads, num_kv_heads, head_size, block_size,
               dtype="float32", kv_dtype=None):
    """Paged batch (NaN in unowned pages) + queries with NUM_PAD_TOKENS padding tokens at the end.

    Returns ``(batch, q_f64_rounded, args)`` where ``batch.kv_cache`` holds the values the kernel sees
    (rounded to ``dtype``) and ``args`` are the kernel's positional arguments.
    """
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    batch = PagedBatch(rng, seq_lens=seq_lens, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size)
    q = jnp.asarray(rng.standard_normal((sum(query_lens) + NUM_PAD_TOKENS, num_heads, head_size)), dtype)
    kv = jnp.asarray(batch.kv_cache, kv_dtype or dtype)
    batch.kv_cache = np.asarray(kv, np.float64)  # the loop sees the same rounded values
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32)
    args = (q, kv, jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens), qsl)
    return batch, np.asarray(q, np.float64), args


def check(out, expected, query_lens, dtype, factor=1.0):
    out = np.asarray(out, np.float64)
    n = sum(query_lens)
    assert np.isfinite(out).all(), "NaN pages leaked into the output"
    assert rel_err(out[:n], expected[:n]) < TOLERANCE[dtype] * factor
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens


CASES = [
    # (num_heads, num_kv_heads, head_size, block_size, dtype, block_q, pages_per_compute_block)
    (9, 3, 64, 16, "float32", None, None),    # SmolLM2 group of 3, tuned defaults
    (9, 3, 64, 16, "bfloat16", 8, 1),
    (9, 3, 80, 8, "float32", 4, 2),           # padded head size, 16-row tiles
    (8, 1, 64, 16, "bfloat16", 2, 4),         # MQA: 2 tokens x 8 heads per tile
    (4, 4, 80, 16, "bfloat16", 16, 2),        # 1:1, padded head size
    (4, 2, 96, 16, "float32", 16, 1),
    (8, 2, 128, 16, "bfloat16", None, None),
    (2, 1, 256, 16, "float32", 8, 1),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size,dtype,block_q,ppcb", CASES)
def test_kernel_matches_float64_loop(rng, num_heads, num_kv_heads, head_size, block_size, dtype,
                                     block_q, ppcb):
    """Prefix lengths 0 / block-1 / block / several blocks, decode tokens beside long queries, a dummy."""
    bs = block_size
    context_lens = [0, bs - 1, bs, 0, 3 * bs + 5, 2 * bs + 7]
    query_lens = [21, 7, 1, 0, 13, 1]
    batch, q, args = make_batch(rng, context_lens, query_lens, num_heads=num_heads,
                                num_kv_heads=num_kv_heads, head_size=head_size, block_size=bs, dtype=dtype)
    scale = head_size ** -0.5
    out = paged_prefill_attention(*args, scale=scale, max_query_len=24, block_q=block_q,
                                  pages_per_compute_block=ppcb, interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == jnp.dtype(dtype)
    check(out, prefill_loop(q, batch, query_lens, scale), query_lens, dtype)


def test_random_lengths_match_loop_and_reference(rng):
    context_lens = rng.integers(0, 40, 5).tolist()
    query_lens = rng.integers(0, 25, 5).tolist()
    query_lens[int(rng.integers(5))] = 1
    batch, q, args = make_batch(rng, context_lens, query_lens, num_heads=6, num_kv_heads=2, head_size=64,
                                block_size=8)
    out = paged_prefill_attention(*args, scale=0.125, max_query_len=max(query_lens), block_q=8,
                                  interpret=INTERPRET)
    check(out, prefill_loop(q, batch, query_lens, 0.125), query_lens, "float32")
    ref = paged_prefill_attention_reference(*args, scale=0.125, max_query_len=max(query_lens))
    assert rel_err(out, np.asarray(ref, np.float64)) < TOLERANCE["float32"]


EXTRAS = [
    dict(sliding_window=5),     # smaller than the prompts: early pages of later tiles are skipped
    dict(sliding_window=100),   # larger than every sequence: no effect
    dict(logits_soft_cap=3.0),
    dict(alibi=True),
    dict(sliding_window=9, logits_soft_cap=2.0, alibi=True),
]


@pytest.mark.parametrize("extra", EXTRAS, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_extras_match_loop(rng, extra):
    nh = 6
    context_lens, query_lens = [0, 7, 20, 3], [19, 1, 12, 0]
    batch, q, args = make_batch(rng, context_lens, query_lens, num_heads=nh, num_kv_heads=2, head_size=64,
                                block_size=8)
    kwargs = {k: v for k, v in extra.items() if k != "alibi"}
    slopes = 2.0 ** -np.arange(1, nh + 1) if extra.get("alibi") else None
    expected = prefill_loop(q, batch, query_lens, 0.125, alibi_slopes=slopes, **kwargs)
    if slopes is not None:
        kwargs["alibi_slopes"] = jnp.asarray(slopes, jnp.float32)
    out = paged_prefill_attention(*args, scale=0.125, max_query_len=19, block_q=8,
                                  pages_per_compute_block=1, interpret=INTERPRET, **kwargs)
    check(out, expected, query_lens, "float32")


@pytest.mark.parametrize("fp8,q_dtype", [("float8_e4m3fn", "bfloat16"), ("float8_e5m2", "float32")])
def test_fp8_cache_dequantised_in_kernel(rng, fp8, q_dtype):
    """An fp8 cache with k/v scales equals attention over exactly the dequantised values."""
    context_lens, query_lens = [0, 17, 5], [12, 1, 9]
    k_scale, v_scale = 0.5, 2.0
    batch, q, args = make_batch(rng, context_lens, query_lens, num_heads=9, num_kv_heads=3, head_size=64,
                                block_size=16, dtype=q_dtype)
    scales = np.array([k_scale, v_scale]).reshape(2, 1, 1, 1, 1)
    quantized = jnp.asarray(batch.kv_cache / scales, fp8)
    batch.kv_cache = np.asarray(quantized, np.float64)  # the loop applies the scales itself
    expected = prefill_loop(q, batch, query_lens, 0.125, k_scale=k_scale, v_scale=v_scale)
    out = paged_prefill_attention(args[0], quantized, *args[2:], scale=0.125, max_query_len=12,
                                  k_scale=jnp.float32(k_scale), v_scale=jnp.float32(v_scale),
                                  interpret=INTERPRET)
    check(out, expected, query_lens, q_dtype, factor=10)  # p is rounded to q.dtype for p @ v


def test_sliding_window_skips_pages_before_the_window(rng):
    """Pages before every tile's window may be NaN (freed): output unchanged; the tile ranges skip them."""
    bs, window = 8, 10
    context_lens, query_lens = [40], [16]  # positions 40..55, two tiles of 8: keys from 31 and 39 on
    batch, q, args = make_batch(rng, context_lens, query_lens, num_heads=4, num_kv_heads=1, head_size=64,
                                block_size=bs)
    kw = dict(scale=0.125, max_query_len=16, sliding_window=window, block_q=16, pages_per_compute_block=1,
              interpret=INTERPRET)
    clean = paged_prefill_attention(*args, **kw)
    poisoned = np.asarray(args[1]).copy()
    poisoned[:, batch.block_tables[0, :31 // bs]] = np.nan  # logical pages 0..2 (tokens 0..23)
    out = paged_prefill_attention(args[0], jnp.asarray(poisoned), *args[2:], **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))
    check(out, prefill_loop(q, batch, query_lens, 0.125, sliding_window=window), query_lens, "float32")

    def tile_range(row0, block_q):
        return tuple(int(x) for x in _tile_kv_range(
            jnp.int32(40), jnp.int32(16), jnp.int32(row0), block_q=block_q, block_size=bs,
            sliding_window=window, max_pages=7))
    assert tile_range(0, 8) == (31, 48, 3, 6)     # tokens 31..47 → pages 3..5 only
    assert tile_range(8, 8) == (39, 56, 4, 7)
    assert tile_range(16, 8)[1] == 0              # a tile past the queries visits nothing
    no_window = _tile_kv_range(jnp.int32(40), jnp.int32(16), jnp.int32(8), block_q=8, block_size=bs,
                               sliding_window=None, max_pages=7)
    assert [int(x) for x in no_window] == [0, 56, 0, 7]


def test_unowned_pages_do_not_matter(rng):
    """Changing every slot no sequence owns (NaN ↔ noise) leaves the output bit-identical."""
    batch, _, args = make_batch(rng, [5, 0, 30], [11, 9, 1], num_heads=9, num_kv_heads=3, head_size=80,
                                block_size=8)
    kw = dict(scale=0.125, max_query_len=11, block_q=4, interpret=INTERPRET)
    with_nan = paged_prefill_attention(*args, **kw)
    cache = np.asarray(args[1])
    filled = np.where(np.isnan(cache), rng.standard_normal(cache.shape) * 100, cache)
    with_noise = paged_prefill_attention(args[0], jnp.asarray(filled, jnp.float32), *args[2:], **kw)
    np.testing.assert_array_equal(np.asarray(with_nan), np.asarray(with_noise))


def test_decode_only_batch_matches_decode_kernel(rng):
    """query_len 1 everywhere (a decode step through the prefill kernel) = the decode kernel."""
    bs = 16
    batch, q, args = make_batch(rng, [0, bs - 1, bs, 70], [1, 1, 1, 1], num_heads=9, num_kv_heads=3,
                                head_size=64, block_size=bs)
    out = paged_prefill_attention(*args, scale=0.125, max_query_len=1, interpret=INTERPRET)
    check(out, decode_attention_loop(q[:4], batch, 0.125), [1, 1, 1, 1], "float32")
    dec = decode_attention(args[0][:4], *args[1:4], scale=0.125, interpret=INTERPRET)
    assert rel_err(out[:4], np.asarray(dec, np.float64)) < TOLERANCE["float32"]


@pytest.mark.parametrize("block_q", [1, 4, 32])
def test_query_tiles_cover_every_query_row_once(rng, block_q):
    """The flattened tile list = a loop over sequences and their ``cdiv(q_len, block_q)`` tiles; the
    tiles past the work own no row; the static bound holds for the largest possible batch too. Host
    logic: runs on the CPU device even on a GPU machine (60 shapes would compile there), jitted as the
    kernel's wrapper runs it (one compile a shape instead of one per eager op: a third of the time)."""
    with jax.default_device(jax.devices("cpu")[0]):
        _check_query_tiles(rng, block_q)


def _check_query_tiles(rng, block_q):
    for _ in range(20):
        num_seqs = int(rng.integers(1, 12))
        q_lens = rng.integers(0, 70, num_seqs) * (rng.random(num_seqs) < 0.8)
        num_tokens = int(q_lens.sum()) + int(rng.integers(0, 40))
        max_query_len = max(1, int(q_lens.max()))
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        seq_lens = jnp.asarray(q_lens + rng.integers(0, 50, num_seqs), jnp.int32)
        tiles = jax.jit(functools.partial(_query_tiles, block_q=block_q, max_query_len=max_query_len,
                                          num_tokens=num_tokens))
        t = jax.tree.map(np.asarray, tiles(qsl, seq_lens)._asdict())
        expected = sorted((s, k * block_q) for s in range(num_seqs) for k in range(-(-int(q_lens[s]) // block_q)))
        real = t["q_len"] > 0
        assert sorted(zip(t["seq"][real].tolist(), t["row0"][real].tolist())) == expected
        assert (t["row0"][~real] == 0).all()
        np.testing.assert_array_equal(t["q_start"][real], np.asarray(qsl)[t["seq"][real]])
        np.testing.assert_array_equal(t["seq_len"][real], np.asarray(seq_lens)[t["seq"][real]])
        # the most keys first inside a sequence (causal): row0 decreases along each sequence's tiles
        for s in range(num_seqs):
            rows = t["row0"][real & (t["seq"] == s)]
            assert (np.diff(rows) < 0).all()
    # worst case for the bound: every sequence ends one token into a tile
    n, bq = 7, 8
    assert num_query_tiles(n * (bq + 1), n, block_q=bq, max_query_len=bq + 1) >= n * 2


def test_mixed_batch_in_a_large_token_bucket(rng):
    """The engine's mixed step: many decode rows, dummy rows (no token) and one long chunk, the tokens padded
    to a bucket far above the real count and ``max_query_len`` = the bucket (what the runner passes)."""
    bs = 8
    context_lens = [5, 0, 17, 40, 0, 9, 30, 0, 2, 0]
    query_lens = [1, 0, 1, 1, 37, 1, 1, 0, 1, 0]
    batch, q, args = make_batch(rng, context_lens, query_lens, num_heads=9, num_kv_heads=3, head_size=64,
                                block_size=bs)
    pad = 128 - args[0].shape[0]
    q_padded = jnp.pad(args[0], ((0, pad), (0, 0), (0, 0)))
    out = paged_prefill_attention(q_padded, *args[1:], scale=0.125, max_query_len=128, interpret=INTERPRET)
    n = sum(query_lens)
    expected = prefill_loop(q, batch, query_lens, 0.125)
    assert rel_err(np.asarray(out[:n], np.float64), expected[:n]) < TOLERANCE["float32"]
    np.testing.assert_array_equal(np.asarray(out[n:]), 0.0)


def test_query_start_loc_may_start_past_zero(rng):
    """``query_start_loc[0] = D > 0`` (jaxkv.attention.dispatch runs a mixed step's D leading decodes elsewhere): rows with no
    token before it, the first D tokens belong to no sequence (output 0), the rest match the loop."""
    context_lens = [30, 4, 9, 0, 11, 6]
    query_lens = [1, 1, 1, 13, 6, 0]
    batch, q, args = make_batch(rng, context_lens, query_lens, num_heads=9, num_kv_heads=3, head_size=64,
                                block_size=8)
    d = 3
    qsl = jnp.maximum(args[4], d)  # the three leading one-token rows now own no token
    seq_lens = args[3].at[:d].set(0)
    out = paged_prefill_attention(args[0], args[1], args[2], seq_lens, qsl, scale=0.125, max_query_len=16,
                                  interpret=INTERPRET)
    expected = prefill_loop(q, batch, query_lens, 0.125)
    n = sum(query_lens)
    np.testing.assert_array_equal(np.asarray(out[:d]), 0.0)
    assert rel_err(np.asarray(out[d:n], np.float64), expected[d:n]) < TOLERANCE["float32"]
    np.testing.assert_array_equal(np.asarray(out[n:]), 0.0)


def test_works_under_jit_with_traced_metadata(rng):
    """Inside jax.jit the metadata is traced: only shapes are validated, the kernel still runs."""
    batch, q, args = make_batch(rng, [3, 0], [9, 4], num_heads=4, num_kv_heads=2, head_size=64,
                                block_size=8)
    fn = jax.jit(lambda *a: paged_prefill_attention(*a, scale=0.125, max_query_len=9, interpret=INTERPRET))
    check(fn(*args), prefill_loop(q, batch, [9, 4], 0.125), [9, 4], "float32")


def _bad_args(change):
    """Concrete valid batch (2 sequences: 3 + 5 new tokens, seq_lens 3 and 9, block 8) with one change."""
    q = np.ones((8, 4, change.get("head_size", 64)), np.float32)
    kv = np.ones((2, 4, 2, 8, q.shape[-1]), np.float32)
    tables = np.array(change.get("tables", [[0, 0], [1, 2]]), np.int32)
    seq_lens = np.array(change.get("seq_lens", [3, 9]), np.int32)
    qsl = np.array(change.get("qsl", [0, 3, 8]), change.get("qsl_dtype", np.int32))
    kw = dict(scale=1.0, max_query_len=change.get("max_query_len", 8), interpret=INTERPRET)
    kw.update(change.get("kw", {}))
    return (q, kv, tables, seq_lens, qsl), kw


@pytest.mark.parametrize("change,match", [
    (dict(qsl=[-1, 3, 8]), r"query_start_loc\[0\]=-1 must be >= 0"),
    (dict(qsl=[0, 5, 3]), r"query_start_loc\[2\]=3 < query_start_loc\[1\]=5"),
    (dict(qsl=[0, 3, 9]), r"query_start_loc\[-1\]=9 exceeds num_tokens=8"),
    (dict(seq_lens=[2, 9]), r"query_len=3 of sequence 0 exceeds its seq_len=2"),
    (dict(max_query_len=4), r"query_len=5 of sequence 1 exceeds max_query_len=4"),
    (dict(seq_lens=[3, 17]), r"seq_lens\[1\]=17 needs 3 blocks"),
    (dict(tables=[[0, 0], [1, 4]]), r"block_tables\[1, 1\]=4 is not a block id"),
    (dict(qsl=[0, 8]), r"query_start_loc.shape=\(2,\)"),
    (dict(qsl_dtype=np.int64), r"query_start_loc.dtype=int64"),
    (dict(head_size=512), r"head_size=512"),
    (dict(kw=dict(block_q=6)), r"block_q=6 must be a power of two"),
    (dict(max_query_len=0), r"max_query_len=0"),
])
def test_bad_input_raises_before_launch(change, match):
    args, kw = _bad_args(change)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(*args, **kw)


def test_valid_bad_input_baseline_runs():
    """The unchanged batch of the bad-input cases is accepted (so each case fails for its own reason)."""
    args, kw = _bad_args({})
    assert np.isfinite(np.asarray(paged_prefill_attention(*args, **kw))).all()


@pytest.mark.parametrize("group,head_size,max_query_len,itemsize,expected", [
    (4, 128, 2048, 2, 32), (3, 64, 2048, 2, 32), (1, 128, 2048, 2, 128),
    (8, 256, 2048, 2, 8),    # 64 rows: a 128 x 256 bf16 Q tile would be 64 KiB
    (4, 128, 2048, 4, 16),   # f32: 64 rows x 128 x 4 B = 32 KiB
    (1, 64, 1, 2, 16),       # a decode-like batch still fills the 16 rows a dot needs
    (32, 64, 512, 2, 4),     # MQA with 32 heads
    (4, 128, 5, 2, 8),       # short chunks: no wider than the longest query
])
def test_prefill_block_q_heuristic(group, head_size, max_query_len, itemsize, expected):
    assert tuning.prefill_block_q(group, head_size, max_query_len, itemsize) == expected


def test_prefill_tiles_fit_shared_memory():
    assert tuning.prefill_pages_per_compute_block(16, 128, 2) == 8   # 128 tokens, 32 KiB
    assert tuning.prefill_pages_per_compute_block(16, 256, 4) == 2   # 32 KiB f32 tile
    assert tuning.prefill_pages_per_compute_block(128, 80, 4) == 1   # 128 x 128 f32 = 64 KiB: one page
