"""The Pallas decode kernel (interpret mode) and its jnp reference vs a float64 loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_prefill_attention import paged_prefill_attention
from tests.conftest import TOLERANCE, PagedBatch, decode_attention_loop, rel_err, slow

ON_GPU = jax.default_backend() == "gpu"  # the tests marked "compiled on a GPU" run interpreted elsewhere

CASES = [
    # (num_heads, num_kv_heads, head_size, block_size, dtype, num_splits, pages_per_compute_block)
    (9, 3, 64, 16, "float32", 1, 8),     # SmolLM2: non-power-of-two group
    (9, 3, 64, 16, "bfloat16", 1, 4),
    (9, 3, 64, 8, "float16", 2, 2),
    (8, 8, 64, 32, "float32", 1, 2),     # 1:1 (MHA)
    (8, 1, 128, 16, "bfloat16", 3, 2),   # MQA, split-k
    (32, 8, 128, 16, "bfloat16", 2, 8),  # Llama-3 style group of 4
    (4, 2, 256, 16, "float32", 1, 1),
    (12, 4, 32, 32, "float16", 1, 4),
    (9, 3, 64, 16, "bfloat16", 8, 1),    # SmolLM2 at the tuned 8 splits: most partitions empty (m = -inf)
    (6, 2, 80, 16, "float32", 4, 1),     # 80 channels computed as 128, group of 3: masked rows and lanes
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size,dtype,num_splits,ppcb", CASES)
def test_kernel_matches_float64_loop(rng, num_heads, num_kv_heads, head_size, block_size, dtype,
                                     num_splits, ppcb):
    bs = block_size
    seq_lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3]
    batch = PagedBatch(rng, seq_lens=seq_lens, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=bs)
    q = rng.standard_normal((len(seq_lens), num_heads, head_size))
    scale = head_size ** -0.5
    args = (jnp.asarray(q, dtype), jnp.asarray(batch.kv_cache, dtype), jnp.asarray(batch.block_tables),
            jnp.asarray(batch.seq_lens))
    # the reference sees the same rounded inputs the kernel sees
    rounded = PagedBatch.__new__(PagedBatch)
    rounded.__dict__.update(batch.__dict__, kv_cache=np.asarray(args[1], np.float64))
    expected = decode_attention_loop(np.asarray(args[0], np.float64), rounded, scale)

    out = paged_attention(*args, scale=scale, interpret=True, num_splits=num_splits,
                          pages_per_compute_block=ppcb)
    assert out.shape == q.shape and out.dtype == jnp.dtype(dtype)
    assert np.isfinite(np.asarray(out, np.float64)).all(), "NaN pages leaked into the output"
    assert rel_err(out, expected) < TOLERANCE[dtype]
    ref = paged_attention_reference(*args, scale=scale)
    assert rel_err(ref, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("masked_loads", [True, False])
def test_plain_gather_variant_matches_loop(rng, masked_loads):
    batch = PagedBatch(rng, seq_lens=[1, 15, 16, 17, 83], num_kv_heads=3, head_size=64, block_size=16)
    q = rng.standard_normal((5, 9, 64))
    out = paged_attention(jnp.asarray(q, jnp.float32), jnp.asarray(batch.kv_cache, jnp.float32),
                          jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens), scale=0.125,
                          interpret=True, masked_loads=masked_loads, num_splits=2)
    assert rel_err(out, decode_attention_loop(q, batch, 0.125)) < TOLERANCE["float32"]


@pytest.mark.parametrize("num_splits,ppcb,merge_impl", [
    (None, None, "pallas"),  # the tuned choice here: 1 split
    (3, 1, "pallas"),        # partitions of 2 pages: the last ones of the short sequences are empty
    (3, 1, "xla"),
])
def test_unowned_pages_do_not_matter(rng, num_splits, ppcb, merge_impl):
    """Changing every page no sequence owns (NaN ↔ random) leaves the output bit-identical."""
    batch = PagedBatch(rng, seq_lens=[3, 17, 40], num_kv_heads=3, head_size=64, block_size=16,
                       extra_blocks=5)
    q = jnp.asarray(rng.standard_normal((3, 9, 64)), jnp.float32)
    meta = (jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens))
    kwargs = dict(scale=0.125, interpret=True, num_splits=num_splits, pages_per_compute_block=ppcb,
                  merge_impl=merge_impl)
    with_nan = paged_attention(q, jnp.asarray(batch.kv_cache, jnp.float32), *meta, **kwargs)
    filled = np.where(np.isnan(batch.kv_cache), rng.standard_normal(batch.kv_cache.shape) * 100, batch.kv_cache)
    with_noise = paged_attention(q, jnp.asarray(filled, jnp.float32), *meta, **kwargs)
    np.testing.assert_array_equal(np.asarray(with_nan), np.asarray(with_noise))
    expected = decode_attention_loop(np.asarray(q, np.float64), batch, 0.125)
    assert rel_err(with_nan, expected) < TOLERANCE["float32"]


@pytest.mark.parametrize("num_splits,merge_impl", [(1, "pallas"), (2, "pallas"), (2, "xla")])
def test_zero_length_sequence_gives_zeros(rng, num_splits, merge_impl):
    batch = PagedBatch(rng, seq_lens=[5, 1], num_kv_heads=1, head_size=64, block_size=16)
    seq_lens = np.array([5, 0], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    out = paged_attention(q, jnp.asarray(batch.kv_cache, jnp.float32), jnp.asarray(batch.block_tables),
                          jnp.asarray(seq_lens), scale=0.125, interpret=True, num_splits=num_splits,
                          merge_impl=merge_impl)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    assert np.isfinite(np.asarray(out)).all()


def _merge_float64(acc, m, l, group, head_size):
    """vLLM v2's reduce, one (partition, sequence, KV head, row) at a time in float64."""
    num_splits, num_seqs, num_kv_heads = m.shape[:3]
    out = np.zeros((num_seqs, num_kv_heads, group, head_size))
    for s in range(num_seqs):
        for h in range(num_kv_heads):
            for r in range(group):
                ms = [float(m[p, s, h, r]) for p in range(num_splits)]
                top = max(ms)
                if top == -np.inf:
                    continue  # an empty sequence: 0
                num, den = np.zeros(head_size), 0.0
                for p in range(num_splits):
                    if ms[p] == -np.inf:
                        continue  # an empty partition weighs nothing
                    w = np.exp(ms[p] - top)
                    num += w * np.asarray(acc[p, s, h, r, :head_size], np.float64)
                    den += w * float(l[p, s, h, r])
                out[s, h, r] = num / den
    return out


