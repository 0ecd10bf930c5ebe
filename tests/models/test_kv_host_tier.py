"""The KV cache's host tier (issue 29) end to end on tiny random models (CPU, f32, greedy).

Multi-turn conversations (each turn's prompt is the conversation so far) run on a device cache far too small
for them, with the tier on (swap preemption, host prefix cache) and off: the transcripts equal the tier-off
engine's and those of each conversation run alone (an unconstrained cache: it never preempts); swaps and
host prefix hits happened; no device or host block is left held after every request ends or is aborted in
the middle of a swap; the host memory is what ``kv_offloading_size`` allows. A hybrid Gemma 3 (a sliding-window
group and a full-attention group) swaps every group's blocks, null blocks included. The engines have the
shapes of test_continuous_batching.py's (their step programs come from the run's compilation cache).
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import pytest

import models
from jaxkv import SamplingParams, SlidingWindowSpec
from jaxkv.engine.core import engine_stats
from jaxkv.worker.kv_offload import bytes_per_block
from tests.conftest import load_script, slow
from tests.models.test_llama_paged import TINY, _tiny_model

BLOCK, NUM_BLOCKS, MAX_LEN = 8, 14, 128


@functools.lru_cache(maxsize=None)
def _model():
    return _tiny_model()


def _make(**options):
    return models.make_engine(_model(), attention_impl="reference", block_size=BLOCK, num_blocks=NUM_BLOCKS,
                              max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=32,
                              long_prefill_token_threshold=16, num_scheduler_steps=4, eos_token_id=None, **options)


def _gib(num_blocks: int, engine) -> float:
    return num_blocks * bytes_per_block(engine.kv_caches) / 2**30


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_multiturn")


@pytest.fixture(scope="module")
def conversations(bench):
    return bench.synthetic_conversations(8, seed=3, vocab_size=TINY.vocab_size, turns=4, user_tokens=(4, 12),
                                         answer_tokens=(4, 10))


@pytest.fixture(scope="module")
def off_engine():
    return _make(async_scheduling=True)


@pytest.fixture(scope="module")
def references(bench, conversations, off_engine):
    """Transcripts with the tier off (all conversations together) and of each conversation alone."""
    together = bench.transcripts(bench.run_workload(off_engine, conversations, max_active=4))
    solo = {}
    for i, conv in enumerate(conversations):
        solo.update({(i, turn): out for (_, turn), out in
                     bench.transcripts(bench.run_workload(off_engine, [conv], max_active=1)).items()})
    assert off_engine.stats.num_preemptions > 0, "the device cache is meant to be too small"
    return together, solo


def _assert_nothing_held(engine):
    kv, host = engine.kv_cache_manager, engine.host_pool
    assert not engine.has_unfinished_requests()
    assert kv.allocator.num_free_blocks + kv.prefix_cache.num_evictable_blocks == kv.num_blocks
    assert kv.prefix_cache.num_evictable_blocks == kv.prefix_cache.num_cached_blocks  # no reference left
    # every host block is free or in the host prefix cache: none held for a swapped-out request
    assert host.allocator.num_free_blocks + host.num_cached_blocks == host.num_blocks


@pytest.mark.parametrize("mode,async_scheduling,host_blocks,loads", [
    ("swap", True, 64, "async"), ("swap", False, 3, "async"), ("recompute", True, 64, "async"),
    ("swap", True, 64, "in-pass"), ("swap", True, 64, "async+loops")])
def test_multiturn_transcripts_equal_tier_off_and_solo(bench, conversations, references, mode, async_scheduling,
                                                       host_blocks, loads, off_engine, monkeypatch):
    """Swap preemption with a roomy host pool (async scheduling) and with one so small that swaps fall back to
    recompute; recompute preemption with the host prefix cache alone; the host → device copies as loads beside
    the steps (the default) and inside the pass (``JAXKV_ASYNC_KV_LOADS=0``); decode loops running while loads
    are in flight (``max_admission_delay_steps``, `LLM`'s default 8; here 4)."""
    monkeypatch.setenv("JAXKV_ASYNC_KV_LOADS", "0" if loads == "in-pass" else "1")
    together, solo = references
    engine = _make(async_scheduling=async_scheduling, preemption_mode=mode,
                   kv_offloading_size=_gib(host_blocks, off_engine),
                   max_admission_delay_steps=4 if loads == "async+loops" else 0)
    loops_while_loading = []
    try_loop = type(engine.scheduler)._try_schedule_decode_loop

    def counting(sched):
        out = try_loop(sched)
        if out is not None and sched.loading:
            loops_while_loading.append(out.num_decode_steps)
        return out
    monkeypatch.setattr(type(engine.scheduler), "_try_schedule_decode_loop", counting)
    if loads == "async+loops":  # each load takes a while (as a GPU's copy does), so later passes see it in flight
        gather_load = type(engine.offloader)._gather_load

        def slow_gather_load(off, *args):
            time.sleep(0.03)
            return gather_load(off, *args)
        monkeypatch.setattr(type(engine.offloader), "_gather_load", slow_gather_load)
    got = bench.transcripts(bench.run_workload(engine, conversations, max_active=4))
    assert bool(loops_while_loading) == (loads == "async+loops")
    assert all(k <= 4 for k in loops_while_loading)
    assert got == together
    assert got == solo
    s = engine.stats
    assert s.num_host_blocks == host_blocks
    assert engine.num_compiles <= engine.num_buckets  # the copies leave the caches as the step programs expect
    assert s.num_blocks_offloaded > 0 and s.num_host_prefix_hit_tokens > 0  # the host prefix cache served hits
    assert (s.kv_offload_load_s > 0) == (loads != "in-pass")  # the loader thread ran the loads (or nothing did)
    assert s.kv_offload_bytes_to_device >= s.num_host_prefix_hit_tokens // BLOCK * bytes_per_block(engine.kv_caches)
    if mode == "swap":
        assert s.num_swaps_out > 0 and s.num_swaps_in > 0
        assert (s.num_swap_recompute_fallbacks > 0) == (host_blocks < 10)
    else:
        assert s.num_swaps_out == 0 and s.num_preemptions > 0
    _assert_nothing_held(engine)
    # host memory: exactly the pool's blocks, within kv_offloading_size
    assert engine.offloader.host_bytes == host_blocks * bytes_per_block(engine.kv_caches)
    assert engine.offloader.host_bytes <= _gib(host_blocks, off_engine) * 2**30


def test_abort_while_swapped_out_loading_and_right_after_the_load_leaks_nothing(off_engine):
    """Requests are aborted while swapped out, while their swap-in load is in flight (WAITING_FOR_REMOTE_KVS:
    never copied in, its host blocks held until read) and in the step after it landed (its copy and model
    step dispatched, async scheduling); nothing stays held, and the others' tokens equal their solo runs."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, TINY.vocab_size, 30).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = _make(async_scheduling=True, preemption_mode="swap", kv_offloading_size=_gib(64, off_engine))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out_abort = load_abort = in_abort = None  # aborted while swapped out / loading / right after landing
    ever_swapped: set[str] = set()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        sched = engine.scheduler
        swapped = {r.request_id for r in sched.waiting if r.host_block_ids is not None}
        ever_swapped |= swapped
        loading = {r.request_id for r in sched.loading}
        landed = ever_swapped & {r.request_id for r in sched.running} - {out_abort, load_abort}
        if out_abort is None and swapped:
            out_abort = min(swapped)
            engine.abort_request(out_abort)
        elif load_abort is None and loading:
            load_abort = min(loading)
            engine.abort_request(load_abort)
        elif in_abort is None and landed:
            in_abort = min(landed)
            engine.abort_request(in_abort)
    assert None not in (out_abort, load_abort, in_abort)
    assert engine.stats.num_swaps_out >= 2
    _assert_nothing_held(engine)
    gone = {out_abort, load_abort, in_abort}
    assert all(done[rid].outputs[0].finish_reason == "abort" for rid in gone)
    for rid, out in done.items():
        if rid not in gone:
            solo = off_engine.generate([prompts[int(rid)]], params)[0]
            assert out.outputs[0].token_ids == solo.outputs[0].token_ids


def test_hybrid_gemma3_swaps_every_group_and_hits_the_host(bench):
    """A Gemma 3 with a sliding-window group (window 8) and a full-attention group, multi-turn conversations:
    swapped-out requests hold host blocks of both groups (the sliding group's skipped blocks stay null:
    ``None``), the host prefix cache serves hits under ``(group, hash)``, and the transcripts equal the
    tier-off engine's and each conversation's solo run."""
    from models.engine_setup import make_engine
    from models.gemma3 import random_weights
    from models.gemma3_config import Gemma3Config

    cfg = Gemma3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_size=16, query_pre_attn_scalar=16.0, sliding_window=8,
                       sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
                       max_position_embeddings=128)
    model = random_weights(cfg, seed=0)

    def engine(**options):
        return make_engine(model, attention_impl="reference", block_size=BLOCK, num_blocks=18, max_model_len=96,
                           max_num_seqs=4, max_num_batched_tokens=16, num_scheduler_steps=4, eos_token_id=None,
                           async_scheduling=True, **options)

    convs = bench.synthetic_conversations(6, seed=5, vocab_size=cfg.vocab_size, turns=3, user_tokens=(6, 16),
                                          answer_tokens=(6, 14))
    off = engine()
    assert len(off.kv_cache_groups) == 2
    ref = bench.transcripts(bench.run_workload(off, convs, max_active=4))
    solo = {(i, t): out for i, c in enumerate(convs)
            for (_, t), out in bench.transcripts(bench.run_workload(off, [c], max_active=1)).items()}
    on = engine(preemption_mode="swap", kv_offloading_size=_gib(48, off))
    layouts, step = [], on.step

    def step_and_look():  # the swapped-out requests' host blocks after every step
        outs = step()
        layouts.extend(r.host_block_ids for r in on.scheduler.waiting if r.host_block_ids is not None)
        return outs
    on.step = step_and_look
    assert bench.transcripts(bench.run_workload(on, convs, max_active=4)) == ref == solo
    s = on.stats
    assert s.num_swaps_out > 0 and s.num_swaps_in > 0 and s.num_host_prefix_hit_tokens > 0
    assert layouts and all(len(layout) == 2 for layout in layouts)
    assert any(all(any(h is not None for h in g) for g in layout) for layout in layouts)  # both groups swapped
    (sliding,) = [g for g, grp in enumerate(on.kv_cache_groups) if isinstance(grp.kv_cache_spec, SlidingWindowSpec)]
    assert any(None in layout[sliding] for layout in layouts)  # skipped blocks stay null
    assert on.num_compiles <= on.num_buckets
    kv, host = on.kv_cache_manager, on.host_pool
    assert kv.allocator.num_free_blocks + kv.prefix_cache.num_evictable_blocks == kv.num_blocks - 1  # null block
    assert host.allocator.num_free_blocks + host.num_cached_blocks == host.num_blocks


def test_stats_reach_the_front_ends(off_engine, caplog):
    """The tier's counters are in the engine-core stats dict (what /stats, /metrics and the log line read)."""
    from prometheus_client.parser import text_string_to_metric_families

    from models.entrypoints.async_llm import AsyncLLM
    from models.entrypoints.openai.metrics import ServerMetrics

    engine = _make(preemption_mode="swap", kv_offloading_size=_gib(16, off_engine))
    stats = engine_stats(engine)
    keys = ("num_host_blocks", "host_kv_cache_usage", "num_swaps_out", "num_swaps_in", "num_swap_recompute_fallbacks",
            "num_blocks_offloaded", "num_host_prefix_hit_tokens", "kv_offload_bytes_to_host",
            "kv_offload_bytes_to_device", "kv_offload_copy_s")
    assert all(k in stats for k in keys) and stats["num_host_blocks"] == 16
    metrics = ServerMetrics("m", 64, lambda: stats)
    metrics.publish_process_stats(stats)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert [s.value for s in families["jaxkv:num_swaps_out"].samples if s.name.endswith("_total")] == [0]
    assert [s.value for s in families["jaxkv:num_host_blocks"].samples] == [16]
    front = AsyncLLM(engine, tokenizer=None)
    front._stats = dict(stats, num_running=1, num_swaps_out=3, num_swaps_in=2, kv_offload_bytes_to_host=3 * 2**20)
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        front._log_stats(1.0, (0, 0, 0))
    assert "Host KV tier: usage 0.0% of 16 blocks, swaps out/in: 3/2" in caplog.text
    assert "moved 3.0 MiB to host" in caplog.text
    with pytest.raises(ValueError, match="kv_offloading_size"):
        _make(preemption_mode="swap")
    with pytest.raises(ValueError, match="kv_offloading_size=1e-09 GiB holds no block"):
        _make(kv_offloading_size=1e-9)


@slow
@pytest.mark.parametrize("host_blocks", [64, 5])
def test_chaos_run_with_the_host_tier(host_blocks):
    """test_engine_chaos.py's random arrivals, aborts and shared prefixes on a 12-block cache with swap
    preemption, async scheduling and a roomy or a 5-block host pool: after every step no device or host block
    is held twice or lost (free + held + cached = total on both sides); every finished request's tokens equal
    its solo run (or a float near-tie). ``JAXKV_SLOW=1``."""
    from tests.models.test_engine_chaos import chaos_steps, make

    model = _tiny_model(3)
    rng = np.random.default_rng(host_blocks)
    probe = make(model, num_blocks=12)
    eng = make(model, num_blocks=12, max_num_seqs=6, max_num_batched_tokens=24, long_prefill_token_threshold=16,
               num_scheduler_steps=4, async_scheduling=True, preemption_mode="swap",
               kv_offloading_size=_gib(host_blocks, probe))
    solo = make(model, num_blocks=16, max_num_seqs=1, enable_prefix_caching=False, num_scheduler_steps=4)
    finished, _, near_ties = chaos_steps(eng, solo, model, rng, 1500, _check_accounting)
    _assert_nothing_held(eng)
    s = eng.stats
    assert s.num_swaps_out > 0 and s.num_host_prefix_hit_tokens > 0 and near_ties <= max(2, finished // 100)
    assert (s.num_swap_recompute_fallbacks > 0) == (host_blocks < 10)


def _check_accounting(eng):
    """Device: no block owned twice, free + owned (running and loading requests) + cached = total, waiting
    requests hold none. Host: no block held twice, free + swapped-out + freed-but-still-read-by-a-load + cached =
    total."""
    kv, host = eng.kv_cache_manager, eng.host_pool
    cached = set(kv.prefix_cache._hash_of)
    own = [b for r in eng.scheduler.running + eng.scheduler.loading for b in r.block_ids
           if b not in r.cached_block_ids]
    assert len(own) == len(set(own)) and not set(own) & cached
    assert kv.allocator.num_free_blocks + len(set(own) | cached) == kv.num_blocks
    assert not any(r.block_ids for r in eng.scheduler.waiting)
    swapped = [h for r in eng.scheduler.waiting if r.host_block_ids for g in r.host_block_ids for h in g
               if h is not None]
    assert len(swapped) == len(set(swapped)) and not set(swapped) & set(host._key_of)
    reading = host._deferred  # swap-ins' host blocks, freed, until their load has read them
    assert not reading & set(swapped) and not reading & set(host._key_of)
    assert host.allocator.num_free_blocks + len(swapped) + len(reading) + host.num_cached_blocks == host.num_blocks
