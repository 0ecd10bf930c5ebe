"""Continuous batching on a tiny random Llama (CPU, f32): requests come and go, the cache is small enough
that requests are preempted, and each request's greedy tokens still equal its solo run."""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
import models
from jaxkv import SamplingParams
from tests.conftest import step_compiles, step_events
from tests.models.test_llama_paged import TINY, _tiny_model  # noqa: F401  (the chaos test imports them from here)

BLOCK = 8
NUM_BLOCKS = 14
MAX_LEN = 128


def _make(**options):
    return models.make_engine(_tiny_model(), attention_impl="reference", block_size=BLOCK,
                              num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, max_num_seqs=8,
                              max_num_batched_tokens=32, long_prefill_token_threshold=16,
                              num_scheduler_steps=4, eos_token_id=None, **options)


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (compiles once per bucket): 14 blocks of 8 tokens, 8 requests a step."""
    return _make()


@pytest.fixture(scope="module")
def async_engine():
    """The same with async scheduling (step N+1 dispatched before step N's tokens are fetched)."""
    return _make(async_scheduling=True)


def _workload(n=34, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TINY.vocab_size, int(k)).tolist() for k in rng.integers(1, 40, n)]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0) for m in rng.integers(1, 30, n)]
    return prompts, params


def _all_free(eng) -> bool:
    kv = eng.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks and not eng.has_unfinished_requests()


@pytest.mark.parametrize("which", ["engine", "async_engine"])
def test_staggered_requests_with_preemption_match_solo_runs(which, request):
    engine = request.getfixturevalue(which)
    solo_engine = request.getfixturevalue("engine")
    prompts, params = _workload()
    done: dict[str, jaxkv.RequestOutput] = {}
    streamed: dict[str, list[int]] = {}
    next_req, step = 0, 0
    rejected = []
    while next_req < len(prompts) or engine.has_unfinished_requests():
        # 6 requests up front, then one or two more per step
        for _ in range(6 if step == 0 else 1 + step % 2):
            if next_req < len(prompts):
                engine.add_request(f"r{next_req}", prompts[next_req], params[next_req])
                next_req += 1
        if step == 3:  # a request that can never fit is refused; nothing else is disturbed
            before = (engine.get_num_unfinished_requests(), engine.kv_cache_manager.num_free_blocks)
            for bad in ([1] * MAX_LEN, [1] * 100):
                with pytest.raises(ValueError) as e:
                    engine.add_request("too-long", bad, SamplingParams(max_tokens=27, temperature=0))
                rejected.append(str(e.value))
            assert (engine.get_num_unfinished_requests(), engine.kv_cache_manager.num_free_blocks) == before
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
            assert out.outputs[0].token_ids == streamed[out.request_id]
            if out.finished:
                done[out.request_id] = out
        step += 1
    assert "max_model_len=128" in rejected[0] and "16 blocks" in rejected[1] and "14 in all" in rejected[1]
    stats = engine.stats
    assert stats.num_preemptions > 0, "the cache is meant to be too small to avoid preemption"
    assert stats.num_compiles <= engine.num_buckets
    assert _all_free(engine), "blocks leaked"
    assert len(done) == len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        got = done[f"r{i}"].outputs[0]
        assert got.finish_reason == "length" and len(got.token_ids) == sp.max_tokens
        solo = solo_engine.generate([p], sp)[0].outputs[0]
        assert solo.token_ids == got.token_ids, f"request {i}"
    assert engine.num_compiles <= engine.num_buckets
    assert _all_free(engine)


@pytest.mark.parametrize("which", ["engine", "async_engine"])
def test_abort_mid_run_frees_blocks_at_once(which, request):
    engine = request.getfixturevalue(which)
    prompts, params = _workload(6, seed=1)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"a{i}", p, SamplingParams(max_tokens=25, temperature=0))
    for _ in range(3):
        engine.step()
    victim = next(r for r in engine.scheduler.running)
    held = len(victim.block_ids)
    assert held > 0
    free_before = engine.kv_cache_manager.num_free_blocks
    engine.abort_request([victim.request_id, "no-such-id"])
    assert engine.kv_cache_manager.num_free_blocks == free_before + held
    assert victim not in engine.scheduler.running
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == victim.request_id]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    engine.abort_request([f"a{i}" for i in range(6)])  # the rest, waiting or running
    engine.step()
    assert _all_free(engine)


