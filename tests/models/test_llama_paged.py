"""The decoder through the paged cache vs the cache-free dense forward; the engine around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from jaxkv import SamplingParams
from models.llama import LlamaForCausalLM

TINY = models.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2,
                          num_heads=6, num_kv_heads=2, head_size=16, rope_theta=10000.0,
                          max_position_embeddings=128)


def _tiny_model(seed=0):
    model = LlamaForCausalLM(TINY, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    # random (not unit) norm weights so a layout bug in any weight shows
    for norm in [model.norm] + [m for l in model.layers for m in (l.input_layernorm, l.post_attention_layernorm)]:
        norm.scale.set_value(jax.random.uniform(jax.random.key(seed + 1), norm.scale.get_value().shape,
                                                minval=0.5, maxval=1.5))
    return model


def _engine(model, impl, *, num_blocks=32, block_size=8, max_model_len=64, num_scheduler_steps=1,
            **options):
    options = dict(max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False) | options
    return models.make_engine(model, attention_impl=impl, block_size=block_size, num_blocks=num_blocks,
                              max_model_len=max_model_len, num_scheduler_steps=num_scheduler_steps,
                              **options)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_paged_logits_match_dense_forward(impl):
    """Every step's logits (prefill + 17 decode steps) equal a full recomputation without a cache."""
    model = _tiny_model()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (5, 1, 9)]
    eng = _engine(model, impl, num_scheduler_steps=4, return_logits=True)
    done = eng.generate(prompts, greedy(18))
    for out in done:
        c = out.outputs[0]
        assert c.logits.shape == (18, TINY.vocab_size)
        seq = out.prompt_token_ids + c.token_ids
        dense = np.asarray(models.dense_logits(model, np.array([seq]), np.ones((1, len(seq)), bool)))[0]
        start = len(out.prompt_token_ids) - 1
        np.testing.assert_allclose(c.logits, dense[start:start + 18], rtol=2e-4, atol=2e-4)
        # greedy: each generated token is the argmax of the dense logits before it
        np.testing.assert_array_equal(c.token_ids, dense[start:-1].argmax(-1))


def test_compiles_stay_within_buckets_across_changing_batches():
    """Sequences finish at different steps (the real batch shrinks): compiles stay <= buckets."""
    model = _tiny_model(3)
    eng = _engine(model, "reference", num_scheduler_steps=3)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (3, 4, 6)]
    eng.generate(prompts, greedy(6))
    first = eng.num_compiles
    for max_new in (3, 9, 12):
        done = eng.generate(prompts, greedy(max_new))
        assert all(len(t) == max_new for t in _tokens(done))
    assert eng.num_compiles <= eng.num_buckets
    # the same batch sizes again: nothing new to compile
    eng.generate(prompts, greedy(9))
    assert eng.num_compiles == max(first, eng.num_compiles)
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks  # everything freed


def test_stop_tokens_end_one_sequence_only():
    model = _tiny_model(4)
    eng = _engine(model, "reference", num_scheduler_steps=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    free_run = _tokens(eng.generate(prompts, greedy(8)))
    stop = free_run[0][2]
    if stop in free_run[1]:
        pytest.skip("stop token appears in both continuations for this seed")
    done = eng.generate(prompts, greedy(8, stop_token_ids=[stop]))
    first = free_run[0].index(stop)
    assert done[0].outputs[0].token_ids == free_run[0][:first + 1] and done[0].outputs[0].finish_reason == "stop"
    assert done[1].outputs[0].token_ids == free_run[1] and done[1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2], []], r"prompts\[1\] is empty"),
    ([[1] * 64], "max_model_len=64"),
    ([[1] * 40] * 2 + [[1] * 60], "blocks"),
])
def test_engine_rejects_bad_requests_without_side_effects(prompts, match):
    eng = _engine(_tiny_model(), "reference", num_blocks=7)
    caches_before = [np.asarray(c) for c in eng.kv_caches]
    with pytest.raises(ValueError, match=match):
        eng.generate(prompts, greedy(4))
    assert eng.kv_cache_manager.num_free_blocks == 7 and not eng.has_unfinished_requests()
    for a, b in zip(caches_before, eng.kv_caches):
        np.testing.assert_array_equal(a, np.asarray(b))
    # and the engine still works afterwards
    done = eng.generate([[1, 2, 3]], greedy(2))
    assert len(done[0].outputs[0].token_ids) == 2


def test_donation_keeps_the_cache_in_place():
    """The step's cache output reuses the donated input buffer (no copy of the cache)."""
    eng = _engine(_tiny_model(), "reference", num_scheduler_steps=2)
    ptr = eng.kv_caches[0].unsafe_buffer_pointer()
    eng.generate([[1, 2, 3]], greedy(5))
    assert eng.kv_caches[0].unsafe_buffer_pointer() == ptr


