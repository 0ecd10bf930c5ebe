"""Front-end clients of engine-core processes: launch, load balancing, liveness, shutdown.

vLLM: ``vllm/v1/engine/core_client.py`` (``SyncMPClient``, ``AsyncMPClient``, ``DPLBAsyncMPClient``) and
``v1/engine/utils.py`` (process launch). The front end binds two ZeroMQ sockets, a ROUTER for its input
messages (one routing id per data-parallel rank) and a PULL for every rank's outputs; each engine core
(:mod:`jaxkv.engine.core`) connects to both. A rank on another host is only another process that
connects to the same two TCP endpoints (:class:`DataParallelConfig`, ``data_parallel_address``).

* :class:`SyncMPClient` — for the offline ``LLM``: a reader thread takes every message off the output
  socket (heartbeats, process deaths) and queues the rest for the caller.
* :class:`AsyncMPClient` — for the server: an asyncio task reads the output socket and hands each step's
  outputs to a callback on the event loop; nothing blocks the loop.

Data parallelism is independent engines (vLLM's DP for dense models): each rank has its own scheduler,
block pool, buckets and ``max_num_seqs``, and steps at its own pace. A request goes to a rank with about the
fewest outstanding requests, the one that last took a prompt with the same first block or else the one that
keeps the outstanding output budgets and prompt tokens most even (:mod:`jaxkv.engine.load_balancer`).

Liveness: a local core that exits is seen within ``_POLL_S`` (its process is polled); a remote one
(``data_parallel_size_local < data_parallel_size``) when its heartbeats stop for
``heartbeat_timeout_s``. Either way every caller gets :class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import zmq
import zmq.asyncio

from jaxkv._lazy import python_module
from jaxkv.engine import protocol
from jaxkv.engine.core import EngineCoreLaunch, as_tuple, routing_id
from jaxkv.engine.load_balancer import LoadBalancer
from jaxkv.engine.protocol import (
    AbortRequests,
    AddRequests,
    AddResult,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    Heartbeat,
    Ready,
    Shutdown,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("jaxkv.engine_core")

_POLL_S = 0.1  # how often the reader looks at the core processes when no message comes


class EngineDeadError(RuntimeError):
    """An engine core died (killed, out of memory, an error in a step); no request can be served by this
    front end any more. vLLM: ``EngineDeadError``. ``error_type`` / ``message``: the core's exception, when
    it could report one (``None`` for a killed process)."""

    error_type: str | None = None
    message: str | None = None


class EngineNotReadyError(RuntimeError):
    """The engine cores are still starting (loading weights, compiling): try again shortly."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """Where the data-parallel ranks run (vLLM's ``--data-parallel-*`` options).

    Attributes:
        data_parallel_size: ranks in all (``N`` independent engines).
        data_parallel_size_local: ranks this process starts, from ``data_parallel_start_rank`` (default:
            all of them); the others connect from elsewhere.
        data_parallel_start_rank: the first rank started here (a headless host starts its own share).
        data_parallel_address: the front end's host for TCP endpoints; ``None``: one host, ``ipc://``
            sockets in a temporary directory.
        data_parallel_rpc_port: the front end's input port (outputs on the next port).
        devices_per_rank: accelerators each local rank owns (its ``tensor_parallel_size``); rank ``r``
            gets devices ``[r * devices_per_rank, (r + 1) * devices_per_rank)`` of this host's visible
            ones (``CUDA_VISIBLE_DEVICES``) when more than one rank runs here.
    """

    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 13345
    devices_per_rank: int = 1

    def __post_init__(self):
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} must be >= 1")
        local = self.local_size
        if not 0 <= self.data_parallel_start_rank or self.data_parallel_start_rank + local > self.data_parallel_size:
            raise ValueError(f"data_parallel_start_rank={self.data_parallel_start_rank} with "
                             f"data_parallel_size_local={local} exceeds data_parallel_size="
                             f"{self.data_parallel_size}")
        if self.devices_per_rank < 1:
            raise ValueError(f"devices_per_rank={self.devices_per_rank} must be >= 1")

    @property
    def local_size(self) -> int:
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def local_ranks(self) -> range:
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + self.local_size)

    def make_ipc_dir(self) -> str | None:
        """A fresh directory for the ``ipc://`` endpoints (its creator removes it), or None with TCP ones."""
        return None if self.data_parallel_address is not None else tempfile.mkdtemp(prefix="jaxkv-ipc-")

    def addresses(self, ipc_dir: str | None = None, client_index: int = 0) -> tuple[str, str]:
        """``(input, output)`` endpoints of front end ``client_index`` (an API-server process): TCP on
        ``data_parallel_address`` (ports ``rpc_port + 2 * client_index`` and the next) or ``ipc://`` in
        ``ipc_dir``."""
        if self.data_parallel_address is None:
            if ipc_dir is None:
                raise ValueError("ipc endpoints need a directory")
            suffix = "" if client_index == 0 else f"-{client_index}"
            return f"ipc://{ipc_dir}/input{suffix}", f"ipc://{ipc_dir}/output{suffix}"
        host, port = self.data_parallel_address, self.data_parallel_rpc_port + 2 * client_index
        return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"

    def all_addresses(self, num_clients: int, ipc_dir: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Every front end's ``(input, output)`` endpoints, as two tuples indexed by ``client_index``."""
        pairs = [self.addresses(ipc_dir, i) for i in range(num_clients)]
        return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)


@dataclasses.dataclass(frozen=True)
class FrontEndAttach:
    """How one of several API-server processes (vLLM's ``--api-server-count``) reaches engine cores that
    another process (the server's supervisor) started: its ``client_index``, the two endpoints it binds
    (:meth:`DataParallelConfig.addresses`) and the local cores' pids, watched through ``/proc``."""

    client_index: int
    input_address: str
    output_address: str
    core_pids: dict[int, int]


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def device_env(local_index: int, devices_per_rank: int, visible: str | None = None) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for the ``local_index``-th rank on this host: its slice of the visible
    devices (``visible``: the host's own list, default all ``0..``)."""
    ids = [d for d in (visible or "").split(",") if d.strip()] if visible else None
    first = local_index * devices_per_rank
    if ids is None:
        mine = [str(i) for i in range(first, first + devices_per_rank)]
    else:
        if first + devices_per_rank > len(ids):
            raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} has {len(ids)} devices; rank {local_index} "
                             f"needs devices {first}..{first + devices_per_rank - 1}")
        mine = ids[first:first + devices_per_rank]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def launch_engine_cores(factory: Callable[[], tuple[Any, dict]], dp: DataParallelConfig,
                        input_address: str | Sequence[str], output_address: str | Sequence[str], *,
                        parent_pid: int | None = None, env: dict[str, str] | None = None
                        ) -> dict[int, subprocess.Popen]:
    """Start this host's engine cores (``python -m jaxkv.engine.core``), one per local rank.

    With more than one local rank each gets its own devices (:func:`device_env`); ``env`` is added to
    every core's environment. ``input_address`` / ``output_address``: the front end's endpoints, or a
    sequence of each, one per API-server process. Returns ``{rank: process}``.
    """
    procs: dict[int, subprocess.Popen] = {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for i, rank in enumerate(dp.local_ranks):
        child_env = dict(os.environ, **(env or {}))
        if dp.local_size > 1 or dp.data_parallel_size > 1:
            child_env.update(device_env(i, dp.devices_per_rank, visible))
        launch = EngineCoreLaunch(rank, as_tuple(input_address), as_tuple(output_address), factory,
                                  parent_pid=os.getpid() if parent_pid is None else parent_pid)
        argv, child_env = python_module("jaxkv.engine.core", child_env)
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=child_env)
        proc.stdin.write(pickle.dumps(launch))
        proc.stdin.close()
        procs[rank] = proc
    return procs


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = 5.0, *, wait_first: bool = True) -> None:
    """Wait for ``procs`` to exit (unless ``wait_first`` is false: processes that will not stop by themselves),
    then SIGTERM, then SIGKILL; none is left running."""
    deadline = time.monotonic() + timeout_s
    for sig in (None, signal.SIGTERM, signal.SIGKILL)[0 if wait_first else 1:]:
        for p in procs:
            if sig is not None and p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return
        deadline = time.monotonic() + 2.0