def test_add_request_validation(engine):
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    engine.step()
    assert _all_free(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, TINY.vocab_size, int(k)).tolist() for k in (5, 17, 9, 30)]
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    others = [SamplingParams(max_tokens=12, temperature=0.7, seed=s) for s in (1, 2, 3)]
    batch = engine.generate(prompts, [sp] + others)
    alone = engine.generate(prompts[:1], sp)
    assert batch[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    other_seed = engine.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9,
                                                             top_k=20, seed=99))
    assert other_seed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids
    assert _all_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_tokens_eos_min_tokens_ignore_eos(async_scheduling):
    eng = models.make_engine(_tiny_model(4), attention_impl="reference", block_size=BLOCK, num_blocks=32,
                             max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                             num_scheduler_steps=3, enable_prefix_caching=False,
                             async_scheduling=async_scheduling)
    prompt = [1, 2, 3, 4, 5]
    free = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids
    stop = free[4]
    first = free.index(stop)
    # stop_token_ids: ends there; the stop token is the last of token_ids (vLLM: it counts) and the stop_reason
    out = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    c = out.outputs[0]
    assert c.token_ids == free[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop
    # EOS the same, stop_reason None; ignore_eos runs to the length cap
    eng.eos_token_ids = frozenset({stop})
    c = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert c.token_ids == free[:first + 1] and c.finish_reason == "stop" and c.stop_reason is None
    c = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert c.token_ids == free and c.finish_reason == "length"
    # min_tokens: the stop token cannot be sampled before min_tokens tokens (its logit is masked)
    c = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0, min_tokens=first + 2))[0].outputs[0]
    assert stop not in c.token_ids[:first + 2] and len(c.token_ids) >= first + 2
    assert c.token_ids[:first] == free[:first]
    eng.eos_token_ids = frozenset()
    assert _all_free(eng)


def test_warmup_compiles_every_bucket_once_and_changes_nothing():
    eng = models.make_engine(_tiny_model(5), attention_impl="reference", block_size=BLOCK, num_blocks=16,
                             max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                             num_scheduler_steps=2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    before = eng.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].token_ids
    caches = [np.asarray(c) for c in eng.kv_caches]
    eng.warmup(run=True)  # the dummy runs too (the default skips them on CPU)
    assert eng.num_compiles == eng.num_buckets == 2  # request bucket 2 (decode loops run >= 2 rows); token bucket 16
    for a, b in zip(caches, eng.kv_caches):  # dummy tokens write nothing
        np.testing.assert_array_equal(a, np.asarray(b))
    eng.reset_prefix_cache()
    after = eng.generate([prompt], SamplingParams(max_tokens=5, temperature=0))
    assert after[0].outputs[0].token_ids == before and after[0].num_cached_tokens == 0
    assert eng.num_compiles == eng.num_buckets


