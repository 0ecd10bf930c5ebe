"""sample_tokens: greedy, temperature and nucleus (top-p) sampling vs. float64 NumPy references.

Statistical tolerance: with N independent draws of a token of probability p, the empirical frequency has
standard deviation sqrt(p (1 - p) / N) (binomial). We accept |freq - p| <= 5 sd + 1e-3 per token: for a
correct sampler a 5-sigma miss has probability ~6e-7 per token (normal approximation), so a correct
implementation essentially never fails, while a wrong temperature (e.g. T applied twice or not at all on
the distributions below) moves some probability by 0.05 - 0.2, i.e. 7 - 30 sd at N = 4000. Keys are fixed,
so the tests are deterministic anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.worker.sampler import sample_tokens

N = 4000


def softmax64(logits, temperature=1.0):
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def ref_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """Smallest set of most-probable tokens whose total mass reaches top_p (vLLM / HF top-p)."""
    order = np.argsort(-probs, kind="stable")
    kept, mass = set(), 0.0
    for tok in order:
        kept.add(int(tok))
        mass += probs[tok]
        if mass >= top_p:
            break
    return kept


def draw(row_logits, n, seed, **kw) -> np.ndarray:
    """n draws from one distribution: the row repeated n times in one batched call."""
    logits = jnp.asarray(np.tile(np.asarray(row_logits, np.float32), (n, 1)))
    out = sample_tokens(logits, jax.random.key(seed), **kw)
    assert out.shape == (n,) and out.dtype == jnp.int32
    return np.asarray(out)


def assert_freqs_close(samples, probs, n):
    freq = np.bincount(samples, minlength=len(probs)) / n
    tol = 5 * np.sqrt(probs * (1 - probs) / n) + 1e-3
    assert np.all(np.abs(freq - probs) <= tol), (freq.round(4), probs.round(4), tol.round(4))


# ----------------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p", [1.0, 0.3])
def test_greedy_is_argmax(top_p):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 50)).astype(np.float32) * 3
    out = sample_tokens(jnp.asarray(logits), jax.random.key(0), temperature=0.0, top_p=top_p)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), np.argmax(logits, axis=-1))


def test_greedy_ignores_key():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((8, 20)).astype(np.float32))
    a = sample_tokens(logits, jax.random.key(1), temperature=0, top_p=1.0)
    b = sample_tokens(logits, jax.random.key(2), temperature=0, top_p=1.0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------------------------
# top-p
# ----------------------------------------------------------------------------------------------

def test_tiny_top_p_is_argmax_at_temperature_one():
    rng = np.random.default_rng(2)
    # distinct rows, many keys: each row repeated 100 times, 5 keys → 500 draws per row
    logits = rng.standard_normal((8, 32)).astype(np.float32) * 2
    want = np.argmax(logits, axis=-1)
    batch = jnp.asarray(np.repeat(logits, 100, axis=0))
    for seed in range(5):
        out = np.asarray(sample_tokens(batch, jax.random.key(seed), temperature=1.0, top_p=1e-6))
        np.testing.assert_array_equal(out, np.repeat(want, 100))


def test_tiny_top_p_with_flat_distribution():
    """Even when the top token has < 10% mass, top_p -> 0 keeps only it."""
    logits = np.zeros(16, np.float32)
    logits[5] = 0.01
    samples = draw(logits, 500, 0, temperature=1.0, top_p=1e-3)
    assert np.all(samples == 5)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_top_p_one_matches_softmax_with_temperature(temperature):
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], np.float32)
    probs = softmax64(logits, temperature)
    samples = draw(logits, N, 10 + int(10 * temperature), temperature=temperature, top_p=1.0)
    assert_freqs_close(samples, probs, N)


def test_temperature_actually_changes_the_distribution():
    """The two tolerances above cannot both hold for T=0.7 and T=1.6 unless T is used: a sanity check
    that the distributions differ by far more than the tolerance."""
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    gap = np.abs(softmax64(logits, 0.7) - softmax64(logits, 1.6)).max()
    tol = 5 * np.sqrt(0.25 / N) + 1e-3
    assert gap > 3 * tol


def test_top_p_half_stays_in_nucleus():
    # probabilities 0.4, 0.3, 0.2, 0.1 in shuffled vocabulary order: nucleus(0.5) = {0.4, 0.3}
    probs = np.array([0.2, 0.4, 0.1, 0.3])
    logits = np.log(probs)
    nucleus = ref_nucleus(probs, 0.5)
    assert nucleus == {1, 3}
    samples = draw(logits, N, 3, temperature=1.0, top_p=0.5)
    assert set(samples.tolist()) <= nucleus
    assert set(samples.tolist()) == nucleus  # both nucleus tokens do occur
    # renormalised inside the nucleus: 4/7 and 3/7
    renorm = np.where(np.isin(np.arange(4), list(nucleus)), probs, 0) / 0.7
    assert_freqs_close(samples, renorm, N)


def test_top_p_applies_after_temperature():
    """At T = 0.5 the same logits become (0.533, 0.3, 0.133, 0.033): nucleus(0.5) is the top token only."""
    probs = np.array([0.2, 0.4, 0.1, 0.3])
    p_t = softmax64(np.log(probs), 0.5)
    assert ref_nucleus(p_t, 0.5) == {1}
    samples = draw(np.log(probs), 1000, 4, temperature=0.5, top_p=0.5)
    assert np.all(samples == 1)


def test_top_p_is_per_row():
    """Rows with different distributions in one batch each keep their own nucleus."""
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(4):
        p = rng.dirichlet(np.ones(10))
        rows.append(np.log(p))
    rows = np.array(rows, np.float32)
    top_p = 0.6
    reps = 1000
    batch = jnp.asarray(np.repeat(rows, reps, axis=0))
    out = np.asarray(sample_tokens(batch, jax.random.key(6), temperature=1.0, top_p=top_p))
    for r in range(4):
        probs = softmax64(rows[r])
        nucleus = ref_nucleus(probs, top_p)
        got = out[r * reps:(r + 1) * reps]
        assert set(got.tolist()) <= nucleus, (r, sorted(nucleus), sorted(set(got.tolist())))
        mask = np.isin(np.arange(10), list(nucleus))
        assert_freqs_close(got, np.where(mask, probs, 0) / probs[mask].sum(), reps)


def test_top_p_with_tie_at_the_nucleus_boundary():
    """probs (0.4, 0.2, 0.2, 0.2), top_p 0.5: the nucleus is token 0 plus ONE of the tied 0.2 tokens
    (whichever one), so token 0 must be drawn with probability 0.4 / 0.6 = 2/3 and at most 2 distinct
    tokens may appear (a value-based mask would keep all four)."""
    probs = np.array([0.4, 0.2, 0.2, 0.2])
    samples = draw(np.log(probs), N, 7, temperature=1.0, top_p=0.5)
    assert len(set(samples.tolist())) <= 2
    freq0 = np.mean(samples == 0)
    assert abs(freq0 - 2 / 3) <= 5 * np.sqrt((2 / 9) / N) + 1e-3, freq0


def test_top_p_with_uniform_logits_keeps_the_smallest_set():
    """Uniform over 4 tokens, top_p 0.3: the smallest set reaching 0.3 has 2 tokens (0.5 mass)."""
    samples = draw(np.zeros(4), N, 8, temperature=1.0, top_p=0.3)
    assert len(set(samples.tolist())) <= 2


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [-1.0, -1e-6])
def test_negative_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        sample_tokens(jnp.zeros((1, 4)), jax.random.key(0), temperature=temperature, top_p=1.0)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.0001, 2.0])
def test_top_p_out_of_range_raises(top_p):
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens(jnp.zeros((1, 4)), jax.random.key(0), temperature=1.0, top_p=top_p)


def _rows(logits, **kw):
    import jax.numpy as jnp

    from jaxkv.worker.sampler import SamplingArrays
    r = logits.shape[0]
    d = dict(temperature=np.ones(r, np.float32), top_p=np.ones(r, np.float32), top_k=np.full(r, -1, np.int32),
             seeds=np.arange(r, dtype=np.uint32), gen_idx=np.zeros(r, np.int32),
             min_tokens=np.zeros(r, np.int32), stop_ids=np.full((r, 2), -1, np.int32)) | kw
    return SamplingArrays(**{k: jnp.asarray(v) for k, v in d.items()})


def test_per_row_sampling_honours_each_rows_parameters():
    import jax

    from jaxkv.worker.sampler import sample_tokens_per_row
    rng = np.random.default_rng(0)
    logits = np.asarray(rng.standard_normal((4, 64)), np.float32)
    order = np.argsort(-logits, axis=-1)
    fn = jax.jit(sample_tokens_per_row)
    for seed in range(20):
        got = np.asarray(fn(logits, _rows(logits, temperature=np.array([0, 1, 1, 1], np.float32),
                                          top_k=np.array([-1, 3, -1, 1], np.int32),
                                          top_p=np.array([1, 1, 1e-6, 1], np.float32),
                                          seeds=np.full(4, seed, np.uint32))))
        assert got[0] == order[0, 0]             # greedy
        assert got[1] in order[1, :3]            # top-k 3
        assert got[2] == order[2, 0]             # top-p tiny: only the most likely token
        assert got[3] == order[3, 0]             # top-k 1


def test_per_row_keys_come_from_seed_and_index_only():
    import jax

    from jaxkv.worker.sampler import sample_tokens_per_row
    rng = np.random.default_rng(1)
    logits = np.asarray(rng.standard_normal((3, 50)), np.float32)
    fn = jax.jit(sample_tokens_per_row)
    a = np.asarray(fn(logits, _rows(logits, seeds=np.array([7, 8, 9], np.uint32))))
    swapped = logits[[2, 1, 0]]  # the same row elsewhere in the batch, same seed -> same token
    b = np.asarray(fn(swapped, _rows(swapped, seeds=np.array([9, 8, 7], np.uint32))))
    assert a[0] == b[2] and a[2] == b[0]


def test_min_tokens_masks_stop_ids_until_reached():
    import jax

    from jaxkv.worker.sampler import sample_tokens_per_row
    logits = np.zeros((2, 10), np.float32)
    logits[:, 4] = 10.0
    kw = dict(temperature=np.zeros(2, np.float32), min_tokens=np.array([3, 3], np.int32),
              gen_idx=np.array([2, 3], np.int32), stop_ids=np.array([[4, -1], [4, -1]], np.int32))
    got = np.asarray(jax.jit(sample_tokens_per_row)(logits, _rows(logits, **kw)))
    assert got[0] != 4 and got[1] == 4


def test_static_filter_flag_gives_the_device_decided_tokens():
    """``top_k_top_p`` decided on the host (a static flag: no ``lax.cond``, which blocks the host on GPU)
    samples what the ``lax.cond`` version samples: the filter when a row asks for it, none otherwise."""
    import functools

    import jax

    from jaxkv.worker.sampler import needs_top_k_top_p, sample_tokens_per_row
    rng = np.random.default_rng(2)
    logits = np.asarray(3 * rng.standard_normal((5, 80)), np.float32)
    plain = dict(temperature=np.array([0, 1, 0.7, 1, 1], np.float32), seeds=np.arange(5, dtype=np.uint32))
    filtered = plain | dict(top_p=np.array([1, 0.8, 1, 1, 0.3], np.float32),
                            top_k=np.array([-1, -1, 5, -1, 2], np.int32))
    greedy_filter = dict(temperature=np.zeros(5, np.float32), top_k=np.full(5, 3, np.int32))
    flag = lambda kw: needs_top_k_top_p(**(dict(temperature=np.ones(5), top_p=np.ones(5), top_k=np.full(5, -1))  # noqa: E731
                                           | {k: v for k, v in kw.items() if k != "seeds"}))
    assert not flag(plain) and flag(filtered)
    assert not flag(greedy_filter)  # top-k on greedy rows changes nothing: no filter needed
    by_cond = jax.jit(sample_tokens_per_row)
    for kw, flag in ((plain, False), (filtered, True)):
        static = jax.jit(functools.partial(sample_tokens_per_row, top_k_top_p=flag))
        for step in range(8):
            rows = _rows(logits, gen_idx=np.full(5, step, np.int32), **kw)
            np.testing.assert_array_equal(np.asarray(static(logits, rows)), np.asarray(by_cond(logits, rows)))
    # rows that do not filter keep every token in the filtering program too
    both = jax.jit(functools.partial(sample_tokens_per_row, top_k_top_p=True))
    off = jax.jit(functools.partial(sample_tokens_per_row, top_k_top_p=False))
    for step in range(8):
        rows = _rows(logits, gen_idx=np.full(5, step, np.int32), **plain)
        np.testing.assert_array_equal(np.asarray(both(logits, rows)), np.asarray(off(logits, rows)))


def _chunky_logits(vocab: int, chunk: int) -> np.ndarray:
    """A row whose chunks' masses differ from their maxima: one chunk with a single likely token, one with many
    medium ones (the same total), one fully masked, one half masked, and a last partial chunk."""
    rng = np.random.default_rng(3)
    logits = rng.uniform(-4.0, -2.0, vocab).astype(np.float32)
    logits[5] = 2.0                                              # chunk 0: one token of mass e^2
    logits[chunk:2 * chunk] = np.log(np.exp(2.0) / chunk)        # chunk 1: e^2 spread over `chunk` tokens
    logits[2 * chunk:3 * chunk] = -np.inf                        # chunk 2: masked
    logits[3 * chunk:3 * chunk + chunk // 2] = -np.inf           # chunk 3: half masked
    logits[-3:] = [1.0, 0.5, 1.5]                                # the last, partial chunk
    return logits


def test_categorical_by_chunks_draws_the_softmax():
    """Two-level Gumbel-max against the float64 softmax, per token (the module docstring's 5-sigma bound), with
    distinct keys a row; picking a chunk by its largest logit instead of its logsumexp would move the masses of
    chunks 0 and 1 apart (equal here) by far more than the bound."""
    from jaxkv.worker.sampler import categorical_by_chunks
    vocab, chunk, n = 203, 16, 20000
    logits = _chunky_logits(vocab, chunk)
    keys = jax.random.split(jax.random.key(11), n)
    got = np.asarray(jax.jit(categorical_by_chunks, static_argnums=2)(keys, jnp.tile(logits, (n, 1)), chunk))
    assert got.dtype == np.int32 and got.min() >= 0 and got.max() < vocab
    probs = softmax64(np.where(np.isfinite(logits), logits, -np.inf))
    assert not np.any(np.isin(got, np.flatnonzero(probs == 0)))  # masked tokens never drawn
    assert_freqs_close(got, probs, n)
    chunk0, chunk1 = np.mean(got // chunk == 0), np.mean(got // chunk == 1)
    assert abs(chunk0 - chunk1) < 5 * np.sqrt(2 * probs[:chunk].sum() / n)


def test_per_row_sampler_on_a_large_vocabulary():
    """Past 2 * SAMPLE_CHUNK tokens the per-row sampler draws by chunks: still each row's own distribution
    (top-k 3 stays in the top 3, a peaked row gives its peak), and a row's token depends on its seed and index
    only, not on its place in the batch."""
    from jaxkv.worker.sampler import SAMPLE_CHUNK, sample_tokens_per_row
    vocab = 2 * SAMPLE_CHUNK + 77
    rng = np.random.default_rng(4)
    logits = np.asarray(rng.standard_normal((3, vocab)), np.float32)
    logits[2, vocab - 5] = 40.0                                   # a peak in the last, partial chunk
    fn = jax.jit(sample_tokens_per_row, static_argnames="top_k_top_p")
    order = np.argsort(-logits, axis=-1)
    seen = set()
    for seed in range(12):
        rows = _rows(logits, seeds=np.array([seed, seed, seed], np.uint32), top_k=np.array([-1, 3, -1], np.int32))
        got = np.asarray(fn(logits, rows, top_k_top_p=True))
        seen.add(int(got[0]))
        assert got[1] in order[1, :3] and got[2] == vocab - 5
        swapped = logits[[2, 0, 1]]
        rows_swapped = _rows(swapped, seeds=np.array([seed, seed, seed], np.uint32),
                             top_k=np.array([-1, -1, 3], np.int32))
        np.testing.assert_array_equal(np.asarray(fn(swapped, rows_swapped, top_k_top_p=True)), got[[2, 0, 1]])
    assert len(seen) > 6  # row 0 is sampled over ~600 tokens, not stuck on one


def test_min_tokens_mask_is_a_feature_and_leaves_raw_logprobs_alone():
    """``features.min_tokens`` masks the stop ids of rows under their ``min_tokens`` (bf16 logits, as the model
    gives them); the raw logprobs (vLLM's ``raw_logprobs``: before any processing) still see the masked stop token,
    as float64 log-softmax does. Without the feature the step has no mask (the engine sets it when a row needs it)."""
    from jaxkv.worker.sampler import SamplerFeatures, sample_with_features
    logits = np.zeros((2, 700), np.float32)
    logits[:, 4] = 10.0
    logits[:, 9] = 3.0
    kw = dict(temperature=np.zeros(2, np.float32), min_tokens=np.array([3, 3], np.int32),
              gen_idx=np.array([2, 3], np.int32), stop_ids=np.array([[4, -1], [4, -1]], np.int32))
    fn = jax.jit(sample_with_features, static_argnames="features")
    tokens, lp = fn(jnp.asarray(logits, jnp.bfloat16), _rows(logits, **kw), {},
                    features=SamplerFeatures(min_tokens=True, num_logprobs=1))
    np.testing.assert_array_equal(np.asarray(tokens), [9, 4])   # row 0 may not stop yet
    ref = np.log(softmax64(logits))
    np.testing.assert_allclose(np.asarray(lp["top_logprobs"])[:, 0], ref[:, 4], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(lp["top_ids"])[:, 0], [4, 4])
    np.testing.assert_allclose(np.asarray(lp["logprob"]), [ref[0, 9], ref[1, 4]], atol=1e-5)
    tokens, _ = fn(jnp.asarray(logits, jnp.bfloat16), _rows(logits, **kw), {}, features=SamplerFeatures())
    np.testing.assert_array_equal(np.asarray(tokens), [4, 4])