def _cleanup(procs, ctx, sockets, tmpdir, closing_flag) -> None:
    closing_flag.set()
    for s in sockets:
        try:
            s.close(linger=0)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    stop_processes(list(procs))
    ctx.term()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


def aggregate_stats(per_rank: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """Every rank's counters as one dict: sums, except shares and rates, which are averaged."""
    ranks = [s for s in per_rank if s]
    if not ranks:
        return {}
    out: dict[str, Any] = {}
    for key in ranks[0]:
        values = [s[key] for s in ranks if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool)]
        if not values:
            continue
        if key.endswith(("usage", "rate", "share")) or key in ("num_buckets",):
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(values)
    return out


class _MPClient:
    """What both clients share: sockets, the cores' processes, per-rank state, placement, shutdown."""

    def __init__(self, factory, dp: DataParallelConfig, *, env: dict[str, str] | None = None,
                 heartbeat_timeout_s: float = 10.0, asyncio_mode: bool = False,
                 attach: FrontEndAttach | None = None):
        self.dp = dp
        self.num_engines = dp.data_parallel_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.attach = attach
        self.client_index = 0 if attach is None else attach.client_index
        if attach is None:
            self._tmpdir = dp.make_ipc_dir()
            self.input_address, self.output_address = dp.addresses(self._tmpdir)
        else:  # the supervisor made the endpoints' directory and removes it
            self._tmpdir = None
            self.input_address, self.output_address = attach.input_address, attach.output_address
        self._ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.input_socket = zmq.Socket(self._ctx, zmq.ROUTER)  # a plain socket: sends never await
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(self.input_address)
        self.output_socket = self._ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(self.output_address)
        self.engine_info: list[dict[str, Any] | None] = [None] * self.num_engines
        self.engine_stats: list[dict[str, Any] | None] = [None] * self.num_engines
        self.balancer = LoadBalancer(self.num_engines)
        self._last_seen = [time.monotonic()] * self.num_engines
        self.dead_error: EngineDeadError | None = None
        self._closing = threading.Event()
        self.procs = ({} if attach is not None
                      else launch_engine_cores(factory, dp, self.input_address, self.output_address, env=env))
        self._finalizer = weakref.finalize(self, _cleanup, list(self.procs.values()), self._ctx,
                                           [self.input_socket, self.output_socket], self._tmpdir, self._closing)

    # -- state -------------------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return all(info is not None for info in self.engine_info)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and not self._closing.is_set()

    def _check_processes(self) -> EngineDeadError | None:
        """A dead core, as an error (``None``: every local core runs and remote ones beat)."""
        if self._closing.is_set() or self.dead_error is not None:
            return None
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return EngineDeadError(f"engine core {rank} (pid {p.pid}) exited with code {code}")
        watched = {} if self.attach is None else self.attach.core_pids
        for rank, pid in watched.items():
            if not _pid_alive(pid):
                return EngineDeadError(f"engine core {rank} (pid {pid}) exited")
        now = time.monotonic()
        for rank in range(self.num_engines):
            remote = rank not in self.procs and rank not in watched
            if remote and now - self._last_seen[rank] > self.heartbeat_timeout_s:
                return EngineDeadError(f"engine core {rank} sent no heartbeat for {self.heartbeat_timeout_s} s")
        return None

    def _note(self, msg) -> bool:
        """Book-keeping every message gets; True if the caller must still act on it."""
        rank = getattr(msg, "engine_index", None)
        if rank is not None and 0 <= rank < self.num_engines:
            self._last_seen[rank] = time.monotonic()
        if isinstance(msg, Heartbeat):
            return False
        if isinstance(msg, Ready):
            self.engine_info[msg.engine_index] = dict(msg.info)
            # every API-server process gets the message; the first one's log line stands for all
            logger.log(logging.INFO if self.client_index == 0 else logging.DEBUG, "engine core %d ready: %s",
                       msg.engine_index, msg.info)
        elif isinstance(msg, EngineCoreOutputs):
            if msg.stats is not None:
                self.engine_stats[msg.engine_index] = msg.stats
            for out in msg.outputs:
                if out.finished:
                    self._forget(out.request_id)
        return True

    def _dead_from(self, msg: EngineDead) -> EngineDeadError:
        error = EngineDeadError(f"engine core {msg.engine_index} failed: {msg.error_type}: {msg.message}")
        error.error_type, error.message = msg.error_type, msg.message
        return error

    # -- placement (jaxkv.engine.load_balancer) ---------------------------------------------------------
    @property
    def outstanding(self) -> list[int]:
        """Placed, unfinished requests per rank."""
        return self.balancer.outstanding

    def _place(self, request: EngineCoreRequest) -> int:
        return self.balancer.place(request.request_id, request.prompt_token_ids, request.sampling_params.max_tokens)

    def _forget(self, request_id: str) -> None:
        self.balancer.forget(request_id)

    # -- sending -----------------------------------------------------------------------------------------
    def _send(self, rank: int, msg) -> None:
        self.input_socket.send_multipart((routing_id(rank), protocol.encode(msg)), copy=False)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); each core applies it before its next
        step."""
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.balancer.rank_of(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
                self._forget(rid)
        if not self.is_alive:
            return
        for rank, ids in by_rank.items():
            self._send(rank, AbortRequests(ids))

    def shutdown(self) -> None:
        """Tell every core to exit, wait for them (then SIGTERM, SIGKILL), close the sockets."""
        if self._finalizer.alive:
            if self.dead_error is None and self.attach is None:  # attached: the supervisor stops the cores
                for rank in range(self.num_engines):
                    if self.engine_info[rank] is not None:
                        try:
                            self._send(rank, Shutdown())
                        except zmq.ZMQError:
                            pass
            self._closing.set()
            self._stop_reader()
            self._finalizer()

    def _stop_reader(self) -> None:
        pass

    @property
    def pids(self) -> list[int]:
        if self.attach is not None:
            return list(self.attach.core_pids.values())
        return [p.pid for p in self.procs.values()]


class SyncMPClient(_MPClient):
    """Engine cores for a synchronous caller (the offline ``LLM``). vLLM: ``SyncMPClient``.

    Args:
        factory: picklable ``() -> (LLMEngine, info)``, run in every core process.
        dp: where the ranks run.
        env: added to the cores' environment.
        startup_timeout_s: most seconds :meth:`wait_ready` waits (``None``: as long as the cores live).
    """

    def __init__(self, factory, dp: DataParallelConfig | None = None, *, env=None,
                 heartbeat_timeout_s: float = 10.0):
        super().__init__(factory, dp or DataParallelConfig(), env=env, heartbeat_timeout_s=heartbeat_timeout_s)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._held: collections.deque = collections.deque()
        self._calls = itertools.count()
        self._reader = threading.Thread(target=self._read, name="jaxkv-core-client", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        sock = self.output_socket
        while not self._closing.is_set():
            try:
                ready = sock.poll(int(_POLL_S * 1000))
            except zmq.ZMQError:
                return
            if ready:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
                msg = protocol.decode_output(data)
                if isinstance(msg, EngineDead):
                    self._die(self._dead_from(msg))
                    logger.error("engine core %d traceback:\n%s", msg.engine_index, msg.traceback)
                    return
                if self._note(msg):
                    if isinstance(msg, Ready):
                        if self.is_ready:
                            self._ready.set()
                    else:
                        self._queue.put(msg)
            error = self._check_processes()
            if error is not None:
                self._die(error)
                return

    def _die(self, error: EngineDeadError) -> None:
        if self._closing.is_set():
            return
        self.dead_error = error
        self._ready.set()
        self._queue.put(error)

    def _stop_reader(self) -> None:
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(2.0)

    def wait_ready(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Block until every core announced itself; their ``info`` dicts.

        Raises:
            EngineDeadError: a core died while starting (its error's text).
            TimeoutError: ``timeout_s`` passed.
        """
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"engine cores not ready after {timeout_s} s")
        if self.dead_error is not None:
            raise self.dead_error
        return list(self.engine_info)

    def _next_message(self, timeout_s: float | None = None):
        if self._held:
            return self._held.popleft()
        try:
            msg = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(msg, EngineDeadError):
            self._queue.put(msg)  # every later call fails the same way
            raise msg
        return msg

    def _wait_for(self, match, count: int) -> list:
        """The next ``count`` messages ``match`` accepts; the others are held for :meth:`get_output`."""
        got, other = [], []
        try:
            while len(got) < count:
                msg = self._next_message()
                (got if match(msg) else other).append(msg)
        finally:
            self._held.extend(other)
        return got

    def add_requests(self, requests: Sequence[EngineCoreRequest], *, wait: bool = True) -> list[int]:
        """Place and queue ``requests``. Returns each one's rank.

        With ``wait`` (default) all or none: the cores acknowledge them before this returns. Without, they
        are sent and this returns at once; a request a core rejects then comes back as an output with
        ``error`` (vLLM's asynchronous ``add_request``).

        Raises:
            ValueError: (``wait``) a core rejected one of them (its message); none is queued anywhere.
            EngineDeadError: a core is dead.
        """
        if self.dead_error is not None:
            raise self.dead_error
        ranks = [self._place(r) for r in requests]
        by_rank: dict[int, list[EngineCoreRequest]] = {}
        for req, rank in zip(requests, ranks):
            by_rank.setdefault(rank, []).append(req)
        if not wait:
            for rank, reqs in by_rank.items():
                self._send(rank, AddRequests(reqs))
            return ranks
        ack = next(self._calls)
        for rank, reqs in by_rank.items():
            self._send(rank, AddRequests(reqs, ack=ack))
        results = self._wait_for(lambda m: isinstance(m, AddResult) and m.ack == ack, len(by_rank))
        errors = [r for r in results if r.error is not None]
        if errors:
            accepted = {r.engine_index for r in results if r.error is None}
            for rank in accepted:
                self._send(rank, AbortRequests([q.request_id for q in by_rank[rank]]))
            for req in requests:
                self._forget(req.request_id)
            raise ValueError(errors[0].error)
        return ranks

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        """The next step's outputs of any core (``None`` after ``timeout_s``).

        Raises:
            EngineDeadError: a core died.
        """
        while True:
            msg = self._next_message(timeout_s)
            if msg is None or isinstance(msg, EngineCoreOutputs):
                return msg

    def call_utility(self, method: str, *args) -> list[Any]:
        """``utility_<method>(*args)`` on every core; the results by rank.

        Raises:
            RuntimeError: a core raised (its type and message).
        """
        call_id = next(self._calls)
        for rank in range(self.num_engines):
            self._send(rank, UtilityCall(call_id, method, list(args)))
        results = self._wait_for(lambda m: isinstance(m, UtilityResult) and m.call_id == call_id,
                                 self.num_engines)
        results.sort(key=lambda r: r.engine_index)
        for r in results:
            if r.error is not None:
                raise RuntimeError(f"engine core {r.engine_index}: {r.error}")
        return [r.result for r in results]


