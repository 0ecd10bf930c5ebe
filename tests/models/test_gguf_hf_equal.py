"""The same SmolLM2-135M-Instruct weights as a GGUF and as a Hugging Face directory (written from the GGUF's
dequantised tensors by scripts/gguf_to_hf.py, float32): identical greedy text, token for token, plain and chat."""

from __future__ import annotations

import pytest

import models
from jaxkv import SamplingParams
from models.registry import load_tokenizer
from tests.conftest import SMOLLM2_LLM_OPTIONS, load_script


@pytest.fixture(scope="module")
def hf_dir(gguf_path, tmp_path_factory):
    return load_script("gguf_to_hf").write_hf_checkpoint(gguf_path, tmp_path_factory.mktemp("smollm2-hf"))


def test_gguf_and_hf_directory_give_the_same_greedy_text(smollm2_llm, hf_dir):
    """Two plain prompts and a chat-template prompt (rendered and tokenized by each LLM's own tokenizer), one
    batch (one prefill program, one decode program per LLM)."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    runs = {}
    smollm2_llm.engine.reset_prefix_cache()  # the shared GGUF LLM: no block cached by another test
    for name, make in (("gguf", lambda: smollm2_llm), ("hf", lambda: models.LLM(hf_dir, **SMOLLM2_LLM_OPTIONS))):
        llm = make()
        tok = llm.get_tokenizer()
        chat_text = tok.apply_chat_template(chat)
        prompts = ["The capital of France is", "Water is made of hydrogen and",
                   {"prompt": chat_text, "prompt_token_ids": tok.encode(chat_text)}]
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        runs[name] = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
        runs[name + "_stop"] = tok.stop_token_ids
    assert type(load_tokenizer(hf_dir)).__name__ == "HFTokenizer"
    assert runs["hf"] == runs["gguf"]
    assert runs["hf_stop"] == runs["gguf_stop"]
    assert "Paris" in runs["hf"][0][2]
