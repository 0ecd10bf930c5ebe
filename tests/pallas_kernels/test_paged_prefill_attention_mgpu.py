"""The Mosaic GPU prefill kernel (``pallas_kernels.paged_prefill_attention_mgpu``) against the float64 fuzz
reference.

Where each test runs: on CPU the kernel runs in the Mosaic GPU interpreter (``InterpretGPUParams``:
simulated shared memory, TMA copies, barriers, the producer and consumer warpgroups), with P through shared
memory (``pv_from_smem=True``, the only ``wgmma`` form the interpreter runs); that checks the kernel's logic
(tile map, paging, causal / window / padding masks, NaN slots, online softmax) but not what only the
hardware shows. ``test_lowers_for_sm90`` lowers every class through Mosaic GPU for CUDA on CPU, with P in
registers (the compiled path) and through shared memory. On a GPU the same tests run the compiled kernel
with P in registers, and ``test_compiled_p_through_smem`` the shared-memory variant
(``scripts/dev/gpu_mgpu.sh``); only that run is evidence that the compiled kernel is right.
``JAXKV_MGPU_FUZZ=N`` adds every case with one and two consumers and N random interpreted classes (slow).
A plain CPU run interprets every case with one consumer warpgroup: with two (three warpgroups, three CPU
threads) the interpreter intermittently deadlocks on the 2-core CI machine (module docstring of the kernel);
the two-consumer cases run with ``JAXKV_MGPU_FUZZ`` (may hang: run under ``timeout``) and on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import dispatch as attention_dispatch
from pallas_kernels import paged_prefill_attention as triton_mod
from pallas_kernels import paged_prefill_attention_mgpu as mgpu_mod
from pallas_kernels import tuning
from pallas_kernels.paged_prefill_attention_mgpu import paged_prefill_attention_mgpu, unsupported_reason
from tests.pallas_kernels import fuzz

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
SLOW = bool(os.environ.get("JAXKV_MGPU_FUZZ"))
PAD_TOKENS = 3  # rows of q past query_start_loc[-1]: their output must be 0


def _cls(lengths, *, kv_heads=1, group=4, head=128, block=16, dtype="bfloat16", window=None, cap=None,
         width=None, fp8=False) -> fuzz.ShapeClass:
    most = max(c + q for c, q in lengths)
    width = width or -(-most // block) + 1
    return fuzz.ShapeClass(kernel="prefill", num_seqs=len(lengths), num_kv_heads=kv_heads, group=group,
                           head_size=head, block_size=block, dtype=dtype, fp8=fp8, table_width=width,
                           num_blocks=len(lengths) * width + 2,
                           num_tokens=sum(q for _, q in lengths) + PAD_TOKENS,
                           max_query_len=max(q for _, q in lengths), sliding_window=window,
                           logits_soft_cap=cap, alibi=False)


# The Triton prefill kernel's test batch (prefix 0 / block-1 / block / several blocks, decode tokens
# beside long queries, a zero-length dummy), at its bf16 shapes.
MIXED = [(0, 21), (15, 7), (16, 1), (0, 0), (53, 13), (39, 1)]
# (lengths as (context_len, query_len), class, num_consumers)
CASES = [
    (MIXED, dict(kv_heads=3, group=3, head=64), 2),                                  # SmolLM2's group of 3
    (MIXED, dict(kv_heads=2, group=4, head=128, dtype="float16"), 1),                # one consumer
    ([(0, 70), (150, 64)], dict(group=8, head=256, block=32, window=100), 2),        # MQA, D 256, window
    ([(0, 19), (7, 1), (20, 12), (3, 0)], dict(kv_heads=2, group=3, head=64, block=8, window=5, cap=3.0), 2),
    ([(300, 70), (40, 1), (129, 64)], dict(group=1, head=128, block=16), 2),         # chunks over a context
    ([(200, 129)], dict(group=1, head=256, block=128), 2),                           # page sliced over steps
    ([(17, 5), (0, 2)], dict(group=64, head=64, block=16), 1),                       # the full 64-row tile
    ([(0, 130), (70, 64)], dict(kv_heads=2, group=4, head=128, block=64), 2),         # pages of 64 (bench p64)
    ([(0, 100), (30, 60), (0, 2), (5, 90)], dict(kv_heads=2, group=2, head=64), 2),   # across program edges
    # an fp8 cache (k_scale / v_scale): converted per consumer into q's dtype; D 64 and 128, window, soft cap
    (MIXED, dict(kv_heads=3, group=3, head=64, fp8=True), 2),
    ([(300, 70), (40, 1), (129, 64)], dict(group=2, head=128, block=16, window=150, cap=20.0, fp8=True), 2),
    ([(0, 19), (7, 1), (20, 12), (3, 0)], dict(kv_heads=2, group=3, head=128, block=8, dtype="float16",
                                             fp8=True), 1),
]
DEFAULT = [0, 2, 3, 4, 8, 10]
PERSISTENT_DEFAULT = [2, 8, 9]  # persistent in a plain CPU run: one Q tile (D 256, window), tiles across sequences  # the cases of a plain CPU run (~5 s each in the interpreter); the rest with SLOW
IDS = [f"{_cls(l, **kw).describe()} {l} c{nc}" for l, kw, nc in CASES]


def _run(lengths, kw, num_consumers, seed=0, **extra):
    cls = _cls(lengths, **kw)
    case = fuzz.make_case(np.random.default_rng(seed), cls, lengths)
    arrays, kwargs = case.kernel_args()
    if INTERPRET and not SLOW:
        num_consumers = 1  # see the module docstring: three interpreted warpgroups may deadlock
    out = paged_prefill_attention_mgpu(*arrays, **kwargs, num_consumers=num_consumers, interpret=INTERPRET,
                                       **extra)
    assert out.shape == case.q.shape and out.dtype == jnp.dtype(cls.dtype)
    out32 = np.asarray(jnp.asarray(out, jnp.float32))
    np.testing.assert_array_equal(out32[int(case.query_start_loc[-1]):], 0.0)   # padding tokens
    return fuzz.error(out, case), case, out32


@functools.lru_cache(maxsize=None)
def _per_item(index):
    """``_run`` of ``CASES[index]``, one program per work item: computed once, shared by the tests below."""
    lengths, kw, nc = CASES[index]
    return _run(lengths, kw, nc, persistent=False)


@pytest.mark.parametrize("persistent", [False, True], ids=["per-item", "persistent"])
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_matches_float64_reference(index, persistent):
    """NaN in every slot no sequence owns and in garbage block-table entries; a kernel that reads or mixes
    in one returns inf error. One program per work item, and persistent programs (the interpreter: 2
    programs, so each loops over several items; the GPU: one per SM)."""
    if (index not in (PERSISTENT_DEFAULT if persistent else DEFAULT)) and not SLOW and not ON_GPU:
        pytest.skip("set JAXKV_MGPU_FUZZ=N for every case in the interpreter")
    lengths, kw, nc = CASES[index]
    err, case, _ = _run(lengths, kw, nc, persistent=True) if persistent else _per_item(index)
    assert err <= fuzz.TOLERANCE[case.cls.dtype]


FP8_CASES = [i for i, (_, kw, _) in enumerate(CASES) if kw.get("fp8")]


@pytest.mark.parametrize("pv_from_smem", [None, True], ids=["default", "p-smem"])
@pytest.mark.parametrize("route", ["convert", "qk8", "qk8lo"])
@pytest.mark.parametrize("index", FP8_CASES, ids=lambda i: IDS[i])
def test_fp8_routes_match_float64(index, route, pv_from_smem):
    """Each way of reading an fp8 cache (the default one runs in the tests above too): "convert" (K and V converted
    into q's dtype) and, with q·kᵀ an fp8 ``wgmma`` from the K slot (the query rows quantized to e4m3 per item, V
    converted to f16), "qk8lo" (two e4m3 halves), within the query dtype's tolerance; "qk8" (one half: the query
    off by up to 2**-4 of itself, FlashAttention-3's fp8 accuracy) within :data:`fuzz.FP8_Q_TOLERANCE`. NaN in every
    unowned slot, as above."""
    if pv_from_smem and not ON_GPU:
        pytest.skip("the interpreter always runs P through shared memory")
    if index != FP8_CASES[1] and not SLOW and not ON_GPU:
        pytest.skip("set JAXKV_MGPU_FUZZ=N for every case in the interpreter")
    lengths, kw, nc = CASES[index]
    err, case, _ = _run(lengths, kw, nc, fp8_route=route, pv_from_smem=pv_from_smem)
    assert err <= (fuzz.FP8_Q_TOLERANCE if route == "qk8" else fuzz.TOLERANCE[case.cls.dtype])


@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("persistent", [False, True], ids=["per-item", "persistent"])
@pytest.mark.parametrize("route", ["convert", "qk8", "qk8lo"])
@pytest.mark.parametrize("index", FP8_CASES, ids=lambda i: IDS[i])
def test_v_converted_by_the_memory_warpgroup(index, route, persistent, block_kv):
    """``v_converter="memory"``: the memory warpgroup converts each step's fp8 V slot once into a shared ring of
    16-bit slots, ``lag`` steps behind its copies, and catches up before it waits for a Q tile (items with fewer
    steps than the lag, padding items with none, the interpreter's 2 persistent programs each looping over items).
    Every route, 64- and 128-key steps (the default with >= 1024 query tokens per sequence), within the same
    tolerances as the consumers' own copies. NaN in every unowned slot."""
    # a plain CPU run: the 128-key steps (the 64-key path is the default of the fp8 cases above)
    if (index != FP8_CASES[1] or route != "qk8lo" or not persistent or block_kv != 128) and not SLOW and not ON_GPU:
        pytest.skip("set JAXKV_MGPU_FUZZ=N for every case in the interpreter")
    lengths, kw, nc = CASES[index]
    err, case, _ = _run(lengths, kw, nc, fp8_route=route, v_converter="memory", persistent=persistent,
                        block_kv=block_kv)
    assert err <= (fuzz.FP8_Q_TOLERANCE if route == "qk8" else fuzz.TOLERANCE[case.cls.dtype])


def test_fp8_routes_are_checked():
    """An ``fp8_route`` outside :data:`FP8_ROUTES` is a ValueError naming it, "qk8"/"qk8lo" with an e5m2 cache too
    (the query tile is e4m3); the default route of an e5m2 cache is "convert"."""
    assert mgpu_mod._fp8_route(None, kv_dtype=jnp.float8_e5m2) == "convert"
    assert mgpu_mod._fp8_route(None, kv_dtype=jnp.bfloat16) == "convert"
    assert mgpu_mod._fp8_route(None, kv_dtype=jnp.float8_e4m3fn) == tuning.MGPU_PREFILL_FP8_ROUTE
    # who converts V by default: the memory warpgroup for the measured qk8 routes, the consumers for "convert"
    assert [tuning.mgpu_prefill_v_converter(r) for r in ("qk8", "qk8lo", "convert")] == \
        [tuning.MGPU_PREFILL_V_CONVERTER] * 2 + ["consumers"]
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 1, 16, 64), jnp.float8_e5m2)
    call = functools.partial(paged_prefill_attention_mgpu, q, kv, jnp.zeros((1, 2), jnp.int32),
                             jnp.full((1,), 2, jnp.int32), jnp.asarray([0, 2], jnp.int32), scale=0.1, max_query_len=2,
                             k_scale=1.0, v_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="fp8_route='qk9' must be one of"):
        call(fp8_route="qk9")
    with pytest.raises(ValueError, match="fp8_route='qk8lo' needs a float8_e4m3fn cache, not float8_e5m2"):
        call(fp8_route="qk8lo")