@pytest.mark.parametrize("num_splits,group,head_size,dtype", [
    (3, 3, 80, "float32"),    # SmolLM2's group, padded rows (16) and lanes (128), a split count not 2^k
    (8, 16, 64, "bfloat16"),  # a full tile: unmasked loads and stores
])
def test_merge_kernel_matches_xla_merge_and_float64(rng, num_splits, group, head_size, dtype):
    """The one-kernel merge vs the XLA merge vs a float64 loop, on random partials with empty partitions
    (m = -inf, acc = l = 0, as the decode kernel writes them), one all-empty sequence and NaN in the
    padding rows/lanes (never read into the output). Compiled on a GPU, interpreted on CPU."""
    from pallas_kernels.paged_attention import _merge_partitions_pallas, _merge_partitions_xla
    num_seqs, num_kv_heads, block_h, head_p = 4, 2, 16, 1 << (head_size - 1).bit_length()
    part = (num_splits, num_seqs, num_kv_heads, block_h)
    m = rng.standard_normal(part) * 4
    l = rng.uniform(1.0, 30.0, part)  # the partition's max contributes exp(0) = 1
    acc = rng.standard_normal((*part, head_p)) * l[..., None]
    empty = rng.random(part[:3]) < 0.4
    empty[:, 1] = True  # sequence 1 saw no key in any partition (seq_len 0)
    empty[0, 2] = empty[1:, 3] = False
    m[empty], l[empty], acc[empty] = -np.inf, 0.0, 0.0
    acc[..., group:, :] = acc[..., head_size:] = np.nan
    m[..., group:] = l[..., group:] = np.nan
    expected = _merge_float64(acc, m, l, group, head_size)
    args = [jnp.asarray(x, jnp.float32) for x in (acc, m, l)]
    kw = dict(group=group, head_size=head_size, dtype=jnp.dtype(dtype))

    got = _merge_partitions_pallas(*args, **kw, interpret=not ON_GPU)
    ref = _merge_partitions_xla(*args, **kw)
    assert got.shape == ref.shape == (num_seqs, num_kv_heads, group, head_size)
    assert got.dtype == ref.dtype == jnp.dtype(dtype)
    assert np.isfinite(np.asarray(got, np.float64)).all()
    np.testing.assert_array_equal(np.asarray(got[1], np.float64), 0.0)
    tol = 1e-6 if dtype == "float32" else TOLERANCE[dtype]
    assert rel_err(got, expected) < tol
    assert rel_err(ref, expected) < tol
    assert rel_err(got, np.asarray(ref, np.float64)) < tol


