"""vLLM's sampling knobs through the engine, against independent references.

* Penalties, ``min_p``, ``logit_bias``, ``allowed_token_ids`` and bad words: NumPy float64 implementations of
  vLLM's formulas (``apply_penalties``, min-p, bias, masks) applied to logits the tiny model produced, and a
  reference decoding loop (a cache-free dense forward per token, the NumPy processors, argmax) that the
  engine's greedy tokens must follow through prefill chunks, mixed steps and device decode loops.
* ``logprobs`` / ``prompt_logprobs``: ``log_softmax`` in float64 of the dense forward's logits (within 1e-3
  nats), with chunked prefill and with the prompt in the prefix cache.
* ``n``: each completion equals a solo request with seed ``seed + i``; the prompt is computed once.
"""

from __future__ import annotations

import numpy as np
import pytest

import models
from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.sampler import (
    SamplerFeatures,
    SamplingArrays,
    apply_min_p,
    process_logits,
    raw_logprobs,
    token_counts,
)
from tests.models.test_llama_paged import TINY, _engine, _tiny_model

V = TINY.vocab_size


@pytest.fixture(scope="module")
def model():
    return _tiny_model(3)


def dense(model, seq) -> np.ndarray:
    """``f64[len(seq), V]`` logits of every position, cache-free (the reference forward)."""
    return np.asarray(models.dense_logits(model, np.array([seq]), np.ones((1, len(seq)), bool)))[0].astype(np.float64)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---- NumPy references of vLLM's logits processors ------------------------------------------------------

