"""``LLM`` with vLLM's front-end knobs on a tiny Hugging Face checkpoint (real BPE tokenizer): stop strings and
the tokens ``usage`` counts, ``include_stop_str_in_output``, ``truncate_prompt_tokens``, bad words, ``n``, beam
search against a brute-force NumPy beam search, new weights without a recompile, sleep and wake-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import models
from jaxkv.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from models import registry
from tests.conftest import step_compiles
from tests.models import hf_checkpoints as hfc


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    hfc.write_checkpoint(d, "LlamaForCausalLM", seed=3)
    return models.LLM(d, dtype="float32", attention_impl="reference", max_model_len=96, num_gpu_blocks=96,
                      block_size=8, max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=4,
                      enable_multiprocessing=False)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_stop_strings_cut_text_and_tokens(llm):
    """A stop string ends the completion at the token that completed it: ``token_ids`` (what usage counts)
    stop there, the text stops before it (or after it with ``include_stop_str_in_output``)."""
    tok = llm.tokenizer
    free = llm.generate("Once upon a time", greedy(24), use_tqdm=False)[0].outputs[0]
    text = tok.decode(free.token_ids)
    assert free.text == text and len(text) > 8
    stop = text[len(text) // 2:len(text) // 2 + 3]
    at = text.index(stop)
    need = next(k for k in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:k]))
    for include in (False, True):
        c = llm.generate("Once upon a time", greedy(24, stop=[stop], include_stop_str_in_output=include),
                         use_tqdm=False)[0].outputs[0]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        assert c.token_ids == free.token_ids[:need]
        assert c.text == (text[:at + len(stop)] if include else text[:at])


def test_truncate_prompt_tokens_and_bad_words(llm):
    ids = llm.tokenizer.encode("The capital of France is Paris. Hello world, hello tokens!")
    cut = llm.generate({"prompt_token_ids": ids}, greedy(6, truncate_prompt_tokens=5), use_tqdm=False)[0]
    alone = llm.generate({"prompt_token_ids": ids[-5:]}, greedy(6), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    free = llm.generate("Once upon a time", greedy(12), use_tqdm=False)[0].outputs[0]
    word = llm.tokenizer.decode(free.token_ids[2:4]).strip()
    banned = llm.generate("Once upon a time", greedy(12, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    seqs = SamplingParams(bad_words=[word]).with_bad_words_tokenized(llm.tokenizer).bad_words_token_ids
    for seq in seqs:
        assert all(tuple(banned.token_ids[i:i + len(seq)]) != seq for i in range(len(banned.token_ids)))
    assert banned.token_ids != free.token_ids


def test_n_and_logprobs_through_llm(llm):
    out = llm.generate(["Hello world", "Once upon"], SamplingParams(n=3, max_tokens=5, seed=7, logprobs=2),
                       use_tqdm=False)
    for o in out:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        for c in o.outputs:
            assert len(c.logprobs) == len(c.token_ids) == 5
            assert all(d[t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
                       for t, d in zip(c.token_ids, c.logprobs))
            np.testing.assert_allclose(c.cumulative_logprob, sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)),
                                       rtol=1e-6)
        solo = [llm.generate("Hello world" if o is out[0] else "Once upon", SamplingParams(max_tokens=5, seed=7 + i),
                             use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
        assert [c.token_ids for c in o.outputs] == solo


def brute_force_beams(llm, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """vLLM's beam search, by hand over the dense forward (NumPy float64): each step extends each beam by its
    2 * width best tokens and keeps the width best by cumulative logprob."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        cands = []
        for seq, score in beams:
            x = np.asarray(models.dense_logits(llm.model, np.array([seq])))[0, -1].astype(np.float64)
            lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            for t in np.argsort(-lp, kind="stable")[:2 * width]:
                cands.append((seq + [int(t)], score + lp[t]))
        beams = sorted(cands, key=lambda b: -b[1])[:width]
    return beams


