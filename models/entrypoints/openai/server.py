"""The OpenAI-compatible server process (vLLM's ``vllm serve``, ``entrypoints/openai/api_server.py``'s
``run_server``): build the app over an engine, run it with uvicorn, and the process layouts around it.

    jaxkv serve [MODEL] [--host 127.0.0.1] [--port 8000] [engine flags] [server flags]

Flags: :func:`models.entrypoints.openai.cli_args.make_arg_parser` (``jaxkv serve --help``). Then ``curl
localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'`` or the ``openai``
client with ``base_url="http://localhost:8000/v1"``. Routes: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` (503 until the engine is loaded and compiled, then 200; 503 again if it dies),
``/stats`` (JSON), ``/metrics`` (Prometheus).

Processes (docs/serving.md): this process serves HTTP, tokenizes, detokenizes and streams; the engine runs
in one engine-core process per data-parallel rank (``-dp N``), each on its own ``-tp`` devices with its
own scheduler, block pool and ``--max-num-seqs``. HTTP answers at once; the cores load and compile
meanwhile. If a core dies, in-flight requests fail, new ones get 503 and the server exits with code 1.
``--api-server-count N`` (vLLM's flag) runs N such front ends as processes sharing the listening socket, each
connected to every engine core; this process then only supervises them (SIGTERM drains them all).

Multi-host data parallelism (vLLM's flags): the front end ``--data-parallel-address HOST
--data-parallel-rpc-port P -dp 4 --data-parallel-size-local 2`` starts ranks 0-1; another host runs
``--headless --data-parallel-address HOST --data-parallel-rpc-port P -dp 4 --data-parallel-size-local 2
--data-parallel-start-rank 2`` with the same model flags: its two cores connect to the front end.

Exposing it: ``--api-key`` (or ``JAXKV_API_KEY``) makes every ``/v1/*`` request need ``Authorization: Bearer
KEY``; the input limits fail closed (413 / 400 / 503, docs/server.md lists them); SIGTERM drains: new
requests get 503, those in flight may finish for ``--shutdown-timeout`` seconds, the rest are aborted with an
error, and the process (and its cores) exits 0.
Needs the ``serve`` extra (``pip install -e ".[serve]"``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import socket
import sys

from models.entrypoints.openai.cli_args import (
    AUTO_API_SERVERS_MIN_CPUS,
    checked_server_flags,
    is_loopback,
    make_arg_parser,
)

log = logging.getLogger("jaxkv.serve")


def parse_args(argv=None) -> argparse.Namespace:
    return make_arg_parser(description=__doc__).parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        import pydantic  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401 - fail before loading weights (and before the flags, which need them)
    except ImportError as e:
        raise SystemExit(f"error: {e.name} is missing: pip install -e '.[serve]'") from None
    args = parse_args(argv)
    attach = os.environ.get(ATTACH_ENV)  # set for the API-server processes of --api-server-count
    if args.api_server_count is None:
        args.api_server_count = default_api_server_count(args)
    try:
        if args.headless:
            return run_headless(args)
        if args.api_server_count < 1:
            raise ValueError(f"--api-server-count={args.api_server_count} must be >= 1")
        if args.api_server_count > 1 and not attach:
            return run_api_servers(args, sys.argv[1:] if argv is None else list(argv))
        server, async_llm = build_server(args, attach=json.loads(attach) if attach else None)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"error: {e}") from None
    # uvicorn handles SIGTERM/SIGINT during run() (stops serving, shuts the engine down) and raises the
    # signal again afterwards: let that land here, so a requested stop exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # what start-up made (the app, the tokenizer; in-process, the engine and its programs) lives as long as the
    # process: keep it out of the collector's full passes, which stall every stream while they walk it (a
    # pass over an in-process engine's ~340k objects took ~100 ms on the CPU machine; the engine-core
    # process does the same, and so does vLLM)
    gc.collect()
    gc.freeze()
    server.run(sockets=[socket.socket(fileno=json.loads(attach)["fd"])] if attach else None)
    if async_llm.dead_error is not None:
        log.error("exiting: %s", async_llm.dead_error)
        return 1
    if server.drain_result is not None:
        log.info("stopped after draining: %s", server.drain_result)
    return 0


def engine_args(args: argparse.Namespace):
    """The :class:`EngineArgs` of the command line (unset options keep the shared defaults).

    Raises:
        ValueError: a value out of range, naming the flag.
    """
    from models.entrypoints.engine_args import EngineArgs

    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]")
    return EngineArgs.from_cli_args(args)


def data_parallel_config(args: argparse.Namespace):
    from jaxkv.engine.core_client import DataParallelConfig
    return DataParallelConfig(data_parallel_size=args.data_parallel_size or 1,
                              data_parallel_size_local=args.data_parallel_size_local,
                              data_parallel_start_rank=args.data_parallel_start_rank,
                              data_parallel_address=args.data_parallel_address,
                              data_parallel_rpc_port=args.data_parallel_rpc_port,
                              devices_per_rank=args.tensor_parallel_size or 1)


def build_server(args: argparse.Namespace, attach: dict | None = None):
    """The :class:`GracefulServer` (a ``uvicorn.Server`` that drains on SIGTERM; not yet running) and its
    :class:`AsyncLLM`. With engine-core processes the cores start loading now and the server answers
    ``/health`` with 503 until they are ready. ``attach``: this is API-server process ``client_index`` of
    ``--api-server-count``, a front end of cores the supervisor started (:func:`run_api_servers`)."""
    from jaxkv.engine.core_client import AsyncMPClient, FrontEndAttach
    from models.entrypoints.engine_args import EngineCoreFactory, multiprocessing_enabled, resolve_max_model_len

    limits, keys = checked_server_flags(args)  # bad flags fail before any process starts
    eargs = engine_args(args)
    dp = data_parallel_config(args)
    multiprocessing = multiprocessing_enabled(args.enable_multiprocessing)
    client = None
    if multiprocessing and attach is None:
        # the cores start now (their imports, weights, compiles) while this process imports the model registry
        # and the HTTP app (~1.5 s on the CPU machine: jaxkv's and models' package imports are lazy for this)
        client = AsyncMPClient(EngineCoreFactory(eargs), dp)
    try:
        import uvicorn

        from models import registry
        from models.entrypoints.async_llm import AsyncLLM
        from models.entrypoints.openai.api_server import build_app
        from models.entrypoints.openai.drain import GracefulServer

        path = registry.resolve_model(eargs.model)  # a bad name: one clear error, the cores stopped
    except BaseException:
        if client is not None:
            client.shutdown()
        raise
    names = args.served_model_name or [args.model or eargs.model]
    if multiprocessing:
        if attach is not None:
            client = AsyncMPClient(None, dp, attach=FrontEndAttach(
                attach["client_index"], attach["input_address"], attach["output_address"],
                {int(r): pid for r, pid in attach["core_pids"].items()}))
        config = registry.load_config(path)
        tokenizer = registry.load_model_tokenizer(path, eargs.tokenizer, config)
        max_model_len = resolve_max_model_len(eargs, config)
        async_llm = AsyncLLM.from_client(client, tokenizer, log_stats_interval_s=args.log_stats_interval)
        info = dict(model=registry.model_name(path), tensor_parallel_size=eargs.tensor_parallel_size,
                    data_parallel_size=dp.data_parallel_size, engine="engine-core processes")
        if attach is not None:
            info.update(api_server_index=attach["client_index"], api_server_count=args.api_server_count)

        def ready():  # logged by the first API-server process only: every one of them gets here
            level = logging.INFO if client.client_index == 0 else logging.DEBUG
            log.log(level, "jaxkv server: %s", " ".join(f"{k}={v}" for k, v in (client.engine_info[0] or {}).items()))
            log.log(level, "engine ready: %d data-parallel rank(s), pids %s", dp.data_parallel_size, client.pids)

        client.ready_handler = ready
    else:
        from models.entrypoints.llm import LLM
        if dp.data_parallel_size > 1:
            raise ValueError(f"--data-parallel-size={dp.data_parallel_size} needs engine-core processes")
        llm = LLM(**dict(vars(eargs), model=eargs.model), enable_multiprocessing=False)
        tokenizer, max_model_len = llm.tokenizer, llm.max_model_len
        async_llm = AsyncLLM(llm.engine, llm.tokenizer, log_stats_interval_s=args.log_stats_interval)
        info = dict(llm.engine_info[0], engine="in-process thread")
        log.info("jaxkv server: %s", " ".join(f"{k}={v}" for k, v in info.items()))
    app = build_app(async_llm, tokenizer, served_model_names=names, max_model_len=max_model_len,
                    extra_stats={k: v for k, v in info.items() if isinstance(v, (int, float, str))},
                    limits=limits, api_keys=keys, enable_auto_tool_choice=args.enable_auto_tool_choice,
                    tool_call_parser=args.tool_call_parser)
    # timeout_graceful_shutdown: uvicorn's own wait for connections after the drain (a slow client's)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=args.access_log,
                            log_level="info", timeout_keep_alive=30, timeout_graceful_shutdown=5)
    server = GracefulServer(config, admission=app.state.admission, engine=app.state.aborting_engine,
                            shutdown_timeout_s=args.shutdown_timeout)

    def on_dead(error):  # vLLM: EngineDeadError shuts the API server down
        log.error("engine core died (%s): shutting the server down", error)
        server.should_exit = True

    async_llm.on_dead = on_dead
    log.info("limits: %s; api keys: %d; shutdown timeout %g s",
             " ".join(f"{k}={v}" for k, v in limits.as_stats().items()), len(keys), args.shutdown_timeout)
    if not keys and not is_loopback(args.host):
        log.warning("no --api-key (or JAXKV_API_KEY): anyone who reaches %s:%d can use this server",
                    args.host, args.port)
    log.info("serving %s on http://%s:%d/v1", names[0], args.host, args.port)
    return server, async_llm


ATTACH_ENV = "JAXKV_API_SERVER_ATTACH"  # JSON for an API-server process: client_index, endpoints, core pids, fd
PROMETHEUS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode (several API servers)
PROMETHEUS_DIR_PREFIX = "jaxkv-prometheus-"  # + the supervisor's pid + "-": its metrics directory


def remove_stale_metrics_dirs(tmp: str | None = None) -> list[str]:
    """Remove the metrics directories of supervisors that are gone without cleaning up (killed with SIGKILL);
    returns their paths. A directory is stale when the pid in its name is not a live process."""
    import shutil
    import tempfile

    removed = []
    root = tmp or tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(PROMETHEUS_DIR_PREFIX):
            continue
        pid = name[len(PROMETHEUS_DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal: leave it)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(os.path.join(root, name))
    return removed


def run_api_servers(args: argparse.Namespace, argv: list[str]) -> int:
    """``--api-server-count N``: start the engine cores, bind the port once, and run ``N`` API-server
    processes (this module again, ``python -m``, with :data:`ATTACH_ENV`) that share the listening socket (the kernel
    spreads connections over them) and each bind their own endpoints, which every core connects to. Each
    balances its own requests over the ranks. SIGTERM / SIGINT are passed to them (they drain); when one
    exits on its own (a dead core, a crash) the others are stopped. Then the cores are stopped. The exit
    code: 0 when every API server exited 0 (a requested stop), else the largest positive code (1 for one
    killed by a signal). vLLM: ``--api-server-count``."""
    import shutil
    import subprocess
    import tempfile
    import time

    from jaxkv.engine.core_client import launch_engine_cores, stop_processes
    from models import registry
    from models.entrypoints.engine_args import EngineCoreFactory, multiprocessing_enabled

    n = args.api_server_count
    if not multiprocessing_enabled(args.enable_multiprocessing):
        raise ValueError(f"--api-server-count={n} needs engine-core processes")
    checked_server_flags(args)  # bad flags fail before any process starts
    eargs = engine_args(args)
    dp = data_parallel_config(args)
    registry.resolve_model(eargs.model)
    listener = socket.create_server((args.host, args.port), backlog=4096)  # SO_REUSEADDR, like uvicorn
    listener.set_inheritable(True)
    tmpdir = dp.make_ipc_dir()
    inputs, outputs = dp.all_addresses(n, tmpdir)
    cores = launch_engine_cores(EngineCoreFactory(eargs), dp, inputs, outputs)
    core_pids = {rank: p.pid for rank, p in cores.items()}
    log.info("engine cores %s (pids %s); starting %d API-server processes on %s:%d", list(cores),
             list(core_pids.values()), n, args.host, args.port)
    # /metrics: the API servers keep their metrics in one directory and each scrape sums them (prometheus_client's
    # multiprocess mode, as vLLM sets it up); a directory given by the user is used as it is and left in place
    prom_dir = None
    if os.environ.get(PROMETHEUS_ENV):
        log.warning("%s=%s is set: the API servers' metrics go there (it is not emptied or removed)",
                    PROMETHEUS_ENV, os.environ[PROMETHEUS_ENV])
    else:
        remove_stale_metrics_dirs()
        prom_dir = tempfile.mkdtemp(prefix=f"{PROMETHEUS_DIR_PREFIX}{os.getpid()}-")
    child_env = dict(os.environ, **({PROMETHEUS_ENV: prom_dir} if prom_dir else {}))
    servers = []
    for i in range(n):
        attach = dict(client_index=i, input_address=inputs[i], output_address=outputs[i], core_pids=core_pids,
                      fd=listener.fileno())
        servers.append(subprocess.Popen([sys.executable, "-m", __spec__.name, *argv],
                                        env=dict(child_env, **{ATTACH_ENV: json.dumps(attach)}),
                                        pass_fds=(listener.fileno(),),
                                        start_new_session=True))  # a terminal's Ctrl-C reaches them once, from here
    listener.close()
    requested = False

    def forward(signum, frame):
        nonlocal requested
        requested = True
        for p in servers:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        while any(p.poll() is None for p in servers):
            if not requested and any(p.poll() is not None for p in servers):
                log.error("an API-server process exited (codes %s): stopping the others",
                          [p.poll() for p in servers])
                requested = True
                for p in servers:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
            time.sleep(0.1)
    finally:
        stop_processes(list(servers), timeout_s=args.shutdown_timeout + 10)
        # the cores serve every API server and have no front end of their own to lose: stop them now
        # (waiting first for them to exit cost 5 s on the H200)
        stop_processes(list(cores.values()), wait_first=False)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
        if prom_dir is not None:
            shutil.rmtree(prom_dir, ignore_errors=True)
    codes = [p.returncode for p in servers]
    return 0 if all(c == 0 for c in codes) else max([c for c in codes if c and c > 0] or [1])


def default_api_server_count(args: argparse.Namespace) -> int:
    """``--api-server-count`` when not given: 2 where that was measured faster, else 1.

    Session 18 (2xH200, SmolLM2, 1000 ShareGPT requests at rate inf, 16 ``openai`` client processes, nothing
    else running): one API-server process carried 0.85x the offline engine's output tok/s, two 0.93x. Two
    need a spare core each beside the engine core, so the default stays 1 below
    :data:`AUTO_API_SERVERS_MIN_CPUS` usable CPUs, with the in-process engine (one process), and for a
    multi-host deployment (``--data-parallel-address`` / ``--headless``), whose hosts must agree on the count:
    give it explicitly there.
    """
    from models.entrypoints.engine_args import multiprocessing_enabled

    if args.headless or args.data_parallel_address is not None:
        return 1
    if not multiprocessing_enabled(args.enable_multiprocessing):
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 if cpus >= AUTO_API_SERVERS_MIN_CPUS else 1


def run_headless(args: argparse.Namespace) -> int:
    """Start this host's engine cores for a front end elsewhere; wait for them; stop them on SIGTERM."""
    from jaxkv.engine.core_client import launch_engine_cores, stop_processes
    from models import registry
    from models.entrypoints.engine_args import EngineCoreFactory

    dp = data_parallel_config(args)
    if dp.data_parallel_address is None:
        raise ValueError("--headless needs --data-parallel-address (the front end's host)")
    eargs = engine_args(args)
    registry.resolve_model(eargs.model)
    input_address, output_address = dp.all_addresses(args.api_server_count)  # one pair per API server
    procs = launch_engine_cores(EngineCoreFactory(eargs), dp, input_address, output_address)
    log.info("headless: engine cores %s (pids %s) -> %s", list(procs), [p.pid for p in procs.values()],
             input_address)

    def stop(signum, frame):
        stop_processes(list(procs.values()))
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [p.wait() for p in procs.values()]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
