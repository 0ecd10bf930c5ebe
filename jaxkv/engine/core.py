"""The engine core in a process of its own: a busy loop over ZeroMQ that owns its device(s).

vLLM: ``vllm/v1/engine/core.py`` (``EngineCoreProc.run_busy_loop``, ``DPEngineCoreProc``). One process per
data-parallel rank runs :class:`jaxkv.LLMEngine` (scheduler, KV-cache manager, model runner) and nothing
else, so host work of the front end (HTTP, tokenization, detokenization, SSE) never delays a step:

```
front end (ROUTER, bound) ── AddRequests / AbortRequests / UtilityCall / Shutdown ──► DEALER (this core)
front end (PULL, bound)  ◄── Ready, EngineCoreOutputs (one per step), AddResult, UtilityResult ── PUSH
                         ◄── Heartbeat (a side thread, every 0.5 s) ─────────────────────────── PUSH
```

Loop: while no request is unfinished, block on the input socket; otherwise drain it without blocking,
apply adds and aborts, run one :meth:`LLMEngine.step_core_outputs` (with async scheduling, step N+1 is
dispatched before step N's tokens are fetched) and send what it produced.

The process is started by :mod:`jaxkv.engine.core_client` as ``python -m jaxkv.engine.core`` with a
pickled :class:`EngineCoreLaunch` on its standard input; the launch's ``factory`` (a picklable callable
from the ``models`` package, so ``jaxkv`` never imports a model) builds the engine in this process. The
core exits when told (:class:`Shutdown`, SIGTERM), when its parent process is gone (checked every
heartbeat: no orphan keeps a GPU), and after any error, which it reports first as :class:`EngineDead`.
SIGINT is ignored: the front end decides (a Ctrl-C reaches the whole process group).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import zmq

from jaxkv.engine import protocol
from jaxkv.engine.protocol import (
    AbortRequests,
    AddRequests,
    AddResult,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    Heartbeat,
    Ready,
    Shutdown,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("jaxkv.engine_core")


@dataclasses.dataclass(frozen=True)
class EngineCoreLaunch:
    """What an engine-core process needs to start (pickled to its standard input).

    Attributes:
        engine_index: the data-parallel rank (also its ZeroMQ routing id).
        input_address, output_address: the bound ROUTER and PULL endpoints (``ipc://`` or
            ``tcp://host:port``) of every front end, one of each per API-server process
            (``--api-server-count``), indexed by ``client_index``.
        factory: ``() -> (LLMEngine, info: dict)``; runs in the core process.
        parent_pid: the process that must outlive the core (``None``: do not watch).
        stats_interval_s: most seconds between stats snapshots sent with the outputs while busy.
    """

    engine_index: int
    input_address: tuple[str, ...]
    output_address: tuple[str, ...]
    factory: Callable[[], tuple[Any, dict]]
    parent_pid: int | None = None
    stats_interval_s: float = 0.5


def as_tuple(addresses: str | Sequence[str]) -> tuple[str, ...]:
    """One endpoint or several, as a tuple (index = the front end's ``client_index``)."""
    return (addresses,) if isinstance(addresses, str) else tuple(addresses)


def routing_id(engine_index: int) -> bytes:
    """The ZeroMQ routing id of rank ``engine_index`` (its DEALER's identity at the front end's ROUTER)."""
    return engine_index.to_bytes(2, "little")


def engine_stats(engine) -> dict[str, Any]:
    """The engine's counters as one flat dict (:class:`jaxkv.engine.llm_engine.EngineStats` plus the free blocks)."""
    s = engine.stats
    out = dataclasses.asdict(s)
    out["gpu_idle_share"] = s.gpu_idle_share
    out["num_unfinished_requests"] = engine.get_num_unfinished_requests()
    kv = engine.kv_cache_manager
    out["num_free_blocks"] = int(getattr(kv, "num_free_blocks", 0))
    out["num_gpu_blocks"] = int(getattr(kv, "num_blocks", 0))
    in_use = [d.memory_stats() or {} for d in _local_devices()]
    if any("bytes_in_use" in m for m in in_use):  # device memory, where the backend reports it (GPU)
        out["device_memory_bytes_in_use"] = sum(int(m.get("bytes_in_use", 0)) for m in in_use)
    return out


def _local_devices():
    import jax
    return jax.local_devices()


class EngineCoreProc:
    """Serve one engine over a DEALER (input) and a PUSH (output) socket per front end until shut down.

    Args:
        engine: a :class:`jaxkv.LLMEngine` (or anything with its ``add_request`` / ``add_requests`` /
            ``abort_request`` / ``step_core_outputs`` / ``has_unfinished_requests`` / ``stats``).
        engine_index: the rank reported in every message.
        input_socket: a DEALER connected to every front end's ROUTER (their messages are fair-queued).
        output_socket: a PUSH connected to the front end's PULL, or a sequence of them, one per front end
            (``client_index``): a request's outputs go to the front end that sent it; stats, ``Ready`` and
            ``EngineDead`` go to all.
        stats_interval_s: most seconds between stats snapshots while busy (one more when it goes idle).
    """

    def __init__(self, engine, *, engine_index: int, input_socket, output_socket, stats_interval_s: float = 0.5):
        self.engine = engine
        self.engine_index = engine_index
        self.input_socket = input_socket
        self.output_sockets = [output_socket] if isinstance(output_socket, zmq.Socket) else list(output_socket)
        self._client_of: dict[str, int] = {}  # request id -> client index (several front ends only)
        self.stats_interval_s = stats_interval_s
        self._last_stats = 0.0
        self._running = True

    # -- the loop ------------------------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        was_busy = False
        while self._running:
            if not self.engine.has_unfinished_requests():
                if was_busy:  # the last counters of a burst, so idle stats are exact
                    self._send(EngineCoreOutputs(self.engine_index, [], self._stats()))
                    was_busy = False
                poller.poll(100)  # idle: wait for input (wake now and then to honour SIGTERM)
            self._drain_input()
            if self._running and self.engine.has_unfinished_requests():
                was_busy = True
                outputs = self.engine.step_core_outputs()
                stats = None
                now = time.monotonic()
                if now - self._last_stats >= self.stats_interval_s:
                    stats = self._stats()
                if outputs or stats is not None:
                    self._send_outputs(outputs, stats)

    def _drain_input(self) -> None:
        while self._running:
            try:
                data = self.input_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(protocol.decode_input(data))

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequests):
            self._add(msg)
        elif isinstance(msg, AbortRequests):
            self.engine.abort_request(msg.request_ids)
            for rid in msg.request_ids:
                self._client_of.pop(rid, None)
        elif isinstance(msg, UtilityCall):
            self._utility(msg)
        elif isinstance(msg, Shutdown):
            self._running = False

    def _add(self, msg: AddRequests) -> None:
        client = msg.client_index
        if msg.ack is not None:  # all or none
            error = None
            try:
                self.engine.add_requests([(r.request_id, r.prompt_token_ids, r.sampling_params, r.final_only,
                                           r.priority) for r in msg.requests])
                self._remember(msg.requests, client)
            except ValueError as e:
                error = str(e)
            self._send(AddResult(self.engine_index, msg.ack, error), client)
            return
        rejected = []
        for r in msg.requests:
            try:
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.sampling_params,
                                        final_only=r.final_only, priority=r.priority)
                self._remember([r], client)
            except ValueError as e:
                rejected.append(EngineCoreOutput(r.request_id, error=str(e)))
        if rejected:
            self._send(EngineCoreOutputs(self.engine_index, rejected), client)

    def _remember(self, requests, client: int) -> None:
        if len(self.output_sockets) > 1:
            for r in requests:
                self._client_of[r.request_id] = client

    def _send_outputs(self, outputs: list[EngineCoreOutput], stats: dict[str, Any] | None) -> None:
        """One step's outputs, each to the front end that sent its request; stats to every front end."""
        if len(self.output_sockets) == 1:
            self._send(EngineCoreOutputs(self.engine_index, outputs, stats))
            return
        by_client: list[list[EngineCoreOutput]] = [[] for _ in self.output_sockets]
        for out in outputs:
            client = (self._client_of.pop(out.request_id, 0) if out.finished
                      else self._client_of.get(out.request_id, 0))
            by_client[client].append(out)
        for client, mine in enumerate(by_client):
            if mine or stats is not None:
                self._send(EngineCoreOutputs(self.engine_index, mine, stats), client)

    def _utility(self, msg: UtilityCall) -> None:
        fn = getattr(self, f"utility_{msg.method}", None)
        try:
            if fn is None:
                raise ValueError(f"method={msg.method!r} is not an engine-core utility")
            result = fn(*msg.args)
            self._send(UtilityResult(self.engine_index, msg.call_id, result), msg.client_index)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the core goes on
            self._send(UtilityResult(self.engine_index, msg.call_id, None, f"{type(e).__name__}: {e}"),
                       msg.client_index)

    def _stats(self) -> dict[str, Any]:
        self._last_stats = time.monotonic()
        return engine_stats(self.engine)

    def _send(self, msg, client: int | None = None) -> None:
        """``msg`` to front end ``client`` (``None``: to every front end)."""
        _send_to(self.output_sockets if client is None else (self.output_sockets[client],), msg)

    # -- utilities (UtilityCall.method names) --------------------------------------------------------------
    def utility_stats(self) -> dict[str, Any]:
        return engine_stats(self.engine)

    def utility_reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def utility_warmup(self, top_k_top_p: bool = False) -> int:
        self.engine.warmup(top_k_top_p=top_k_top_p)
        return self.engine.num_compiles

    def utility_sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def utility_wake_up(self) -> None:
        self.engine.wake_up()

    def utility_is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def utility_pid(self) -> int:
        return os.getpid()


