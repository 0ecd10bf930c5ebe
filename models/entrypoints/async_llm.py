"""The engine behind an asyncio server: requests stream their tokens while the engine steps elsewhere.

vLLM: ``v1/engine/async_llm.py`` (``AsyncLLM.generate`` / ``abort``) and ``v1/engine/output_processor.py``.
:class:`AsyncLLM` is the front end's half: per request, an ``asyncio.Queue`` of engine outputs, the
incremental detokenizer and the stop strings (vLLM's ``OutputProcessor``), all on the event loop. The engine
steps in one of two places:

* **engine-core processes** (:meth:`AsyncLLM.from_client`, what ``scripts/serve.py`` uses): one process
  per data-parallel rank behind :class:`jaxkv.engine.core_client.AsyncMPClient`; the client's reader task
  hands each step's :class:`EngineCoreOutputs` to :meth:`AsyncLLM._deliver` on the loop;
* **an engine thread** in this process (``AsyncLLM(engine, tokenizer)``; tests and debugging), the only
  caller of the synchronous :class:`jaxkv.LLMEngine`:

```
request handlers (event loop)                      engine thread / engine-core process(es)
  generate() ── add ─────────────────────────────────► add_request / abort_request (between steps)
  per-request asyncio.Queue ◄── one hand-off per step ◄── step() (token ids only)
  detokenize, stop strings ──► async generator ──► HTTP response
```

A consumer that stops iterating (client disconnected, stop string found) aborts its request; the abort is
applied before the engine's next step, so the request's blocks are free within one step. Stats (running /
waiting requests, prompt and generation tokens/s, KV-cache usage) are logged periodically like vLLM's
``LoggingStatLogger``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any, AsyncIterator, Iterable, Sequence

from jaxkv.engine.core_client import AsyncMPClient, EngineDeadError, EngineNotReadyError, aggregate_stats
from jaxkv.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    LogprobsLists,
    child_request_id,
)
from jaxkv.outputs import Logprob
from jaxkv.sampling_params import SamplingParams
from models.entrypoints.output_processor import CompletionState, logprob_dicts, truncate_prompt

logger = logging.getLogger("jaxkv.serve")

__all__ = ["AsyncLLM", "EngineDeadError", "EngineNotReadyError", "StreamOutput", "truncate_prompt"]


@dataclasses.dataclass
class StreamOutput:
    """What :meth:`AsyncLLM.generate` yields: one completion's progress after an engine step.

    Attributes:
        request_id: the id given to :meth:`AsyncLLM.generate`.
        prompt_token_ids: ``[num_prompt_tokens]`` (after ``truncate_prompt_tokens``).
        token_ids: every token of this completion so far, ``[num_generated_tokens]`` (a live view: it grows with
            the completion's later outputs; copy it to keep a snapshot): a stop token or EOS
            that ended it is the last one; with a stop string, the token that completed it is the last
            (tokens the engine generated after it are dropped). ``usage.completion_tokens`` is their count.
        text: detokenized text that may be sent to the client so far (cut before a stop string, or after it
            with ``include_stop_str_in_output``; while running, the characters that could still start a stop
            string are held back). It only grows.
        finished: this completion ended; this is its last output.
        finish_reason: ``None`` while running, then ``"stop"``, ``"length"`` or ``"abort"``.
        stop_reason: the stop string or stop token id that ended it, or ``None``.
        index: which of the request's ``n`` completions (outputs of several interleave).
        logprobs: with ``SamplingParams.logprobs``: one ``{token_id: Logprob}`` per token of ``token_ids``
            (the sampled token and the top ones; ``decoded_token`` filled).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: ``None`` then one dict per prompt token
            after the first; complete in every output that carries generated tokens.
        cumulative_logprob: the sum of the sampled tokens' logprobs (with ``logprobs``).
        num_cached_tokens: prompt tokens served from the prefix cache.
        queue_time_s: seconds the request waited in the engine before its first step (``None`` until known).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    index: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    queue_time_s: float | None = None


_ABORTED = object()  # queue marker: AsyncLLM.abort was called for this request


class _RequestState:
    """The front end's state of one request: its completions (``n``), prompt logprobs and output queue."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], tokenizer, params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.tokenizer = tokenizer
        self.completions = [CompletionState(i, tokenizer, params) for i in range(params.n)]
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0
        self.queue_time_s: float | None = None
        self.queue: asyncio.Queue = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    @finished.setter
    def finished(self, value: bool) -> None:
        for c in self.completions:
            c.finished = value

    def process(self, out: EngineCoreOutput) -> StreamOutput:
        """Fold one step's :class:`EngineCoreOutput` into its completion; applies stop strings."""
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None and out.index == 0:
            self.prompt_logprobs.extend(logprob_dicts(out.new_prompt_logprobs, self.completions[0].texts))
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        c = self.completions[out.index]
        text, finished, finish_reason, stop_reason = c.add(out)
        if out.queue_time_s is not None and self.queue_time_s is None:
            self.queue_time_s = out.queue_time_s
        return self._output(c, text, finished, finish_reason, stop_reason)

    def _output(self, c: CompletionState, text: str, finished: bool, finish_reason, stop_reason) -> StreamOutput:
        return StreamOutput(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                            token_ids=c.detok.token_ids, text=text, finished=finished,
                            finish_reason=finish_reason if finished else None,
                            stop_reason=stop_reason if finished else None, index=c.index,
                            logprobs=c.logprobs,
                            prompt_logprobs=self.prompt_logprobs, cumulative_logprob=c.cumulative,
                            num_cached_tokens=self.num_cached_tokens, queue_time_s=self.queue_time_s)

    def aborted(self) -> list[StreamOutput]:
        """An ``"abort"`` output for every completion still running."""
        outs = []
        for c in self.completions:
            if not c.finished:
                c.finished = True
                text = c.detok.text[:c.stops.safe_len(c.detok.text, False)]
                outs.append(self._output(c, text, True, "abort", None))
        return outs


def _stats_dict(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    if isinstance(stats, dict):
        return dict(stats)
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


class AsyncLLM:
    """Runs an ``LLMEngine`` in a background thread and streams each request's outputs to asyncio.

    Create it inside a running event loop (or call :meth:`start` from one): outputs are handed to that loop.

    Args:
        engine: ``add_request(request_id, prompt_token_ids, sampling_params)``, ``abort_request(ids)``,
            ``step() -> list[RequestOutput]``, ``has_unfinished_requests()``, ``stats``
            (:class:`jaxkv.engine.llm_engine.LLMEngine`).
        tokenizer: ``decode(ids, skip_special_tokens=...)``.
        log_stats_interval_s: seconds between stats log lines (``None``: never log). Lines are only
            written when something happened since the last one.
    """

    def __init__(self, engine, tokenizer, *, log_stats_interval_s: float | None = 10.0):
        self.engine = engine
        self.client: AsyncMPClient | None = None
        self.tokenizer = tokenizer
        self.log_stats_interval_s = log_stats_interval_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _RequestState] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead_error: BaseException | None = None
        # counters written by the engine thread, read anywhere (ints: atomic under the GIL)
        self._stats: dict[str, Any] = {}
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._num_requests_finished = self._num_requests_aborted = 0
        self._num_steps = 0

    # ---------------------------------------------------------------- life cycle (event loop side)

    def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stats = self._snapshot_stats()
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still running are abandoned)."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """The engine can take requests (or will, once started): not dead, not shut down."""
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def is_ready(self) -> bool:
        """Built and warm: what ``/health`` reports (vLLM's readiness)."""
        return self.is_running

    @classmethod
    def from_client(cls, client: AsyncMPClient, tokenizer, *,
                    log_stats_interval_s: float | None = 10.0) -> "AsyncLLM":
        """An :class:`AsyncLLM` over engine-core processes (``client``, started or starting)."""
        return _MPAsyncLLM(client, tokenizer, log_stats_interval_s=log_stats_interval_s)

    # ---------------------------------------------------------------------------------- requests

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, request_id: str, *,
                       stop: Sequence[str] | None = None, skip_special_tokens: bool | None = None,
                       priority: int = 0) -> AsyncIterator[StreamOutput]:
        """Submit a request and yield its outputs as they are produced. vLLM: ``AsyncLLM.generate``.

        Args:
            prompt_token_ids: ``[num_prompt_tokens]``; cut to the last ``truncate_prompt_tokens``.
            sampling_params: :class:`jaxkv.sampling_params.SamplingParams` (stop strings, detokenization,
                ``bad_words`` are applied here; the rest in the engine).
            request_id: unique among unfinished requests.
            stop, skip_special_tokens: override ``sampling_params``' fields of the same names.
            priority: with the engine's ``scheduling_policy="priority"``: smaller is admitted first (vLLM's).

        Yields:
            :class:`StreamOutput` s of every completion (``index``) as they progress, each ending with one
            whose ``finished`` is true; the iteration ends when all ``n`` have. Closing the generator early
            (``aclose()``, task cancelled, client gone) aborts the request.

        Raises:
            ValueError: the engine rejected the request (nothing else is disturbed); ``priority != 0`` with an
                engine whose policy is ``"fcfs"``.
            EngineDeadError: the engine thread has died.
        """
        if priority and self.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs an engine with scheduling_policy='priority' (this one's is "
                             f"{self.scheduling_policy!r})")
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already running")
        params = sampling_params
        if stop is not None or skip_special_tokens is not None:
            params = params.replace(**{k: v for k, v in (("stop", stop), ("skip_special_tokens", skip_special_tokens))
                                       if v is not None})
        if not params.spaces_between_special_tokens:
            raise ValueError("spaces_between_special_tokens=False is not supported")
        params = params.with_bad_words_tokenized(self.tokenizer)
        prompt = truncate_prompt([int(t) for t in prompt_token_ids], params.truncate_prompt_tokens)
        state = _RequestState(request_id, prompt, self.tokenizer, params)
        self._submit(request_id, prompt, params, priority)  # raises before anything is registered
        self._requests[request_id] = state
        try:
            while not state.finished:
                # everything that arrived while this stream was busy is folded into one output per
                # completion (vLLM's RequestOutputCollector): a front end that falls behind sends fewer,
                # larger chunks
                items = [await state.queue.get()]
                while not state.queue.empty():
                    items.append(state.queue.get_nowait())
                latest: dict[int, StreamOutput] = {}
                for item in items:
                    if isinstance(item, BaseException) or item is _ABORTED:
                        for out in latest.values():
                            yield out
                        if item is _ABORTED:
                            for out in state.aborted():
                                yield out
                            return
                        state.finished = True  # rejected or engine dead: nothing to abort
                        raise item
                    if state.completions[item.index].finished:
                        continue  # ended by a stop string: the engine's tokens after it are not its
                    out = state.process(item)
                    latest[out.index] = out
                    if out.finished and item.finish_reason is None:  # a stop string: the engine runs on
                        self._abort_in_core([request_id if len(state.completions) == 1
                                             else child_request_id(request_id, out.index)])
                for out in latest.values():
                    yield out
        finally:
            self._requests.pop(request_id, None)
            if not state.finished:
                self._abort_in_core([request_id])

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed before the next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            state = self._requests.get(rid)
            if state is not None:
                state.queue.put_nowait(_ABORTED)  # its generator ends with finish_reason "abort"
        self._abort_in_core(ids)

    # hooks of the engine's side: the engine thread here, engine-core processes in _MPAsyncLLM
    @property
    def scheduling_policy(self) -> str:
        """The engine's ``"fcfs"`` or ``"priority"`` (an engine without a scheduler config: ``"fcfs"``)."""
        return getattr(getattr(self.engine, "config", None), "policy", "fcfs")

    def _submit(self, request_id: str, prompt: list[int], sampling_params, priority: int = 0) -> None:
        if self._thread is None:
            self.start()
        self._commands.put(("add", request_id, prompt, sampling_params, priority))

    def _abort_in_core(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._commands.put(("abort", rid))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests submitted and not yet finished (as seen by their streams)."""
        return len(self._requests)

    def stats(self) -> dict[str, Any]:
        """Engine stats after the latest step (``num_running``, ``num_waiting``, ``kv_cache_usage``, ...),
        plus the server's request and token counters."""
        return dict(self._stats, num_steps=self._num_steps,
                    num_prompt_tokens_total=self._num_prompt_tokens,
                    num_generation_tokens_total=self._num_generation_tokens,
                    num_requests_finished=self._num_requests_finished,
                    num_requests_aborted=self._num_requests_aborted,
                    engine_alive=self.is_running)

    # ------------------------------------------------------------------------ engine thread side

    def _snapshot_stats(self) -> dict[str, Any]:
        stats_obj = getattr(self.engine, "stats", None)
        stats = _stats_dict(stats_obj)
        if hasattr(stats_obj, "gpu_idle_share"):
            stats["gpu_idle_share"] = float(stats_obj.gpu_idle_share)
        for name, key in (("get_num_unfinished_requests", "num_unfinished_requests"),):
            fn = getattr(self.engine, name, None)
            if fn is not None:
                stats[key] = int(fn())
        for key, owners, attr in (("num_free_blocks", ("", "kv", "kv_cache_manager"), "num_free_blocks"),
                                  ("num_gpu_blocks", ("", "runner", "kv", "kv_cache_manager"), "num_blocks")):
            for owner in owners:
                value = getattr(getattr(self.engine, owner, None) if owner else self.engine, attr, None)
                if isinstance(value, int):
                    stats[key] = value
                    break
        return stats

    def _run(self) -> None:
        last_log = time.monotonic()
        logged = (0, 0, 0)
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                self._apply_commands(block=not busy, timeout=self.log_stats_interval_s or 1.0)
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self._step()
                    self._num_steps += 1
                    self._count(outputs)
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs)
                    self._stats = self._snapshot_stats()
                elif busy:
                    self._stats = self._snapshot_stats()
                if self.log_stats_interval_s is not None:
                    now = time.monotonic()
                    if now - last_log >= self.log_stats_interval_s:
                        logged = self._log_stats(now - last_log, logged)
                        last_log = now
        except BaseException as e:  # noqa: BLE001 - anything here is a bug: fail every request loudly
            logger.error("engine thread died:\n%s", traceback.format_exc())
            self.dead_error = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, e)

    def _apply_commands(self, *, block: bool, timeout: float) -> None:
        commands = []
        try:
            commands.append(self._commands.get(timeout=timeout) if block else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        aborts: list[str] = []
        for cmd in commands:
            if cmd[0] == "add":
                _, rid, prompt, params, priority = cmd
                if aborts and rid in aborts:  # re-used id after an abort: apply the abort first
                    self._abort_in_engine(aborts)
                    aborts = []
                try:
                    self.engine.add_request(rid, prompt, params, **({"priority": priority} if priority else {}))
                except ValueError as e:
                    self._loop.call_soon_threadsafe(self._deliver_error, rid, e)
            elif cmd[0] == "abort":
                aborts.append(cmd[1])
        if aborts:
            self._abort_in_engine(aborts)

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
        except (KeyError, ValueError):  # some were already finished: abort one by one, ignore those
            for rid in request_ids:
                with contextlib.suppress(KeyError, ValueError):
                    self.engine.abort_request(rid)
        self._num_requests_aborted += len(request_ids)

    def _step(self) -> list[EngineCoreOutput]:
        """One engine step as :class:`EngineCoreOutput` s: the engine's own (``step_core_outputs``), or
        converted from the :class:`RequestOutput` s of an engine with only ``step()`` (test stand-ins)."""
        step_core = getattr(self.engine, "step_core_outputs", None)
        if step_core is not None:
            return step_core()
        return [core_output_of(out, c) for out in self.engine.step() for c in out.outputs]

    def _count(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            state = self._requests.get(out.request_id)
            new = len(out.new_token_ids)
            if new and state is not None and not state.completions[out.index].detok.token_ids and out.index == 0:
                self._num_prompt_tokens += len(state.prompt_token_ids)  # first tokens: the prompt was computed
            self._num_generation_tokens += new
            if out.finish_reason is not None and out.finish_reason != "abort":
                self._num_requests_finished += 1

    def _log_stats(self, interval: float, logged: tuple[int, int, int]) -> tuple[int, int, int]:
        s = self._stats
        # the engine's counters when it has them (prompt tokens computed, re-prefills included)
        prompt = s.get("prompt_tokens", s.get("num_prompt_tokens_computed", self._num_prompt_tokens))
        generated = s.get("generated_tokens", s.get("num_generated_tokens", self._num_generation_tokens))
        now = (int(prompt), int(generated), self._num_steps)
        if now == logged and not s.get("num_running") and not s.get("num_waiting"):
            return now  # idle: say nothing
        prompt_tps = (now[0] - logged[0]) / interval
        gen_tps = (now[1] - logged[1]) / interval
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
            "Preemptions: %d", prompt_tps, gen_tps, s.get("num_running", 0), s.get("num_waiting", 0),
            100 * float(s.get("kv_cache_usage", 0.0)), 100 * float(s.get("prefix_cache_hit_rate", 0.0)),
            s.get("num_preemptions", 0))
        if s.get("num_host_blocks"):  # the KV cache's host tier (kv_offloading_size)
            logger.info(
                "Host KV tier: usage %.1f%% of %d blocks, swaps out/in: %d/%d, recompute fallbacks: %d, "
                "offloaded blocks: %d, host prefix hits: %d tokens, moved %.1f MiB to host / %.1f MiB to device, "
                "copy dispatch %.2f s, loads %.2f s", 100 * float(s.get("host_kv_cache_usage", 0.0)), s["num_host_blocks"],
                s.get("num_swaps_out", 0), s.get("num_swaps_in", 0), s.get("num_swap_recompute_fallbacks", 0),
                s.get("num_blocks_offloaded", 0), s.get("num_host_prefix_hit_tokens", 0),
                s.get("kv_offload_bytes_to_host", 0) / 2**20, s.get("kv_offload_bytes_to_device", 0) / 2**20,
                float(s.get("kv_offload_copy_s", 0.0)), float(s.get("kv_offload_load_s", 0.0)))
        return now

    # ---------------------------------------------------------------- event loop side, from the thread

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is not None:  # else: aborted / gone
                state.queue.put_nowait(out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            state.queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for state in list(self._requests.values()):
            dead = EngineDeadError(f"engine is dead: {error!r}")
            dead.in_flight = True  # the request was running: a server error (500), not unavailability
            state.queue.put_nowait(dead)


class _MPAsyncLLM(AsyncLLM):
    """:class:`AsyncLLM` whose engine runs in engine-core processes (:class:`AsyncMPClient`)."""

    def __init__(self, client: AsyncMPClient, tokenizer, *, log_stats_interval_s: float | None = 10.0):
        super().__init__(None, tokenizer, log_stats_interval_s=log_stats_interval_s)
        self.client = client
        self._started = False
        self._closed = False
        self._log_task: asyncio.Task | None = None
        self.on_dead = lambda error: None  # the server's hook: stop serving, exit non-zero

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self.client.output_handler = self._deliver_core
        self.client.dead_handler = self._core_died
        self.client.start()
        if self.log_stats_interval_s is not None:
            self._log_task = self._loop.create_task(self._log_periodically())

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True
        if self._log_task is not None:
            self._log_task.cancel()
        self.client.shutdown()

    @property
    def is_running(self) -> bool:
        return not self._closed and self.dead_error is None and self.client.dead_error is None

    @property
    def is_ready(self) -> bool:
        return self.is_running and self.client.is_ready

    @property
    def scheduling_policy(self) -> str:
        """The engine cores' policy, from their ``Ready`` facts (``"fcfs"`` before they are ready)."""
        info = next((i for i in self.client.engine_info if i), None) or {}
        return info.get("scheduling_policy", "fcfs")

    def _submit(self, request_id: str, prompt: list[int], sampling_params, priority: int = 0) -> None:
        if not self._started:
            self.start()
        if self.client.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.client.dead_error}")
        self.client.add_request(EngineCoreRequest(request_id, prompt, sampling_params, priority=priority))

    def _abort_in_core(self, request_ids: list[str]) -> None:
        if self.client.is_alive:
            self.client.abort(request_ids)
        self._num_requests_aborted += len(request_ids)

    def _deliver_core(self, msg: EngineCoreOutputs) -> None:
        for out in msg.outputs:
            state = self._requests.get(out.request_id)
            if out.error is not None:
                if state is not None:
                    state.queue.put_nowait(ValueError(out.error))
                continue
            new = len(out.new_token_ids)
            if state is not None:
                if new and out.index == 0 and not state.completions[0].detok.token_ids:  # the prompt was computed
                    self._num_prompt_tokens += len(state.prompt_token_ids)
                state.queue.put_nowait(out)
            self._num_generation_tokens += new
            if out.finish_reason is not None and out.finish_reason != "abort":
                self._num_requests_finished += 1
        self._num_steps += 1

    def _core_died(self, error: EngineDeadError) -> None:
        self.dead_error = error
        self._fail_all(error)
        self.on_dead(error)

    def stats(self) -> dict[str, Any]:
        self._stats = aggregate_stats(self.client.engine_stats)
        out = super().stats()
        out.update(engine_ready=self.is_ready, data_parallel_size=self.client.num_engines,
                   num_outstanding_requests=sum(self.client.outstanding))
        return out

    async def _log_periodically(self) -> None:
        logged = (0, 0, 0)
        while True:
            await asyncio.sleep(self.log_stats_interval_s)
            self._stats = aggregate_stats(self.client.engine_stats)
            logged = self._log_stats(self.log_stats_interval_s, logged)


def lists_of(logprobs: list[dict[int, Logprob]], token_ids: Sequence[int]) -> LogprobsLists:
    """``{token_id: Logprob}`` per position (the chosen ``token_ids``) back to :class:`LogprobsLists`: the chosen
    token, then every entry of the dict in rank order, padded to one width with the chosen token (a repeat of
    the chosen token is skipped when the dict is rebuilt, so every position reads back as its dict)."""
    rows = []
    for d, tok in zip(logprobs, token_ids):
        rows.append([(tok, d[tok].logprob)] + [(t, d[t].logprob) for t in sorted(d, key=lambda t: d[t].rank or 0)])
    width = max((len(r) for r in rows), default=1)
    rows = [r + [r[0]] * (width - len(r)) for r in rows]
    return LogprobsLists.from_arrays([[t for t, _ in r] for r in rows], [[lp for _, lp in r] for r in rows],
                                     [d[tok].rank or 0 for d, tok in zip(logprobs, token_ids)])


def core_output_of(out, completion) -> EngineCoreOutput:
    """One completion of a :class:`jaxkv.outputs.RequestOutput` (an in-process engine's ``step()``) as the
    :class:`EngineCoreOutput` an engine core sends."""
    new = list(completion.new_token_ids)
    new_logprobs = None
    if getattr(completion, "logprobs", None) is not None and new:
        new_logprobs = lists_of(completion.logprobs[len(completion.logprobs) - len(new):], new)
    prompt_lp = getattr(out, "prompt_logprobs", None)
    new_prompt = None
    if prompt_lp and new and len(completion.token_ids) == len(new) and completion.index == 0:  # with the first tokens
        new_prompt = lists_of(prompt_lp[1:], out.prompt_token_ids[1:])
    return EngineCoreOutput(out.request_id, new, completion.finish_reason if completion.finish_reason else None,
                            completion.stop_reason, getattr(out, "num_cached_tokens", 0), None,
                            completion.index, new_logprobs, new_prompt)
