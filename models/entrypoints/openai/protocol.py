"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

vLLM: ``entrypoints/openai/protocol.py``.

Requests accept the fields OpenAI clients send (unknown fields are ignored, as OpenAI's server does for
most of them); fields the engine cannot honour (``n > 1``, logprobs, penalties, ``echo``, ``suffix``,
tools) are rejected with a 400 that names the field rather than silently ignored. Every range check
happens here or in :class:`jaxkv.sampling_params.SamplingParams`, so a request that gets past validation cannot
make the engine fail.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class OpenAIError(Exception):
    """An error answered to the client as OpenAI's error JSON.

    Args:
        message: human-readable, names the offending field.
        status_code: HTTP status (400 bad request, 404 unknown model, 503 engine dead, 500 bug).
        param: the field at fault (``"max_tokens"``, ``"messages.0.content"``) or ``None``.
        code: machine-readable reason (``"invalid_value"``, ``"model_not_found"``,
            ``"context_length_exceeded"``, ``"unsupported_parameter"``) or ``None``.
    """

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = "invalid_value"):
        super().__init__(message)
        self.message, self.status_code, self.param, self.code = message, status_code, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status_code < 500 else "server_error"

    def to_dict(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_from_validation(e: ValidationError) -> OpenAIError:
    """The first pydantic error as a 400 naming its field (``loc`` joined with dots)."""
    err = e.errors(include_url=False)[0]
    # drop pydantic's union-member tags ("str", "list[int]", function names) from the location
    loc = [str(p) for p in err.get("loc", ()) if isinstance(p, int) or not _is_type_tag(str(p))]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if param is None:
        return OpenAIError(f"Invalid request body: {msg}", param=None)
    return OpenAIError(f"Invalid value for '{param}': {msg} (got {_short(err.get('input'))})", param=param)


def _is_type_tag(part: str) -> bool:
    return any(c in part for c in "[]()") or part in {"str", "int", "float", "bool", "list", "dict",
                                                     "function-after", "function-before"}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Ignores fields it does not know (OpenAI clients send some, e.g. ``user``)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# ---------------------------------------------------------------------------------------------- requests

class _SamplingFields(OpenAIBaseModel):
    """What completions and chat share: sampling, stopping, streaming, and the unsupported fields."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension: -1 (or 0) = off
    seed: int | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check_supported(self) -> None:
        """Raise a 400 for a field the engine cannot honour (after pydantic's type checks)."""
        if self.n != 1:
            raise OpenAIError(f"Invalid value for 'n': only n=1 is supported (got {self.n})", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise OpenAIError(f"'{name}' is not supported (got {getattr(self, name)}; only 0)",
                                  param=name, code="unsupported_parameter")
        if self.logit_bias:
            raise OpenAIError("'logit_bias' is not supported", param="logit_bias",
                              code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("'stream_options' is only allowed when 'stream' is true",
                              param="stream_options")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. vLLM: ``CompletionRequest``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token-id prompts must not be empty")
        return v

    def check_supported(self) -> None:
        super().check_supported()
        for name, bad in (("echo", self.echo), ("logprobs", self.logprobs is not None),
                          ("suffix", self.suffix is not None),
                          ("best_of", self.best_of not in (None, 1))):
            if bad:
                raise OpenAIError(f"'{name}' is not supported", param=name, code="unsupported_parameter")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. vLLM: ``ChatCompletionRequest``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def check_supported(self) -> None:
        super().check_supported()
        for name, bad in (("logprobs", self.logprobs), ("top_logprobs", self.top_logprobs is not None),
                          ("tools", bool(self.tools)),
                          ("response_format", self.response_format not in (None, {"type": "text"}))):
            if bad:
                raise OpenAIError(f"'{name}' is not supported", param=name, code="unsupported_parameter")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --------------------------------------------------------------------------------------------- responses

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string / token id that ended it


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
