"""Input limits of the HTTP server. Every one fails closed: a request past it gets a clear 4xx / 503 naming
the limit, before it costs the server more than the limit allows.

vLLM has none of these apart from the context length (``--max-model-len``); the names follow its flags.

| limit (``ServerLimits`` field / serve.py flag) | what | answer |
|---|---|---|
| ``max_request_body_bytes`` / ``--max-request-body-bytes`` | request body size, counted while it streams in (``Content-Length`` or chunked) | 413 |
| ``max_json_depth`` / ``--max-json-depth`` | nesting of ``[`` / ``{`` in the body, measured without recursion before parsing | 400 |
| ``max_stop_strings`` / ``--max-stop-strings`` | strings in ``stop`` | 400 |
| ``max_stop_chars`` / ``--max-stop-chars`` | characters of all ``stop`` strings together | 400 |
| ``max_stop_token_ids`` / ``--max-stop-token-ids`` | ids in ``stop_token_ids`` | 400 |
| ``max_prompts_per_request`` / ``--max-prompts-per-request`` | prompts in one ``/v1/completions`` request | 400 |
| ``max_pending_requests`` / ``--max-pending-requests`` | ``POST /v1/*`` requests in the server at once (reading, waiting, running, streaming) | 503 + ``Retry-After`` |

:class:`RequestLimitsMiddleware` (pure ASGI) enforces the body size and the pending-request cap, and
refuses new ``/v1`` requests while the server drains (:mod:`models.entrypoints.openai.drain`); the handlers
check the rest (:func:`check_json_depth`, :func:`check_stop`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np

from models.entrypoints.openai.protocol import OpenAIError

# A JSON string: quote, then runs of non-special bytes or escapes, then quote (no backtracking blow-up).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """The server's input limits (module docstring: what each bounds and how it is answered).

    Attributes:
        max_request_body_bytes: largest request body in bytes (default 4 MiB; a prompt that fits a
            32k-token context is under 1 MiB as text or as token ids).
        max_json_depth: deepest nesting of JSON arrays / objects in a body (OpenAI bodies use < 10).
        max_stop_strings: most strings in ``stop`` (OpenAI allows 4).
        max_stop_chars: most characters of all ``stop`` strings together (each step searches new text
            for every stop string and holds back ``len(longest) - 1`` characters of a stream).
        max_stop_token_ids: most ids in ``stop_token_ids``.
        max_prompts_per_request: most prompts in one completions request (each is one engine request).
        max_pending_requests: most ``POST /v1/*`` requests in the server at once; the next one is
            answered 503 with ``Retry-After: retry_after_s``. Bounds the memory a flood can take to about
            this many request bodies (each at most ``max_request_body_bytes``).
        retry_after_s: seconds in ``Retry-After`` of a 503.

    Raises:
        ValueError: a limit below 1.
    """

    max_request_body_bytes: int = 4 * 2**20
    max_json_depth: int = 64
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 64
    max_prompts_per_request: int = 256
    max_pending_requests: int = 1024
    retry_after_s: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}={value!r} must be an integer >= 1")

    def as_stats(self) -> dict[str, int]:
        """The limits as ``/stats`` fields (clients such as scripts/soak_server.py read them there)."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------- body checks

def json_depth(body: bytes) -> int:
    """Deepest nesting of ``[`` / ``{`` in a JSON text, outside strings, without parsing or recursing.

    Linear in ``len(body)`` (a regex drops the strings, ``bytes.translate`` keeps the brackets, NumPy sums
    them); for text that is not valid JSON the number is only an estimate (the parser rejects it anyway).
    """
    if b"[" not in body and b"{" not in body:
        return 0
    if b'"' in body:
        body = _JSON_STRING.sub(b"", body)
    brackets = np.frombuffer(body.translate(None, _NOT_BRACKETS), np.uint8)
    if brackets.size == 0:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def check_json_depth(body: bytes, limits: ServerLimits) -> None:
    """400 for a body nested deeper than ``limits.max_json_depth`` (before ``json.loads`` recurses)."""
    depth = json_depth(body)
    if depth > limits.max_json_depth:
        raise OpenAIError(f"Invalid request body: JSON nested {depth} levels deep; this server accepts at "
                          f"most {limits.max_json_depth} (--max-json-depth)", param=None,
                          code="json_too_deep")


def parse_json_object(body: bytes, limits: ServerLimits) -> dict[str, Any]:
    """The body as a JSON object; OpenAIError (400) for a body too deep, not JSON, or not an object."""
    check_json_depth(body, limits)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an int of > 4300 digits
        raise OpenAIError(f"Invalid request body: not JSON ({e})", param=None) from None
    if not isinstance(data, dict):
        raise OpenAIError("Invalid request body: expected a JSON object", param=None)
    return data


def check_stop(stop: tuple[str, ...], stop_token_ids, limits: ServerLimits) -> None:
    """400 naming ``stop`` / ``stop_token_ids`` when they exceed the server's limits."""
    if len(stop) > limits.max_stop_strings:
        raise OpenAIError(f"Invalid value for 'stop': {len(stop)} stop strings; this server accepts at most "
                          f"{limits.max_stop_strings} (--max-stop-strings)", param="stop")
    chars = sum(map(len, stop))
    if chars > limits.max_stop_chars:
        raise OpenAIError(f"Invalid value for 'stop': the stop strings have {chars} characters together; this "
                          f"server accepts at most {limits.max_stop_chars} (--max-stop-chars)", param="stop")
    n_ids = len(stop_token_ids or ())
    if n_ids > limits.max_stop_token_ids:
        raise OpenAIError(f"Invalid value for 'stop_token_ids': {n_ids} ids; this server accepts at most "
                          f"{limits.max_stop_token_ids} (--max-stop-token-ids)", param="stop_token_ids")


# ----------------------------------------------------------------------------------------- admission

class RequestTooLarge(OpenAIError):
    """413: the body passed ``max_request_body_bytes`` (raised from ``receive`` while it streams in)."""

    def __init__(self, limit: int, got: int | None = None):
        size = "" if got is None else f" ({got} bytes)"
        super().__init__(f"Request body too large{size}: this server accepts at most {limit} bytes "
                         f"(--max-request-body-bytes)", status_code=413, code="request_too_large")


class Admission:
    """Which ``POST /v1/*`` requests the server takes in: at most ``max_pending`` at once, none while it
    drains. Shared by :class:`RequestLimitsMiddleware` (which counts) and the drain (which waits for
    ``in_flight`` to reach 0). Touched on the event loop only.

    Attributes:
        in_flight: gated requests between their headers and the end of their response.
        accepting: ``False`` once the server drains: new requests get 503.
        num_rejected_busy: requests answered 503 because ``max_pending`` were in flight.
        num_rejected_draining: requests answered 503 because the server was draining.
    """

    def __init__(self, max_pending: int):
        self.max_pending = int(max_pending)
        self.in_flight = 0
        self.accepting = True
        self.num_rejected_busy = 0
        self.num_rejected_draining = 0

    def stats(self) -> dict[str, Any]:
        return {"num_pending_requests": self.in_flight, "draining": not self.accepting,
                "num_rejected_busy": self.num_rejected_busy,
                "num_rejected_draining": self.num_rejected_draining}


def _gated(scope) -> bool:
    path = scope["path"]
    return scope["method"] == "POST" and (path == "/v1" or path.startswith("/v1/"))


async def send_error(send, e: OpenAIError, headers: dict[str, str] | None = None) -> None:
    """Answer with OpenAI's error JSON from ASGI middleware (no Starlette request needed)."""
    body = json.dumps(e.to_dict()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status_code, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestLimitsMiddleware:
    """Pure ASGI middleware: body size (413), pending-request cap and drain (503 + ``Retry-After``).

    A body whose ``Content-Length`` is over the limit is refused before a byte of it is read; any other
    body (chunked too) is counted as it streams in, and ``receive`` raises :class:`RequestTooLarge` at the
    first chunk past the limit, so the handler never holds more than the limit. Both answers close the
    connection (the rest of the body is never read).

    Args:
        app: the ASGI app inside.
        limits: :class:`ServerLimits`.
        admission: the shared :class:`Admission` counter.
    """

    def __init__(self, app, *, limits: ServerLimits, admission: Admission):
        self.app, self.limits, self.admission = app, limits, admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_request_body_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            return await send_error(send, RequestTooLarge(limit, length), {"Connection": "close"})
        gated = _gated(scope)
        if gated:
            adm = self.admission
            if not adm.accepting:
                adm.num_rejected_draining += 1
                return await send_error(send, OpenAIError(
                    "The server is shutting down and takes no new requests", status_code=503,
                    code="server_shutting_down"),
                    {"Retry-After": str(self.limits.retry_after_s), "Connection": "close"})
            if adm.in_flight >= adm.max_pending:
                adm.num_rejected_busy += 1
                return await send_error(send, OpenAIError(
                    f"The server is busy: {adm.in_flight} requests are pending, the most it takes is "
                    f"{adm.max_pending} (--max-pending-requests); retry later", status_code=503,
                    code="server_busy"), {"Retry-After": str(self.limits.retry_after_s)})
            adm.in_flight += 1
        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(limit)
            return message

        try:
            await self.app(scope, receive_limited, send)
        finally:
            if gated:
                self.admission.in_flight -= 1


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP parser rejects these before the app sees them
                return None
    return None