def test_multi_step_device_loop_equals_one_step_per_sync():
    """num_scheduler_steps=5 (device loop) gives the same tokens, stops and logits as one step each."""
    model = _tiny_model(5)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (2, 7, 4)]
    base = _engine(model, "reference", return_logits=True).generate(prompts, greedy(11))
    stop = base[1].outputs[0].token_ids[3]
    one = _engine(model, "reference").generate(prompts, greedy(11, stop_token_ids=[stop]))
    eng = _engine(model, "reference", num_scheduler_steps=5, return_logits=True)
    many = eng.generate(prompts, greedy(11, stop_token_ids=[stop]))
    assert _tokens(many) == _tokens(one)
    assert [o.outputs[0].finish_reason for o in many] == [o.outputs[0].finish_reason for o in one]
    assert many[1].outputs[0].finish_reason == "stop" and len(many[1].outputs[0].token_ids) <= 3
    for m, b in zip(many, base):
        n = len(m.outputs[0].token_ids)
        np.testing.assert_allclose(m.outputs[0].logits[:n], b.outputs[0].logits[:n], rtol=1e-5, atol=1e-5)
    assert eng.stats.model_steps > eng.stats.steps  # several decode steps per host round trip
    assert eng.num_compiles <= eng.num_buckets
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_sampling_with_temperature_is_reproducible_and_varies_with_seed():
    model = _tiny_model(6)
    eng = _engine(model, "reference", num_scheduler_steps=4)
    prompts = [[1, 2, 3], [4, 5]]
    a = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=1))
    b = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=1))
    c = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=2))
    assert _tokens(a) == _tokens(b)
    assert _tokens(a) != _tokens(c)


def test_fp8_kv_cache_follows_the_dense_forward_within_fp8_error():
    """kv_cache_dtype fp8 (e4m3, scales 1) is wired through write and attention: logits move, but only
    by the K/V rounding (e4m3 keeps 3 mantissa bits, 2^-4 relative; through this random 2-layer model
    that moved the logits by ~12 % of their largest value). Exactness of fp8 write + read is tested
    against float64 loops in tests/jaxkv/kv_cache/test_write_fp8.py and the kernel tests."""
    model = _tiny_model(7)
    eng = models.make_engine(model, attention_impl="reference", block_size=8, num_blocks=32, max_model_len=64,
                             cache_dtype=jnp.float8_e4m3fn, num_scheduler_steps=4, max_num_seqs=4,
                             max_num_batched_tokens=32, return_logits=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    done = eng.generate(prompts, greedy(6))
    assert eng.kv_caches[0].dtype == jnp.float8_e4m3fn
    for out in done:
        c = out.outputs[0]
        seq = out.prompt_token_ids + c.token_ids
        dense = np.asarray(models.dense_logits(model, np.array([seq]), np.ones((1, len(seq)), bool)))[0]
        for step, logits in enumerate(c.logits):
            want = dense[len(out.prompt_token_ids) - 1 + step]
            err = np.abs(logits - want).max()
            assert 0 < err <= 0.25 * np.abs(want).max()


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_prefill_equals_one_shot(chunk):
    """Prompts prefilled in chunks (each chunk attends to the cached earlier chunks) give the same
    first-token logits and the same greedy continuation as one-shot prefill."""
    model = _tiny_model(8)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (11, 3, 17)]
    one = _engine(model, "reference", return_logits=True).generate(prompts, greedy(5))
    got = _engine(model, "reference", long_prefill_token_threshold=chunk,
                  return_logits=True).generate(prompts, greedy(5))
    assert _tokens(got) == _tokens(one)
    for g, o in zip(got, one):
        np.testing.assert_allclose(g.outputs[0].logits[0], o.outputs[0].logits[0], rtol=1e-4, atol=1e-4)


def test_prefix_caching_computes_only_the_new_tokens_and_matches_no_caching():
    model = _tiny_model(9)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, TINY.vocab_size, 27).tolist()  # 3 full blocks of 8 + 3 tokens
    first = shared + [1, 2]
    second = shared + [3, 4, 5, 6, 7]
    eng = _engine(model, "reference", enable_prefix_caching=True, return_logits=True)
    done1 = eng.generate([first], greedy(6))
    assert done1[0].num_cached_tokens == 0
    before = eng.stats.num_prompt_tokens_computed
    done2 = eng.generate([second], greedy(6))
    # the 3 full blocks of the shared prefix were reused: only the remaining 8 prompt tokens ran
    assert done2[0].num_cached_tokens == 24
    assert eng.stats.num_prompt_tokens_computed - before == 8
    ref2 = _engine(model, "reference", return_logits=True).generate([second], greedy(6))
    assert _tokens(done2) == _tokens(ref2)
    np.testing.assert_allclose(done2[0].outputs[0].logits[0], ref2[0].outputs[0].logits[0], rtol=1e-5,
                               atol=1e-5)
    # an identical prompt reuses every full block of prompt[:-1] (the last token is always computed)
    done3 = eng.generate([first], greedy(6))
    assert done3[0].num_cached_tokens == 24 and _tokens(done3) == _tokens(done1)
    assert 0 < eng.stats.prefix_cache_hit_rate < 1


def test_prefix_cache_evicts_idle_blocks_when_the_cache_is_full():
    model = _tiny_model(10)
    rng = np.random.default_rng(6)
    eng = _engine(model, "reference", num_blocks=8, enable_prefix_caching=True)
    plain = _engine(model, "reference", num_blocks=8)
    for _ in range(5):  # 5 distinct 20-token prompts: each needs 3 blocks, each leaves 2-3 cached
        prompt = rng.integers(0, TINY.vocab_size, 20).tolist()
        assert _tokens(eng.generate([prompt], greedy(4))) == _tokens(plain.generate([prompt], greedy(4)))
    kv = eng.kv_cache_manager
    cache = kv.prefix_cache
    assert cache.num_cached_blocks == cache.num_evictable_blocks <= 8
    assert kv.allocator.num_free_blocks + cache.num_cached_blocks == 8  # every block accounted for
