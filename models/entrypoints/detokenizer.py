"""Incremental detokenization and stop strings for streamed outputs. vLLM: ``v1/engine/detokenizer.py``.

A byte-level BPE token can end in the middle of a UTF-8 character: decoding such a prefix yields the
replacement character U+FFFD. :class:`IncrementalDetokenizer` only emits text up to the last complete
character (it holds back a decode that ends in U+FFFD until more tokens arrive or the request ends), and
decodes a small window of tokens per step instead of the whole output, so the cost per token stays constant;
a tokenizer that offers ``decode_stream`` (the project's, over ``tokenizers``' Rust ``DecodeStream``) is
stepped token by token instead, and the request's last step checks the text against one full decode.

:class:`StopChecker` applies stop strings to the detokenized text: the output is cut before the first stop
string and the request ends with ``finish_reason="stop"``, ``stop_reason=<the string>``. While streaming it
holds back the last ``len(longest stop) - 1`` characters, which could be the start of a stop string, so a
client never receives text that a later token turns into a stop string.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, a delta at a time.

    Invariant: ``self.text == tokenizer.decode(token_ids[:read_offset])`` (with the same
    ``skip_special_tokens``), and ``prefix_offset <= read_offset`` both fall on character boundaries; each
    call decodes only ``token_ids[prefix_offset:]``.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` (:class:`models.GGUFTokenizer`).
        skip_special_tokens: drop control tokens (``<|im_end|>``) from the text.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: a character boundary already emitted
        self._read_offset = 0  # tokens up to here are in self.text
        make_stream = getattr(tokenizer, "decode_stream", None)
        self._stream = None if make_stream is None else make_stream(skip_special_tokens=skip_special_tokens)

    def add_tokens(self, new_token_ids: Sequence[int], *, finished: bool = False) -> str:
        """Append tokens; return the newly completed text (possibly ``""``).

        Args:
            new_token_ids: ``[num_new_tokens]`` ids generated since the last call.
            finished: no more tokens will come: flush whatever is held back, broken characters included.
        """
        new = [int(t) for t in new_token_ids]
        self.token_ids.extend(new)
        if self._stream is not None:
            delta = self._stream.step(new)
            if finished:  # what the stream still holds (a broken character) comes out as the full decode has it
                full = self._decode(self.token_ids)
                delta = full[len(self.text):] if full.startswith(self.text + delta) else delta
            self.text += delta
            self._read_offset = len(self.token_ids)
            return delta
        if self._read_offset == len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset:]
        before = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        now = self._decode(window)
        if now.endswith(REPLACEMENT_CHAR) and not finished:
            return ""  # a character is still incomplete: wait for its next bytes
        delta = now[len(before):] if now.startswith(before) else self._decode_all_delta()
        self.text += delta
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _decode_all_delta(self) -> str:
        # Fallback for tokenizers whose windowed decode is not a prefix extension (e.g. ones that strip a
        # leading space): decode everything once and take the suffix.
        return self._decode(self.token_ids)[len(self.text):]


class StopChecker:
    """Stop strings over a growing text; what may be sent to a client so far.

    Args:
        stop: the stop strings (non-empty).
    """

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} contains an empty string")
        self._hold = max(map(len, self.stop), default=1) - 1
        self._searched = 0  # text before this index has no stop string starting in it

    def check(self, text: str) -> tuple[int, str] | None:
        """Earliest stop string in ``text`` as ``(index, stop_string)``, or ``None``.

        Only the part that can contain a new match is searched (the text grows between calls).
        """
        if not self.stop:
            return None
        start = self._searched
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self._searched = max(start, len(text) - self._hold)
        return best

    def safe_len(self, text: str, finished: bool) -> int:
        """How much of ``text`` can be streamed now (all of it once the request is finished)."""
        return len(text) if finished else max(0, len(text) - self._hold)
