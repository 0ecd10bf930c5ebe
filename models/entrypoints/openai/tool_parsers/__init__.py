"""Tool calling: the ``--tool-call-parser`` formats, their streaming, and the JSON schema that
``tool_choice: "required"`` or a named function puts on the output.

vLLM: ``entrypoints/openai/tool_parsers/`` (``ToolParserManager``) and
``ChatCompletionRequest._get_json_schema_from_tool``.
"""

from __future__ import annotations

import copy
from typing import Any

from models.entrypoints.openai.tool_parsers.base import (
    NotJson,
    PartialCall,
    ToolCallStreamer,
    ToolParser,
    make_tool_call_id,
)
from models.entrypoints.openai.tool_parsers.formats import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    RequiredToolChoiceParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}

__all__ = ["TOOL_PARSERS", "NotJson", "PartialCall", "ToolCallStreamer", "ToolParser", "get_tool_parser",
           "make_tool_call_id", "RequiredToolChoiceParser", "tool_choice_json_schema"]


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of ``--tool-call-parser NAME``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser={name!r} is not one of {sorted(TOOL_PARSERS)}") from None


def _parameters(tool) -> dict[str, Any]:
    params = tool.function.parameters
    return copy.deepcopy(params) if params else {"type": "object", "properties": {}}


def tool_choice_json_schema(tools, choice, *, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema that holds the output to the tool choice (vLLM ``_get_json_schema_from_tool``).

    Args:
        tools: the request's ``tools`` (:class:`~models.entrypoints.openai.protocol.ChatCompletionToolParam`).
        choice: ``"required"`` or a named choice (``.function.name``).
        parallel: ``parallel_tool_calls``; false: at most one call (``maxItems: 1``).

    Returns:
        For a named function, its ``parameters`` schema (the output is the arguments); for ``"required"``, an
        array of at least one ``{"name": <one of the tools>, "parameters": <its schema>}`` object, the tools'
        ``$defs`` lifted to the top (their ``$ref`` s point at the root).

    Raises:
        OpenAIError: 400 when two tools define the same ``$defs`` name differently.
    """
    from models.entrypoints.openai.protocol import OpenAIError

    if choice != "required":
        name = choice.function.name
        return next(_parameters(t) for t in tools if t.function.name == name)
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        params = _parameters(t)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise OpenAIError(f"Invalid value for 'tools': two tools define $defs.{key} differently",
                                  param="tools")
            defs[key] = value
        variants.append({"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                        "parameters": params}, "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
