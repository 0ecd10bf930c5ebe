"""scripts/serve.py and scripts/bench_serving.py refuse bad options with one line, before loading anything."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).parents[2] / "scripts"


@pytest.mark.parametrize("script,args,message", [
    ("serve.py", ["--model", "no-such-model"], "error: model='no-such-model' is neither"),
    ("serve.py", ["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization=1.5 must be in (0, 1]"),
    ("bench_serving.py", ["--request-rate", "0.5x,inf"], "a relative rate needs an 'inf' run before it"),
    ("bench_serving.py", ["--request-rate", "0"], "--request-rate=0 must be > 0"),
])
def test_bad_options_fail_fast_with_one_line(script, args, message):
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_exposure_flags_build_limits_and_keys():
    """serve.py's --api-key / JAXKV_API_KEY and limit flags (in-process: no model is loaded)."""
    sys.path.insert(0, str(SCRIPTS))
    import serve

    from models.entrypoints.openai.limits import ServerLimits

    args = serve.parse_args([])
    assert serve.server_limits(args) == ServerLimits() and args.shutdown_timeout == 20.0
    assert serve.api_keys(args, environ={}) == []
    assert serve.api_keys(args, environ={"JAXKV_API_KEY": "k0"}) == ["k0"]
    args = serve.parse_args(["--api-key", "k1", "--api-key", "k2", "--max-pending-requests", "7",
                             "--max-request-body-bytes", "1000", "--shutdown-timeout", "3"])
    assert serve.api_keys(args, environ={"JAXKV_API_KEY": "k0"}) == ["k1", "k2"]  # the flag wins, as in vLLM
    limits = serve.server_limits(args)
    assert (limits.max_pending_requests, limits.max_request_body_bytes, args.shutdown_timeout) == (7, 1000, 3.0)
    with pytest.raises(ValueError, match=r"^--max-stop-strings=0 must be an integer >= 1$"):
        serve.server_limits(serve.parse_args(["--max-stop-strings", "0"]))
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        serve.api_keys(serve.parse_args(["--api-key", " "]), environ={})


def test_api_server_count_default(monkeypatch):
    """--api-server-count: as given; by default 2 on one host with engine-core processes and >= 8 usable CPUs
    (measured faster there), else 1 (in-process engine, multi-host flags, small machines)."""
    sys.path.insert(0, str(SCRIPTS))
    import serve

    monkeypatch.delenv("JAXKV_ENABLE_MULTIPROCESSING", raising=False)
    cpus = {"n": 32}
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(cpus["n"])))
    assert serve.default_api_server_count(serve.parse_args([])) == 2
    assert serve.parse_args(["--api-server-count", "3"]).api_server_count == 3
    for flags in (["--no-enable-multiprocessing"], ["--headless"], ["--data-parallel-address", "10.0.0.1"]):
        assert serve.default_api_server_count(serve.parse_args(flags)) == 1, flags
    cpus["n"] = serve.AUTO_API_SERVERS_MIN_CPUS - 1
    assert serve.default_api_server_count(serve.parse_args([])) == 1
