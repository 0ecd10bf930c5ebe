"""What the engine returns per step. vLLM: ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: completion index (always 0: one completion per request).
        token_ids: every token generated so far (a stop token is not included).
        new_token_ids: the tokens generated in this step.
        finish_reason: ``"stop"`` (EOS or a stop token), ``"length"`` (``max_tokens`` or the model
            length), ``"abort"``, or ``None`` while running.
        stop_reason: the stop token id that ended it (``None`` for EOS, length or abort).
        text: decoded text (filled by :class:`models.LLM`; the engine has no tokenizer).
        logits: ``f32[len(token_ids), vocab]`` logits of each generated token, only from an engine
            built with ``return_logits=True`` and only once finished (tests and accuracy scripts).
    """

    index: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    logits: np.ndarray | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: its prompt, its completion(s), whether it is done."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
