"""What the completion and chat handlers share: model check, length check, sampling params, SSE framing.

vLLM: ``entrypoints/openai/serving_engine.py`` (``OpenAIServing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any, AsyncIterator, Sequence

from pydantic import BaseModel

from jaxkv.sampling_params import SamplingParams
from models.entrypoints.async_llm import AsyncLLM, EngineDeadError, StreamOutput
from models.entrypoints.openai.limits import ServerLimits, check_stop
from models.entrypoints.openai.protocol import OpenAIError, UsageInfo, _SamplingFields

_FIELD_IN_MESSAGE = re.compile(r"^\s*'?([a-z_]+)'?\s*=")


class OpenAIServing:
    """Shared state of the OpenAI handlers.

    Args:
        async_llm: the running engine (``generate``, ``is_running``: :class:`AsyncLLM` or the drain's
            :class:`~models.entrypoints.openai.drain.AbortingEngine` around it).
        tokenizer: :class:`models.GGUFTokenizer` (``encode``, ``decode``, ``apply_chat_template``,
            ``vocab_size``).
        served_model_names: names the ``model`` field may take (the first is reported in responses).
        max_model_len: longest prompt + completion, in tokens.
        default_stop_token_ids: ids that end every request unless ``ignore_eos`` (EOS, ``<|im_end|>``);
            the same set ``LLM.generate`` uses, so the server's greedy output equals the offline one.
        limits: the server's input limits (stop strings, prompts per request).
    """

    def __init__(self, async_llm: AsyncLLM, tokenizer, *, served_model_names: Sequence[str],
                 max_model_len: int, default_stop_token_ids: Sequence[int] = (),
                 limits: ServerLimits | None = None):
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.async_llm = async_llm
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names)
        self.max_model_len = int(max_model_len)
        self.default_stop_token_ids = tuple(int(t) for t in default_stop_token_ids)
        self.limits = limits or ServerLimits()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (``None`` means the default)."""
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", status_code=404, param="model",
                              code="model_not_found")

    def check_alive(self) -> None:
        if not self.async_llm.is_running:
            raise OpenAIError("The engine is not running (see the server log).", status_code=503,
                              code="engine_dead")
        if not getattr(self.async_llm, "is_ready", True):
            raise OpenAIError("The engine is starting (loading weights, compiling); retry shortly.",
                              status_code=503, code="engine_not_ready")

    def encode(self, text: str, field: str, *, add_special_tokens: bool) -> list[int]:
        """Tokenize a prompt (``add_special_tokens``: BOS as the GGUF asks, as ``LLM.generate`` does for
        completions; chat templates carry their own); 400 (context length) for text that cannot fit,
        before tokenizing it all."""
        # A token covers at most a few dozen characters: text far longer than that cannot fit.
        if len(text) > 64 * self.max_model_len:
            raise self.too_long(field, None)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_token_ids(self, ids: Sequence[int], field: str) -> list[int]:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Invalid value for '{field}': token ids {bad[:4]} are outside [0, {vocab})",
                              param=field)
        return list(ids)

    def too_long(self, field: str, num_tokens: int | None) -> OpenAIError:
        got = "" if num_tokens is None else f" However, your {field} has {num_tokens} tokens."
        return OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens.{got} "
                           f"Please reduce the length of '{field}'.", param=field,
                           code="context_length_exceeded")

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, prompt_field: str,
                           max_tokens_field: str = "max_tokens") -> int:
        """``max_tokens`` checked against ``max_model_len`` (``None``: all the room left)."""
        if prompt_len == 0:
            raise OpenAIError(f"Invalid value for '{prompt_field}': the prompt is empty", param=prompt_field)
        if prompt_len >= self.max_model_len:
            raise self.too_long(prompt_field, prompt_len)
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in '{prompt_field}', {max_tokens} in "
                f"'{max_tokens_field}'). Please reduce the length of '{prompt_field}' or "
                f"'{max_tokens_field}'.", param=max_tokens_field, code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, request: _SamplingFields, max_tokens: int) -> SamplingParams:
        """The engine's :class:`SamplingParams` for a request (OpenAI defaults: temperature 1, top_p 1)."""
        check_stop(request.stop_strings, request.stop_token_ids, self.limits)
        stop_ids = list(request.stop_token_ids or ())
        if stop_ids:
            self.check_token_ids(stop_ids, "stop_token_ids")
        if not request.ignore_eos:
            stop_ids += [t for t in self.default_stop_token_ids if t not in stop_ids]
        # unset fields: the checkpoint's generation_config.json defaults (vLLM --generation-config auto), else OpenAI's
        gen = getattr(self.tokenizer, "generation_config", None) or {}
        top_k = request.top_k if request.top_k is not None else gen.get("top_k")
        top_k = top_k if top_k not in (None, 0) else -1
        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=gen.get("temperature", 1.0) if request.temperature is None else request.temperature,
            top_p=gen.get("top_p", 1.0) if request.top_p is None else request.top_p, top_k=top_k, seed=request.seed,
            stop_token_ids=tuple(stop_ids), ignore_eos=request.ignore_eos, min_tokens=request.min_tokens)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            m = _FIELD_IN_MESSAGE.match(str(e))
            param = m.group(1) if m and m.group(1) in kwargs else None
            raise OpenAIError(f"Invalid request: {e}", param=param) from None

    def stream(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
               request: _SamplingFields) -> AsyncIterator[StreamOutput]:
        return self.async_llm.generate(prompt_token_ids, params, request_id, stop=request.stop_strings,
                                       skip_special_tokens=request.skip_special_tokens)


