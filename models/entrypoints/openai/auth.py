"""API-key authentication of the OpenAI routes (vLLM: ``--api-key`` / ``VLLM_API_KEY``,
``entrypoints/openai/api_server.py``'s ``AuthenticationMiddleware``).

Every request whose path is ``/v1`` or under it must carry ``Authorization: Bearer <key>`` with one of the
server's keys; otherwise it is answered 401 with OpenAI's error JSON (``code: "invalid_api_key"``) and a
``WWW-Authenticate: Bearer`` header, before its body is read. ``/health``, ``/metrics`` and ``/stats`` stay
open (probes and scrapers carry no key), as do ``OPTIONS`` requests (CORS preflights), as in vLLM.

The comparison is constant-time: the presented token and every key are hashed to SHA-256 digests of the
same length and compared with :func:`hmac.compare_digest`, against every key (no early exit), so neither
the time nor the length of the answer depends on how much of a key matched or on which key it was.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence

from models.entrypoints.openai.limits import send_error
from models.entrypoints.openai.protocol import OpenAIError


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def is_protected(path: str) -> bool:
    """Whether a request path needs a key (``/v1`` and everything under it)."""
    return path == "/v1" or path.startswith("/v1/")


def bearer_token(headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (ASGI raw headers), else ``None``."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 for a ``/v1`` request without one of ``api_keys`` as its Bearer token.

    Args:
        app: the ASGI app inside.
        api_keys: the accepted keys (at least one; empty strings are refused).

    Raises:
        ValueError: no key, or an empty one.
    """

    def __init__(self, app, *, api_keys: Sequence[str]):
        keys = list(api_keys)
        if not keys or any(not k for k in keys):
            raise ValueError(f"api_keys must be non-empty strings (got {len(keys)} keys, "
                             f"{sum(not k for k in keys)} empty)")
        self.app = app
        self._digests = [_digest(k) for k in keys]

    def accepts(self, token: str | None) -> bool:
        """Whether ``token`` is one of the keys (constant time in the token's content)."""
        presented = _digest(token or "")
        ok = False
        for key in self._digests:
            ok |= hmac.compare_digest(presented, key)
        return ok and token is not None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not is_protected(scope["path"]):
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers", ()))
        if self.accepts(token):
            return await self.app(scope, receive, send)
        if token is None:
            message = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                       "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        else:
            message = "Incorrect API key provided."  # never echo the key back
        await send_error(send, OpenAIError(message, status_code=401, code="invalid_api_key"),
                         {"WWW-Authenticate": "Bearer"})