def np_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM ``apply_penalties`` for one row, float64."""
    logits = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(output, int), minlength=logits.shape[-1]) if len(output) else np.zeros(logits.shape[-1])
    seen = np.zeros(logits.shape[-1], bool)
    seen[list(prompt)] = True
    seen |= counts > 0
    rep = np.where(seen, repetition, 1.0)
    logits = np.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency * counts - presence * (counts > 0)


def np_process(logits, sp: SamplingParams, prompt, output, *, eos=()):
    """Everything before the temperature for one row, in vLLM V1's order (float64)."""
    x = np.array(logits, np.float64)
    if sp.allowed_token_ids:
        keep = np.zeros_like(x, bool)
        keep[list(sp.allowed_token_ids)] = True
        x = np.where(keep, x, -np.inf)
    for seq in sp.bad_words_token_ids or ():
        if len(seq) == 1 or list(output[len(output) - len(seq) + 1:]) == list(seq[:-1]) and len(output) >= len(seq) - 1:
            x[seq[-1]] = -np.inf
    if len(output) < sp.min_tokens:
        x[list(set(eos) | set(sp.stop_token_ids))] = -np.inf
    for tok, b in (sp.logit_bias or {}).items():
        x[tok] += b
    if sp.has_penalties:
        x = np_penalties(x, prompt, output, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
    return x


def _arrays(rows: int, **over):
    base = dict(temperature=np.zeros(rows, np.float32), top_p=np.ones(rows, np.float32),
                top_k=np.full(rows, -1, np.int32), seeds=np.zeros(rows, np.uint32), gen_idx=np.zeros(rows, np.int32),
                min_tokens=np.zeros(rows, np.int32), stop_ids=np.full((rows, 2), -1, np.int32))
    return SamplingArrays(**(base | over))


def test_processors_equal_numpy_on_model_logits(model):
    """Penalties, bias, allow list and bad words of process_logits equal the NumPy formulas row by row, on the
    tiny model's logits of 4 sequences."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, V, 12).tolist() for _ in range(4)]
    logits = np.stack([dense(model, s)[-1] for s in seqs]).astype(np.float32)
    prompts, outputs = [s[:7] for s in seqs], [s[7:] for s in seqs]
    sps = [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.3),
           SamplingParams(repetition_penalty=0.6, logit_bias={3: 5.0, 9: -100.0}),
           SamplingParams(allowed_token_ids=[1, 4, 9, 50], frequency_penalty=1.5),
           SamplingParams(bad_words_token_ids=((outputs[3][-1], 11), (13,)), presence_penalty=-2.0)]
    width = 16
    hist = np.full((4, width), -1, np.int32)
    out_ids = np.full((4, width), -1, np.int32)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        hist[r, :len(p)] = p
        out_ids[r, :len(o)] = o
    extras = dict(presence=np.array([sp.presence_penalty for sp in sps], np.float32),
                  frequency=np.array([sp.frequency_penalty for sp in sps], np.float32),
                  repetition=np.array([sp.repetition_penalty for sp in sps], np.float32),
                  bias_ids=np.array([[-1, -1], [3, 9], [-1, -1], [-1, -1]], np.int32),
                  bias_values=np.array([[0, 0], [5, -100], [0, 0], [0, 0]], np.float32),
                  allowed_ids=np.array([[-1] * 4, [-1] * 4, [1, 4, 9, 50], [-1] * 4], np.int32),
                  has_allowed=np.array([0, 0, 1, 0], np.int32),
                  bad_ids=np.array([[-1, -1], [-1, -1], [-1, -1], [11, 13]], np.int32))  # the runner's matches
    feats = SamplerFeatures(penalties=True, logit_bias=True, allowed=True, bad_words=True)
    got = np.asarray(process_logits(logits, _arrays(4), extras, feats, output_counts=token_counts(out_ids, V),
                                    prompt_mask=token_counts(hist, V) > 0))
    for r in range(4):
        want = np_process(logits[r], sps[r], prompts[r], outputs[r])
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got[r]), finite)
        np.testing.assert_allclose(got[r][finite], want[finite], rtol=1e-5, atol=1e-5)


def test_min_p_and_raw_logprobs_equal_numpy(model):
    logits = np.stack([dense(model, [5, 6, 7, k])[-1] for k in range(3)]).astype(np.float32)
    min_p = np.array([0.0, 0.05, 0.5], np.float32)
    got = np.asarray(apply_min_p(logits / 0.7, min_p))
    for r in range(3):
        probs = np.exp(log_softmax64(logits[r] / 0.7))
        np.testing.assert_array_equal(np.isfinite(got[r]), probs >= min_p[r] * probs.max())
    sampled = np.array([4, 0, 96], np.int32)
    lp = {k: np.asarray(v) for k, v in raw_logprobs(logits, sampled, 5).items()}
    ref = log_softmax64(logits)
    for r in range(3):
        np.testing.assert_allclose(lp["logprob"][r], ref[r, sampled[r]], atol=1e-5)
        assert lp["rank"][r] == 1 + np.sum(ref[r] > ref[r, sampled[r]] + 1e-9)
        np.testing.assert_array_equal(lp["top_ids"][r], np.argsort(-ref[r], kind="stable")[:5])
        np.testing.assert_allclose(lp["top_logprobs"][r], np.sort(ref[r])[::-1][:5], atol=1e-5)


def reference_greedy(model, prompt, sp: SamplingParams, n: int) -> list[tuple[int, np.ndarray]]:
    """The reference decoding loop: a dense forward per token, NumPy processors, argmax. Returns the tokens
    and each position's processed logits (to judge near ties)."""
    seq, out = list(prompt), []
    for _ in range(n):
        x = np_process(dense(model, seq)[-1], sp, prompt, [t for t, _ in out])
        tok = int(np.argmax(x))
        out.append((tok, x))
        seq.append(tok)
    return out


def assert_follows(tokens, ref):
    """The engine's greedy tokens follow the reference: each is the reference's argmax up to a 1e-4 tie."""
    for i, (tok, (want, x)) in enumerate(zip(tokens, ref)):
        assert x[tok] >= x[want] - 1e-4, (i, tok, want, x[tok], x[want])
        if tok != want:  # a near tie went the other way: the continuations differ from here
            return
    assert len(tokens) == len(ref)


@pytest.mark.parametrize("steps,async_scheduling", [(1, False), (4, False), (4, True)])
def test_greedy_with_processors_follows_the_numpy_reference(model, steps, async_scheduling):
    """Penalties, bias, allow list and bad words (one of two tokens) through the engine: mixed steps with a
    chunked prefill, device decode loops (counts and bad-word tails updated inside the loop), async scheduling;
    three requests with different knobs and one plain one in the same batches."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, V, n).tolist() for n in (13, 6, 9, 7, 8)]
    free = [o.outputs[0].token_ids for o in _engine(model, "reference").generate(
        [prompts[0], prompts[4]], SamplingParams(max_tokens=8, temperature=0))]
    bad = (tuple(free[0][1:3]),)  # two-token words the free runs produce (the second inside a decode loop)
    sps = [SamplingParams(max_tokens=10, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                          repetition_penalty=1.8, bad_words_token_ids=bad),
           SamplingParams(max_tokens=10, temperature=0, logit_bias={17: 3.0, 40: 2.5}, repetition_penalty=0.8),
           SamplingParams(max_tokens=10, temperature=0, allowed_token_ids=[2, 17, 33, 40, 61, 90]),
           SamplingParams(max_tokens=10, temperature=0),
           SamplingParams(max_tokens=10, temperature=0, bad_words_token_ids=(tuple(free[1][4:6]),))]
    eng = _engine(model, "reference", num_scheduler_steps=steps, async_scheduling=async_scheduling,
                  max_num_batched_tokens=16, vocab_size=V)
    outs = eng.generate(prompts, sps)
    for prompt, sp, out in zip(prompts, sps, outs):
        assert_follows(out.outputs[0].token_ids, reference_greedy(model, prompt, sp, 10))
    assert bad[0] != tuple(outs[0].outputs[0].token_ids[1:3])
    got = outs[4].outputs[0].token_ids
    word = sps[4].bad_words_token_ids[0]
    assert got != free[1][:10] and all(tuple(got[i:i + 2]) != word for i in range(len(got) - 1))


def test_logprobs_and_prompt_logprobs_equal_the_dense_forward(model):
    """Sampled tokens' logprobs (greedy and sampled), their ranks and top-5, and every prompt position's
    logprob (top-3), within 1e-3 nats of log_softmax of the dense forward; with a prompt computed in chunks
    of 16 tokens and a prompt whose blocks are in the prefix cache."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, V, n).tolist() for n in (37, 5, 20)]
    eng = _engine(model, "reference", num_scheduler_steps=3, max_num_batched_tokens=16, enable_prefix_caching=True,
                  async_scheduling=True, vocab_size=V)
    eng.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))  # its blocks into the prefix cache
    sps = [SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=3),
           SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=0, prompt_logprobs=0),
           SamplingParams(max_tokens=6, temperature=1.0, seed=4, logprobs=2)]
    outs = eng.generate(prompts, sps)
    for prompt, sp, out in zip(prompts, sps, outs):
        c = out.outputs[0]
        seq = prompt + c.token_ids
        ref = log_softmax64(dense(model, seq))
        assert len(c.logprobs) == len(c.token_ids)
        for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert abs(d[tok].logprob - row[tok]) < 1e-3
            assert d[tok].rank == 1 + np.sum(row > row[tok] + 1e-6)
            top = np.argsort(-row, kind="stable")[:sp.logprobs]
            assert set(top) <= set(d) and len(d) <= sp.logprobs + 1
            for t in top:
                assert abs(d[int(t)].logprob - row[t]) < 1e-3
        np.testing.assert_allclose(c.cumulative_logprob, sum(ref[len(prompt) - 1 + i, t] for i, t in
                                                            enumerate(c.token_ids)), atol=5e-3)
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            d = out.prompt_logprobs[j]
            row = ref[j - 1]
            assert abs(d[prompt[j]].logprob - row[prompt[j]]) < 1e-3
            for t in np.argsort(-row, kind="stable")[:sp.prompt_logprobs]:
                assert abs(d[int(t)].logprob - row[t]) < 1e-3
    assert outs[0].num_cached_tokens == 0  # prompt logprobs compute the whole prompt, never from the cache


