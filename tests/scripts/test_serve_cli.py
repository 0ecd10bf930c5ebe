"""``jaxkv serve`` and ``jaxkv bench serving`` refuse bad options with one line, before loading anything; the
server's flag helpers (no model loaded)."""

from __future__ import annotations

import subprocess

import pytest

from models.entrypoints.openai import cli_args, server
from tests.conftest import jaxkv_command


@pytest.mark.parametrize("command,args,message", [
    (["serve"], ["no-such-model"], "error: model='no-such-model' is neither"),
    (["serve"], ["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization=1.5 must be in (0, 1]"),
    (["serve"], ["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (["bench", "serving"], ["--request-rate", "0.5x,inf"], "a relative rate needs an 'inf' run before it"),
    (["bench", "serving"], ["--request-rate", "0"], "--request-rate=0 must be > 0"),
    (["servee"], [], "jaxkv: unknown subcommand 'servee'"),
])
def test_bad_options_fail_fast_with_one_line(command, args, message):
    proc = subprocess.run([*jaxkv_command(), *command, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_exposure_flags_build_limits_and_keys():
    """--api-key / JAXKV_API_KEY and the limit flags (in-process: no model is loaded)."""
    from models.entrypoints.openai.limits import ServerLimits

    args = server.parse_args([])
    assert cli_args.server_limits(args) == ServerLimits() and args.shutdown_timeout == 20.0
    assert cli_args.api_keys(args, environ={}) == []
    assert cli_args.api_keys(args, environ={"JAXKV_API_KEY": "k0"}) == ["k0"]
    args = server.parse_args(["--api-key", "k1", "--api-key", "k2", "--max-pending-requests", "7",
                             "--max-request-body-bytes", "1000", "--shutdown-timeout", "3"])
    assert cli_args.api_keys(args, environ={"JAXKV_API_KEY": "k0"}) == ["k1", "k2"]  # the flag wins, as in vLLM
    limits = cli_args.server_limits(args)
    assert (limits.max_pending_requests, limits.max_request_body_bytes, args.shutdown_timeout) == (7, 1000, 3.0)
    with pytest.raises(ValueError, match=r"^--max-stop-strings=0 must be an integer >= 1$"):
        cli_args.server_limits(server.parse_args(["--max-stop-strings", "0"]))
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        cli_args.api_keys(server.parse_args(["--api-key", " "]), environ={})


def test_api_server_count_default(monkeypatch):
    """--api-server-count: as given; by default 2 on one host with engine-core processes and >= 8 usable CPUs
    (measured faster there), else 1 (in-process engine, multi-host flags, small machines)."""
    monkeypatch.delenv("JAXKV_ENABLE_MULTIPROCESSING", raising=False)
    cpus = {"n": 32}
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: set(range(cpus["n"])))
    assert server.default_api_server_count(server.parse_args([])) == 2
    assert server.parse_args(["--api-server-count", "3"]).api_server_count == 3
    for flags in (["--no-enable-multiprocessing"], ["--headless"], ["--data-parallel-address", "10.0.0.1"]):
        assert server.default_api_server_count(server.parse_args(flags)) == 1, flags
    cpus["n"] = cli_args.AUTO_API_SERVERS_MIN_CPUS - 1
    assert server.default_api_server_count(server.parse_args([])) == 1
