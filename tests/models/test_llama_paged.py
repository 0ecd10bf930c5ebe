"""The decoder through the paged cache vs the cache-free dense forward; the engine around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
import models
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


def _engine(model, impl, *, num_blocks=32, block_size=8, max_model_len=64, steps_per_sync=1):
    return models.make_engine(model, attention_impl=impl, block_size=block_size, num_blocks=num_blocks,
                              max_model_len=max_model_len, steps_per_sync=steps_per_sync)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_paged_logits_match_dense_forward(impl):
    """Every step's logits (prefill + 17 decode steps) equal a full recomputation without a cache."""
    model = _tiny_model()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (5, 1, 9)]
    eng = _engine(model, impl)
    done, stats = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=18), return_logits=True)
    assert len(stats.step_logits) == 18
    for s, c in enumerate(done):
        seq = c.prompt_token_ids + c.token_ids
        dense = np.asarray(models.dense_logits(model, np.array([seq]), np.ones((1, len(seq)), bool)))[0]
        for step, logits in enumerate(stats.step_logits):
            pos = len(c.prompt_token_ids) - 1 + step
            np.testing.assert_allclose(logits[s], dense[pos], rtol=2e-4, atol=2e-4,
                                       err_msg=f"seq {s} step {step}")
        # greedy: each generated token is the argmax of the dense logits before it
        np.testing.assert_array_equal(c.token_ids, dense[len(c.prompt_token_ids) - 1:-1].argmax(-1))


def test_decode_step_compiles_once_across_changing_batches():
    """Sequences finish at different steps (so the real batch shrinks): still one decode compile."""
    model = _tiny_model(3)
    eng = _engine(model, "reference")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (3, 4, 6)]
    eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=6))
    compiles_after_first = eng.num_compiles  # prefill + decode
    assert compiles_after_first == 2
    # stop early on whatever token sequence 0 produces first: batch sizes change across steps
    for max_new in (3, 9, 12):
        done, stats = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=max_new))
        assert all(len(c.token_ids) == max_new for c in done)
    assert eng.num_compiles == compiles_after_first
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks  # everything freed


def test_stop_tokens_end_one_sequence_only():
    model = _tiny_model(4)
    eng = _engine(model, "reference")
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    free_run, _ = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=8))
    stop = free_run[0].token_ids[2]
    if stop in free_run[1].token_ids:
        pytest.skip("stop token appears in both continuations for this seed")
    done, _ = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=8, stop_token_ids=frozenset({stop})))
    first = free_run[0].token_ids.index(stop)
    assert done[0].token_ids == free_run[0].token_ids[:first] and done[0].finish_reason == "stop"
    assert done[1].token_ids == free_run[1].token_ids and done[1].finish_reason == "length"


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2], []], r"prompts\[1\] is empty"),
    ([[1] * 64], "max_model_len=64"),
    ([[1] * 40] * 8, "blocks"),
    ([], "no prompt"),
])
def test_engine_rejects_bad_batches_without_side_effects(prompts, match):
    eng = _engine(_tiny_model(), "reference", num_blocks=32)
    caches_before = [np.asarray(c) for c in eng.kv_caches]
    with pytest.raises(ValueError, match=match):
        eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=4))
    assert eng.allocator.num_free_blocks == 32
    for a, b in zip(caches_before, eng.kv_caches):
        np.testing.assert_array_equal(a, np.asarray(b))
    # and the engine still works afterwards
    done, _ = eng.generate([[1, 2, 3]], jaxkv.SamplingParams(max_new_tokens=2))
    assert len(done[0].token_ids) == 2


def test_donation_keeps_the_cache_in_place():
    """The step's cache output reuses the donated input buffer (no copy of the cache)."""
    eng = _engine(_tiny_model(), "reference")
    ptr = eng.kv_caches[0].unsafe_buffer_pointer()
    eng.generate([[1, 2, 3]], jaxkv.SamplingParams(max_new_tokens=3))
    assert eng.kv_caches[0].unsafe_buffer_pointer() == ptr


def test_multi_step_device_loop_equals_one_step_per_sync():
    """steps_per_sync=5 (device loop) gives the same tokens, stops and logits as one step per sync."""
    model = _tiny_model(5)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (2, 7, 4)]
    base, base_stats = _engine(model, "reference").generate(
        prompts, jaxkv.SamplingParams(max_new_tokens=11), return_logits=True)
    stop = base[1].token_ids[3]
    sampling = jaxkv.SamplingParams(max_new_tokens=11, stop_token_ids=frozenset({stop}))
    one, _ = _engine(model, "reference").generate(prompts, sampling)
    eng = _engine(model, "reference", steps_per_sync=5)
    many, stats = eng.generate(prompts, sampling, return_logits=True)
    assert [c.token_ids for c in many] == [c.token_ids for c in one]
    assert [c.finish_reason for c in many] == [c.finish_reason for c in one]
    assert many[1].finish_reason == "stop" and len(many[1].token_ids) <= 3
    # logits of the steps where a row was active match the single-step run's
    for step, logits in enumerate(stats.step_logits[:4]):
        for r in range(3):
            if not np.isnan(logits[r]).any():
                np.testing.assert_allclose(logits[r], base_stats.step_logits[step][r], rtol=1e-5, atol=1e-5)
    assert eng.num_compiles == 2  # prefill + decode loop
    eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=3), return_logits=True)
    assert eng.num_compiles == 2 and eng.allocator.num_free_blocks == eng.allocator.num_blocks