@pytest.mark.parametrize("num_programs", [1, 5])
def test_persistent_programs_give_the_per_item_result(num_programs):
    """A persistent program walks its items one after another with the K/V ring, the step counter and
    the double-buffered Q tiles running on; every row's arithmetic is the per-item kernel's, so the
    output is bit-identical for any program count (here 1 and 5 programs over 4 tiles x 4 heads,
    sequences crossing tile edges, a zero-length sequence, padding tokens)."""
    lengths, kw, nc = CASES[8]
    _, case, per_item = _per_item(8)
    _, _, persistent = _run(lengths, kw, nc, persistent=True, num_programs=num_programs)
    np.testing.assert_array_equal(persistent, per_item)


@pytest.mark.skipif(not (SLOW or ON_GPU), reason="set JAXKV_MGPU_FUZZ=N (slow in the interpreter)")
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_other_consumer_count(index):
    lengths, kw, nc = CASES[index]
    err, case, _ = _run(lengths, kw, 3 - nc)
    assert err <= fuzz.TOLERANCE[case.cls.dtype]


@pytest.mark.skipif(not (SLOW or ON_GPU), reason="set JAXKV_MGPU_FUZZ=N (slow in the interpreter)")
@pytest.mark.parametrize("index", [i for i, c in enumerate(CASES) if c[2] == 2], ids=lambda i: IDS[i])
def test_two_consumers_without_pingpong(index):
    """The scheduling barrier only orders the two consumers' turns: without it the result is as right."""
    lengths, kw, nc = CASES[index]
    err, case, _ = _run(lengths, kw, nc, pingpong=False)
    assert err <= fuzz.TOLERANCE[case.cls.dtype]


