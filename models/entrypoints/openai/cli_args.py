"""The command line of ``jaxkv serve`` (vLLM: ``vllm/entrypoints/openai/cli_args.py``): the engine's flags
(:meth:`models.entrypoints.engine_args.EngineArgs.add_cli_args`), the server's, and the exposure flags
(API keys, input limits, drain), with the checks that turn them into server settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os

AUTO_API_SERVERS_MIN_CPUS = 8  # usable CPUs from which --api-server-count defaults to 2


def make_arg_parser(prog: str = "jaxkv serve", description: str | None = None) -> argparse.ArgumentParser:
    """Every flag of ``jaxkv serve`` (vLLM ``make_arg_parser``)."""
    from models.entrypoints.engine_args import EngineArgs

    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may use in 'model' (default: --model); the first is reported")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    # a server compiles each bucket's top-k/top-p and grammar-bitmask programs at start-up too: no stall at the
    # first such request
    EngineArgs.add_cli_args(p, compile_top_k_top_p=True, compile_structured_outputs=True)
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
    p.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    add_tool_args(p)
    add_exposure_args(p)
    return p


def add_tool_args(p: argparse.ArgumentParser) -> None:
    """``--enable-auto-tool-choice`` and ``--tool-call-parser`` (vLLM's flags)."""
    from models.entrypoints.openai.tool_parsers import TOOL_PARSERS

    g = p.add_argument_group("tool calling")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a request has tools): the model decides, '
                        "and its output is parsed for tool calls with --tool-call-parser")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the tool-call format of the model's output: hermes (Hermes, Qwen 2.5 / 3), "
                        "llama3_json (Llama 3.1+), mistral")


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


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"




def checked_server_flags(args: argparse.Namespace):
    """``(limits, api keys)`` of the command line.

    Raises:
        ValueError: a limit, an API key or ``--shutdown-timeout`` out of range, or ``--enable-auto-tool-choice``
            without ``--tool-call-parser`` (names the flag).
    """
    limits, keys = server_limits(args), api_keys(args)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout={args.shutdown_timeout} must be >= 0")
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return limits, keys
