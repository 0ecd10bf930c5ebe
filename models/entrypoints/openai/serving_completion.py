"""``POST /v1/completions``. vLLM: ``entrypoints/openai/serving_completion.py``.

A request may carry several prompts (a list of strings or of token-id lists): each becomes one engine
request with ``n`` completions, and choice ``index = prompt_index * n + completion_index`` (vLLM's order).
The prompts run concurrently and, when streaming, their chunks interleave in the order tokens are produced.

``echo`` puts the prompt text before the completion; with ``logprobs`` the prompt's tokens come first in
``logprobs`` too (their log-probabilities from the engine's ``prompt_logprobs``; the first token has none).
``echo`` with ``max_tokens: 0`` is lm-eval's log-likelihood request: the engine generates one token, which is
dropped; the answer is the prompt and its logprobs, ``completion_tokens`` is 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import AsyncIterator

from jaxkv.sampling_params import SamplingParams
from models.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
    UsageInfo,
)
from models.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkFormatter,
    OpenAIServing,
    completion_logprobs,
    error_event,
    merge_streams,
    prompt_logprobs_json,
    sse,
)


@dataclasses.dataclass
class PreparedPrompt:
    """One prompt of a completions request, ready for the engine."""

    token_ids: list[int]
    params: SamplingParams
    text: str | None  # the prompt as text (for echo); None: decode token_ids when needed


class OpenAIServingCompletion(OpenAIServing):
    """Handles text completions."""

    def prepare(self, request: CompletionRequest) -> list[PreparedPrompt]:
        """Validate and tokenize every prompt.

        Raises:
            OpenAIError: 400 naming the field (values, lengths, limits), 404 for the model, 503 engine down.
        """
        self.check_model(request.model)
        request.check_supported()
        self.check_priority(request)
        self.check_alive()
        prompts = request.prompts
        most = self.limits.max_prompts_per_request
        if len(prompts) * request.n > most:
            field = "prompt" if len(prompts) > most else "n"
            raise OpenAIError(f"Invalid value for '{field}': {len(prompts)} prompts x n={request.n} completions; this "
                              f"server accepts at most {most} per request (--max-prompts-per-request)", param=field)
        structured = request.structured_outputs_params()
        echo_only = request.echo and request.max_tokens == 0
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs  # vLLM: echo's prompt logprobs come from `logprobs`
        truncating = request.truncate_prompt_tokens is not None
        prepared = []
        for p in prompts:
            if isinstance(p, str):
                ids = self.encode(p, "prompt", add_special_tokens=request.add_special_tokens, truncating=truncating)
                text = p
            else:
                ids, text = self.check_token_ids(p, "prompt"), None
            if truncating:
                cut = self.truncate(ids, request)
                text, ids = (text if len(cut) == len(ids) else None), cut
            # echo_only: the engine generates one token, which is dropped (vLLM)
            max_tokens = self.resolve_max_tokens(len(ids), 1 if echo_only else request.max_tokens, "prompt")
            params = self.sampling_params(request, max_tokens, logprobs=request.logprobs,
                                          prompt_logprobs=prompt_logprobs, structured_outputs=structured)
            prepared.append(PreparedPrompt(ids, params, text))
        return prepared

    def _prompt_text(self, p: PreparedPrompt) -> str:
        if p.text is None:
            p.text = self.tokenizer.decode(p.token_ids, skip_special_tokens=False)
        return p.text

    def _streams(self, request: CompletionRequest, request_id: str, prepared: list[PreparedPrompt]):
        return [self.stream(p.token_ids, p.params, f"{request_id}-{i}", request.priority)
                for i, p in enumerate(prepared)]

    def _trackers(self, request: CompletionRequest, prepared: list[PreparedPrompt]):
        if self.metrics is None:
            return None
        return [self.metrics.track(len(p.token_ids), request.n, p.params.max_tokens) for p in prepared]

    async def create_completion(self, request: CompletionRequest, request_id: str,
                                prepared: list[PreparedPrompt] | None = None) -> CompletionResponse:
        """Non-streaming: wait for every prompt's completions. vLLM: ``create_completion`` +
        ``request_output_to_completion_response``."""
        prepared = self.prepare(request) if prepared is None else prepared
        n = request.n
        finals: list[list] = [[None] * n for _ in prepared]
        trackers = self._trackers(request, prepared)
        try:
            async with contextlib.aclosing(merge_streams(self._streams(request, request_id, prepared))) as merged:
                async for i, out in merged:
                    if trackers is not None:
                        trackers[i].on_output(out)
                    if out.finished:
                        finals[i][out.index] = out
        finally:
            for t in trackers or ():
                t.finish()
        echo_only = request.echo and request.max_tokens == 0
        want_prompt_lp = request.prompt_logprobs is not None or (request.echo and request.logprobs is not None)
        choices = []
        prompt_tokens = completion_tokens = 0
        for p, outs in zip(prepared, finals):
            prompt_tokens += len(p.token_ids)
            for out in outs:
                token_ids, lps = out.token_ids, out.logprobs
                text = out.text
                if request.echo:
                    prompt_lps = out.prompt_logprobs or [None] * len(p.token_ids)
                    if echo_only:
                        token_ids, lps, text = p.token_ids, prompt_lps, self._prompt_text(p)
                    else:
                        token_ids = [*p.token_ids, *out.token_ids]
                        lps = None if out.logprobs is None else [*prompt_lps, *out.logprobs]
                        text = self._prompt_text(p) + out.text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = CompletionLogProbs(**completion_logprobs(token_ids, lps or [None] * len(token_ids),
                                                                        request.logprobs, self.token_text))
                completion_tokens += 0 if echo_only else len(out.token_ids)
                choices.append(CompletionChoice(
                    index=len(choices), text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if want_prompt_lp else None))
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=UsageInfo.of(prompt_tokens, completion_tokens))

    async def completion_stream(self, request: CompletionRequest, request_id: str,
                                prepared: list[PreparedPrompt]) -> AsyncIterator[str]:
        """Streaming: one ``text_completion`` chunk per new text (and one with the finish reason), then
        usage if ``stream_options.include_usage``, then ``[DONE]``. With ``logprobs`` a chunk carries the
        logprobs of the tokens it adds; with ``echo`` a choice's first chunk carries the prompt."""
        n = request.n
        num = len(prepared) * n
        sent = [0] * num  # characters of out.text sent, per choice
        sent_tokens = [0] * num
        offsets = [0] * num  # text_offset of the next token (logprobs)
        finished = [False] * num
        generated = [0] * num
        created = int(time.time())
        fmt = ChunkFormatter(object_="text_completion", request_id=request_id, model=self.model_name,
                             created=created)
        want_lp = request.logprobs is not None
        echo_only = request.echo and request.max_tokens == 0
        echoed = [not request.echo] * num
        trackers = self._trackers(request, prepared)
        try:
            async with contextlib.aclosing(merge_streams(self._streams(request, request_id, prepared))) as merged:
                async for i, out in merged:
                    if trackers is not None:
                        trackers[i].on_output(out)
                    c = i * n + out.index
                    if finished[c]:
                        continue
                    finished[c] = out.finished
                    if not want_lp and echoed[c]:  # the common case: text only
                        delta = out.text[sent[c]:]
                        sent[c] = len(out.text)
                        if delta or out.finished:
                            yield fmt.completion(c, delta, out.finish_reason, out.stop_reason)
                        generated[c] = len(out.token_ids)
                        continue
                    text, token_ids, lps = "", [], []
                    if not echoed[c]:
                        p = prepared[i]
                        echoed[c] = True
                        text, token_ids = self._prompt_text(p), list(p.token_ids)
                        lps = list(out.prompt_logprobs or [None] * len(p.token_ids))
                    if not echo_only:
                        text += out.text[sent[c]:]
                        sent[c] = len(out.text)
                        token_ids += out.token_ids[sent_tokens[c]:]
                        lps += (out.logprobs or [])[sent_tokens[c]:]
                        sent_tokens[c] = len(out.token_ids)
                        generated[c] = len(out.token_ids)
                    if not text and not token_ids and not out.finished:
                        continue
                    logprobs = None
                    if want_lp:
                        logprobs = completion_logprobs(token_ids, lps + [None] * (len(token_ids) - len(lps)),
                                                       request.logprobs, self.token_text, offsets[c])
                        offsets[c] += len(text)
                    yield fmt.completion(c, text, out.finish_reason if out.finished else None,
                                         out.stop_reason if out.finished else None, logprobs)
            if request.stream_options is not None and request.stream_options.include_usage:
                usage = UsageInfo.of(sum(len(p.token_ids) for p in prepared), sum(generated))
                yield sse(CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage,
                                             created=created))
        except Exception as e:  # noqa: BLE001 - the status line is already sent: report in-band
            yield error_event(e)
        finally:
            for t in trackers or ():
                t.finish()
        yield SSE_DONE