def test_n_completions_share_the_prompt_and_equal_solo_runs(model):
    """n=4: completion i is the solo request with seed + i; the prompt's full blocks are computed once (the
    others compute only its last partial block)."""
    prompt = list(range(3, 3 + 29))  # 3 full blocks of 8 and 5 tokens
    sp = SamplingParams(max_tokens=7, temperature=1.0, seed=11)
    eng = _engine(model, "reference", num_scheduler_steps=2, enable_prefix_caching=True, async_scheduling=True)
    before = eng.stats.num_prompt_tokens_computed
    out = eng.generate([prompt], sp.replace(n=4))[0]
    computed = eng.stats.num_prompt_tokens_computed - before
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert computed == len(prompt) + 3 * (len(prompt) - 24)
    solo = _engine(model, "reference", num_scheduler_steps=2)
    for i, c in enumerate(out.outputs):
        assert c.token_ids == solo.generate([prompt], sp.replace(seed=11 + i))[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert not eng.has_unfinished_requests() and eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_bad_request_options_name_the_field(model):
    eng = _engine(model, "reference", vocab_size=V, max_logprobs=5)
    for sp, match in [(SamplingParams(logit_bias={V: 1.0}), f"logit_bias has token ids \\[{V}\\]"),
                      (SamplingParams(allowed_token_ids=[0, V + 3]), "allowed_token_ids has token ids"),
                      (SamplingParams(logprobs=6), r"logprobs=6 must be in \[0, max_logprobs=5\]"),
                      (SamplingParams(bad_words=["x"]), "need their token ids")]:
        with pytest.raises(ValueError, match=match):
            eng.add_request("r", [1, 2, 3], sp)
    assert not eng.has_unfinished_requests()
