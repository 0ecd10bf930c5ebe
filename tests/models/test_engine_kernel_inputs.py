"""Memory safety of the engine's kernel inputs (``LLMEngine(check_kernel_inputs=True)``).

The Pallas interpreter and XLA's CPU gathers clamp out-of-bounds indices, so a CPU run cannot show that a
compiled GPU kernel would stay in bounds; these runs check, on every step, what the kernels rely on
(:func:`jaxkv.checks` conditions: block ids of every block a sequence reads, ``seq_lens`` within the
table, ``query_start_loc``, written slots, and fed token ids >= 0) over async and synchronous scheduling,
static-like batches whose length caps differ (prompt + ``max_tokens`` past ``max_model_len``) and a
continuous run with preemption; and one run with a corrupted block table must be caught."""

from __future__ import annotations

import numpy as np
import pytest

import models
from jaxkv import SamplingParams
from tests.models.test_continuous_batching import TINY, _tiny_model

MAX_MODEL_LEN = 80


@pytest.fixture(scope="module")
def engine():
    """One engine for every scenario (its compiled buckets are shared); scheduling mode set per test."""
    return _engine(False)


def _engine(async_scheduling: bool, **kw):
    opts = dict(attention_impl="reference", block_size=8, num_blocks=48, max_model_len=MAX_MODEL_LEN,
                eos_token_id=None, max_num_seqs=12, max_num_batched_tokens=64, num_scheduler_steps=8,
                async_scheduling=async_scheduling, check_kernel_inputs=True)
    opts.update(kw)
    return models.make_engine(_tiny_model(), **opts)


def _workload(seed: int, n: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TINY.vocab_size, int(rng.integers(1, MAX_MODEL_LEN - 1))).tolist()
               for _ in range(n)]
    return prompts, [int(rng.integers(1, MAX_MODEL_LEN)) for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "continuous"])
def test_kernel_inputs_stay_in_bounds(engine, async_scheduling, static):
    eng = engine
    assert not eng.has_unfinished_requests()
    eng.async_scheduling = async_scheduling
    preemptions = eng.stats.num_preemptions
    prompts, outs = _workload(0, 20)
    params = lambda n, i: SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)  # noqa: E731
    if static:  # bench_throughput's static batches: every request asks for the batch's longest output
        for s in range(0, len(prompts), 12):
            idx = range(s, min(len(prompts), s + 12))
            longest = max(outs[i] for i in idx)
            res = eng.generate([prompts[i] for i in idx], [params(longest, i) for i in idx])
            for i, r in zip(idx, res):
                assert len(r.outputs[0].token_ids) == min(longest, MAX_MODEL_LEN - len(prompts[i]))
    else:
        res = eng.generate(prompts, [params(n, i) for i, n in enumerate(outs)])
        assert [len(r.outputs[0].token_ids) for r in res] == [min(n, MAX_MODEL_LEN - len(p))
                                                              for p, n in zip(prompts, outs)]
    assert eng.stats.num_preemptions > preemptions, "the cache should be small enough to preempt"
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_corrupted_block_table_is_caught():
    eng = _engine(False, num_blocks=8, max_num_seqs=1, max_num_batched_tokens=16, num_scheduler_steps=1)
    eng.add_request("a", list(range(1, 20)), SamplingParams(max_tokens=8, temperature=0))
    eng.step()  # prefill
    req = eng.scheduler.running[0]
    req.block_ids[0] = eng.kv_cache_manager.num_blocks + 5  # a block id the cache does not have
    with pytest.raises(ValueError, match="block"):
        eng.step()
