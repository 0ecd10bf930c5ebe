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