@pytest.mark.parametrize("merge_impl", ["pallas", "xla"])
def test_smollm2_split_decode_matches_loop(rng, merge_impl):
    """SmolLM2's heads (9 q / 3 KV, D 64, bf16, block 16) with the tuned small-batch 8 splits over a
    40-page table: a 1-token sequence (7 empty partitions), a partial and a full table, NaN in unowned
    pages; both merges vs the float64 loop. Compiled on a GPU, interpreted on CPU."""
    batch = PagedBatch(rng, seq_lens=[1, 300, 640], num_kv_heads=3, head_size=64, block_size=16,
                       extra_table_cols=0)
    q = jnp.asarray(rng.standard_normal((3, 9, 64)), jnp.bfloat16)
    kv = jnp.asarray(batch.kv_cache, jnp.bfloat16)
    rounded = PagedBatch.__new__(PagedBatch)
    rounded.__dict__.update(batch.__dict__, kv_cache=np.asarray(kv, np.float64))
    expected = decode_attention_loop(np.asarray(q, np.float64), rounded, 0.125)
    out = paged_attention(q, kv, jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens),
                          scale=0.125, num_splits=8, pages_per_compute_block=4, merge_impl=merge_impl,
                          interpret=not ON_GPU)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(np.asarray(out, np.float64)).all()
    assert rel_err(out, expected) < TOLERANCE["bfloat16"]


def _ops_outside_pallas(jaxpr, counts):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            counts["pallas_call"] += 1
        elif "jaxpr" in eqn.params and eqn.primitive.name in ("pjit", "jit", "closed_call"):
            _ops_outside_pallas(eqn.params["jaxpr"].jaxpr, counts)
        else:
            counts[eqn.primitive.name] += 1
    return counts


@pytest.mark.parametrize("num_splits,launches", [(1, 1), (8, 2)])
def test_decode_call_is_only_pallas_kernels(num_splits, launches):
    """At SmolLM2's decode shape (9 q / 3 KV heads, D 64, block 16, bf16, batch 8, 128 pages) the traced
    call is the decode kernel (and the merge kernel when split) plus free reshapes and the constant
    fp8 scales: no pad, slice, cast or reduction left to run as its own small XLA kernel."""
    import collections

    import jax
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((8, 9, 64), jnp.bfloat16),
                                                      ((2, 1025, 3, 16, 64), jnp.bfloat16),
                                                      ((8, 128), jnp.int32), ((8,), jnp.int32))]
    jaxpr = jax.make_jaxpr(lambda *a: paged_attention(*a, scale=0.125, num_splits=num_splits))(*shapes)
    counts = _ops_outside_pallas(jaxpr.jaxpr, collections.Counter())
    assert counts.pop("pallas_call") == launches
    # reshape: a bitcast; the rest builds the f32[2] (k_scale, v_scale) = (1, 1) constant
    allowed = {"reshape", "stack", "concatenate", "broadcast_in_dim", "convert_element_type"}
    assert set(counts) <= allowed, counts


def test_bad_merge_impl_raises():
    with pytest.raises(ValueError, match="merge_impl='triton'"):
        paged_attention(jnp.ones((1, 4, 64)), jnp.ones((2, 2, 1, 16, 64)), jnp.zeros((1, 1), jnp.int32),
                        jnp.ones((1,), jnp.int32), scale=1.0, merge_impl="triton", interpret=True)


@pytest.mark.parametrize("change,match", [
    (dict(q_shape=(2, 9, 288)), "head_size=288"),
    (dict(dtype="int8"), "dtype"),
    (dict(seq_lens_dtype="float32"), "seq_lens.dtype"),
    (dict(num_heads=8), "num_heads=8"),
    (dict(block_tables_rows=3), "block_tables.shape"),
])
def test_bad_input_raises(change, match):
    head = change.get("q_shape", (2, change.get("num_heads", 9), 64))
    dtype = change.get("dtype", "float32")
    q = jnp.ones(head, dtype)
    kv = jnp.ones((2, 4, 3, 16, head[-1]), dtype)
    tables = jnp.zeros((change.get("block_tables_rows", 2), 2), jnp.int32)
    seq_lens = jnp.ones((2,), change.get("seq_lens_dtype", "int32"))
    with pytest.raises(ValueError, match=match):
        paged_attention(q, kv, tables, seq_lens, scale=1.0, interpret=True)