async def final_output(gen: AsyncIterator[StreamOutput]) -> StreamOutput:
    """Run a request to its end; return its last output (the generator is closed in any case)."""
    last = None
    async with contextlib.aclosing(gen):
        async for out in gen:
            last = out
    if last is None:  # pragma: no cover - a stream always ends with a finished output
        raise OpenAIError("request produced no output", status_code=500, code="internal_error")
    return last


async def merge_streams(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as ``(index, item)`` in arrival order; closing the merged
    iterator closes (and so aborts) every stream still open."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, it):
        try:
            async with contextlib.aclosing(it):
                async for item in it:
                    await q.put((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))
            raise
        finally:
            await q.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                if isinstance(item, asyncio.CancelledError):
                    continue
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event: ``data: {json}\\n\\n``."""
    body = payload.model_dump_json(exclude_unset=False) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChunkFormatter:
    """Streaming chunks of one response as SSE events, without a pydantic model per token.

    The part of every chunk that does not change (id, object, created, model) is rendered once; a chunk
    is that head plus ``json.dumps`` of the changing fields. The result is the JSON the pydantic models
    (:class:`CompletionResponse`, :class:`ChatCompletionChunk`) would give; tests parse it with the
    official client. Streaming costs one chunk per engine step per request, so this is the server's
    per-token hot path.
    """

    def __init__(self, *, object_: str, request_id: str, model: str, created: int):
        self._head = ('data: {"id":' + json.dumps(request_id) + ',"object":' + json.dumps(object_)
                      + f',"created":{created},"model":' + json.dumps(model) + ',"choices":[{"index":')

    def completion(self, index: int, text: str, finish_reason=None, stop_reason=None) -> str:
        return (f'{self._head}{index},"text":{json.dumps(text)},"logprobs":null,"finish_reason":'
                f'{json.dumps(finish_reason)},"stop_reason":{json.dumps(stop_reason)}}}]}}\n\n')

    def chat(self, index: int, content: str | None, *, role: str | None = None, finish_reason=None,
             stop_reason=None) -> str:
        delta = {} if role is None else {"role": role}
        if content is not None:
            delta["content"] = content
        return (f'{self._head}{index},"delta":{json.dumps(delta)},"logprobs":null,"finish_reason":'
                f'{json.dumps(finish_reason)},"stop_reason":{json.dumps(stop_reason)}}}]}}\n\n')


def error_event(e: BaseException) -> str:
    """An error met after the stream started: OpenAI's error JSON as one event."""
    if isinstance(e, OpenAIError):
        return sse(e.to_dict())
    if isinstance(e, ValueError):
        return sse(OpenAIError(str(e)).to_dict())
    if isinstance(e, EngineDeadError):
        return sse(OpenAIError(str(e), status_code=503, code="engine_dead").to_dict())
    return sse(OpenAIError(f"internal error: {e!r}", status_code=500, code="internal_error").to_dict())


def usage_of(outputs: Sequence[StreamOutput]) -> UsageInfo:
    return UsageInfo.of(sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.token_ids) for o in outputs))