def test_warmup_compiles_concurrently_each_bucket_once():
    """warmup lowers every bucket, compiles them on threads, then runs them: each executable is built
    once (the dummy runs and later steps reuse it), nothing compiles while serving."""
    eng = models.make_engine(_tiny_model(5), attention_impl="reference", block_size=BLOCK, num_blocks=16,
                             max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                             num_scheduler_steps=2)
    compiled = step_compiles(lambda: eng.warmup(max_workers=2))
    assert len(compiled) == eng.num_buckets == eng.num_compiles == 4  # request buckets 2, 4; tokens 16, 32
    assert compiled.count("jit(_packed_mixed_step)") == 2
    # the largest temporary buffer of the built programs (the engine's memory report), from XLA's own analyses
    temps = [exe.memory_analysis().temp_size_in_bytes for exe in eng.runner.executables.values()]
    assert len(temps) == 4 and eng.runner.warmup_temp_bytes == max(temps) > 0
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], list(range(1, 30))]
    outs = []
    assert step_compiles(lambda: outs.extend(eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0)))) == []
    solo = models.make_engine(_tiny_model(5), attention_impl="reference", block_size=BLOCK, num_blocks=16,
                              max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    for p, o in zip(prompts, outs):
        ref = solo.generate([p], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
        assert o.outputs[0].token_ids == ref
    assert eng.num_compiles == eng.num_buckets


def test_executable_cache_warm_start_traces_nothing_and_generates_the_same(tmp_path):
    """warmup(executable_cache=...) stores each compiled bucket; a second engine of the same description loads
    them without tracing, lowering or compiling a step, and generates what the first did. Another
    description, or a file that does not load, compiles again."""
    import pickle

    from jaxkv.worker.executable_cache import ExecutableCache

    def make():
        return models.make_engine(_tiny_model(5), attention_impl="reference", block_size=BLOCK, num_blocks=16,
                                  max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                  num_scheduler_steps=2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], list(range(1, 30))]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    cold, cache = make(), ExecutableCache(tmp_path, "tiny-5")
    assert len(step_compiles(lambda: cold.warmup(max_workers=2, executable_cache=cache))) == 4
    files = sorted(tmp_path.glob("*.exe"))
    assert (cache.hits, cache.misses, len(files)) == (0, 4, 4)
    ref = [o.outputs[0].token_ids for o in cold.generate(prompts, greedy)]

    warm, cache = make(), ExecutableCache(tmp_path, "tiny-5")
    assert step_events(lambda: warm.warmup(executable_cache=cache)) == []  # no trace, lowering or compile
    assert (cache.hits, cache.misses) == (4, 0) and warm.num_compiles == warm.num_buckets == 4
    outs = []
    assert step_events(lambda: outs.extend(warm.generate(prompts, greedy))) == []
    assert [o.outputs[0].token_ids for o in outs] == ref

    other = ExecutableCache(tmp_path, "tiny-5, another config")
    assert len(step_compiles(lambda: make().warmup(executable_cache=other))) == 4 and other.misses == 4
    victim = files[0]  # a file that unpickles, but whose executable does not load
    victim.write_bytes(pickle.dumps((b"not an executable", *pickle.loads(victim.read_bytes())[1:])))
    again = ExecutableCache(tmp_path, "tiny-5")
    assert len(step_compiles(lambda: make().warmup(executable_cache=again))) == 1
    assert (again.hits, again.misses) == (3, 1) and pickle.loads(victim.read_bytes())[0] != b"not an executable"


def test_executable_cache_key_holds_the_model_switches(monkeypatch):
    """The model code's trace-time switches change the executable cache's key through its environment fingerprint
    (every ``JAXKV_*`` variable), so an A/B of one never loads the other's executables."""
    from jaxkv.worker.executable_cache import environment_fingerprint
    from models.fused import FUSE_ENV
    from models.parallel import TP_ALL_REDUCE_ENV
    from models.quantization import GEMM_OUT_ENV, NORM_QUANT_ENV
    for name in (FUSE_ENV, TP_ALL_REDUCE_ENV, GEMM_OUT_ENV, NORM_QUANT_ENV):
        monkeypatch.delenv(name, raising=False)
    base = environment_fingerprint()
    for name, value in ((FUSE_ENV, "0"), (TP_ALL_REDUCE_ENV, "two-shot"), (GEMM_OUT_ENV, "f32"), (NORM_QUANT_ENV, "0")):
        monkeypatch.setenv(name, value)
        assert environment_fingerprint() != base, name
        monkeypatch.delenv(name)
    assert environment_fingerprint() == base


def test_step_programs_hold_no_device_predicated_control_flow():
    """On GPU, XLA runs a ``lax.cond`` by waiting on the host for its predicate, so a step holding one
    blocks the dispatching thread until the device is nearly done (session 8, H100: 11.8 of 15.7 ms of
    host work per round trip). Neither step program may hold a conditional; the decode loop's scan (a
    while loop with a trip count known at compile time) is allowed, and measured not to block."""
    from jaxkv.worker.model_runner import _LowerOnly
    eng = models.make_engine(_tiny_model(5), attention_impl="reference", block_size=BLOCK, num_blocks=16,
                             max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_scheduler_steps=3)
    runner, lowered = eng.runner, []
    saved = runner._mixed, runner._decode, runner.kv_caches
    runner._mixed = _LowerOnly("mixed", runner._mixed, lowered)
    runner._decode = _LowerOnly("decode", runner._decode, lowered)
    try:
        for top_k_top_p in (False, True):
            runner._warmup_batches(top_k_top_p)
    finally:
        runner._mixed, runner._decode, runner.kv_caches = saved
    assert len(lowered) == 2 * eng.num_buckets
    for program in lowered:
        text = program.lowered.as_text()
        assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_top_k_top_p_batches_compile_their_own_programs_once():
    """A batch with a top-k/top-p row runs its bucket's filtering program (compiled on first use, or by
    ``warmup(top_k_top_p=True)``); the other rows sample as in the plain program; nothing compiles twice."""
    def make():
        return models.make_engine(_tiny_model(5), attention_impl="reference", block_size=BLOCK, num_blocks=32,
                                  max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                                  num_scheduler_steps=2)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    plain = SamplingParams(max_tokens=6, temperature=0.8, seed=5)
    nucleus = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.5, top_k=4, seed=6)
    eng = make()
    eng.warmup()
    assert eng.num_compiles == eng.num_buckets
    outs = eng.generate(prompts, [plain, nucleus])
    assert eng.num_buckets < eng.num_compiles <= 2 * eng.num_buckets
    warm = make()
    assert len(step_compiles(lambda: warm.warmup(top_k_top_p=True))) == 2 * warm.num_buckets
    again = []
    assert step_compiles(lambda: again.extend(warm.generate(prompts, [plain, nucleus]))) == []
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    # the plain request alone (plain programs) samples what it sampled beside the nucleus request
    alone = warm.generate(prompts[:1], plain)[0].outputs[0].token_ids
    assert alone == outs[0].outputs[0].token_ids


