"""``POST /v1/completions``. vLLM: ``entrypoints/openai/serving_completion.py``.

A request may carry several prompts (a list of strings or of token-id lists): each becomes one engine
request and one choice (``index`` = its position); they run concurrently and, when streaming, their chunks
interleave in the order tokens are produced.
"""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator

from models.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, OpenAIError
from models.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkFormatter,
    OpenAIServing,
    error_event,
    merge_streams,
    sse,
    usage_of,
)


class OpenAIServingCompletion(OpenAIServing):
    """Handles text completions."""

    def prepare(self, request: CompletionRequest):
        """Validate and tokenize; returns ``[(prompt_token_ids, SamplingParams)]`` or raises OpenAIError."""
        self.check_model(request.model)
        request.check_supported()
        self.check_alive()
        prompts = request.prompts
        most = self.limits.max_prompts_per_request
        if len(prompts) > most:
            raise OpenAIError(f"Invalid value for 'prompt': {len(prompts)} prompts; this server accepts at most "
                              f"{most} per request (--max-prompts-per-request)", param="prompt")
        prepared = []
        for p in prompts:
            if isinstance(p, str):
                ids = self.encode(p, "prompt", add_special_tokens=True)
            else:
                ids = self.check_token_ids(p, "prompt")
            max_tokens = self.resolve_max_tokens(len(ids), request.max_tokens, "prompt")
            prepared.append((ids, self.sampling_params(request, max_tokens)))
        return prepared

    def streams(self, request: CompletionRequest, request_id: str, prepared):
        return [self.stream(ids, params, f"{request_id}-{i}", request)
                for i, (ids, params) in enumerate(prepared)]

    async def create_completion(self, request: CompletionRequest, request_id: str) -> CompletionResponse:
        """Non-streaming: wait for every prompt's result."""
        prepared = self.prepare(request)
        finals = [None] * len(prepared)
        streams = merge_streams(self.streams(request, request_id, prepared))
        async with contextlib.aclosing(streams) as merged:
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
        choices = [CompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason,
                                    stop_reason=o.stop_reason) for i, o in enumerate(finals)]
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage_of(finals))

    async def completion_stream(self, request: CompletionRequest, request_id: str,
                                prepared) -> AsyncIterator[str]:
        """Streaming: one ``text_completion`` chunk per new text (and one with the finish reason), then
        usage if ``stream_options.include_usage``, then ``[DONE]``."""
        sent = [0] * len(prepared)
        finals: list = [None] * len(prepared)
        created = int(time.time())
        fmt = ChunkFormatter(object_="text_completion", request_id=request_id, model=self.model_name,
                             created=created)
        try:
            streams = merge_streams(self.streams(request, request_id, prepared))
            async with contextlib.aclosing(streams) as merged:
                async for i, out in merged:
                    delta = out.text[sent[i]:]
                    sent[i] = len(out.text)
                    if not delta and not out.finished:
                        continue
                    if out.finished:
                        finals[i] = out
                    yield fmt.completion(i, delta, out.finish_reason, out.stop_reason)
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse(CompletionResponse(id=request_id, model=self.model_name, choices=[],
                                             usage=usage_of(finals), created=created))
        except Exception as e:  # noqa: BLE001 - the status line is already sent: report in-band
            yield error_event(e)
        yield SSE_DONE

