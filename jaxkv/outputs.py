"""What the engine returns. vLLM: ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``) and
``vllm/logprobs.py`` (``Logprob``)."""

from __future__ import annotations

import dataclasses

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


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: ``{token_id: Logprob}`` of the top ``logprobs`` tokens and the sampled one."""

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