def test_sampling_with_temperature_is_reproducible_and_varies_with_seed():
    model = _tiny_model(6)
    eng = _engine(model, "reference", steps_per_sync=4)
    prompts = [[1, 2, 3], [4, 5]]
    a, _ = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=12, temperature=1.0, seed=1))
    b, _ = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=12, temperature=1.0, seed=1))
    c, _ = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=12, temperature=1.0, seed=2))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_fp8_kv_cache_follows_the_dense_forward_within_fp8_error():
    """kv_cache_dtype fp8 (e4m3, scales 1) is wired through write and attention: logits move, but only
    by the K/V rounding (e4m3 keeps 3 mantissa bits, 2^-4 relative; through this random 2-layer model
    that moved the logits by ~12 % of their largest value). Exactness of fp8 write + read is tested
    against float64 loops in tests/jaxkv/test_ops_fp8.py and the kernel tests."""
    model = _tiny_model(7)
    eng = models.make_engine(model, attention_impl="reference", block_size=8, num_blocks=32, max_model_len=64,
                             cache_dtype=jnp.float8_e4m3fn, steps_per_sync=4)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    done, stats = eng.generate(prompts, jaxkv.SamplingParams(max_new_tokens=6), return_logits=True)
    assert eng.kv_caches[0].dtype == jnp.float8_e4m3fn
    for s, c in enumerate(done):
        seq = c.prompt_token_ids + c.token_ids
        dense = np.asarray(models.dense_logits(model, np.array([seq]), np.ones((1, len(seq)), bool)))[0]
        for step, logits in enumerate(stats.step_logits):
            want = dense[len(c.prompt_token_ids) - 1 + step]
            err = np.abs(logits[s] - want).max()
            assert 0 < err <= 0.25 * np.abs(want).max()


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_prefill_equals_one_shot(chunk):
    """Prompts prefilled in chunks (each chunk attends to the cached earlier chunks) give the same
    first-token logits and the same greedy continuation as one-shot prefill."""
    model = _tiny_model(8)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (11, 3, 17)]
    sampling = jaxkv.SamplingParams(max_new_tokens=5)
    one, one_stats = _engine(model, "reference").generate(prompts, sampling, return_logits=True)
    eng = models.make_engine(model, attention_impl="reference", block_size=8, num_blocks=32, max_model_len=64,
                             prefill_chunk_size=chunk)
    got, got_stats = eng.generate(prompts, sampling, return_logits=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in one]
    np.testing.assert_allclose(got_stats.step_logits[0], one_stats.step_logits[0], rtol=1e-4, atol=1e-4)


def _caching_engine(model, *, num_blocks=32, block_size=8):
    return models.make_engine(model, attention_impl="reference", block_size=block_size, num_blocks=num_blocks,
                              max_model_len=64, enable_prefix_caching=True)


def test_prefix_caching_computes_only_the_new_tokens_and_matches_no_caching():
    model = _tiny_model(9)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, TINY.vocab_size, 27).tolist()  # 3 full blocks of 8 + 3 tokens
    first = shared + [1, 2]
    second = shared + [3, 4, 5, 6, 7]
    sampling = jaxkv.SamplingParams(max_new_tokens=6)
    eng = _caching_engine(model)
    done1, stats1 = eng.generate([first], sampling, return_logits=True)
    assert stats1.cached_prompt_tokens == 0
    done2, stats2 = eng.generate([second], sampling, return_logits=True)
    # the 3 full blocks of the shared prefix were reused: only the remaining 8 prompt tokens ran
    assert stats2.cached_prompt_tokens == 24
    plain = _engine(model, "reference")
    ref2, ref_stats2 = plain.generate([second], sampling, return_logits=True)
    assert done2[0].token_ids == ref2[0].token_ids
    np.testing.assert_allclose(stats2.step_logits[0], ref_stats2.step_logits[0], rtol=1e-5, atol=1e-5)
    # an identical prompt reuses every full block of prompt[:-1] (the last token is always computed)
    done3, stats3 = eng.generate([first], sampling)
    assert stats3.cached_prompt_tokens == 24 and done3[0].token_ids == done1[0].token_ids


def test_prefix_cache_evicts_idle_blocks_when_the_cache_is_full():
    model = _tiny_model(10)
    rng = np.random.default_rng(6)
    eng = _caching_engine(model, num_blocks=8)
    plain = _engine(model, "reference", num_blocks=8)
    sampling = jaxkv.SamplingParams(max_new_tokens=4)
    for _ in range(5):  # 5 distinct 20-token prompts: each needs 3 blocks, each leaves 2 cached
        prompt = rng.integers(0, TINY.vocab_size, 20).tolist()
        got, _ = eng.generate([prompt], sampling)
        want, _ = plain.generate([prompt], sampling)
        assert got[0].token_ids == want[0].token_ids
    cache = eng.prefix_cache
    assert cache.num_cached_blocks == cache.num_evictable_blocks <= 8
    assert eng.allocator.num_free_blocks + cache.num_cached_blocks == 8  # every block accounted for