def test_beam_search_equals_a_brute_force_search_and_shares_blocks(llm):
    prompt = llm.tokenizer.encode("Once upon a time, there was")
    engine = llm.engine
    before = engine.stats.num_prompt_tokens_computed
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    computed = engine.stats.num_prompt_tokens_computed - before
    seqs = out[0].sequences
    ref = brute_force_beams(llm, prompt, 3, 4)
    assert [s.tokens for s in seqs] == [b[0] for b in ref]
    np.testing.assert_allclose([s.cum_logprob for s in seqs], [b[1] for b in ref], atol=1e-3)
    assert all(len(s.logprobs) == 4 and s.text == llm.tokenizer.decode(s.tokens[len(prompt):]) for s in seqs)
    # every step after the first computes at most each beam's last, partial block: the shared prefix once
    block = 8
    assert computed <= len(prompt) + 3 * 3 * (block + 1)
    assert computed < 4 * 3 * len(prompt)


def test_update_weights_changes_outputs_without_a_compile(llm):
    prompt = "Hello world, hello"
    before = llm.generate(prompt, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    params = llm.get_params()
    noisy = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype)
                         if x.dtype.kind == "f" and x.ndim == 2 else x, params)
    compiles = llm.engine.num_compiles
    events = step_compiles(lambda: (llm.update_weights(noisy),
                                    setattr(test_update_weights_changes_outputs_without_a_compile, "out",
                                            llm.generate(prompt, greedy(8), use_tqdm=False))))
    after = test_update_weights_changes_outputs_without_a_compile.out[0].outputs[0].token_ids
    assert events == [] and llm.engine.num_compiles == compiles
    assert after != before
    ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
    graphdef, _ = nnx.split(llm.model)
    noisy_model = nnx.merge(graphdef, noisy)
    for k, t in enumerate(after):  # the new weights' dense forward picks the same tokens
        x = np.asarray(models.dense_logits(noisy_model, np.array([ids + after[:k]])))[0, -1]
        assert x[t] >= x.max() - 1e-4
    llm.update_weights(params)
    assert llm.generate(prompt, greedy(8), use_tqdm=False)[0].outputs[0].token_ids == before
    # a trainer's model of the same checkpoint with separate q/k/v and gate/up Linears, fused on its way in
    config, weights, _ = registry.load_checkpoint(llm.engine_args.model)
    trainer = registry.build_model(config, weights, dtype="float32", fuse_projections=False)
    llm.update_weights(jax.tree.map(lambda x: x + 1.0 if x.ndim == 2 else x, nnx.state(trainer)))
    assert llm.generate(prompt, greedy(8), use_tqdm=False)[0].outputs[0].token_ids != before
    llm.update_weights(trainer)
    assert llm.generate(prompt, greedy(8), use_tqdm=False)[0].outputs[0].token_ids == before
    with pytest.raises(ValueError, match="another structure"):
        llm.update_weights({"w": np.zeros(3)})


def test_sleep_frees_the_cache_and_wake_up_restores_it(llm):
    prompt = "Once upon a time"
    before = llm.generate(prompt, greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    choice = greedy(6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate(prompt, choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    tables = llm.engine.runner.dfa_tables  # the automata's device tables (grammar_dfa.DFATables)
    caches, automata, writes = list(llm.engine.kv_caches), list(tables.arrays.values()), tables.num_writes
    assert writes >= 1  # the choice ran as an automaton on the device
    llm.sleep(level=1)
    assert all(c.is_deleted() for c in caches + automata) and llm.engine.is_sleeping
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(prompt, greedy(6), use_tqdm=False)
    llm.wake_up()
    assert llm.generate(prompt, greedy(6), use_tqdm=False)[0].outputs[0].token_ids == before
    assert llm.generate(prompt, choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    assert tables.num_writes > writes  # placed anew in the tables allocated again
