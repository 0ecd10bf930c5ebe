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
    """Per generated token ``{token_id: Logprob}``, stored flat (vLLM ``FlatLogprobs``): the NumPy rows the engine
    sent, and a position's dict built only when it is read (``logprobs[i]``, iteration, slicing). An offline
    ``generate`` with ``logprobs=5`` would otherwise build six ``Logprob`` objects per token on the front
    end's process, time that the engine-core process then waits for requests.

    It is a read-only sequence: ``len``, indexing (a slice is a :class:`FlatLogprobs`), iteration, and ``==``
    against any sequence of dicts (a ``list[dict[int, Logprob]]`` with the same entries is equal).

    Attributes:
        token_ids: ``int[n, 1 + k]``: per position, the chosen token then the top-k tokens in rank order.
        logprobs: ``float[n, 1 + k]``: their logprobs (float32 from the engine).
        ranks: ``int[n]``: the chosen token's rank per position (1 = most likely); the top-k tokens' ranks
            are ``1..k`` in order.
        texts: ``token_id -> text`` for ``Logprob.decoded_token`` (``None``: no text).

    Raises:
        ValueError: rows of different widths, or shapes that disagree (:meth:`extend_rows`).
    """

    __slots__ = ("_chunks", "_len", "texts")

    def __init__(self, token_ids=None, logprobs=None, ranks=None, texts: Mapping[int, str] | None = None):
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # joined into one when read
        self._len = 0
        self.texts = texts
        if token_ids is not None:
            self.extend_rows(token_ids, logprobs, ranks)

    def extend_rows(self, token_ids, logprobs, ranks) -> None:
        """Append positions: ``[n, 1 + k]`` ids and logprobs and ``[n]`` ranks (arrays, a
        :class:`jaxkv.engine.protocol.LogprobsLists`' views, or nested lists)."""
        ids, lps, rks = np.asarray(token_ids), np.asarray(logprobs), np.asarray(ranks)
        if rks.size == 0 and ids.size == 0:
            return
        if ids.ndim != 2 or lps.shape != ids.shape or rks.shape != ids.shape[:1]:
            raise ValueError(f"FlatLogprobs: token_ids {ids.shape}, logprobs {lps.shape} and ranks {rks.shape} "
                             "must be [n, 1 + k], [n, 1 + k] and [n]")
        if self._chunks and self._chunks[0][0].shape[1] != ids.shape[1]:
            raise ValueError(f"FlatLogprobs: rows of width {ids.shape[1]} after rows of width "
                             f"{self._chunks[0][0].shape[1]}")
        self._chunks.append((ids, lps, rks))
        self._len += len(rks)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._chunks:
            return np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32), np.zeros(0, np.int32)
        if len(self._chunks) > 1:
            self._chunks = [tuple(np.concatenate([c[i] for c in self._chunks]) for i in range(3))]
        return self._chunks[0]

    @property
    def token_ids(self) -> np.ndarray:
        return self._arrays()[0]

    @property
    def logprobs(self) -> np.ndarray:
        return self._arrays()[1]

    @property
    def ranks(self) -> np.ndarray:
        return self._arrays()[2]

    def chosen_logprob_sum(self) -> float:
        """The sum of the chosen tokens' logprobs (``cumulative_logprob``), in float64."""
        return float(sum(c[1][:, 0].sum(dtype=np.float64) for c in self._chunks))

    def __len__(self) -> int:
        return self._len

    def _row_dict(self, ids: list, lps: list, rank: int) -> dict[int, Logprob]:
        texts = self.texts
        chosen = ids[0]
        d = {chosen: Logprob(lps[0], rank, None if texts is None else texts[chosen])}
        for r in range(1, len(ids)):
            tok = ids[r]
            if tok not in d:  # the chosen token among the top ones keeps its own rank
                d[tok] = Logprob(lps[r], r, None if texts is None else texts[tok])
        return d

    def __getitem__(self, i):
        ids, lps, rks = self._arrays()
        if isinstance(i, slice):
            return FlatLogprobs(ids[i], lps[i], rks[i], self.texts)
        i = range(len(self))[i]  # negative indices; IndexError names the range
        return self._row_dict(ids[i].tolist(), lps[i].tolist(), int(rks[i]))

    def __iter__(self):
        ids, lps, rks = self._arrays()
        for row_ids, row_lps, rank in zip(ids.tolist(), lps.tolist(), rks.tolist()):
            yield self._row_dict(row_ids, row_lps, rank)

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
