"""What the completion and chat handlers share: model check, length check, sampling params, logprobs in
OpenAI's formats, SSE framing.

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
from models.entrypoints.async_llm import AsyncLLM, EngineDeadError, StreamOutput, truncate_prompt
from models.entrypoints.openai.limits import ServerLimits, check_stop
from models.entrypoints.openai.protocol import OpenAIError, UsageInfo, _SamplingFields
from models.entrypoints.output_processor import token_text

_FIELD_IN_MESSAGE = re.compile(r"^\s*'?([a-z_]+)'?\s*[=\[]")
LOGPROB_FLOOR = -9999.0  # OpenAI's JSON-safe stand-in for -inf (vLLM clamps the same way)


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
        metrics: the server's :class:`~models.entrypoints.openai.metrics.ServerMetrics` (``None``: none).
    """

    def __init__(self, async_llm: AsyncLLM, tokenizer, *, served_model_names: Sequence[str],
                 max_model_len: int, default_stop_token_ids: Sequence[int] = (),
                 limits: ServerLimits | None = None, metrics=None):
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.async_llm = async_llm
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names)
        self.max_model_len = int(max_model_len)
        self.default_stop_token_ids = tuple(int(t) for t in default_stop_token_ids)
        self.limits = limits or ServerLimits()
        self.metrics = metrics

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

    def encode(self, text: str, field: str, *, add_special_tokens: bool, truncating: bool = False) -> list[int]:
        """Tokenize a prompt (``add_special_tokens``: BOS as the GGUF asks, as ``LLM.generate`` does for
        completions; chat templates carry their own); 400 (context length) for text that cannot fit,
        before tokenizing it all (unless ``truncating``: ``truncate_prompt_tokens`` keeps its end)."""
        # A token covers at most a few dozen characters: text far longer than that cannot fit.
        if not truncating and len(text) > 64 * self.max_model_len:
            raise self.too_long(field, None)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_token_ids(self, ids: Sequence[int], field: str) -> list[int]:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Invalid value for '{field}': token ids {bad[:4]} are outside [0, {vocab})",
                              param=field)
        return list(ids)

    def truncate(self, ids: list[int], request: _SamplingFields) -> list[int]:
        """The prompt after ``truncate_prompt_tokens`` (vLLM keeps the last tokens; ``-1``: the last
        ``max_model_len``). The engine front end (``AsyncLLM``) truncates the same way; doing it here too
        makes the length checks, ``usage`` and ``echo`` see the prompt the model sees."""
        return truncate_prompt(ids, request.truncate_prompt_tokens, self.max_model_len)

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

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        vocab = self.tokenizer.vocab_size
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise OpenAIError(f"Invalid value for 'logit_bias': key {key!r} is not a token id",
                                  param="logit_bias") from None
            if not 0 <= token < vocab:
                raise OpenAIError(f"Invalid value for 'logit_bias': token id {token} is outside [0, {vocab})",
                                  param="logit_bias")
            out[token] = value
        return out

    def sampling_params(self, request: _SamplingFields, max_tokens: int, *, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, structured_outputs=None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        """The engine's :class:`SamplingParams` for a request. Unset fields take the checkpoint's
        ``generation_config.json`` defaults (vLLM ``--generation-config auto``), else OpenAI's (temperature 1,
        top_p 1). vLLM: ``CompletionRequest.to_sampling_params`` / ``ChatCompletionRequest.to_sampling_params``.

        Raises:
            OpenAIError: 400 naming the field for a value out of range, token ids outside the vocabulary,
                or past the server's stop limits.
        """
        check_stop(request.stop_strings, request.stop_token_ids, self.limits)
        stop_ids = list(request.stop_token_ids or ())
        if stop_ids:
            self.check_token_ids(stop_ids, "stop_token_ids")
        if request.allowed_token_ids:
            self.check_token_ids(request.allowed_token_ids, "allowed_token_ids")
        if not request.ignore_eos:
            stop_ids += [t for t in self.default_stop_token_ids if t not in stop_ids]
        gen = getattr(self.tokenizer, "generation_config", None) or {}

        def pick(name: str, default):
            value = getattr(request, name)
            return gen.get(name, default) if value is None else value

        top_k = pick("top_k", -1)
        kwargs: dict[str, Any] = dict(
            n=request.n, max_tokens=max_tokens, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=-1 if top_k in (None, 0) else top_k, min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=request.presence_penalty or 0.0, frequency_penalty=request.frequency_penalty or 0.0,
            seed=request.seed, stop=request.stop_strings, stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=request.include_stop_str_in_output, ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            truncate_prompt_tokens=request.truncate_prompt_tokens, logit_bias=self._logit_bias(request.logit_bias),
            allowed_token_ids=request.allowed_token_ids, bad_words=tuple(request.bad_words or ()),
            structured_outputs=structured_outputs)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            m = _FIELD_IN_MESSAGE.match(str(e))
            param = m.group(1) if m and m.group(1) in kwargs else None
            raise OpenAIError(f"Invalid request: {e}", param=param) from None

    def stream(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
               ) -> AsyncIterator[StreamOutput]:
        """The engine's outputs of one request (:meth:`AsyncLLM.generate`)."""
        return self.async_llm.generate(prompt_token_ids, params, request_id, priority=priority)

    def check_priority(self, request: _SamplingFields) -> int:
        """``request.priority``, which needs an engine started with ``--scheduling-policy priority`` unless it is 0
        (vLLM's rule).

        Raises:
            OpenAIError: 400 naming ``priority``.
        """
        policy = getattr(self.async_llm, "scheduling_policy", "fcfs")
        if request.priority and policy != "priority":
            raise OpenAIError(f"Invalid value for 'priority': {request.priority} needs a server started with "
                              f"--scheduling-policy priority (this one's is {policy!r})", param="priority")
        return request.priority

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included; cached per tokenizer)."""
        return token_text(self.tokenizer, token_id)


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


# ------------------------------------------------------------------------------------------- logprobs

def _clamp(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf and NaN-free for JSON


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict | None], num_top: int,
                        token_text, initial_text_offset: int = 0) -> dict[str, list]:
    """OpenAI's completions ``logprobs`` object for consecutive tokens. vLLM:
    ``OpenAIServingCompletion._create_completion_logprobs``.

    Args:
        token_ids: ``[num_tokens]`` the tokens (prompt tokens for ``echo``, then generated ones).
        logprobs: per token, ``{token_id: Logprob}`` (the token itself first, then the top ones by rank)
            or ``None`` (the prompt's first token: nothing predicts it).
        num_top: the request's ``logprobs``: ``top_logprobs[i]`` holds the token itself and the
            ``num_top`` most likely ones (``num_top + 1`` entries at most, as OpenAI documents).
        token_text: ``token_id -> str`` for a token without a ``Logprob`` (or one without ``decoded_token``).
        initial_text_offset: ``text_offset`` of the first token (the text already sent, when streaming).

    Returns:
        ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}`` (lists of ``num_tokens``).
    """
    offsets, token_lps, tokens, tops = [], [], [], []
    offset = initial_text_offset
    for tok, d in zip(token_ids, logprobs):
        if d is None:
            text = token_text(tok)
            token_lps.append(None)
            tops.append(None)
        else:
            lp = d[tok]
            text = lp.decoded_token if lp.decoded_token is not None else token_text(tok)
            token_lps.append(_clamp(lp.logprob))
            top: dict[str, float] = {}
            for i, (t, p) in enumerate(d.items()):
                if i > num_top and num_top >= 0:
                    break
                top[p.decoded_token if p.decoded_token is not None else token_text(t)] = _clamp(p.logprob)
            tops.append(top)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict], top_logprobs: int | None,
                  token_text) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content``: per token ``{token, logprob, bytes, top_logprobs}``, where
    ``top_logprobs`` lists the ``top_logprobs`` most likely tokens by rank (``-1``: every one returned).
    vLLM: ``OpenAIServingChat._create_chat_logprobs``.

    Args:
        token_ids: ``[num_tokens]`` generated tokens.
        logprobs: per token, ``{token_id: Logprob}``.
        top_logprobs: the request's ``top_logprobs`` (``None`` = 0).
        token_text: ``token_id -> str`` for a ``Logprob`` without ``decoded_token``.
    """
    k = top_logprobs or 0
    out = []
    for tok, d in zip(token_ids, logprobs):
        lp = d[tok]
        text = lp.decoded_token if lp.decoded_token is not None else token_text(tok)
        tops = []
        if k:
            ranked = sorted(d.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
            for t, p in ranked if k < 0 else ranked[:k]:
                s = p.decoded_token if p.decoded_token is not None else token_text(t)
                tops.append({"token": s, "logprob": _clamp(p.logprob), "bytes": list(s.encode("utf-8", "replace"))})
        out.append({"token": text, "logprob": _clamp(lp.logprob), "bytes": list(text.encode("utf-8", "replace")),
                    "top_logprobs": tops})
    return out


def prompt_logprobs_json(prompt_logprobs) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` response field: ``None`` for the first prompt token, then
    ``{"<token_id>": {"logprob", "rank", "decoded_token"}}`` per position."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": _clamp(p.logprob), "rank": p.rank,
                                             "decoded_token": p.decoded_token} for t, p in d.items()}
            for d in prompt_logprobs]


# ------------------------------------------------------------------------------------------ streaming

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
    per-token hot path: a request without logprobs pays nothing for them (``logprobs`` stays ``null``).
    """

    def __init__(self, *, object_: str, request_id: str, model: str, created: int):
        self._head = ('data: {"id":' + json.dumps(request_id) + ',"object":' + json.dumps(object_)
                      + f',"created":{created},"model":' + json.dumps(model) + ',"choices":[{"index":')

    def completion(self, index: int, text: str, finish_reason=None, stop_reason=None, logprobs=None) -> str:
        lp = "null" if logprobs is None else json.dumps(logprobs)
        return (f'{self._head}{index},"text":{json.dumps(text)},"logprobs":{lp},"finish_reason":'
                f'{json.dumps(finish_reason)},"stop_reason":{json.dumps(stop_reason)}}}]}}\n\n')

    def chat(self, index: int, content: str | None, *, role: str | None = None, finish_reason=None,
             stop_reason=None, logprobs=None, tool_calls=None) -> str:
        delta: dict[str, Any] = {} if role is None else {"role": role}
        if content is not None:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        lp = "null" if logprobs is None else '{"content":' + json.dumps(logprobs) + "}"
        return (f'{self._head}{index},"delta":{json.dumps(delta)},"logprobs":{lp},"finish_reason":'
                f'{json.dumps(finish_reason)},"stop_reason":{json.dumps(stop_reason)}}}]}}\n\n')


def engine_error(e: ValueError) -> OpenAIError:
    """The 400 for a request the engine refused (``ValueError("field=value ...")``), naming the field when the
    message starts with one of the request's fields (``"n=3 is not supported by this engine yet"``)."""
    from models.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    m = _FIELD_IN_MESSAGE.match(str(e))
    param = m.group(1) if m and (m.group(1) in CompletionRequest.model_fields
                                 or m.group(1) in ChatCompletionRequest.model_fields) else None
    code = "unsupported_parameter" if "not supported" in str(e) else "invalid_value"
    return OpenAIError(f"Invalid request: {e}", param=param, code=code)


def error_event(e: BaseException) -> str:
    """An error met after the stream started: OpenAI's error JSON as one event."""
    if isinstance(e, OpenAIError):
        return sse(e.to_dict())
    if isinstance(e, ValueError):
        return sse(engine_error(e).to_dict())
    if isinstance(e, EngineDeadError):
        return sse(OpenAIError(str(e), status_code=503, code="engine_dead").to_dict())
    return sse(OpenAIError(f"internal error: {e!r}", status_code=500, code="internal_error").to_dict())


def usage_of(outputs: Sequence[StreamOutput]) -> UsageInfo:
    """``usage`` of one engine request per output (prompt counted once per output)."""
    return UsageInfo.of(sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.token_ids) for o in outputs))