def _send_to(sockets, msg) -> None:
    """``msg``, encoded once, on each of ``sockets``."""
    data = protocol.encode(msg)
    for sock in sockets:
        sock.send(data, copy=False)


def _push_sockets(ctx: zmq.Context, addresses: tuple[str, ...], linger_ms: int) -> list:
    """One PUSH socket connected to each front end's PULL endpoint (a PUSH with several peers would pick one
    of them for each message)."""
    socks = []
    for address in addresses:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.connect(address)
        socks.append(sock)
    return socks


def _heartbeat(ctx: zmq.Context, addresses: tuple[str, ...], engine_index: int, parent_pid: int | None,
               stop: threading.Event) -> None:
    """Every ``HEARTBEAT_INTERVAL_S``: tell the front end this process lives, and exit it (hard) once its
    parent is gone, so a killed front end leaves no core holding a device."""
    socks = _push_sockets(ctx, addresses, linger_ms=0)
    beat = protocol.encode(Heartbeat(engine_index))
    while not stop.wait(protocol.HEARTBEAT_INTERVAL_S):
        if parent_pid is not None and os.getppid() != parent_pid:
            logger.error("engine core %d: the front end (pid %d) is gone; exiting", engine_index, parent_pid)
            os._exit(1)
        for sock in socks:
            try:
                sock.send(beat, zmq.NOBLOCK)
            except zmq.Again:
                pass
    for sock in socks:
        sock.close()


