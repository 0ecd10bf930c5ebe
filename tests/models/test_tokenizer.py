"""Tests of models.tokenizer.GGUFTokenizer on the real SmolLM2 GGUF."""

import re

import gguf
import numpy as np
import pytest

from models.gguf_loader import read_gguf_metadata
from models.tokenizer import GGUFTokenizer


@pytest.fixture(scope="module")
def meta(gguf_reader):
    return read_gguf_metadata(gguf_reader)


@pytest.fixture(scope="module")
def tok(gguf_reader):
    return GGUFTokenizer.from_gguf(gguf_reader)


ROUND_TRIP = [
    "The capital of France is",
    "12345 + 678 = 13023",
    "  leading spaces and trailing   ",
    "line one\nline two\n\n\tindented\r\n",
    "héllo wörld — naïve café, 日本語, emoji 🙂👍🏽",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nHi!<|im_end|>\n",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_known_special_ids(tok, meta):
    tokens = meta["tokenizer.ggml.tokens"]
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.encode("<|im_start|>") == [tokens.index("<|im_start|>")] == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == {0, 2}
    assert tok.vocab_size == 49152 == len(tokens)


def test_special_tokens_skipped_on_decode(tok):
    ids = tok.encode("<|im_start|>assistant\nHello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "assistant\nHello"


def test_digits_split_individually(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.id_to_token(i) for i in ids] == list("12345")


def test_tokens_concatenate_to_byte_level_text(tok):
    ids = tok.encode("The capital of France is")
    assert "".join(tok.id_to_token(i) for i in ids) == "TheĠcapitalĠofĠFranceĠis"
    assert len(ids) == 5  # every word is common enough to be one token


def test_add_special_tokens_follows_gguf_flags(tok, meta):
    # SmolLM2's GGUF says add_bos_token = False (and has no add_eos_token).
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


# An independent reference for ASCII text: GPT-2 pre-tokenization regex (ASCII classes)
# after splitting every digit off, ASCII byte-level mapping, and textbook rank-ordered
# BPE merging. Agreement checks the vocabulary, merge ranks and pre-tokenizer wiring.
_ASCII_GPT2 = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
_ASCII_BYTE_LEVEL = {" ": "Ġ", "\n": "Ċ", "\t": "ĉ"}


def _reference_bpe(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    vocab = {t: i for i, t in enumerate(tokens)}
    ids = []
    for piece in re.split(r"([0-9])", text):
        for word in _ASCII_GPT2.findall(piece):
            parts = [_ASCII_BYTE_LEVEL.get(c, c) for c in word]
            while len(parts) > 1:
                pairs = [(ranks.get((a, b), np.inf), j)
                         for j, (a, b) in enumerate(zip(parts, parts[1:]))]
                rank, j = min(pairs)
                if rank == np.inf:
                    break
                parts[j:j + 2] = [parts[j] + parts[j + 1]]
            ids += [vocab[p] for p in parts]
    return ids


@pytest.mark.parametrize("text", [
    "The capital of France is",
    "Hello, world! It's 2024-11-21 and I'll pay $3.50.",
    "def f(x):\n\treturn x**2  # squared\n\n",
    "  tokenization   is  unbelievably   fun",
])
def test_matches_reference_bpe(tok, meta, text):
    expected = _reference_bpe(text, meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"])
    assert tok.encode(text) == expected


def test_chat_template(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt.startswith("<|im_start|>system")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in prompt
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_with_system_and_no_generation_prompt(tok):
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi<|im_end|>\n")


def test_bad_inputs(tok):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="ids"):
        tok.decode([49152])
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")


def test_rejects_unknown_tokenizer_model(tmp_path):
    path = tmp_path / "wordpiece.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("bert")  # 'llama' (SentencePiece, Gemma 3) is supported since issue 12
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.model='bert'"):
        GGUFTokenizer.from_gguf(path)