@pytest.mark.parametrize("tables,seq_lens,match", [
    ([[0, 1], [2, 4]], [20, 17], r"block_tables\[1, 1\]=4 is not a block id in \[0, num_blocks=4\)"),
    ([[0, 1], [-1, 3]], [20, 17], r"block_tables\[1, 0\]=-1 is not a block id"),
    ([[0, 1], [2, 3]], [20, 33], r"seq_lens\[1\]=33 needs 3 blocks .* block_size=32\]"),
    ([[0, 1], [2, 3]], [-1, 17], r"seq_lens\[0\]=-1 must be >= 0"),
])
def test_bad_metadata_values_raise_before_launch(tables, seq_lens, match):
    """Issue 9: block ids outside the cache, seq_lens past the block table and negative seq_lens used to
    return finite garbage; with concrete metadata they raise (the value checks of jaxkv.checks)."""
    q, kv = jnp.ones((2, 9, 64)), jnp.ones((2, 4, 3, 16, 64))
    args = (q, kv, jnp.asarray(tables, jnp.int32), jnp.asarray(seq_lens, jnp.int32))
    with pytest.raises(ValueError, match=match):
        paged_attention(*args, scale=1.0, interpret=True)
    garbage_past_the_end = jnp.asarray([[0, 99], [2, 3]], jnp.int32)  # seq 0 (5 tokens) reads block 0 only
    out = paged_attention(q, kv, garbage_past_the_end, jnp.asarray([5, 17], jnp.int32), scale=1.0,
                          interpret=True)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("num_seqs,num_kv_heads,max_blocks,expected", [
    # the measured grid (ctx / 16 pages): the fastest measured split count within 3 %, except batch 8 /
    # ctx 4096 (4 splits measured 9 % faster than the rule's 16)
    (1, 8, 256, 16), (1, 8, 2048, 32), (8, 8, 256, 16), (8, 8, 2048, 16),
    (64, 8, 64, 2), (64, 8, 256, 2), (256, 8, 64, 1), (256, 8, 256, 1),
    (1, 8, 15, 1),     # shorter than one minimum partition: nothing to split
    (1, 3, 100, 4),    # 100 // 16 = 6 partitions of >= 16 pages → 4
    (2, 1, 1 << 20, 32),  # capped by DECODE_MAX_SPLITS
])
def test_decode_num_splits_heuristic(num_seqs, num_kv_heads, max_blocks, expected):
    from pallas_kernels.tuning import decode_num_splits
    assert decode_num_splits(num_seqs, num_kv_heads, max_blocks) == expected


def test_auto_splits_matches_reference(rng):
    batch = PagedBatch(rng, seq_lens=[1, 200, 333], num_kv_heads=2, head_size=64, block_size=16)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    args = (q, jnp.asarray(batch.kv_cache, jnp.float32), jnp.asarray(batch.block_tables),
            jnp.asarray(batch.seq_lens))
    expected = decode_attention_loop(np.asarray(q, np.float64), batch, 0.125)
    assert rel_err(paged_attention(*args, scale=0.125, interpret=True), expected) < TOLERANCE["float32"]


EXTRAS = [
    dict(sliding_window=1),
    dict(sliding_window=20),
    dict(sliding_window=70),
    dict(logits_soft_cap=5.0),
    dict(alibi=True),
    dict(sliding_window=33, logits_soft_cap=2.0, alibi=True),
]


def _extra_id(extra, num_splits):
    return "-".join(f"{k}={v}" for k, v in extra.items()) + f"-{num_splits}"


# Every extra with 3 splits (partitions a window leaves empty, the merge), all of them together with one;
# each alone with one split as well with JAXKV_SLOW=1 (the masks are the same code with any split).
EXTRA_CASES = ([pytest.param(e, 3, id=_extra_id(e, 3)) for e in EXTRAS]
               + [pytest.param(e, 1, id=_extra_id(e, 1), marks=() if e is EXTRAS[-1] else slow) for e in EXTRAS])


