"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

vLLM: ``entrypoints/openai/protocol.py`` (``CompletionRequest``, ``ChatCompletionRequest``, ...).

Three kinds of request fields:

* fields OpenAI or vLLM define that this server implements (the class attributes below);
* fields OpenAI or vLLM define that it does not implement (:data:`_NOT_IMPLEMENTED`): a request that sets one
  to anything but its no-op value is answered 400 naming the field (``unsupported_parameter``);
* any other field: accepted and dropped with a warning naming it, as vLLM's ``OpenAIBaseModel`` logs
  ("The following fields were present in the request but ignored: ...").

Every range check happens here or in :class:`jaxkv.sampling_params.SamplingParams`, so a request that gets
past validation cannot make the engine fail on its values.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger("jaxkv.serve")


class OpenAIError(Exception):
    """An error answered to the client as OpenAI's error JSON.

    Args:
        message: human-readable, names the offending field.
        status_code: HTTP status (400 bad request, 404 unknown model / route, 405, 503 engine dead, 500 bug).
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


def unsupported(name: str, value: Any, why: str = "") -> OpenAIError:
    """The 400 for a field this server does not implement (``code: unsupported_parameter``)."""
    return OpenAIError(f"'{name}' is not supported by this server{why} (got {_short(value)})", param=name,
                       code="unsupported_parameter")


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
                                                     "function-after", "function-before", "literal['text']",
                                                     "ChatCompletionNamedToolChoiceParam"}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Fields OpenAI or vLLM define that this server does not implement, with the values that mean "off" (sent by
# some clients as defaults): anything else is a 400 naming the field. None is always accepted.
_NOT_IMPLEMENTED: dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "prompt_embeds": (),
    "logprob_token_ids": (), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    "cache_salt": (), "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": (),
    "repetition_detection": (), "thinking_token_budget": (), "stream_interval": (), "watermarking": (False,),
    "truncation_side": ("left",), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "logits_processors": (), "mm_processor_kwargs": ({},), "documents": (), "chat_template": (),
    "chat_template_content_format": ("auto", "string"), "reasoning_effort": (), "include_reasoning": (True,),
    "return_prompt_text": (False,), "media_io_kwargs": ({},), "session_id": (), "functions": (),
    "function_call": (), "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (),
    "routed_experts_prompt_start": (0,), "return_token_offsets": (False,), "return_mm_kwargs": (True,),
    "spaces_between_special_tokens": (True,), "structural_tag": (), "top_a": (),
}


class OpenAIBaseModel(BaseModel):
    """Drops fields it does not know, with a warning naming them (vLLM's behaviour); 400 for a known field
    this server does not implement (:data:`_NOT_IMPLEMENTED`, restricted to ``_checked_fields``)."""

    model_config = ConfigDict(extra="ignore")
    _checked_fields: ClassVar[frozenset[str]] = frozenset()
    _known_cache: ClassVar[frozenset[str] | None] = None

    @classmethod
    def _known(cls) -> frozenset[str]:
        known = cls.__dict__.get("_known_cache")
        if known is None:
            names = set()
            for name, field in cls.model_fields.items():
                names.add(name)
                if field.alias:
                    names.add(field.alias)
            known = frozenset(names)
            cls._known_cache = known
        return known

    @model_validator(mode="before")
    @classmethod
    def _unknown_and_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        extra = [k for k in data if k not in cls._known()]
        if not extra:
            return data
        ignored = []
        for k in extra:
            if k in cls._checked_fields:
                value = data[k]
                if value is not None and value not in _NOT_IMPLEMENTED[k]:
                    raise unsupported(k, value)
            else:
                ignored.append(k)
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s (%s)",
                           sorted(ignored), cls.__name__)
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous(cls, v):
        if v:
            raise unsupported("stream_options.continuous_usage_stats", v)
        return v


# --------------------------------------------------------------------------------- structured outputs

class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request field (its ``StructuredOutputsParams``)."""

    _checked_fields: ClassVar[frozenset[str]] = frozenset({"structural_tag"})
    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _only_defaults(self):
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name):
                raise unsupported(f"structured_outputs.{name}", True)
        if self.whitespace_pattern is not None:
            raise unsupported("structured_outputs.whitespace_pattern", self.whitespace_pattern)
        return self


