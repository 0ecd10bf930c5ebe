"""Rendering a chat request with the model's chat template. vLLM: ``entrypoints/chat_utils.py``
(``apply_hf_chat_template``, ``_postprocess_messages``) and transformers' ``apply_chat_template``
(``tools``, ``continue_final_message``, extra template variables).

A plain conversation goes through the tokenizer's own ``apply_chat_template(messages,
add_generation_prompt=...)``. A request with ``tools``, ``chat_template_kwargs``, tool calls or tool results
in its messages needs template variables that method does not take, so the template source
(``tokenizer.chat_template``) is compiled here the same way (:func:`models.tokenizer.compile_chat_template`,
cached) and rendered with them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import jinja2

from models.entrypoints.openai.protocol import ChatMessage, OpenAIError

# template variables a request may not set through chat_template_kwargs
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                    "bos_token", "eos_token", "documents"})

_compiled: dict[str, Any] = {}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` filter (keys in their order, non-ASCII kept, no HTML escaping); Jinja's own
    sorts keys and escapes ``<>&'``, which changes how tool definitions read in the prompt."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template(source: str):
    t = _compiled.get(source)
    if t is None:
        from models.tokenizer import compile_chat_template

        # the tokenizer's environment (sandbox, trim/lstrip blocks, loopcontrols, raise_exception,
        # strftime_now) with transformers' tojson
        env = compile_chat_template("").environment.overlay()
        env.filters = dict(env.filters, tojson=_tojson)
        t = _compiled[source] = env.from_string(source)
    return t


def conversation(messages: Sequence[ChatMessage]) -> tuple[list[dict[str, Any]], bool]:
    """The messages as template dicts, and whether any needs more than ``role`` and ``content`` (tool calls,
    a tool call id, a name, ``reasoning_content``). Tool-call arguments given as JSON text become objects, as vLLM passes them
    (templates write them with ``tojson``)."""
    out, rich = [], False
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
            rich = True
        if m.reasoning_content is not None:  # an assistant turn's reasoning (Qwen 3's template reads it)
            d["reasoning_content"] = m.reasoning_content
            rich = True
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
            rich = True
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # left as the text the client sent
                call = {"type": "function", "function": {"name": c.function.name, "arguments": args}}
                if c.id is not None:
                    call["id"] = c.id
                calls.append(call)
            d["tool_calls"] = calls
            rich = True
        out.append(d)
    return out, rich


def render_chat(tokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, field: str = "messages") -> str:
    """The prompt text of a conversation.

    Args:
        tokenizer: ``apply_chat_template(messages, add_generation_prompt=...)``; for tools, tool messages
            or extra variables also ``chat_template`` (the Jinja source), ``bos_token_id`` /
            ``eos_token_id`` and ``id_to_token``.
        messages: the request's messages.
        add_generation_prompt: end with the assistant turn's header.
        continue_final_message: end inside the last message (no end-of-turn after it), for the model to
            continue it (transformers' rule: the text is cut after the last occurrence of its content).
        tools: OpenAI tool definitions (``{"type": "function", "function": {...}}``), the template's ``tools``.
        chat_template_kwargs: more template variables (``enable_thinking``, ...).
        field: the request field named in errors.

    Returns:
        The prompt text (tokenize it without adding special tokens: the template has them).

    Raises:
        OpenAIError: 400 when the template rejects the conversation, a variable is reserved, or the tokenizer
            has no template source for tools / extra variables.
    """
    msgs, rich = conversation(messages)
    kwargs = dict(chat_template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if bad:
        raise OpenAIError(f"Invalid value for 'chat_template_kwargs': {bad} are set by the server, not by "
                          f"chat_template_kwargs", param="chat_template_kwargs")
    try:
        if not (rich or kwargs or tools is not None):
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        else:
            source = getattr(tokenizer, "chat_template", None)
            if not isinstance(source, str):
                raise OpenAIError("this model's tokenizer has no chat template source: tools, tool messages and "
                                  "chat_template_kwargs cannot be rendered", param="tools" if tools else field)
            text = _template(source).render(messages=msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                                            bos_token=_special_text(tokenizer, "bos_token_id"),
                                            eos_token=_special_text(tokenizer, "eos_token_id"), **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:  # raise_exception() on a role order, ...
        raise OpenAIError(f"Invalid value for '{field}': the chat template rejected them: {e}", param=field) from None
    if continue_final_message:
        text = _cut_after_final_message(text, msgs[-1]["content"], field)
    return text


def _special_text(tokenizer, attr: str) -> str:
    token_id = getattr(tokenizer, attr, None)
    if token_id is None or getattr(tokenizer, "is_placeholder", False):
        return ""
    try:
        return tokenizer.id_to_token(token_id)
    except (ValueError, AttributeError):
        return ""


def _cut_after_final_message(text: str, final: str, field: str) -> str:
    for probe in (final, final.strip()):
        if probe and probe in text:
            return text[:text.rindex(probe) + len(probe)]
    if not final.strip():
        return text
    raise OpenAIError(f"Invalid value for '{field}': continue_final_message is set but the last message's content "
                      f"does not appear in the rendered chat template", param=field)