@pytest.mark.parametrize("extra,num_splits", EXTRA_CASES)
def test_decode_extras_match_loop(rng, extra, num_splits):
    """Sliding window, soft cap and ALiBi, alone and together, vs the float64 loop."""
    bs, nh, nkv, d = 16, 6, 2, 64
    batch = PagedBatch(rng, seq_lens=[1, 15, 16, 17, 90], num_kv_heads=nkv, head_size=d, block_size=bs)
    q = rng.standard_normal((5, nh, d))
    kwargs = {k: v for k, v in extra.items() if k != "alibi"}
    slopes = None
    if extra.get("alibi"):
        slopes = 2.0 ** -np.arange(1, nh + 1)  # the ALiBi paper's geometric slopes
        kwargs["alibi_slopes"] = jnp.asarray(slopes, jnp.float32)
    args = (jnp.asarray(q, jnp.float32), jnp.asarray(batch.kv_cache, jnp.float32),
            jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens))
    expected = decode_attention_loop(q, batch, d ** -0.5, alibi_slopes=slopes,
                                     **{k: v for k, v in kwargs.items() if k != "alibi_slopes"})
    out = paged_attention(*args, scale=d ** -0.5, interpret=True, num_splits=num_splits,
                          pages_per_compute_block=2, **kwargs)
    assert rel_err(out, expected) < TOLERANCE["float32"]
    ref = paged_attention_reference(*args, scale=d ** -0.5, **kwargs)
    assert rel_err(ref, expected) < TOLERANCE["float32"]