@pytest.mark.skipif(not ON_GPU, reason="GPU only: the interpreter always runs P through shared memory")
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_compiled_p_through_smem(index):
    lengths, kw, nc = CASES[index]
    err, case, _ = _run(lengths, kw, nc, pv_from_smem=True)
    assert err <= fuzz.TOLERANCE[case.cls.dtype]


def test_unowned_and_out_of_window_slots_do_not_matter():
    """NaN → noise in every unowned slot and in the pages before every tile's window (freed pages of a
    sliding-window model) leaves the output bit-identical: those pages are never read, and the tail slots
    read with the last step are masked and zeroed."""
    lengths, window, block = [(40, 16), (9, 3)], 10, 8
    cls = _cls(lengths, kv_heads=1, group=4, head=64, block=block, window=window)
    case = fuzz.make_case(np.random.default_rng(3), cls, lengths)
    arrays, kwargs = case.kernel_args()
    run = lambda kv: np.asarray(jnp.asarray(paged_prefill_attention_mgpu(
        arrays[0], kv, *arrays[2:], **kwargs, interpret=INTERPRET), jnp.float32))
    cache = np.array(jnp.asarray(arrays[1], jnp.float32))
    before_window = case.block_tables[0, :(40 - window + 1) // block]   # tokens 0..23 of sequence 0
    cache[:, before_window] = np.nan
    poisoned = run(jnp.asarray(cache, cls.dtype))
    noisy = np.where(np.isnan(cache), np.random.default_rng(4).standard_normal(cache.shape) * 100, cache)
    np.testing.assert_array_equal(poisoned, run(jnp.asarray(noisy, cls.dtype)))
    assert fuzz.error(poisoned, case) <= fuzz.TOLERANCE[cls.dtype]


def test_tile_order_puts_the_most_keys_first():
    """The persistent programs' tile order is a permutation of the tiles, by decreasing key count of each
    tile's last row (a loop over tokens computes it here), padding tiles last."""
    rng = np.random.default_rng(6)
    for _ in range(10):
        q_lens = rng.integers(0, 300, int(rng.integers(1, 6)))
        ctx = rng.integers(0, 500, q_lens.size)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        tt = 128
        num_tiles = -(-int(qsl[-1] + rng.integers(0, 300)) // tt)
        order = np.asarray(mgpu_mod._tile_order(jnp.asarray(qsl), jnp.asarray(ctx + q_lens, jnp.int32),
                                                num_tiles, tt))
        assert sorted(order.tolist()) == list(range(num_tiles))
        keys = []
        for t in range(num_tiles):
            toks = [u for u in range(t * tt, (t + 1) * tt) if u < qsl[-1]]
            if not toks:
                keys.append(0)
                continue
            s = int(np.searchsorted(qsl, toks[-1], side="right") - 1)
            keys.append(int(ctx[s] + toks[-1] - qsl[s] + 1))
        assert all(keys[a] >= keys[b] for a, b in zip(order, order[1:])), (keys, order)


def test_sequence_search_matches_searchsorted():
    """The kernel's binary search over ``query_start_loc`` (the sequence that owns a flat token: the last
    with ``query_start_loc[s] <= token``, so zero-length sequences own nothing) equals NumPy's
    ``searchsorted(side="right") - 1`` for every token of random batches, tokens past the end included."""
    rng = np.random.default_rng(5)
    for num_seqs in [1, 2, 3, 7, 8, 9, 64, 255, 256]:
        q_lens = rng.integers(0, 5, num_seqs) * (rng.random(num_seqs) < 0.7)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        tokens = np.arange(int(qsl[-1]) + 3, dtype=np.int32)
        want = np.clip(np.searchsorted(qsl, tokens, side="right") - 1, 0, num_seqs - 1)
        got = jax.vmap(lambda t: mgpu_mod._seq_of(jnp.asarray(qsl), t, num_seqs))(jnp.asarray(tokens))
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{num_seqs=}")


@pytest.mark.parametrize("change,match", fuzz.MGPU_UNSUPPORTED + [
    (dict(kv_dtype=jnp.float8_e4m3fn, head=256), "fp8 up to head size 128")])
def test_unsupported_calls_say_why(change, match):
    """The kernel refuses what it does not implement, naming the field (the dispatch falls back): the decode
    kernel's rules, and an fp8 cache of head size 256."""
    args, q, kv, extra = fuzz.mgpu_unsupported_call(change, num_tokens=2)
    reason = unsupported_reason(args["dtype"], args["kv_dtype"], *args["heads"], args["head"], args["block"],
                                alibi=args["alibi"])
    assert reason is not None and match in reason
    with pytest.raises(NotImplementedError, match=match):
        paged_prefill_attention_mgpu(q, kv, jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 2, jnp.int32),
                                     jnp.asarray([0, 2], jnp.int32), scale=0.1, max_query_len=2,
                                     interpret=True, **extra)


@pytest.mark.parametrize("kw,match", [(dict(block_kv=48), "block_kv=48"), (dict(num_stages=0), "num_stages=0"),
                                      (dict(num_consumers=3), "num_consumers=3"),
                                      (dict(persistent=True, num_programs=0), "num_programs=0"),
                                      (dict(persistent=False, num_programs=4), "needs persistent=True"),
                                      (dict(max_query_len=1), "max_query_len=1"),
                                      (dict(v_converter="both"), "v_converter='both' must be one of"),
                                      (dict(memory_registers=44), "memory_registers=44 must be a multiple of 8")])
def test_bad_knobs_raise(kw, match):
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 1, 16, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention_mgpu(q, kv, jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 2, jnp.int32),
                                     jnp.asarray([0, 2], jnp.int32), scale=0.1, interpret=True,
                                     **({"max_query_len": 2} | kw))


