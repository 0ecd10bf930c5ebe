"""Gemma 3 through hybrid KV-cache groups (sliding window + full attention) vs its cache-free forward.

A tiny random-weight Gemma 3 (window 24 < prompt lengths up to 70, block size 8): paged logits of every
step equal the dense forward with a sliding-window mask; the sliding-window groups' blocks stay bounded
while a sequence grows; removing skipped blocks follows vLLM's rule.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import SamplingParams
from models.engine_setup import get_kv_cache_config, make_engine
from models.gemma3 import random_weights
from models.gemma3_config import Gemma3Config

TINY = Gemma3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=2,
                    num_kv_heads=1, head_size=32, query_pre_attn_scalar=24.0, sliding_window=24,
                    sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
                    max_position_embeddings=256)


@functools.lru_cache(maxsize=None)
def _model():
    return random_weights(TINY, seed=0)


@functools.partial(jax.jit, static_argnums=(0,))
def _dense(graphdef, state, ids):
    # padding after the sequence cannot change its (causal) logits; valid=True everywhere is fine
    return nnx.merge(graphdef, state).forward_dense(ids, jnp.ones(ids.shape, bool))


DENSE_LEN = 128  # every dense forward is padded to this length: one compile


def dense_logits(model, seq):
    ids = np.zeros((1, DENSE_LEN), np.int32)
    ids[0, :len(seq)] = seq
    graphdef, state = nnx.split(model)
    return np.asarray(_dense(graphdef, state, jnp.asarray(ids)))[0, :len(seq)]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


def _engine(impl="reference", *, hybrid=True, num_blocks=96, **options):
    options = dict(max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False,
                   num_scheduler_steps=1, return_logits=True) | options
    return make_engine(_model(), attention_impl=impl, block_size=8, num_blocks=num_blocks,
                       max_model_len=160, hybrid=hybrid, **options)


# the reference attention is checked against the dense forward in the next test (and, on the real model,
# in test_gemma3_model.py); one Pallas case keeps this file within its time budget
@pytest.mark.parametrize("impl,steps,async_scheduling", [("pallas_interpret", 4, True)])
def test_hybrid_paged_logits_match_dense_sliding_window_forward(impl, steps, async_scheduling):
    """Prompts shorter and longer than the window, chunked prefill, decode past the window, a pool so small
    that freed sliding-window blocks are reused by other sequences at once (and requests are preempted):
    every step's logits equal the cache-free forward (sliding-window mask on sliding layers). The Pallas
    case runs decode loops of 4 steps with async scheduling."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (70, 5, 31)]
    eng = _engine(impl, num_scheduler_steps=steps, long_prefill_token_threshold=20, num_blocks=40,
                  async_scheduling=async_scheduling)
    assert len(eng.kv_cache_groups) == 3
    n = 20
    done = eng.generate(prompts, greedy(n))
    for out in done:
        c = out.outputs[0]
        seq = out.prompt_token_ids + c.token_ids
        dense = dense_logits(_model(), seq)
        start = len(out.prompt_token_ids) - 1
        np.testing.assert_allclose(c.logits, dense[start:start + n], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(c.token_ids, dense[start:-1].argmax(-1))
    assert eng.stats.num_preemptions > 0


def test_window_matters_and_hybrid_equals_unified_cache():
    """Reference attention: the hybrid engine's logits equal the dense sliding-window forward and the same
    tokens through one full-attention group (sliding only in compute); a forward without the window
    differs (so these comparisons can fail)."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, TINY.vocab_size, 40).tolist()
    one = dict(max_num_seqs=1, max_num_batched_tokens=16)  # one request and one token bucket: 2 compiles
    hyb = _engine(**one).generate([prompt], greedy(3))[0].outputs[0]
    uni = _engine(hybrid=False, **one).generate([prompt], greedy(3))[0].outputs[0]
    np.testing.assert_allclose(hyb.logits, uni.logits, rtol=1e-5, atol=1e-5)
    dense = dense_logits(_model(), prompt + hyb.token_ids)
    np.testing.assert_allclose(hyb.logits, dense[39:42], rtol=1e-4, atol=1e-4)
    no_window = random_weights(Gemma3Config(**{**TINY.__dict__, "sliding_window": 10 ** 6}), seed=0)
    seq = prompt + hyb.token_ids
    assert np.abs(dense_logits(no_window, seq)[39] - hyb.logits[0]).max() > 1e-2


def test_sliding_groups_hold_a_bounded_number_of_blocks_as_a_sequence_grows():
    """Decoding far past the window: full group grows with the sequence, every sliding group holds at
    most cdiv(window, block_size) + 1 blocks after each step (vLLM remove_skipped_blocks)."""
    eng = _engine(max_num_batched_tokens=32, return_logits=False)
    kv = eng.kv_cache_manager
    windows = kv.sliding_windows
    assert sorted(w is None for w in windows) == [False, False, True]
    eng.add_request("a", [1, 2, 3, 4, 5], greedy(70))
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        req = eng._requests.get("a")
        if req is None or req.group_block_ids is None:
            continue
        per_group = kv.num_blocks_in_use(req)
        n = req.num_computed_tokens
        for used, w in zip(per_group, windows):
            if w is None:
                assert used == -(-n // 8)
            else:
                assert used <= -(-w // 8) + 1, (n, per_group)
        # blocks were last trimmed when this step was allocated (n - 1 tokens computed then): those wholly
        # before its token's window start are null; every block the next token can see is real
        for blocks, w in zip(req.group_block_ids, windows):
            if w is not None:
                assert all(b == kv.null_block for b in blocks[:max(0, n - 1 - w + 1) // 8])
                assert all(b != kv.null_block for b in blocks[max(0, n - w + 1) // 8:])
        seen.append(n)
    assert max(seen) >= 70
    assert kv.num_free_blocks == kv.num_blocks - 1  # all back but the null block


def test_hybrid_kv_cache_config_follows_vllm_grouping_rules():
    """Gemma-3-270M's 18 layers (15 sliding, 3 full): group_size = min(15, 3) = 3 → five sliding groups
    of 3 layers in layer order, one full group, 3 tensors; tensor i shared by layer i of every group;
    num_blocks = budget // page_size // 3 (seed 004: KVCacheConfig / _get_kv_cache_config_uniform_page_size),
    computed here from the rules, not from the code."""
    cfg = Gemma3Config(vocab_size=8, hidden_size=640, intermediate_size=8, num_layers=18, num_heads=4,
                       num_kv_heads=1, head_size=256)
    kv = get_kv_cache_config(cfg, block_size=16, dtype=jnp.bfloat16, num_blocks=100)
    name = "model.layers.{}.self_attn.attn".format
    sliding = [i for i in range(18) if (i + 1) % 6]
    full = [5, 11, 17]
    expected_groups = [sliding[i:i + 3] for i in range(0, 15, 3)] + [full]
    assert [[int(n.split(".")[2]) for n in g.layer_names] for g in kv.kv_cache_groups] == expected_groups
    page = 2 * 16 * 1 * 256 * 2  # K and V, block_size tokens, 1 KV head, head size 256, bf16
    for g, layers in zip(kv.kv_cache_groups, expected_groups):
        spec = g.kv_cache_spec
        assert spec.page_size_bytes == page and spec.block_size == 16
        assert getattr(spec, "sliding_window", None) == (None if layers == full else 512)
    assert kv.num_blocks == 100
    assert [t.size for t in kv.kv_cache_tensors] == [100 * page] * 3
    assert [set(t.shared_by) for t in kv.kv_cache_tensors] == [
        {name(g[i]) for g in expected_groups} for i in range(3)]
    unified = get_kv_cache_config(cfg, block_size=16, dtype=jnp.bfloat16, num_blocks=100, hybrid=False)
    assert len(unified.kv_cache_groups) == 1 and len(unified.kv_cache_tensors) == 18


def test_prefix_cache_hit_follows_vllm_rules_for_sliding_window_groups():
    """get_computed_blocks returns the largest L such that every full-attention group has blocks
    [0, L) cached and every sliding-window group has [max(0, L - cdiv(window - 1, block_size)), L) cached
    (vLLM's FullAttentionManager / SlidingWindowManager.find_longest_cache_hit, combined to a fixed
    point); checked against that statement by brute force over random cache contents."""
    from jaxkv import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from jaxkv.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from jaxkv.core.request import Request
    bs, window = 4, 10  # a sliding group needs the last cdiv(9, 4) = 3 blocks before the hit point
    common = dict(block_size=bs, num_kv_heads=1, head_size=8, dtype="float32")
    sliding = SlidingWindowSpec(sliding_window=window, **common)
    groups = [KVCacheGroupSpec(layer_names=["s0"], kv_cache_spec=sliding),
              KVCacheGroupSpec(layer_names=["f0"], kv_cache_spec=FullAttentionSpec(**common)),
              KVCacheGroupSpec(layer_names=["s1"], kv_cache_spec=sliding)]
    rng = np.random.default_rng(0)
    for trial in range(300):
        kv = HybridKVCacheManager(groups, 400, enable_prefix_caching=True)
        req = Request("r", rng.integers(0, 5, 4 * 12 + 3).tolist(), greedy(1), arrival_index=0, seed=0,
                      max_model_len=100, eos_token_ids=frozenset())
        hashes = req.hashes_of_full_blocks(req.num_tokens - 1, bs)
        p = rng.uniform(0.3, 1.0)
        cached = rng.random((3, len(hashes))) < p
        where = {}
        for g in range(3):
            for i in np.flatnonzero(cached[g]):
                (b,) = kv.allocator.allocate(1)
                assert kv.prefix_cache.register([(g, hashes[i])], [b]) == []
                kv.prefix_cache.release([b])
                where[g, i] = b
        need = -(-(window - 1) // bs)

        def ok(length):
            return (cached[1, :length].all() and cached[0, max(0, length - need):length].all()
                    and cached[2, max(0, length - need):length].all())

        best = max(L for L in range(len(hashes) + 1) if ok(L))
        hits, num_tokens = kv.get_computed_blocks(req)
        assert num_tokens == best * bs, trial
        if best:
            assert hits[1] == [where[1, i] for i in range(best)]
            for g in (0, 2):
                assert len(hits[g]) == best
                assert all(hits[g][i] == where[g, i] for i in range(max(0, best - need), best))
                assert all(b == kv.null_block or b == where.get((g, i)) for i, b in enumerate(hits[g]))


def test_prefix_caching_reuses_blocks_and_keeps_logits():
    """Two prompts sharing a 56-token prefix (> window 24): the second computes only its new tokens,
    its logits equal the dense forward; block accounting returns every block at the end."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, TINY.vocab_size, 56).tolist()
    a, b = shared + [5, 6, 7], shared + rng.integers(0, TINY.vocab_size, 9).tolist()
    eng = _engine(enable_prefix_caching=True, max_num_seqs=1, max_num_batched_tokens=16)
    out_a = eng.generate([a], greedy(6))[0]
    out_b = eng.generate([b], greedy(6))[0]
    assert out_a.num_cached_tokens == 0 and out_b.num_cached_tokens == 56
    for out in (out_a, out_b):
        c = out.outputs[0]
        dense = dense_logits(_model(), out.prompt_token_ids + c.token_ids)
        start = len(out.prompt_token_ids) - 1
        np.testing.assert_allclose(c.logits, dense[start:start + 6], rtol=1e-4, atol=1e-4)
    kv = eng.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_hybrid_block_accounting_under_random_arrivals_preemption_and_aborts(prefix_caching):
    """Scheduler + HybridKVCacheManager alone (dummy sampled tokens) over 400 steps of random arrivals
    with shared prefixes, aborts and preemption: after every step each block is in exactly one place
    (the null block, the free list, the prefix cache's evictable set, or one group of one request, cached
    blocks possibly shared), and sliding groups never hold a block their window cannot see."""
    from jaxkv.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from jaxkv.core.request import Request, RequestStatus
    from jaxkv.core.scheduler import Scheduler, SchedulerConfig
    kv_config = get_kv_cache_config(TINY, block_size=8, dtype="float32", num_blocks=60)
    kv = HybridKVCacheManager(kv_config.kv_cache_groups, 60, enable_prefix_caching=prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=120,
                                      num_scheduler_steps=3, long_prefill_token_threshold=16), kv)
    rng = np.random.default_rng(5)
    prefixes = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    live, n = [], 0
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 8:
            prompt = (prefixes[rng.integers(3)][:rng.integers(1, 41)]
                      + rng.integers(0, 50, rng.integers(1, 30)).tolist())
            req = Request(f"r{n}", prompt, greedy(int(rng.integers(1, 40))), arrival_index=n, seed=0,
                          max_model_len=120, eos_token_ids=frozenset())
            n += 1
            sched.add_request(req)
            live.append(req)
        if live and rng.random() < 0.05:
            victim = live.pop(int(rng.integers(len(live))))
            if not victim.is_finished:
                sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        if not out.is_empty:
            sched.update_from_output(out, [[int(rng.integers(0, 50))] * max(1, out.num_decode_steps)]
                                     * len(out.scheduled))
        live = [r for r in live if not r.is_finished]
        held = collections.Counter()
        for r in sched.running + list(sched.waiting):
            for blocks, w in zip(r.group_block_ids or (), kv.sliding_windows):
                real = [b for b in blocks if b != kv.null_block]
                held.update(real)
                if w is not None:  # nothing before the window of the last computed token is held
                    dead = max(0, r.num_computed_tokens - 1 - w + 1) // 8
                    assert all(b == kv.null_block for b in blocks[:max(0, dead - 4)]), (step, r)
        cache = kv.prefix_cache
        evictable = set(cache._evictable) if cache else set()
        free = list(kv.allocator._free)
        assert len(free) == len(set(free)) and kv.null_block not in free
        assert not (set(free) & set(held)) and not (set(free) & evictable) and not (evictable & set(held))
        shared = [b for b, c in held.items() if c > 1]
        assert all(cache is not None and cache._hash_of.get(b) is not None for b in shared), shared
        assert 1 + len(free) + len(evictable) + len(held) == kv.num_blocks, step
    assert n > 50
