"""``POST /v1/chat/completions``. vLLM: ``entrypoints/openai/serving_chat.py``.

The conversation is rendered with the model's own chat template (:meth:`models.GGUFTokenizer.
apply_chat_template`, read from the GGUF) and tokenized without adding special tokens (the template
already has them). ``max_tokens`` / ``max_completion_tokens`` default to all the room left in
``max_model_len``.
"""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

import jinja2

from models.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    OpenAIError,
)
from models.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkFormatter,
    OpenAIServing,
    error_event,
    final_output,
    sse,
    usage_of,
)


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions (n = 1)."""

    def prepare(self, request: ChatCompletionRequest):
        """Validate, render the template, tokenize; returns ``(prompt_token_ids, SamplingParams)``."""
        self.check_model(request.model)
        request.check_supported()
        self.check_alive()
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:  # the template may raise_exception() on a role order
            raise OpenAIError(f"Invalid value for 'messages': the chat template rejected them: {e}",
                              param="messages") from None
        ids = self.encode(text, "messages", add_special_tokens=False)
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(ids), request.requested_max_tokens, "messages", field)
        return ids, self.sampling_params(request, max_tokens)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     request_id: str) -> ChatCompletionResponse:
        ids, params = self.prepare(request)
        out = await final_output(self.stream(ids, params, request_id, request))
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, usage=usage_of([out]),
            choices=[ChatChoice(index=0, message=ChatMessageOut(content=out.text),
                                finish_reason=out.finish_reason, stop_reason=out.stop_reason)])

    async def chat_completion_stream(self, request: ChatCompletionRequest, request_id: str,
                                     prepared) -> AsyncIterator[str]:
        """First chunk: ``delta.role``; then content deltas; the last with ``finish_reason``; usage chunk
        if asked; ``[DONE]``."""
        ids, params = prepared
        created = int(time.time())
        fmt = ChunkFormatter(object_="chat.completion.chunk", request_id=request_id, model=self.model_name,
                             created=created)
        sent, last = 0, None
        try:
            yield fmt.chat(0, "", role="assistant")
            async with contextlib.aclosing(self.stream(ids, params, request_id, request)) as outputs:
                async for out in outputs:
                    delta = out.text[sent:]
                    sent = len(out.text)
                    if out.finished:
                        last = out
                        yield fmt.chat(0, delta or None, finish_reason=out.finish_reason,
                                       stop_reason=out.stop_reason)
                    elif delta:
                        yield fmt.chat(0, delta)
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                              usage=usage_of([last]), created=created))
        except Exception as e:  # noqa: BLE001 - the status line is already sent: report in-band
            yield error_event(e)
        yield SSE_DONE

