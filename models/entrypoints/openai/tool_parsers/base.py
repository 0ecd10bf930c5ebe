"""What the tool-call parsers share: a scanner for JSON that may still be growing, the parser interface, and
the streaming driver that turns a growing text into OpenAI's ``delta.tool_calls`` fragments.

vLLM: ``entrypoints/openai/tool_parsers/abstract_tool_parser.py`` (``ToolParser``:
``extract_tool_calls`` / ``extract_tool_calls_streaming``). Here a parser only says what the text holds so
far (:meth:`ToolParser.scan`: the content before the tool calls, and each call's name and the part of its
arguments written so far); :class:`ToolCallStreamer` sends what is new since the last chunk. The streamed
``arguments`` fragments of a call join to exactly the non-streamed ``arguments``: the arguments' JSON text
as the model wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
import uuid
from typing import Any

WS = " \t\r\n"


class NotJson(ValueError):
    """The text where a tool call's JSON should be is not JSON."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at ``s[i] == '"'``, or ``None`` while it is unterminated."""
    j = i + 1
    n = len(s)
    while j < n:
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """Index after the JSON value starting at ``s[i]``, or ``None`` while it may still grow."""
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth, j, n = 0, i, len(s)
        while j < n:
            c = s[j]
            if c == '"':
                e = string_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None


def scan_object(s: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level members of the JSON object starting at ``s[i] == '{'``, which may be unfinished.

    Returns:
        ``({key: (value_start, value_end or None)}, end)``: ``end`` is the index after the closing brace, or
        ``None`` while the object is unfinished (its last member may be partial or its value missing).

    Raises:
        NotJson: the text is not the start of a JSON object.
    """
    members: dict[str, tuple[int, int | None]] = {}
    j = i + 1
    n = len(s)
    while True:
        j = skip_ws(s, j)
        if j >= n:
            return members, None
        c = s[j]
        if c == "}":
            return members, j + 1
        if c == ",":
            j += 1
            continue
        if c != '"':
            raise NotJson(f"expected a key at {j}: {s[j:j + 20]!r}")
        e = string_end(s, j)
        if e is None:
            return members, None
        key = json.loads(s[j:e])
        j = skip_ws(s, e)
        if j >= n:
            return members, None
        if s[j] != ":":
            raise NotJson(f"expected ':' at {j}: {s[j:j + 20]!r}")
        j = skip_ws(s, j + 1)
        if j >= n:
            return members, None
        end = value_end(s, j)
        members[key] = (j, end)
        if end is None:
            return members, None
        j = end


@dataclasses.dataclass
class PartialCall:
    """A tool call as far as the text goes.

    Attributes:
        name: the function name once it is complete, else ``None``.
        arguments: the arguments' JSON text written so far (a prefix of the final one).
        complete: the call's text is finished.
    """

    name: str | None
    arguments: str
    complete: bool


def call_from_object(s: str, i: int, *, args_keys=("arguments", "parameters")) -> tuple[PartialCall, int | None]:
    """The :class:`PartialCall` of a ``{"name": ..., "arguments": {...}}`` object at ``s[i] == '{'`` and the
    index after it (``None`` while unfinished). Arguments given as a JSON string are its content, sent once
    complete.

    Raises:
        NotJson: not a JSON object, or a name that is not a string.
    """
    members, end = scan_object(s, i)
    name = None
    if "name" in members and members["name"][1] is not None:
        start, stop = members["name"]
        name = json.loads(s[start:stop])
        if not isinstance(name, str):
            raise NotJson(f"a tool call's name must be a string (got {name!r})")
    args = ""
    key = next((k for k in args_keys if k in members), None)
    if key is not None:
        start, stop = members[key]
        if stop is not None:
            args = s[start:stop]
            if args.startswith('"'):
                args = json.loads(args)
        elif not s[start].startswith('"'):
            args = s[start:]
    elif end is not None:
        args = "{}"
    return PartialCall(name, args, end is not None), end


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with (held back while streaming:
    the next characters may complete the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def make_tool_call_id() -> str:
    """vLLM's tool-call id: ``chatcmpl-tool-<32 hex>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """A model family's tool-call format. Subclasses implement :meth:`scan`.

    Args:
        tools: the request's tool definitions (unused by the formats here; vLLM passes them too).
    """

    name = ""

    def __init__(self, tools: list | None = None):
        self.tools = tools

    def scan(self, text: str, final: bool) -> tuple[str | None, list[PartialCall]]:
        """The content (text that is not a tool call; with ``final`` false, what cannot become a tool-call
        marker any more) and the calls the text holds so far.

        Raises:
            NotJson: a tool call's JSON is malformed.
        """
        raise NotImplementedError

    def content_before_calls(self, text: str) -> str | None:
        """The content of a text whose tool calls are malformed (streaming keeps what came before them)."""
        return None

    def make_id(self) -> str:
        return make_tool_call_id()

    @classmethod
    def adjust_skip_special_tokens(cls, skip_special_tokens: bool) -> bool:
        """The detokenization the format needs (Mistral's ``[TOOL_CALLS]`` is a special token)."""
        return skip_special_tokens

    def extract(self, text: str) -> tuple[str | None, list[tuple[str, str, str]]]:
        """Non-streaming extraction: ``(content, [(id, name, arguments)])``; no calls: the whole text is the
        content (also when a call is malformed or unfinished, as vLLM falls back). vLLM:
        ``extract_tool_calls``."""
        try:
            content, calls = self.scan(text, True)
        except NotJson:
            return text, []
        if not calls:
            return text if content is None else content, []
        out = []
        for call in calls:
            if not call.complete or call.name is None:
                return text, []
            try:
                json.loads(call.arguments)
            except ValueError:
                return text, []
            out.append((self.make_id(), call.name, call.arguments))
        return content or None, out


class ToolCallStreamer:
    """Streams one completion's tool calls: feed the whole text so far; get what to send now.

    Args:
        parser: the format.
        max_calls: most calls to stream (1 when ``parallel_tool_calls`` is false).
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.content_sent = 0
        self.calls: list[list[Any]] = []  # [id, arguments sent]
        self.broken = False

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def update(self, text: str, final: bool) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content delta or None, tool-call deltas)`` for ``text`` (the completion's text so far).

        The first delta of a call carries ``index``, ``id``, ``type``, ``function.name`` and the arguments
        written so far; later ones ``index`` and the next ``function.arguments`` fragment."""
        if self.broken:
            return None, []
        try:
            content, calls = self.parser.scan(text, final)
        except NotJson:
            self.broken = True  # what was sent stays; nothing after the malformed call is parsed
            content, calls = self.parser.content_before_calls(text), []
        delta = None
        if content is not None and len(content) > self.content_sent:
            delta = content[self.content_sent:]
            self.content_sent = len(content)
        out = []
        for idx, call in enumerate(calls if self.max_calls is None else calls[:self.max_calls]):
            if call.name is None:
                break
            if idx >= len(self.calls):
                self.calls.append([self.parser.make_id(), len(call.arguments)])
                out.append({"index": idx, "id": self.calls[idx][0], "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.calls[idx][1]
            if len(call.arguments) > sent:
                out.append({"index": idx, "function": {"arguments": call.arguments[sent:]}})
                self.calls[idx][1] = len(call.arguments)
        return delta, out


def mistral_tool_call_id() -> str:
    """Mistral's tool-call id: 9 letters and digits (its chat template checks them)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))
