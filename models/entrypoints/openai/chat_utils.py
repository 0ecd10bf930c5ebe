"""Rendering a chat request with the model's chat template. vLLM: ``entrypoints/chat_utils.py``
(``apply_hf_chat_template``, ``_postprocess_messages``) and transformers' ``apply_chat_template``
(``tools``, ``continue_final_message``, extra template variables).

Every conversation goes through the tokenizer's own ``apply_chat_template(messages, add_generation_prompt=...,
tools=..., **chat_template_kwargs)`` (transformers' signature; the template compiled as transformers compiles it,
:func:`models.tokenizer.compile_chat_template`, with its ``tojson``).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import jinja2

from models.entrypoints.openai.protocol import ChatMessage, OpenAIError

# template variables a request may not set through chat_template_kwargs
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                    "bos_token", "eos_token", "documents"})

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
        if tools is not None:
            kwargs["tools"] = tools
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:  # raise_exception() on a role order, ...
        raise OpenAIError(f"Invalid value for '{field}': the chat template rejected them: {e}", param=field) from None
    if continue_final_message:
        text = _cut_after_final_message(text, msgs[-1]["content"], field)
    return text


def _cut_after_final_message(text: str, final: str, field: str) -> str:
    for probe in (final, final.strip()):
        if probe and probe in text:
            return text[:text.rindex(probe) + len(probe)]
    if not final.strip():
        return text
    raise OpenAIError(f"Invalid value for '{field}': continue_final_message is set but the last message's content "
                      f"does not appear in the rendered chat template", param=field)
