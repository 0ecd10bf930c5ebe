"""``POST /v1/chat/completions``. vLLM: ``entrypoints/openai/serving_chat.py``.

The conversation is rendered with the model's own chat template (:mod:`.chat_utils`) and tokenized
without adding special tokens (the template has them; ``add_special_tokens`` changes that).
``max_tokens`` / ``max_completion_tokens`` default to all the room left in ``max_model_len``.

One engine request with ``n`` completions; choice ``index`` is the completion's. The response role is
``assistant``, or the last message's role when ``add_generation_prompt`` is false; ``echo`` puts the last
message's content before each choice's when that message has the response role (vLLM).

Tools (:mod:`.tool_parsers`): the definitions go to the template (``tools``); ``tool_choice``:

* ``"none"``: the output is content;
* ``"auto"`` (the default with tools): needs ``--enable-auto-tool-choice --tool-call-parser NAME``; the
  output is parsed in that format: ``tool_calls`` and ``finish_reason: "tool_calls"`` when it holds calls;
* ``"required"``: the output is held (``structured_outputs``) to a JSON array of ``{"name", "parameters"}``
  objects, returned as ``tool_calls`` with ``finish_reason: "tool_calls"``;
* ``{"type": "function", "function": {"name": ...}}``: the output is held to that function's parameters
  schema and returned as its one tool call; ``finish_reason`` stays ``"stop"`` (OpenAI's and vLLM's rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, AsyncIterator

from jaxkv.sampling_params import SamplingParams
from models.entrypoints.openai.chat_utils import render_chat
from models.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatMessageOut,
    FunctionCall,
    OpenAIError,
    ToolCall,
    UsageInfo,
)
from models.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkFormatter,
    OpenAIServing,
    chat_logprobs,
    error_event,
    prompt_logprobs_json,
    sse,
)
from models.entrypoints.openai.tool_parsers import (
    RequiredToolChoiceParser,
    ToolCallStreamer,
    ToolParser,
    make_tool_call_id,
)


@dataclasses.dataclass
class PreparedChat:
    """A chat request ready for the engine."""

    token_ids: list[int]
    params: SamplingParams
    role: str
    echo: str  # what echo puts before each choice's content ("" for nothing)
    tool_mode: str | None  # None (content), "auto", "required" or "named"
    parser: type[ToolParser] | None  # the format of "auto" (and RequiredToolChoiceParser for "required")
    function_name: str | None  # the named function
    strip_stop_text: bool  # special tokens are detokenized for the parser: drop a final stop token's text


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions.

    Args:
        enable_auto_tools: ``--enable-auto-tool-choice``: ``tool_choice: "auto"`` is served.
        tool_parser: the ``--tool-call-parser`` class (``None``: none).
        (the rest: :class:`OpenAIServing`'s)
    """

    def __init__(self, *args, enable_auto_tools: bool = False, tool_parser: type[ToolParser] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = tool_parser

    def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """Validate, render the template, tokenize.

        Raises:
            OpenAIError: 400 naming the field, 404 for the model, 503 when the engine is down.
        """
        self.check_model(request.model)
        request.check_supported()
        self.check_priority(request)
        if request.n > self.limits.max_prompts_per_request:
            raise OpenAIError(f"Invalid value for 'n': {request.n} completions; this server accepts at most "
                              f"{self.limits.max_prompts_per_request} per request (--max-prompts-per-request)",
                              param="n")
        choice = request.effective_tool_choice
        tool_mode, parser, function_name = None, None, None
        if choice == "auto":
            if not (self.enable_auto_tools and self.tool_parser is not None):
                raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                  'be set', param="tool_choice")
            tool_mode, parser = "auto", self.tool_parser
        elif choice == "required":
            tool_mode, parser = "required", RequiredToolChoiceParser
        elif isinstance(choice, ChatCompletionNamedToolChoiceParam):
            tool_mode, function_name = "named", choice.function.name
        self.check_alive()
        tools = None if request.tools is None else [t.model_dump(exclude_none=True) for t in request.tools]
        text = render_chat(self.tokenizer, request.messages, add_generation_prompt=request.add_generation_prompt,
                           continue_final_message=request.continue_final_message, tools=tools,
                           chat_template_kwargs=request.chat_template_kwargs)
        ids = self.encode(text, "messages", add_special_tokens=request.add_special_tokens,
                          truncating=request.truncate_prompt_tokens is not None)
        ids = self.truncate(ids, request)
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(ids), request.requested_max_tokens, "messages", field)
        skip = request.skip_special_tokens
        if tool_mode == "auto":
            skip = parser.adjust_skip_special_tokens(skip)
        params = self.sampling_params(
            request, max_tokens, logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs, structured_outputs=request.structured_outputs_params(),
            skip_special_tokens=skip)
        role = "assistant" if request.add_generation_prompt else request.messages[-1].role
        last = request.messages[-1]
        echo = last.text() if request.echo and last.role == role else ""
        return PreparedChat(ids, params, role, echo, tool_mode, parser, function_name,
                            strip_stop_text=not skip and request.skip_special_tokens)

    def _final_text(self, out, prep: PreparedChat) -> str:
        """The completion's text; without the text of the stop token that ended it when special tokens were
        detokenized only for the tool parser."""
        text = out.text
        if prep.strip_stop_text and out.finished and out.finish_reason == "stop" and out.token_ids:
            last = out.token_ids[-1]
            if last in self.default_stop_token_ids or last == out.stop_reason:
                s = self.token_text(last)
                if s and text.endswith(s):
                    text = text[:-len(s)]
        return text

    def _track(self, request: ChatCompletionRequest, prep: PreparedChat):
        return None if self.metrics is None else self.metrics.track(len(prep.token_ids), request.n,
                                                                   prep.params.max_tokens)

    async def create_chat_completion(self, request: ChatCompletionRequest, request_id: str,
                                     prep: PreparedChat | None = None) -> ChatCompletionResponse:
        """Non-streaming. vLLM: ``chat_completion_full_generator``."""
        prep = self.prepare(request) if prep is None else prep
        finals: list = [None] * request.n
        tracker = self._track(request, prep)
        try:
            stream = self.stream(prep.token_ids, prep.params, request_id, request.priority)
            async with contextlib.aclosing(stream) as outputs:
                async for out in outputs:
                    if tracker is not None:
                        tracker.on_output(out)
                    if out.finished:
                        finals[out.index] = out
        finally:
            if tracker is not None:
                tracker.finish()
        choices = []
        for out in finals:
            text = self._final_text(out, prep)
            content: str | None = text
            calls: list[tuple[str, str, str]] = []
            finish = out.finish_reason
            if prep.tool_mode == "named":
                content, calls = "", [(make_tool_call_id(), prep.function_name, text)]
            elif prep.tool_mode is not None:
                content, calls = prep.parser(request.tools).extract(text)
                if calls and prep.tool_mode == "required":
                    content = content or ""
                if calls and (prep.tool_mode == "auto" or finish == "stop"):
                    finish = "tool_calls"
            if request.parallel_tool_calls is False:
                calls = calls[:1]
            if prep.echo:
                content = prep.echo + (content or "")
            logprobs = None
            if request.logprobs:
                logprobs = ChatLogProbs(content=chat_logprobs(out.token_ids, out.logprobs or [],
                                                              request.top_logprobs, self.token_text))
            message = ChatMessageOut(role=prep.role, content=content, tool_calls=[
                ToolCall(id=i, function=FunctionCall(name=name, arguments=args)) for i, name, args in calls])
            choices.append(ChatChoice(index=out.index, message=message, logprobs=logprobs, finish_reason=finish,
                                      stop_reason=out.stop_reason))
        usage = UsageInfo.of(len(prep.token_ids), sum(len(o.token_ids) for o in finals))
        prompt_lps = prompt_logprobs_json(finals[0].prompt_logprobs) if request.prompt_logprobs is not None else None
        return ChatCompletionResponse(id=request_id, model=self.model_name, usage=usage, choices=choices,
                                      prompt_logprobs=prompt_lps)

    async def chat_completion_stream(self, request: ChatCompletionRequest, request_id: str,
                                     prep: PreparedChat) -> AsyncIterator[str]:
        """First a ``delta.role`` chunk per choice (and, with ``echo``, one with the echoed content); then
        content / ``tool_calls`` deltas (with ``logprobs`` when asked); each choice's last chunk with its
        ``finish_reason``; a usage chunk if asked; ``[DONE]``. vLLM: ``chat_completion_stream_generator``."""
        n = request.n
        created = int(time.time())
        fmt = ChunkFormatter(object_="chat.completion.chunk", request_id=request_id, model=self.model_name,
                             created=created)
        sent = [0] * n
        sent_tokens = [0] * n
        generated = [0] * n
        done = [False] * n
        streamers: list[ToolCallStreamer | None] = [None] * n
        named_started = [False] * n
        max_calls = 1 if request.parallel_tool_calls is False else None
        if prep.tool_mode in ("auto", "required"):
            streamers = [ToolCallStreamer(prep.parser(request.tools), max_calls) for _ in range(n)]
        plain = prep.tool_mode is None and not request.logprobs and not prep.strip_stop_text
        tracker = self._track(request, prep)
        try:
            for i in range(n):
                yield fmt.chat(i, "", role=prep.role)
            if prep.echo:
                for i in range(n):
                    yield fmt.chat(i, prep.echo)
            stream = self.stream(prep.token_ids, prep.params, request_id, request.priority)
            async with contextlib.aclosing(stream) as outputs:
                async for out in outputs:
                    if tracker is not None:
                        tracker.on_output(out)
                    i = out.index
                    if done[i]:
                        continue
                    done[i] = out.finished
                    generated[i] = len(out.token_ids)
                    if plain:  # the common case: content only
                        delta = out.text[sent[i]:]
                        sent[i] = len(out.text)
                        if out.finished:
                            yield fmt.chat(i, delta or None, finish_reason=out.finish_reason,
                                           stop_reason=out.stop_reason)
                        elif delta:
                            yield fmt.chat(i, delta)
                        continue
                    yield_ = self._chunk(fmt, request, prep, out, i, sent, sent_tokens, streamers, named_started)
                    if yield_ is not None:
                        yield yield_
            if request.stream_options is not None and request.stream_options.include_usage:
                usage = UsageInfo.of(len(prep.token_ids), sum(generated))
                yield sse(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[], usage=usage,
                                              created=created))
        except Exception as e:  # noqa: BLE001 - the status line is already sent: report in-band
            yield error_event(e)
        finally:
            if tracker is not None:
                tracker.finish()
        yield SSE_DONE

    def _chunk(self, fmt: ChunkFormatter, request: ChatCompletionRequest, prep: PreparedChat, out, i: int,
               sent: list[int], sent_tokens: list[int], streamers, named_started) -> str | None:
        """The chunk of one output of a choice with logprobs or tools (``None``: nothing to send yet)."""
        text = self._final_text(out, prep)
        delta_text = text[sent[i]:]
        sent[i] = len(text)
        content: str | None = delta_text or None
        tool_calls: list[dict[str, Any]] = []
        streamer = streamers[i]
        if streamer is not None:
            content, tool_calls = streamer.update(text, out.finished)
        elif prep.tool_mode == "named":
            content = None
            if delta_text or (out.finished and not named_started[i]):
                if named_started[i]:
                    tool_calls = [{"index": 0, "function": {"arguments": delta_text}}]
                else:
                    named_started[i] = True
                    tool_calls = [{"index": 0, "id": make_tool_call_id(), "type": "function",
                                   "function": {"name": prep.function_name, "arguments": delta_text}}]
        logprobs = None
        if request.logprobs:
            new = out.token_ids[sent_tokens[i]:]
            if new:
                logprobs = chat_logprobs(new, (out.logprobs or [])[sent_tokens[i]:], request.top_logprobs,
                                         self.token_text)
            sent_tokens[i] = len(out.token_ids)
        if not out.finished:
            if content is None and not tool_calls and logprobs is None:
                return None
            return fmt.chat(i, content, logprobs=logprobs, tool_calls=tool_calls)
        finish = out.finish_reason
        if streamer is not None and streamer.called and (prep.tool_mode == "auto" or finish == "stop"):
            finish = "tool_calls"
        return fmt.chat(i, content, finish_reason=finish, stop_reason=out.stop_reason, logprobs=logprobs,
                        tool_calls=tool_calls)