def test_sliding_window_ignores_blocks_outside_the_window(rng):
    """Blocks wholly before the window can be NaN (e.g. already freed): the output stays finite."""
    bs = 16
    batch = PagedBatch(rng, seq_lens=[100], num_kv_heads=1, head_size=64, block_size=bs)
    window = 30  # visible tokens 70..99: logical blocks 4..6
    poisoned = batch.kv_cache.copy()
    poisoned[:, batch.block_tables[0, :4]] = np.nan
    q = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.float32)
    args = (jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens))
    clean = paged_attention(q, jnp.asarray(batch.kv_cache, jnp.float32), *args, scale=0.125,
                            sliding_window=window, interpret=True, pages_per_compute_block=1)
    out = paged_attention(q, jnp.asarray(poisoned, jnp.float32), *args, scale=0.125,
                          sliding_window=window, interpret=True, pages_per_compute_block=1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float32"])
def test_fp8_cache_dequantised_in_kernel(rng, fp8, q_dtype):
    """An fp8 cache with k/v scales equals attention over the dequantised values (exactly those)."""
    batch = PagedBatch(rng, seq_lens=[1, 17, 40], num_kv_heads=3, head_size=64, block_size=16)
    k_scale, v_scale = 0.5, 2.0
    scales = np.array([k_scale, v_scale]).reshape(2, 1, 1, 1, 1)
    quantized = jnp.asarray(batch.kv_cache / scales, fp8)
    # the reference sees exactly what the kernel dequantises: fp8 values times the scales
    deq = PagedBatch.__new__(PagedBatch)
    deq.__dict__.update(batch.__dict__, kv_cache=np.asarray(quantized, np.float64) * scales)
    q = rng.standard_normal((3, 9, 64))
    expected = decode_attention_loop(np.asarray(jnp.asarray(q, q_dtype), np.float64), deq, 0.125)
    out = paged_attention(jnp.asarray(q, q_dtype), quantized, jnp.asarray(batch.block_tables),
                          jnp.asarray(batch.seq_lens), scale=0.125, k_scale=jnp.float32(k_scale),
                          v_scale=jnp.float32(v_scale), interpret=True)
    # K/V are cast to q's dtype for the dots: bf16 rounding of fp8 values is exact, p is rounded
    assert rel_err(out, expected) < TOLERANCE[q_dtype if q_dtype != "float32" else "float32"] * 10


def test_fp8_cache_without_scales_is_rejected():
    q = jnp.ones((1, 4, 64), jnp.bfloat16)
    kv = jnp.ones((2, 2, 1, 16, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_attention(q, kv, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0,
                        interpret=True)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan")])
def test_non_positive_scale_raises(scale):
    # The kernels take each row's max before applying the scale: only valid for scale > 0.
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention
    q = jnp.ones((2, 4, 64), jnp.float32)
    kv = jnp.ones((2, 4, 2, 16, 64), jnp.float32)
    tables = jnp.zeros((2, 2), jnp.int32)
    lens = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="scale="):
        paged_attention(q, kv, tables, lens, scale=scale, interpret=True)
    with pytest.raises(ValueError, match="scale="):
        paged_prefill_attention(q, kv, tables, lens, jnp.array([0, 1, 2], jnp.int32), scale=scale,
                                max_query_len=1, interpret=True)


# 96, 112 and 120 are padded to 128 lanes as 80 is (the same masked path): with JAXKV_SLOW=1
@pytest.mark.parametrize("head_size", [32, 80, pytest.param(96, marks=slow), pytest.param(112, marks=slow),
                                       pytest.param(120, marks=slow), 192, 256])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_vllm_head_sizes(rng, kernel, head_size):
    """Every head size vLLM serves, in both kernels: padded lanes never change the result (by default one
    unpadded small size, one padded to 128, one padded to 256 and the largest; all with JAXKV_SLOW=1)."""
    from tests.pallas_kernels import fuzz
    cls = fuzz.ShapeClass(kernel=kernel, num_seqs=2, num_kv_heads=1, group=3, head_size=head_size,
                          block_size=16, dtype="float32", fp8=False, table_width=3, num_blocks=8,
                          num_tokens=2 if kernel == "decode" else 12, max_query_len=1 if kernel == "decode" else 6,
                          sliding_window=None, logits_soft_cap=None, alibi=False)
    case = fuzz.make_case(rng, cls, [(16, 1), (30, 1)] if kernel == "decode" else [(10, 6), (0, 5)])
    arrays, kwargs = case.kernel_args()
    fn = paged_attention if kernel == "decode" else paged_prefill_attention
    assert fuzz.error(fn(*arrays, **kwargs, interpret=True), case) <= fuzz.TOLERANCE["float32"]


@pytest.mark.parametrize("block_size,head_size,dtype,table_width", [
    (8, 64, "bfloat16", 1),      # one 8-slot page per sequence: two pages per step (16 keys)
    (64, 256, "float32", 2),     # 64 KiB pages: read in 32-slot slices
    (128, 256, "bfloat16", 2),   # 64 KiB pages: 64-slot slices
    (128, 128, "float32", 3),
])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_large_and_small_pages(rng, kernel, block_size, head_size, dtype, table_width):
    from tests.pallas_kernels import fuzz
    cls = fuzz.ShapeClass(kernel=kernel, num_seqs=2, num_kv_heads=2, group=2, head_size=head_size,
                          block_size=block_size, dtype=dtype, fp8=False, table_width=table_width,
                          num_blocks=2 * table_width + 1, num_tokens=2 if kernel == "decode" else 20,
                          max_query_len=1 if kernel == "decode" else 10, sliding_window=None,
                          logits_soft_cap=None, alibi=False)
    most = table_width * block_size
    lengths = ([(most - 1, 1), (block_size - 1, 1)] if kernel == "decode"
               else [(max(most - 10, 0), min(most, 10)), (0, 7)])
    case = fuzz.make_case(rng, cls, lengths)
    arrays, kwargs = case.kernel_args()
    fn = paged_attention if kernel == "decode" else paged_prefill_attention
    assert fuzz.error(fn(*arrays, **kwargs, interpret=True), case) <= fuzz.TOLERANCE[dtype]


@pytest.mark.parametrize("block_size,head_size,itemsize,pages,max_pages,expected", [
    (16, 128, 2, 4, 64, (4, 16)),     # the tuned default: 4 whole pages
    (8, 64, 2, 4, 1, (2, 8)),         # a 1-wide table still gets 16 keys (issue 9's block-8 bug)
    (4, 64, 2, 1, 1, (4, 4)),
    (16, 64, 2, 4, 1, (1, 16)),       # clamped to the table's width
    (128, 256, 2, 1, 8, (1, 64)),     # a 64 KiB page: 32 KiB slices
    (128, 256, 4, 1, 8, (1, 32)),
    (64, 80, 4, 2, 8, (2, 64)),       # head 80 computes as 128 lanes: a 32 KiB page fits; pages as asked
])
def test_kv_step_geometry(block_size, head_size, itemsize, pages, max_pages, expected):
    from pallas_kernels._paging import kv_step
    step = kv_step(block_size=block_size, head_size=head_size, itemsize=itemsize, pages=pages,
                   max_tile_bytes=32 * 1024, max_pages=max_pages)
    assert (step.pages, step.tokens) == expected
    assert step.block_k >= 16
