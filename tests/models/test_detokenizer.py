"""Incremental detokenization never splits a character and equals the full decode; stop strings."""

from __future__ import annotations

import pytest

from models.entrypoints.detokenizer import IncrementalDetokenizer, StopChecker


class ByteTokenizer:
    """One token per UTF-8 byte: the worst case for split characters."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TEXTS = ["plain ascii text", "naïve café — 東京 🙂 ok", "🙂🙂🙂", "ends in emoji 🎉"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_bytes_one_at_a_time_never_split_a_character(text, chunk):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.add_tokens(ids[i:i + chunk], finished=i + chunk >= len(ids)))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text


def test_broken_bytes_are_flushed_when_finished():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.add_tokens([0xF0, 0x9F]) == ""  # half an emoji: held back
    assert detok.add_tokens([], finished=True) == "\ufffd"  # the request ended: emit what there is


def test_real_tokenizer_stream_equals_full_decode(gguf_reader):
    from models.tokenizer import GGUFTokenizer
    tok = GGUFTokenizer.from_gguf(gguf_reader)
    text = "Grüße aus 東京! 🙂 Ça va? <|im_end|> done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add_tokens([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)  # special tokens skipped in both


def test_stop_checker_finds_earliest_across_calls_and_holds_back_prefixes():
    stops = StopChecker(["STOP", "\n\n"])
    assert stops.check("hello ST") is None
    assert stops.safe_len("hello ST", finished=False) == len("hello ST") - 3  # "ST" could start "STOP"
    assert stops.check("hello STOP and \n\n") == (6, "STOP")
    assert StopChecker(["c", "abc"]).check("xxabc") == (2, "abc")  # earliest start wins
    assert StopChecker().check("anything") is None and StopChecker().safe_len("abc", False) == 3
    with pytest.raises(ValueError, match="empty"):
        StopChecker([""])


class _Windowed:
    """A tokenizer without ``decode_stream``: IncrementalDetokenizer's windowed path (the reference here)."""

    def __init__(self, tok):
        self.decode = tok.decode


def _stream_all(tok, ids, chunk, skip=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.add_tokens(ids[i:i + chunk], finished=i + chunk >= len(ids)) for i in range(0, len(ids), chunk)]
    return deltas, detok


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_decode_stream_path_equals_the_windowed_path_and_the_full_decode(gguf_reader, chunk):
    from models.tokenizer import GGUFTokenizer
    tok = GGUFTokenizer.from_gguf(gguf_reader)
    assert tok.decode_stream() is not None  # tokenizers >= 0.21: the Rust path is the one under test
    for text in TEXTS + ["Grüße aus 東京! 🙂 Ça va? <|im_end|> done", "  two  spaces\n\nnew lines\t"]:
        ids = tok.encode(text)
        for skip in (True, False):
            fast, detok = _stream_all(tok, ids, chunk, skip)
            slow, _ = _stream_all(_Windowed(tok), ids, chunk, skip)
            assert "".join(fast) == "".join(slow) == tok.decode(ids, skip_special_tokens=skip) == detok.text
            assert all("\ufffd" not in d for d in fast)


def test_decode_stream_flushes_a_broken_character_when_finished_and_keeps_each_vocabulary_policy(gguf_reader):
    from models.hf_tokenizer import HFTokenizer
    from models.tokenizer import GGUFTokenizer
    tok = GGUFTokenizer.from_gguf(gguf_reader)
    ids = tok.encode("ok 🦩")  # a rare emoji: byte-level pieces
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))  # inside the emoji
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens(ids[:cut]) == "ok"  # the partial character is held back ...
    assert detok.add_tokens([], finished=True) == tok.decode(ids[:cut])[2:]  # ... and flushed as decode has it
    with pytest.raises(ValueError, match="outside"):
        IncrementalDetokenizer(tok).add_tokens([10**7])
    hf = HFTokenizer(tok._tok, bos_token=None, eos_token=None)
    n = hf.vocab_size
    assert IncrementalDetokenizer(hf).add_tokens(tok.encode("hi") + [n, n + 5], finished=True) == "hi"  # padded rows


def test_decode_stream_with_a_sentencepiece_style_decoder():
    """Metaspace ("▁" for spaces, the first one dropped) and byte fallback, as Gemma's and Llama 2's are."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers
    from tokenizers import models as tmodels

    from models.hf_tokenizer import HFTokenizer
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["▁", "▁Hello", "▁world", "▁é", "t", "e", "s", "▁t"]:
        vocab.setdefault(piece, len(vocab))
    sp = tokenizers.Tokenizer(tmodels.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = HFTokenizer(sp, bos_token=None, eos_token=None)
    for text in ["Hello world", "Hello é test 東", "tes 🙂 t"]:
        ids = sp.encode(text).ids
        for chunk in (1, 2, 5):
            fast, detok = _stream_all(tok, ids, chunk)
            assert "".join(fast) == detok.text == tok.decode(ids), (text, chunk)
