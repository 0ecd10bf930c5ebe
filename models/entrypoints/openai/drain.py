"""Graceful drain: on SIGTERM (or SIGINT) the server stops taking requests, lets the ones in flight finish
for up to ``--shutdown-timeout`` seconds, aborts the rest with an error, then exits 0.

vLLM: ``--shutdown-timeout`` (``vllm serve``; there 0, abort at once, is the default).

```
SIGTERM ─► Admission.accepting = False        new POST /v1/* ─► 503 + Retry-After (code server_shutting_down)
           /health ─► 503                      (load balancers stop routing; the port stays open meanwhile)
           wait until no request is in flight, at most shutdown_timeout_s
           still running? AbortingEngine.abort_all ─► AsyncLLM.abort ─► each stream: one error event
                                                      (503, server_shutting_down) then [DONE]; a
                                                      non-streaming request: 503 error JSON
           uvicorn shuts down (sockets closed, lifespan: engine stopped) ─► exit 0
a second signal while draining: abort what is left now.
```

Only :class:`AsyncLLM`'s public interface is used (``generate``, ``abort``, ``is_running``), so the drain
does not depend on how the engine runs (a thread here, a process behind ZeroMQ later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import AsyncIterator, Sequence

import uvicorn

from models.entrypoints.openai.limits import Admission
from models.entrypoints.openai.protocol import OpenAIError

logger = logging.getLogger("jaxkv.serve")


class AbortingEngine:
    """:class:`AsyncLLM`'s ``generate`` / ``is_running`` with the requests it runs tracked, so the drain can
    abort them and their streams end in an error instead of a normal ``finish_reason: "abort"``.

    Args:
        async_llm: the engine (``generate``, ``abort``, ``is_running``).
    """

    def __init__(self, async_llm):
        self.async_llm = async_llm
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self._error: OpenAIError | None = None  # set once the drain aborts: new requests are refused too

    @property
    def is_running(self) -> bool:
        return self.async_llm.is_running

    @property
    def scheduling_policy(self) -> str:
        """The engine's ``"fcfs"`` or ``"priority"`` (``"fcfs"`` for an engine that does not say)."""
        return getattr(self.async_llm, "scheduling_policy", "fcfs")

    @property
    def is_ready(self) -> bool:
        """``AsyncLLM.is_ready`` where it has one (engine-core processes loaded and compiled)."""
        return getattr(self.async_llm, "is_ready", self.async_llm.is_running)

    @property
    def num_live(self) -> int:
        return len(self._live)

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params, request_id: str,
                       **kwargs) -> AsyncIterator:
        """``AsyncLLM.generate``; raises the drain's OpenAIError (503) if the drain aborts the request.

        Raises:
            OpenAIError: 503 ``server_shutting_down`` once the drain has aborted requests.
        """
        if self._error is not None:
            raise self._error
        self._live.add(request_id)
        try:
            async with contextlib.aclosing(self.async_llm.generate(prompt_token_ids, sampling_params,
                                                                   request_id, **kwargs)) as outputs:
                async for out in outputs:
                    if request_id in self._aborted and out.finished and out.finish_reason == "abort":
                        raise self._error
                    yield out
            if request_id in self._aborted:  # the stream ended without a last output
                raise self._error
        finally:
            self._live.discard(request_id)
            self._aborted.discard(request_id)

    def abort_all(self, message: str) -> int:
        """Abort every request running now (and refuse new ones): their streams raise
        ``OpenAIError(message, 503, code="server_shutting_down")``. Returns how many were aborted."""
        self._error = OpenAIError(message, status_code=503, code="server_shutting_down")
        ids = sorted(self._live)
        self._aborted.update(ids)
        if ids:
            self.async_llm.abort(ids)
        return len(ids)


async def drain(admission: Admission, engine: AbortingEngine, timeout_s: float, *,
                hurry: asyncio.Event | None = None, abort_grace_s: float = 10.0, poll_s: float = 0.05) -> dict:
    """Stop admitting, wait for the requests in flight (at most ``timeout_s`` or until ``hurry`` is set),
    abort the rest and wait (at most ``abort_grace_s``) for their error answers to be sent.

    Returns:
        ``{"in_flight": at the start, "finished": ..., "aborted": ..., "left": still in flight at the end,
        "seconds": ...}``.
    """
    t0 = time.monotonic()
    admission.accepting = False
    start = admission.in_flight
    logger.info("draining: %d request(s) in flight, new ones refused (503); waiting up to %.1f s", start, timeout_s)
    hurry = hurry or asyncio.Event()
    deadline = t0 + timeout_s
    while admission.in_flight and time.monotonic() < deadline and not hurry.is_set():
        await asyncio.sleep(poll_s)
    finished = start - admission.in_flight
    aborted = 0
    if admission.in_flight:
        waited = time.monotonic() - t0
        aborted = engine.abort_all(f"The server is shutting down: the request was aborted after {waited:.1f} s "
                                   f"of draining (--shutdown-timeout={timeout_s:g})")
        logger.warning("draining: aborted %d engine request(s) still running after %.1f s", aborted, waited)
        deadline = time.monotonic() + abort_grace_s
        while admission.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
    result = {"in_flight": start, "finished": max(finished, 0), "aborted": aborted, "left": admission.in_flight,
              "seconds": round(time.monotonic() - t0, 3)}
    logger.info("drained in %.1f s: %d request(s) finished, %d engine request(s) aborted, %d left",
                result["seconds"], result["finished"], aborted, result["left"])
    return result


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` whose first SIGTERM / SIGINT drains (:func:`drain`) before uvicorn's own shutdown,
    and which then exits normally (status 0: uvicorn itself re-raises the signal it caught, which would end
    the process with 128 + the signal's number). A later signal cuts the drain short; one after the drain
    skips uvicorn's wait for connections.

    Args:
        config: ``uvicorn.Config``.
        admission, engine: the app's (``app.state.admission``, ``app.state.aborting_engine``).
        shutdown_timeout_s: how long in-flight requests may run after the signal.
    """

    def __init__(self, config, *, admission: Admission, engine: AbortingEngine, shutdown_timeout_s: float):
        super().__init__(config)
        if not shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s={shutdown_timeout_s} must be >= 0")
        self.admission, self.engine = admission, engine
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self.drain_result: dict | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._hurry: asyncio.Event | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (main thread); also callable from another thread (tests)."""
        if self.should_exit or self._loop is None or self._loop.is_closed():
            self.should_exit = self.force_exit = True  # not recorded: no re-raise, the exit stays 0
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain_task is None:
            logger.info("%s received", name)
            self._drain_task = asyncio.ensure_future(self._drain())
        else:
            logger.info("%s received again: aborting what is left now", name)
            self._hurry.set()

    async def _drain(self) -> None:
        try:
            self.drain_result = await drain(self.admission, self.engine, self.shutdown_timeout_s,
                                            hurry=self._hurry)
        finally:
            self.should_exit = True
