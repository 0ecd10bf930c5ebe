"""The OpenAI-compatible HTTP app (Starlette + pydantic, served by uvicorn).

vLLM: ``entrypoints/openai/api_server.py``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true → server-sent events ending
in ``data: [DONE]``), ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /health`` and ``GET|POST /ping`` (200 once the engine is loaded and compiled and while it runs, else 503),
``GET /stats`` (JSON: running / waiting requests, KV-cache usage, token counters, the server's limits and
pending requests, its memory — what the tests, the benchmark and the soak test read), ``GET /metrics``
(Prometheus: :mod:`models.entrypoints.openai.metrics`). An unknown route is a 404 and a known route with
another method a 405, both with OpenAI's error JSON.

In front of the routes, outermost first: :class:`~models.entrypoints.openai.auth.ApiKeyMiddleware` (401 on
``/v1/*`` without a key, when keys are set) and
:class:`~models.entrypoints.openai.limits.RequestLimitsMiddleware` (413 for a body over the limit, 503 +
``Retry-After`` past the pending-request cap or while draining); the handlers check JSON depth and stop
strings (:mod:`models.entrypoints.openai.limits`). ``/health`` answers 503 while the server drains.

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed body or
a bad / unsupported / out-of-range field (the message and ``param`` name it) and for prompts that do not fit
``max_model_len``; 404 for an unknown model; 503 once the engine is dead; 500 for a bug (logged with its
traceback). A handler's failure is confined to its request.

A client that disconnects cancels its handler: streaming responses are cancelled by Starlette, non-streaming
ones by :func:`_until_disconnected`; either way the request's generator is closed and the engine aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
from typing import Any, Awaitable, Sequence

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from models.entrypoints.async_llm import AsyncLLM, EngineDeadError, EngineNotReadyError
from models.entrypoints.openai.auth import ApiKeyMiddleware
from models.entrypoints.openai.drain import AbortingEngine
from models.entrypoints.openai.limits import Admission, RequestLimitsMiddleware, ServerLimits, parse_json_object
from models.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from models.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_from_validation,
    random_id,
)
from models.entrypoints.openai.serving_chat import OpenAIServingChat
from models.entrypoints.openai.serving_completion import OpenAIServingCompletion
from models.entrypoints.openai.serving_engine import engine_error
from models.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("jaxkv.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(e: OpenAIError) -> JSONResponse:
    headers = {"Connection": "close"} if e.status_code == 413 else None  # the rest of the body is unread
    return JSONResponse(e.to_dict(), status_code=e.status_code, headers=headers)


async def _parse(request: Request, model_cls, limits: ServerLimits):
    """The JSON body validated into ``model_cls``; OpenAIError (400) naming the field otherwise, 413 for a
    body over ``limits.max_request_body_bytes`` (raised by RequestLimitsMiddleware's ``receive``)."""
    data = parse_json_object(await request.body(), limits)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise error_from_validation(e) from None


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work`` unless the client disconnects first (then cancel it). Returns ``(finished, result)``."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return False, None


def _jax_with_devices():
    """JAX if this process already uses a device backend, else ``None``. Never imports JAX or initializes a
    backend: the front end of engine-core processes must not take device memory."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        from jax._src import xla_bridge
        return jax if xla_bridge._backends else None  # private: initialized backends (empty until first use)
    except Exception:  # noqa: BLE001 - another JAX layout: do not risk initializing one
        return None


def process_stats() -> dict[str, Any]:
    """This process's resident memory (``process_rss_bytes``, Linux) and, where this process runs the model
    and JAX reports it (GPU), device memory in use summed over its local devices
    (``device_memory_bytes_in_use``; engine stats of the same name, from engine-core processes, win)."""
    stats: dict[str, Any] = {"pid": os.getpid()}
    try:
        with open("/proc/self/statm") as f:
            stats["process_rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    jax = _jax_with_devices()
    if jax is not None:
        try:
            mems = [d.memory_stats() for d in jax.local_devices()]
        except Exception:  # noqa: BLE001 - backends without memory stats
            mems = []
        if mems and all(m and "bytes_in_use" in m for m in mems):
            stats["device_memory_bytes_in_use"] = sum(int(m["bytes_in_use"]) for m in mems)
            stats["device_memory_peak_bytes_in_use"] = sum(int(m.get("peak_bytes_in_use", 0)) for m in mems)
    return stats


def server_version() -> str:
    """The installed jaxkv version (``GET /version``)."""
    from importlib import metadata

    try:
        return metadata.version("jaxkv")
    except metadata.PackageNotFoundError:  # a source tree without the package installed
        return "unknown"


def _request_id(prefix: str, body) -> str:
    """``<prefix>-<the request's request_id>`` (vLLM's extension field), else a random one."""
    return f"{prefix}-{body.request_id}" if body.request_id else random_id(prefix)


def build_app(async_llm: AsyncLLM, tokenizer, *, served_model_names: list[str], max_model_len: int,
              default_stop_token_ids=(), extra_stats=None, limits: ServerLimits | None = None,
              api_keys: Sequence[str] = (), enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None) -> Starlette:
    """The ASGI app serving ``async_llm``; the engine thread starts with the app and stops with it.

    Args:
        async_llm: engine wrapper (started in the app's lifespan if not running yet).
        tokenizer: :class:`models.GGUFTokenizer`.
        served_model_names: accepted ``model`` values; the first one is reported.
        max_model_len: longest prompt + completion in tokens.
        default_stop_token_ids: ids that end generation unless ``ignore_eos``.
        extra_stats: constant facts merged into ``/stats`` (cache blocks, device, ...).
        limits: the input limits (default :class:`ServerLimits`' defaults).
        api_keys: keys a ``/v1`` request must present as ``Authorization: Bearer <key>``; empty: no auth.
        enable_auto_tool_choice: serve ``tool_choice: "auto"`` (vLLM ``--enable-auto-tool-choice``; needs
            ``tool_call_parser``).
        tool_call_parser: the tool-call format of the model's output (``hermes``, ``llama3_json``,
            ``mistral``; vLLM ``--tool-call-parser``).

    Raises:
        ValueError: ``enable_auto_tool_choice`` without ``tool_call_parser``, or an unknown parser.

    ``app.state`` holds ``async_llm``, ``admission`` (:class:`Admission`) and ``aborting_engine``
    (:class:`AbortingEngine`), which :class:`~models.entrypoints.openai.drain.GracefulServer` drains.
    """
    from models.entrypoints.openai.tool_parsers import get_tool_parser

    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    parser = None if tool_call_parser is None else get_tool_parser(tool_call_parser)
    limits = limits or ServerLimits()
    admission = Admission(limits.max_pending_requests)
    engine = AbortingEngine(async_llm)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async_llm.start()
        yield
        async_llm.shutdown()

    constant_stats = dict(extra_stats or {}, max_model_len=max_model_len, **limits.as_stats(),
                          api_key_required=bool(api_keys))

    def all_stats() -> dict[str, Any]:
        out = dict(constant_stats)
        for part in (process_stats(), admission.stats(), async_llm.stats()):  # the engine's own keys win
            out.update(part)
        return out

    server_metrics = ServerMetrics(served_model_names[0], max_model_len, all_stats)
    options = dict(served_model_names=served_model_names, max_model_len=max_model_len,
                   default_stop_token_ids=default_stop_token_ids, limits=limits, metrics=server_metrics)
    completion = OpenAIServingCompletion(engine, tokenizer, **options)
    chat = OpenAIServingChat(engine, tokenizer, enable_auto_tools=enable_auto_tool_choice, tool_parser=parser,
                             **options)
    tokenization = OpenAIServingTokenization(engine, tokenizer, **options)

    async def _openai_error(_: Request, e: OpenAIError):
        return error_response(e)

    async def _engine_dead(_: Request, e: EngineDeadError):  # in flight: 500; new requests: 503
        return error_response(OpenAIError(str(e), status_code=500 if getattr(e, "in_flight", False) else 503,
                                          code="engine_dead"))

    async def _not_ready(_: Request, e: EngineNotReadyError):
        response = error_response(OpenAIError(str(e), status_code=503, code="engine_not_ready"))
        response.headers["Retry-After"] = "5"
        return response

    async def _value_error(_: Request, e: ValueError):  # the engine rejected a request
        return error_response(engine_error(e))

    async def _http_error(_: Request, e: HTTPException):  # no route (404), wrong method (405)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        response = error_response(OpenAIError(str(e.detail), status_code=e.status_code, code=code))
        for k, v in (e.headers or {}).items():
            response.headers[k] = v
        return response

    async def _internal(_: Request, e: Exception):
        logger.exception("internal error while serving a request")
        return error_response(OpenAIError(f"Internal server error: {type(e).__name__}: {e}",
                                          status_code=500, code="internal_error"))

    async def health(_: Request) -> Response:
        if not admission.accepting:
            return error_response(OpenAIError("the server is shutting down", status_code=503,
                                              code="server_shutting_down"))
        if async_llm.is_ready:
            return Response(status_code=200)
        if async_llm.is_running:
            return error_response(OpenAIError("engine is starting (loading, compiling)", status_code=503,
                                              code="engine_not_ready"))
        return error_response(OpenAIError("engine is not running", status_code=503, code="engine_dead"))

    async def stats(_: Request) -> JSONResponse:
        # JSON has no NaN / inf (a ratio before the first step is 0/0): null instead
        return JSONResponse({k: None if isinstance(v, float) and not math.isfinite(v) else v
                             for k, v in all_stats().items()})

    async def metrics(_: Request) -> Response:
        return Response(server_metrics.render(), media_type=CONTENT_TYPE)

    async def version(_: Request) -> JSONResponse:
        return JSONResponse({"version": server_version()})

    async def tokenize(request: Request) -> JSONResponse:
        data = parse_json_object(await request.body(), limits)
        model_cls = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            raise error_from_validation(e) from None
        return JSONResponse(tokenization.tokenize(body))

    async def detokenize(request: Request) -> JSONResponse:
        body = await _parse(request, DetokenizeRequest, limits)
        return JSONResponse(tokenization.detokenize(body))

    async def models(_: Request) -> JSONResponse:
        root = served_model_names[0]
        cards = [ModelCard(id=name, root=root, max_model_len=max_model_len) for name in served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    async def create_completion(request: Request):
        body = await _parse(request, CompletionRequest, limits)
        request_id = _request_id("cmpl", body)
        if body.stream:
            prepared = completion.prepare(body)  # errors before the stream starts are plain 4xx
            return StreamingResponse(completion.completion_stream(body, request_id, prepared),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        finished, result = await _until_disconnected(request, completion.create_completion(body, request_id))
        if not finished:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(result.model_dump())

    async def create_chat_completion(request: Request):
        body = await _parse(request, ChatCompletionRequest, limits)
        request_id = _request_id("chatcmpl", body)
        if body.stream:
            prepared = chat.prepare(body)
            return StreamingResponse(chat.chat_completion_stream(body, request_id, prepared),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        finished, result = await _until_disconnected(request, chat.create_chat_completion(body, request_id))
        if not finished:
            return Response(status_code=499)
        return JSONResponse(result.model_dump())

    middleware = [Middleware(ApiKeyMiddleware, api_keys=list(api_keys))] if api_keys else []
    middleware.append(Middleware(RequestLimitsMiddleware, limits=limits, admission=admission))
    app = Starlette(
        middleware=middleware,
        routes=[Route("/health", health, methods=["GET"]), Route("/ping", health, methods=["GET", "POST"]),
                Route("/stats", stats, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
                Route("/version", version, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
                Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
                Route("/v1/completions", create_completion, methods=["POST"]),
                Route("/v1/chat/completions", create_chat_completion, methods=["POST"])],
        exception_handlers={OpenAIError: _openai_error, HTTPException: _http_error, EngineDeadError: _engine_dead,
                            EngineNotReadyError: _not_ready, ValueError: _value_error,
                            Exception: _internal},
        lifespan=lifespan)
    app.state.async_llm = async_llm
    app.state.admission = admission
    app.state.aborting_engine = engine
    app.state.metrics = server_metrics
    return app