def test_admission_delay_runs_decode_loops_and_keeps_tokens(engine):
    """max_admission_delay_steps=3: admissible requests may wait up to 3 decode steps (fewer round
    trips); the tokens are still each request's solo tokens."""
    eng = models.make_engine(_tiny_model(), attention_impl="reference", block_size=BLOCK,
                             num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, max_num_seqs=8,
                             max_num_batched_tokens=32, num_scheduler_steps=4, max_admission_delay_steps=3)
    prompts, params = _workload(12, seed=7)
    got = eng.generate(prompts[:4], params[:4])  # then staggered: the rest arrive while these run
    for i, (p, sp) in enumerate(zip(prompts[4:], params[4:])):
        eng.add_request(f"late{i}", p, sp)
    late = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                late[out.request_id] = out
    assert eng.stats.model_steps > eng.stats.steps
    outs = got + [late[f"late{i}"] for i in range(8)]
    for p, sp, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == engine.generate([p], sp)[0].outputs[0].token_ids
    assert _all_free(eng)


def test_async_scheduling_queues_the_next_step_before_fetching(async_engine):
    """With async scheduling a step is in flight between step() calls, and its tokens arrive in order."""
    prompts, params = _workload(5, seed=11)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        async_engine.add_request(f"q{i}", p, sp)
    async_engine.step()
    assert async_engine._inflight is not None and async_engine.has_unfinished_requests()
    done = {}
    while async_engine.has_unfinished_requests():
        for out in async_engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == [f"q{i}" for i in range(5)]
    stats = async_engine.stats
    assert 0 <= stats.device_idle_s <= stats.step_s and 0 <= stats.gpu_idle_share <= 1
    assert _all_free(async_engine)


def test_priority_policy_admits_the_smallest_priorities_first_and_keeps_tokens(engine):
    """``scheduling_policy="priority"`` (vLLM's): 12 requests added at once are first admitted in
    ``(priority, arrival)`` order; every request's greedy tokens equal its solo run. FCFS refuses a priority.
    (The module's engine with its scheduler switched to the policy: no new compiles.)"""
    import dataclasses

    from jaxkv.core.request_queue import PriorityQueue

    prompts, params = _workload(n=12, seed=5)
    prios = [3, 0, 2, 0, 1, 5, 0, 2, 4, 1, 0, 3]
    with pytest.raises(ValueError, match="priority=3 needs scheduling_policy='priority'"):
        engine.add_request("p", prompts[0], params[0], priority=3)
    sched, before = engine.scheduler, (engine.config, engine.scheduler.config, engine.scheduler.waiting)
    engine.config = sched.config = dataclasses.replace(engine.config, policy="priority")
    sched.waiting = PriorityQueue()
    try:
        for i in range(12):
            engine.add_request(f"q{i}", prompts[i], params[i], priority=prios[i])
        reqs = [engine._requests[f"q{i}"] for i in range(12)]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    finally:
        engine.config, sched.config, sched.waiting = before
    # first admissions in (priority, arrival) order (requests admitted in one step share a time)
    by_key = sorted(range(12), key=lambda i: (prios[i], i))
    times = [reqs[i].first_scheduled_time for i in by_key]
    assert times == sorted(times) and times[0] < times[-1]
    for i in range(12):
        assert done[f"q{i}"] == engine.generate([prompts[i]], params[i])[0].outputs[0].token_ids, f"request {i}"
    assert _all_free(engine)
