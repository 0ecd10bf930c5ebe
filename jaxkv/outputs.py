"""What the engine returns. vLLM: ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``) and
``vllm/logprobs.py`` (``Logprob``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass
class Logprob:
    """One token's log-probability at one position (vLLM ``Logprob``).

    Attributes:
        logprob: natural log of its probability (float32 on the device, then a Python float).
        rank: 1 for the most likely token of the position, 2 for the next, ...
        decoded_token: its text (filled by the front end, which has the tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence):
    """Per generated token ``{token_id: Logprob}``, stored flat (vLLM ``FlatLogprobs``): the rows the engine
    sent, and a position's dict built only when it is read (``logprobs[i]``, iteration, slicing). An offline
    ``generate`` with ``logprobs=5`` would otherwise build six ``Logprob`` objects per token on the front
    end's process, time that the engine-core process then waits for requests.

    It is a read-only sequence: ``len``, indexing (a slice is a :class:`FlatLogprobs`), iteration, and ``==``
    against any sequence of dicts (a ``list[dict[int, Logprob]]`` with the same entries is equal).

    Attributes:
        token_ids: per position, the chosen token then the top-k tokens (``list[list[int]]``).
        logprobs: their logprobs (``list[list[float]]``).
        ranks: the chosen token's rank per position (``list[int]``; 1 = most likely); the top-k tokens'
            ranks are ``1..k`` in order.
        texts: ``token_id -> text`` for ``Logprob.decoded_token`` (``None``: no text).
    """

    __slots__ = ("logprobs", "ranks", "texts", "token_ids")

    def __init__(self, token_ids: list[list[int]] | None = None, logprobs: list[list[float]] | None = None,
                 ranks: list[int] | None = None, texts: Mapping[int, str] | None = None):
        self.token_ids = [] if token_ids is None else token_ids
        self.logprobs = [] if logprobs is None else logprobs
        self.ranks = [] if ranks is None else ranks
        self.texts = texts

    def extend_rows(self, token_ids: list[list[int]], logprobs: list[list[float]], ranks: list[int]) -> None:
        """Append positions (the rows of a ``LogprobsLists``)."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.ranks.extend(ranks)

    def chosen_logprob_sum(self) -> float:
        """The sum of the chosen tokens' logprobs (``cumulative_logprob``)."""
        return float(sum(row[0] for row in self.logprobs))

    def __len__(self) -> int:
        return len(self.ranks)

    def _dict(self, i: int) -> dict[int, Logprob]:
        ids, lps, texts = self.token_ids[i], self.logprobs[i], self.texts
        chosen = ids[0]
        d = {chosen: Logprob(lps[0], self.ranks[i], None if texts is None else texts[chosen])}
        for r, (tok, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            if tok not in d:
                d[tok] = Logprob(lp, r, None if texts is None else texts[tok])
        return d

    def __getitem__(self, i):
        if isinstance(i, slice):
            return FlatLogprobs(self.token_ids[i], self.logprobs[i], self.ranks[i], self.texts)
        return self._dict(range(len(self))[i])  # negative indices; IndexError names the range

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return NotImplemented if not isinstance(other, Sequence) else False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


SampleLogprobs = FlatLogprobs | list[dict[int, Logprob]]
"""Per generated token: ``{token_id: Logprob}`` of the top ``logprobs`` tokens and the sampled one (a
:class:`FlatLogprobs` from ``LLM``/the server, a list from an in-process ``LLMEngine``)."""

PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token: ``None`` for the first, then ``{token_id: Logprob}`` of the prompt token and the top
``prompt_logprobs`` tokens at that position."""


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: which of the request's ``n`` completions.
        token_ids: every token generated so far; a stop token or EOS that ended it is the last one (vLLM
            counts it: ``usage.completion_tokens`` is ``len(token_ids)`` summed over completions).
        new_token_ids: the tokens generated in this step.
        finish_reason: ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens`` or the
            model length), ``"abort"``, or ``None`` while running.
        stop_reason: the stop token id or stop string that ended it (``None`` for EOS, length or abort).
        text: decoded text (filled by the front end; the engine has no tokenizer).
        logprobs: with ``SamplingParams.logprobs``, one dict per token of ``token_ids``.
        cumulative_logprob: the sum of the sampled tokens' logprobs (with ``logprobs``), else ``None``.
        logits: ``f32[len(token_ids), vocab]`` logits of each generated token, only from an engine
            built with ``return_logits=True`` and only once finished (tests and accuracy scripts).
    """

    index: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    logits: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: its prompt, its completion(s), whether it is done.

    Attributes:
        request_id: the id it was added with.
        prompt_token_ids: ``[num_prompt_tokens]`` (after ``truncate_prompt_tokens``).
        outputs: one :class:`CompletionOutput` per completion (``n``), by ``index``.
        finished: every completion ended.
        prompt: the prompt text, when it was given as text.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` (:data:`PromptLogprobs`).
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