def test_num_stages_fit_shared_memory():
    """bf16, D 128, 128 keys, two consumers: 2 stages with P in registers, with one Q tile per consumer or
    two (the persistent kernel); head size 256 (64 keys): 2 stages and one Q tile."""
    assert tuning.mgpu_prefill_num_stages(128, 128, num_consumers=2, pv_from_smem=False) == 2
    assert tuning.mgpu_prefill_num_stages(128, 128, num_consumers=2, pv_from_smem=False, num_q_buffers=2) == 2
    assert tuning.mgpu_prefill_q_buffers(128, 128, num_consumers=2, pv_from_smem=False) == 2
    assert tuning.mgpu_prefill_num_stages(64, 256, num_consumers=2, pv_from_smem=False) == 2
    assert tuning.mgpu_prefill_q_buffers(64, 256, num_consumers=2, pv_from_smem=False) == 1
    assert tuning.mgpu_prefill_num_stages(128, 64, num_consumers=2, pv_from_smem=True) == 4
    # fp8, D 128: 64-key steps, two Q tiles, each consumer's converted K and V tiles: 4 fp8 stages, 192 KiB
    assert tuning.mgpu_prefill_block_kv(128, fp8=True) == 64
    assert tuning.mgpu_prefill_block_kv(128, fp8=True, v_converter="memory", tokens_per_seq=1023) == 64
    assert tuning.mgpu_prefill_block_kv(128, fp8=True, v_converter="memory", tokens_per_seq=1024) == 128
    assert tuning.mgpu_prefill_block_kv(128, fp8=True, v_converter="consumers", tokens_per_seq=4096) == 64
    assert tuning.mgpu_prefill_block_kv(256, fp8=True, v_converter="memory", tokens_per_seq=4096) == 64
    assert tuning.mgpu_prefill_q_buffers(64, 128, num_consumers=2, pv_from_smem=False, fp8=True) == 2
    assert tuning.mgpu_prefill_num_stages(64, 128, num_consumers=2, pv_from_smem=False, num_q_buffers=2,
                                          fp8=True) == 4
    assert 2 * 2 * 64 * 128 * 2 + 2 * 2 * 64 * 128 * 2 + 4 * 2 * 64 * 128 == 192 * 1024 <= tuning.MGPU_SMEM_BYTES
    # "qk8": each consumer's converted V tile and e4m3 query tile (176 KiB at 4 stages); "qk8lo": and its low half
    for route, kib in (("qk8", 176), ("qk8lo", 192)):
        assert tuning.mgpu_prefill_num_stages(64, 128, num_consumers=2, pv_from_smem=False, num_q_buffers=2, fp8=True,
                                              fp8_route=route) == 4
        halves = 2 if route == "qk8lo" else 1
        assert 2 * 2 * 64 * 128 * 2 + 2 * (64 * 128 * 2 + halves * 64 * 128) + 4 * 2 * 64 * 128 == kib * 1024
    # V converted by the memory warpgroup: no V tile per consumer, a shared ring of 2 16-bit slots (192 KiB)
    assert tuning.mgpu_prefill_num_stages(64, 128, num_consumers=2, pv_from_smem=False, num_q_buffers=2, fp8=True,
                                          fp8_route="qk8lo", v_converter="memory") == 4
    assert 2 * 2 * 64 * 128 * 2 + 2 * 2 * 64 * 128 + 2 * 64 * 128 * 2 + 4 * 2 * 64 * 128 == 192 * 1024
    # 128-key steps with "qk8lo": one Q tile per consumer, 2 stages
    assert tuning.mgpu_prefill_q_buffers(128, 128, num_consumers=2, pv_from_smem=False, fp8=True,
                                         fp8_route="qk8lo") == 1
    assert tuning.mgpu_prefill_num_stages(128, 128, num_consumers=2, pv_from_smem=False, fp8=True,
                                          fp8_route="qk8lo") == 2
    for d in (64, 128, 256):
        bkv = tuning.mgpu_prefill_block_kv(d)
        for smem_p in (False, True):
            for nq in (1, tuning.mgpu_prefill_q_buffers(bkv, d, num_consumers=2, pv_from_smem=smem_p)):
                st = tuning.mgpu_prefill_num_stages(bkv, d, num_consumers=2, pv_from_smem=smem_p,
                                                    num_q_buffers=nq)
                used = nq * 2 * 64 * d * 2 + (2 * 64 * bkv * 2 if smem_p else 0) + st * 2 * bkv * d * 2
                assert st >= 1 and (used <= tuning.MGPU_SMEM_BYTES or st == 1)