class AsyncMPClient(_MPClient):
    """Engine cores for an asyncio front end (the server). vLLM: ``AsyncMPClient`` / ``DPLBAsyncMPClient``.

    Outputs are delivered on the event loop to ``output_handler(EngineCoreOutputs)``; a dead core calls
    ``dead_handler(EngineDeadError)`` once. :meth:`start` must run inside the loop.
    """

    def __init__(self, factory, dp: DataParallelConfig | None = None, *, env=None,
                 heartbeat_timeout_s: float = 10.0, attach: FrontEndAttach | None = None):
        super().__init__(factory, dp or DataParallelConfig(), env=env, heartbeat_timeout_s=heartbeat_timeout_s,
                         asyncio_mode=True, attach=attach)
        self.output_handler: Callable[[EngineCoreOutputs], None] = lambda outputs: None
        self.dead_handler: Callable[[EngineDeadError], None] = lambda error: None
        self.ready_handler: Callable[[], None] = lambda: None
        self._task: asyncio.Task | None = None
        self._calls = itertools.count()
        self._pending_calls: dict[int, tuple[asyncio.Future, list]] = {}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._read(), name="jaxkv-core-client")

    async def _read(self) -> None:
        sock = self.output_socket
        last_check = time.monotonic()
        try:
            while not self._closing.is_set():
                if await sock.poll(int(_POLL_S * 1000)):
                    msg = protocol.decode_output(await sock.recv())
                    if isinstance(msg, EngineDead):
                        logger.error("engine core %d traceback:\n%s", msg.engine_index, msg.traceback)
                        self._die(self._dead_from(msg))
                        return
                    if self._note(msg):
                        self._dispatch(msg)
                now = time.monotonic()
                if now - last_check >= _POLL_S:
                    last_check = now
                    error = self._check_processes()
                    if error is not None:
                        self._die(error)
                        return
        except (asyncio.CancelledError, zmq.ZMQError):
            return

    def _dispatch(self, msg) -> None:
        if isinstance(msg, EngineCoreOutputs):
            if msg.outputs:
                self.output_handler(msg)
        elif isinstance(msg, Ready):
            if self.is_ready:
                self.ready_handler()
        elif isinstance(msg, UtilityResult):
            pending = self._pending_calls.get(msg.call_id)
            if pending is not None:
                fut, results = pending
                results.append(msg)
                if len(results) == self.num_engines and not fut.done():
                    fut.set_result(sorted(results, key=lambda r: r.engine_index))

    def _die(self, error: EngineDeadError) -> None:
        if self._closing.is_set() or self.dead_error is not None:
            return
        self.dead_error = error
        logger.error("%s", error)
        for fut, _ in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(error)
        self.dead_handler(error)

    def add_request(self, request: EngineCoreRequest) -> int:
        """Place and queue one request; a rejection comes back as an output with ``error``. Its rank.

        Raises:
            EngineDeadError: a core is dead. EngineNotReadyError: cores still starting.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if not self.is_ready:
            raise EngineNotReadyError("the engine is starting (loading weights, compiling); retry shortly")
        rank = self._place(request)
        self._send(rank, AddRequests([request], client_index=self.client_index))
        return rank

    async def call_utility(self, method: str, *args) -> list[Any]:
        """``utility_<method>(*args)`` on every core; the results by rank."""
        if self.dead_error is not None:
            raise self.dead_error
        call_id = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = (fut, [])
        try:
            for rank in range(self.num_engines):
                self._send(rank, UtilityCall(call_id, method, list(args), client_index=self.client_index))
            results = await fut
        finally:
            self._pending_calls.pop(call_id, None)
        for r in results:
            if r.error is not None:
                raise RuntimeError(f"engine core {r.engine_index}: {r.error}")
        return [r.result for r in results]

    def _stop_reader(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
