"""The tool-call formats of ``--tool-call-parser`` (vLLM's names), and the one ``tool_choice: "required"``
makes the model write.

* ``hermes`` (Hermes 2/3, Qwen 2.5, Qwen 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call; text before the first block is the content. vLLM: ``Hermes2ProToolParser``.
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole output is ``{"name": ...,
  "parameters": {...}}`` (optionally after ``<|python_tag|>``), several separated by ``;``; an output that
  does not start that way is content. vLLM: ``Llama3JsonToolParser``.
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` (repeated for several calls); text before ``[TOOL_CALLS]`` is the
  content; ids of 9 letters and digits. ``[TOOL_CALLS]`` is a special token, so requests with tools are
  detokenized with ``skip_special_tokens=False``. vLLM: ``MistralToolParser``.
* ``tool_choice: "required"``: a JSON array of ``{"name": ..., "parameters": {...}}`` (the schema of
  :func:`tool_choice_json_schema` holds the model to it).
"""

from __future__ import annotations

from models.entrypoints.openai.tool_parsers.base import (
    NotJson,
    PartialCall,
    ToolParser,
    call_from_object,
    held_prefix,
    mistral_tool_call_id,
    skip_ws,
    value_end,
)


def _array_calls(text: str, i: int) -> list[PartialCall]:
    """The calls of a JSON array of call objects starting at ``text[i] == '['``."""
    calls = []
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return calls
        c = text[j]
        if c == "]":
            return calls
        if c == ",":
            j += 1
            continue
        if c != "{":
            raise NotJson(f"expected a tool call object at {j}: {text[j:j + 20]!r}")
        call, end = call_from_object(text, j)
        calls.append(call)
        if end is None:
            return calls
        j = end


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (module docstring)."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def content_before_calls(self, text):
        return text[:text.find(self.start)] if self.start in text else text

    def scan(self, text, final):
        k = text.find(self.start)
        if k < 0:
            return (text if final else text[:len(text) - held_prefix(text, self.start)]), []
        calls = []
        pos = k
        while pos >= 0:
            j = skip_ws(text, pos + len(self.start))
            if j >= len(text):
                break
            if text[j] != "{":
                raise NotJson(f"expected a JSON object after {self.start}")
            call, stop = call_from_object(text, j)
            calls.append(call)
            if stop is None:
                break
            pos = text.find(self.start, stop)
        return text[:k], calls


class Llama3JsonToolParser(ToolParser):
    """A whole output of ``;``-separated JSON calls, maybe after ``<|python_tag|>`` (module docstring)."""

    name = "llama3_json"
    bot = "<|python_tag|>"

    def scan(self, text, final):
        j = skip_ws(text, 0)
        rest = text[j:]
        if rest.startswith(self.bot):
            j = skip_ws(text, j + len(self.bot))
        elif not final and (not rest or self.bot.startswith(rest)):
            return None, []  # not decided yet: maybe the tag, maybe text
        if j >= len(text):
            return (text if final and not rest.startswith(self.bot) else None), []
        if text[j] != "{":
            return text, []  # plain content
        calls = []
        while True:
            call, stop = call_from_object(text, j)
            calls.append(call)
            if stop is None:
                return None, calls
            j = skip_ws(text, stop)
            if j >= len(text) or text[j] != ";":
                return None, calls
            j = skip_ws(text, j + 1)
            if j >= len(text):
                return None, calls
            if text[j] != "{":
                raise NotJson("expected another tool call after ';'")


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON array or by ``name[ARGS]{json}`` (module docstring)."""

    name = "mistral"
    bot = "[TOOL_CALLS]"
    args_tag = "[ARGS]"

    def make_id(self) -> str:
        return mistral_tool_call_id()

    def content_before_calls(self, text):
        return text[:text.find(self.bot)] if self.bot in text else text

    @classmethod
    def adjust_skip_special_tokens(cls, skip_special_tokens: bool) -> bool:
        return False

    def scan(self, text, final):
        k = text.find(self.bot)
        if k < 0:
            return (text if final else text[:len(text) - held_prefix(text, self.bot)]), []
        content = text[:k]
        j = skip_ws(text, k + len(self.bot))
        if j >= len(text):
            return content, []
        if text[j] == "[":
            return content, _array_calls(text, j)
        calls = []
        while True:  # name[ARGS]{...} ([TOOL_CALLS] name[ARGS]{...} ...)
            a = text.find(self.args_tag, j)
            if a < 0:
                return content, calls  # the name is still being written
            name = text[j:a].strip()
            if not name:
                raise NotJson("a tool call without a name")
            b = skip_ws(text, a + len(self.args_tag))
            if b >= len(text):
                calls.append(PartialCall(name, "", False))
                return content, calls
            if text[b] != "{":
                raise NotJson("expected a JSON object after [ARGS]")
            stop = value_end(text, b)
            calls.append(PartialCall(name, text[b:stop] if stop else text[b:], stop is not None))
            if stop is None:
                return content, calls
            j = skip_ws(text, stop)
            if not text.startswith(self.bot, j):
                return content, calls
            j = skip_ws(text, j + len(self.bot))


class RequiredToolChoiceParser(ToolParser):
    """The JSON array ``tool_choice: "required"`` produces: ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required"

    def scan(self, text, final):
        j = skip_ws(text, 0)
        if j >= len(text):
            return None, []
        if text[j] != "[":
            raise NotJson("expected a JSON array of tool calls")
        return None, _array_calls(text, j)