def test_dispatch_uses_mosaic_kernel_and_falls_back_with_a_reason(monkeypatch):
    """``impl="pallas_mosaic"`` (``_interpret`` on CPU): a supported prefill / mixed batch runs the Mosaic
    prefill kernel, under ``jax.jit`` too, and matches the reference; an fp8 cache runs it too, and with
    ``tuning.MGPU_PREFILL_FP8_COMPILED`` off falls back to the Triton kernel with a one-time warning naming the
    reason."""
    calls = []

    def spy(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(mgpu_mod, "paged_prefill_attention_mgpu",
                        spy("mosaic", mgpu_mod.paged_prefill_attention_mgpu))
    monkeypatch.setattr(triton_mod, "paged_prefill_attention", spy("triton", triton_mod.paged_prefill_attention))
    monkeypatch.setattr(attention_dispatch, "_warned_fallbacks", set())
    lengths = [(20, 9), (7, 1)]
    cls = _cls(lengths, kv_heads=2, group=2, head=64, block=8)
    case = fuzz.make_case(np.random.default_rng(2), cls, lengths)
    (q, kv, tables, lens, _), kwargs = case.kernel_args()
    md = jaxkv.build_attn_metadata(np.asarray(tables), [20, 7], [9, 1], cls.block_size)
    scale = kwargs["scale"]
    impl = "pallas_mosaic" if ON_GPU else "pallas_mosaic_interpret"
    out = jax.jit(lambda q, kv, md: jaxkv.paged_attention(q, kv, md, scale=scale, impl=impl))(q, kv, md)
    assert calls == ["mosaic"]
    assert fuzz.error(out[:10], case) <= fuzz.TOLERANCE[cls.dtype]

    # an fp8 cache: where it goes (its numbers are the float64 fuzz's above), so the kernels are stubs here
    monkeypatch.setattr(mgpu_mod, "paged_prefill_attention_mgpu", spy("mosaic", lambda q, *a, **k: q))
    monkeypatch.setattr(triton_mod, "paged_prefill_attention", spy("triton", lambda q, *a, **k: q))
    kv8 = kv.astype(jnp.float8_e4m3fn)
    jaxkv.paged_attention(q, kv8, md, scale=scale, impl=impl, k_scale=1.0, v_scale=1.0)
    assert calls == ["mosaic", "mosaic"]
    monkeypatch.setattr(tuning, "MGPU_PREFILL_FP8_COMPILED", False)
    with pytest.warns(UserWarning, match="prefill falls back to the Triton kernel: kv_cache.dtype=float8_e4m3fn "
                      r"\(the Mosaic prefill kernel's fp8 path awaits its compiled GPU tests\)"):
        jaxkv.paged_attention(q, kv8, md, scale=scale, impl=impl, k_scale=1.0, v_scale=1.0)
    assert calls == ["mosaic", "mosaic", "triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        jaxkv.paged_attention(q, kv8, md, scale=scale, impl=impl, k_scale=1.0, v_scale=1.0)


@pytest.mark.skipif(ON_GPU, reason="CPU-only lowering check; the GPU runs the compiled tests")
@pytest.mark.parametrize("pv_from_smem", [False, True], ids=["p-registers", "p-smem"])
def test_lowers_for_sm90(pv_from_smem):
    """Every class of ``CASES`` (with its consumer count: both occur; per item and persistent) lowers through
    Pallas Mosaic GPU for CUDA on CPU.

    Export stops after Mosaic GPU has lowered the kernel to its MLIR module (serialised into the custom
    call), so unsupported ops, casts and layouts fail here; shared-memory budget, register pressure and
    ptxas issues show only on the GPU."""
    from jax import export
    for lengths, kw, nc in (CASES if not pv_from_smem else CASES[:3]):   # P via smem: the interpreted path
        cls = _cls(lengths, **kw)
        case = fuzz.make_case(np.random.default_rng(0), cls, lengths)
        arrays, kwargs = case.kernel_args()
        runs = [(persistent, None) for persistent in ((False, True) if not pv_from_smem else (False,))]
        if kw.get("fp8") and kw.get("head") == 128 and not pv_from_smem:   # the other fp8 routes, persistent
            runs += [(True, r) for r in mgpu_mod.FP8_ROUTES if r != tuning.MGPU_PREFILL_FP8_ROUTE]
        for persistent, route in runs:
            for v_converter in (mgpu_mod.V_CONVERTERS if kw.get("fp8") and route is None and persistent else (None,)):
                fn = jax.jit(lambda *a: paged_prefill_attention_mgpu(
                    *a, **kwargs, num_consumers=nc, pv_from_smem=pv_from_smem, persistent=persistent,
                    num_programs=132 if persistent else None, fp8_route=route, v_converter=v_converter))
                exported = export.export(fn, platforms=("cuda",))(*arrays)
                assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.skipif(not SLOW, reason="set JAXKV_MGPU_FUZZ=N (slow, ~5 s a case)")
def test_random_classes_match_float64():
    """``JAXKV_MGPU_FUZZ`` random shape classes of the shared fuzz (bf16/f16, the kernel's head sizes,
    NaN in unowned slots) against the float64 reference: in the interpreter on CPU, compiled on a GPU
    (``scripts/dev/gpu_mgpu.sh`` sets it)."""
    rng = np.random.default_rng(13)
    failed = []
    for cls in fuzz.shape_classes(rng, "prefill", int(os.environ["JAXKV_MGPU_FUZZ"])):
        head = int(rng.choice(mgpu_mod.HEAD_SIZES))
        dtype = "bfloat16" if cls.dtype == "float32" else cls.dtype
        cls = dataclasses.replace(cls, head_size=head, dtype=dtype, alibi=False, fp8=False)
        lengths = fuzz.random_lengths(rng, cls)
        case = fuzz.make_case(rng, cls, lengths)
        arrays, kwargs = case.kernel_args()
        persistent = bool(rng.integers(2))
        err = fuzz.error(paged_prefill_attention_mgpu(*arrays, **kwargs, persistent=persistent,
                                                      interpret=INTERPRET), case)
        if not err <= fuzz.TOLERANCE[cls.dtype]:
            failed.append((cls.describe(), lengths, persistent, err))
    assert not failed, failed


def test_automatic_selection_follows_the_measured_table(monkeypatch):
    """``impl="pallas"`` picks the Mosaic prefill kernel only where ``tuning.MGPU_PREFILL_MIN_QUERY_LEN``
    says it was measured faster (sm_90, head size 128, bf16 or fp8 e4m3 cache, ``max_query_len`` >= 512,
    whole-prompt batches); the engine's mixed steps, short prompts, other head sizes, e5m2 and other GPUs stay on
    Triton,
    and decode moves only for the measured head size 128 with a bf16 or fp8 e4m3 cache."""
    import types

    from jaxkv.attention.dispatch import _use_mosaic
    sds = jax.ShapeDtypeStruct
    sm90 = [types.SimpleNamespace(platform="gpu", compute_capability="9.0")]
    monkeypatch.setattr(jax, "devices", lambda *a: sm90)

    def pick(tokens, seqs, max_query_len, head=128, dtype=jnp.bfloat16, heads=(32, 8)):
        q = sds((tokens, heads[0], head), jnp.bfloat16)
        kv = sds((2, 64, heads[1], 16, head), dtype)
        return _use_mosaic("prefill", q, kv, "pallas", False, max_query_len=max_query_len, num_seqs=seqs)

    assert pick(2048, 1, 2048) and pick(8 * 8192, 8, 8192) and pick(512, 1, 512) and pick(8 * 512, 8, 512)
    assert not pick(256, 1, 256)                      # not measured below 512 tokens
    assert not pick(4096, 256, 4096)                  # an engine mixed step: 16 token slots per row
    assert not pick(2048, 1, 2048, head=64, heads=(9, 3))          # not measured
    assert pick(2048, 1, 2048, dtype=jnp.float8_e4m3fn)            # measured: e4m3 D128
    assert not pick(256, 1, 256, dtype=jnp.float8_e4m3fn)          # not measured below 512 tokens
    assert not pick(2048, 1, 2048, dtype=jnp.float8_e5m2)          # not measured
    q, kv = sds((2048, 32, 128), jnp.bfloat16), sds((2, 64, 8, 16, 128), jnp.bfloat16)
    assert _use_mosaic("decode", sds((8, 32, 128), jnp.bfloat16), kv, "pallas", False)   # measured: bf16 D128
    assert _use_mosaic("decode", sds((8, 32, 128), jnp.bfloat16), kv.update(dtype=jnp.float8_e4m3fn),
                       "pallas", False)                                                   # measured: e4m3 D128
    assert not _use_mosaic("decode", sds((8, 32, 128), jnp.bfloat16), kv.update(dtype=jnp.float8_e5m2),
                           "pallas", False)                                               # e5m2: not measured
    assert not _use_mosaic("decode", sds((8, 9, 64), jnp.bfloat16), sds((2, 64, 3, 16, 64), jnp.bfloat16),
                           "pallas", False)                                               # D 64: not measured
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform="gpu", compute_capability="8.0")])
    assert not _use_mosaic("prefill", q, kv, "pallas", False, max_query_len=2048, num_seqs=1)