def _json_schema_value(value: Any, field: str) -> dict | bool:
    """A JSON schema given as an object (or its JSON text): 400 naming ``field`` unless it is one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise OpenAIError(f"Invalid value for '{field}': not a JSON schema ({e})", param=field) from None
    if not isinstance(value, (dict, bool)):
        raise OpenAIError(f"Invalid value for '{field}': a JSON schema must be an object (got {_short(value)})",
                          param=field)
    return value


# ---------------------------------------------------------------------------------------------- requests

class _SamplingFields(OpenAIBaseModel):
    """What completions and chat share: sampling, stopping, logprobs, structured outputs, streaming."""

    _checked_fields: ClassVar[frozenset[str]] = frozenset(_NOT_IMPLEMENTED)

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension: -1 (or 0) = off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM extension
    seed: int | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension
    priority: int = 0  # vLLM extension: with --scheduling-policy priority, smaller is admitted first
    skip_special_tokens: bool = True  # vLLM extension
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM extension
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM extension
    bad_words: list[str] | None = None  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM extension
    prompt_logprobs: int | None = Field(default=None, ge=-1)  # vLLM extension
    echo: bool = False  # chat: vLLM extension
    user: str | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # vLLM extension
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, v):
        if v == 0:
            raise ValueError("must be -1 or >= 1")
        return v

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v):
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("bad words must be non-empty strings")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check_supported(self) -> None:
        """Raise a 400 for field combinations the server cannot honour (after pydantic's type checks)."""
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("'stream_options' is only allowed when 'stream' is true",
                              param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise OpenAIError("'prompt_logprobs' are not available when 'stream' is true (vLLM)",
                              param="prompt_logprobs")

    def structured_outputs_params(self):
        """The request's output constraint as :class:`jaxkv.sampling_params.StructuredOutputsParams`, or
        ``None`` (vLLM: ``structured_outputs`` / ``response_format`` / ``guided_*`` →
        ``SamplingParams.structured_outputs``).

        Raises:
            OpenAIError: 400 when two of these fields are set (naming both), or a value is not valid.
        """
        from jaxkv.sampling_params import StructuredOutputsParams

        sources: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                sources.append(("response_format", {"json_object": True}))
            else:
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise OpenAIError("Invalid value for 'response_format': type 'json_schema' needs "
                                      "'json_schema.schema'", param="response_format.json_schema")
                sources.append(("response_format", {"json": _json_schema_value(
                    rf.json_schema.schema_, "response_format.json_schema.schema")}))
        so = self.structured_outputs
        if so is not None:
            kinds = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                       ("grammar", so.grammar), ("json_object", so.json_object or None))
                     if v is not None}
            if len(kinds) != 1:
                raise OpenAIError(f"Invalid value for 'structured_outputs': set exactly one of json, regex, choice, "
                                  f"grammar, json_object (got {sorted(kinds) or 'none'})", param="structured_outputs")
            if "json" in kinds:
                kinds["json"] = _json_schema_value(kinds["json"], "structured_outputs.json")
            sources.append(("structured_outputs", kinds))
        if self.guided_json is not None:
            sources.append(("guided_json", {"json": _json_schema_value(self.guided_json, "guided_json")}))
        for name, key in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                sources.append((name, {key: getattr(self, name)}))
        sources += self._extra_structured_sources()
        if not sources:
            return None
        if len(sources) > 1:
            names = [s[0] for s in sources]
            raise OpenAIError(f"Invalid request: {' and '.join(repr(n) for n in names)} both constrain the output; "
                              f"set only one", param=names[1])
        field, kwargs = sources[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as e:
            raise OpenAIError(f"Invalid value for '{field}': {e}", param=field) from None

    def _extra_structured_sources(self) -> list[tuple[str, dict]]:
        return []


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. vLLM: ``CompletionRequest``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=-1)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True  # vLLM extension

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("token-id prompts must not be empty")
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _null_is_default(cls, v):
        return 16 if v is None else v  # vLLM: a null max_tokens is the default 16

    def check_supported(self) -> None:
        """400 for ``suffix``, ``best_of`` other than ``n``, ``max_tokens: 0`` without ``echo`` (and the shared
        checks)."""
        super().check_supported()
        if self.suffix is not None:
            raise unsupported("suffix", self.suffix, " (no fill-in-the-middle)")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(f"Invalid value for 'best_of': {self.best_of}; this server (as vLLM V1) only "
                              f"accepts best_of equal to n={self.n}", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError("Invalid value for 'max_tokens': 0 is only allowed with 'echo' (the prompt's "
                              "logprobs without generating)", param="max_tokens")

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


class FunctionCallIn(OpenAIBaseModel):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(OpenAIBaseModel):
    """A tool call of an earlier assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(OpenAIBaseModel):
    """One message of ``messages`` (``tool_calls`` of an assistant turn, ``tool_call_id`` of a tool result)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined with newlines, as vLLM's "string" format)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    """One of ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. vLLM: ``ChatCompletionRequest``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1)
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True  # vLLM extension
    continue_final_message: bool = False  # vLLM extension
    add_special_tokens: bool = False  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension

    def check_supported(self) -> None:
        """400 for ``top_logprobs`` without ``logprobs``, ``continue_final_message`` with
        ``add_generation_prompt``, a ``tool_choice`` without ``tools`` or naming a tool not in them (and the
        shared checks). vLLM: ``check_logprobs``, ``check_generation_prompt``, ``check_tool_usage``."""
        super().check_supported()
        if self.top_logprobs is not None and self.top_logprobs != 0 and not self.logprobs:
            raise OpenAIError("Invalid value for 'top_logprobs': it needs 'logprobs' set to true",
                              param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError("Invalid request: 'continue_final_message' and 'add_generation_prompt' cannot both "
                              "be true (set add_generation_prompt to false)", param="continue_final_message")
        if self.tool_choice is not None and self.tool_choice != "none" and self.tools is None:
            raise OpenAIError("Invalid value for 'tool_choice': it needs 'tools'", param="tool_choice")
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            name = self.tool_choice.function.name
            if name not in [t.function.name for t in self.tools or ()]:
                raise OpenAIError(f"Invalid value for 'tool_choice': tool {name!r} is not in 'tools'",
                                  param="tool_choice")

    @property
    def effective_tool_choice(self) -> str | ChatCompletionNamedToolChoiceParam:
        """``tool_choice`` with OpenAI's default: ``"auto"`` when tools are given, else ``"none"``;
        ``"required"`` with an empty tool list is ``"none"`` (vLLM)."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if self.tool_choice == "required" and not self.tools:
            return "none"
        return self.tool_choice

    def _extra_structured_sources(self) -> list[tuple[str, dict]]:
        from models.entrypoints.openai.tool_parsers import tool_choice_json_schema

        choice = self.effective_tool_choice
        if choice == "required" or isinstance(choice, ChatCompletionNamedToolChoiceParam):
            return [("tool_choice", {"json": tool_choice_json_schema(
                self.tools, choice, parallel=self.parallel_tool_calls is not False)})]
        return []

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ------------------------------------------------------------------------------------- tokenize routes

class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a prompt. vLLM: ``TokenizeCompletionRequest``."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    """``POST /tokenize`` with chat messages. vLLM: ``TokenizeChatRequest``."""

    _checked_fields: ClassVar[frozenset[str]] = frozenset({"chat_template", "mm_processor_kwargs", "documents"})
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``. vLLM: ``DetokenizeRequest``."""

    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------------------------- responses

class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogProbs(OpenAIBaseModel):
    """OpenAI's completions ``logprobs`` (vLLM: ``CompletionLogProbs``)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string / token id that ended it
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM extension


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM extension


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
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