def gpu_local_cpus(visible: str | None = None) -> set[int] | None:
    """The CPUs on the NUMA node of the first GPU in ``visible`` (default ``$CUDA_VISIBLE_DEVICES``), by
    NVML (``nvidia-ml-py``), intersected with the CPUs this process may use; ``None`` when that is unknown
    (no NVML, no GPU, a UUID-style device list) or would leave no CPU. NVML numbers GPUs in PCI bus order,
    as CUDA does for identical GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    first = (visible or "").split(",")[0].strip()
    if not first.isdigit():
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
            words = pynvml.nvmlDeviceGetCpuAffinity(handle, (os.cpu_count() + 63) // 64)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    cpus = {64 * i + b for i, word in enumerate(words) for b in range(64) if word >> b & 1}
    cpus &= os.sched_getaffinity(0)
    return cpus or None


def _bind_to_gpu_node() -> None:
    """Run this process on the CPUs of its GPU's NUMA node (``$JAXKV_NUMA_AFFINITY=0``: leave it to the
    OS), before JAX starts its threads, which inherit it. Two ranks on a two-socket host otherwise may
    both run on one socket, one of them copying its inputs across the interconnect."""
    if os.environ.get("JAXKV_NUMA_AFFINITY", "1") == "0":
        return
    cpus = gpu_local_cpus()
    if cpus is not None and cpus != os.sched_getaffinity(0):
        os.sched_setaffinity(0, cpus)
        logger.info("engine core bound to the %d CPUs local to GPU %s", len(cpus),
                    os.environ.get("CUDA_VISIBLE_DEVICES"))


def run_engine_core(launch: EngineCoreLaunch) -> int:
    """Build the engine with ``launch.factory``, announce it, serve until shut down; the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _bind_to_gpu_node()

    def _terminate(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _terminate)
    ctx = zmq.Context()
    outs = _push_sockets(ctx, launch.output_address, linger_ms=5000)  # 5 s: deliver the last messages (EngineDead)
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.ROUTING_ID, routing_id(launch.engine_index))
    inp.setsockopt(zmq.LINGER, 0)
    for address in launch.input_address:  # every front end's messages, fair-queued
        inp.connect(address)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, name="jaxkv-heartbeat", daemon=True,
                            args=(ctx, launch.output_address, launch.engine_index, launch.parent_pid, stop))
    beat.start()
    code = 0
    try:
        t0 = time.perf_counter()
        engine, info = launch.factory()
        # what start-up made (traced programs, the tokenizer...) lives as long as the process: keep it out of
        # the collector's full passes, which otherwise walk it (~1M objects) in the middle of steps (vLLM does
        # the same after start-up)
        gc.collect()
        gc.freeze()
        info = dict(info, startup_s=time.perf_counter() - t0, pid=os.getpid())
        _send_to(outs, Ready(launch.engine_index, info))
        try:
            EngineCoreProc(engine, engine_index=launch.engine_index, input_socket=inp, output_socket=outs,
                           stats_interval_s=launch.stats_interval_s).run_busy_loop()
        finally:
            trace = getattr(engine, "write_step_trace", None)
            if trace is not None and trace():
                logger.info("engine core %d: step trace written to $JAXKV_STEP_TRACE", launch.engine_index)
    except SystemExit:
        code = 0
    except BaseException as e:  # noqa: BLE001 - report every failure, then exit non-zero
        tb = traceback.format_exc()
        logger.error("engine core %d failed:\n%s", launch.engine_index, tb)
        _send_to(outs, EngineDead(launch.engine_index, type(e).__name__, str(e), tb))
        code = 1
    finally:
        stop.set()
        inp.close()
        for out in outs:
            out.close()
        ctx.term()
    return code


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing is not news
    launch = pickle.loads(sys.stdin.buffer.read())
    return run_engine_core(launch)


if __name__ == "__main__":
    sys.exit(main())
