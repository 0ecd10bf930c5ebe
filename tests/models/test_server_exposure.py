"""A server you can expose (issue 30): API keys, input limits that fail closed, graceful drain.

In-process server (uvicorn in a thread) over test_openai_api_fake_engine.py's fake engine (one byte-token
per step), so each behaviour costs milliseconds; the drain on a real ``scripts/serve.py`` process (SIGTERM,
exit status, child processes) is in test_serve_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from test_openai_api_fake_engine import EOS, MODEL, ByteTokenizer, FakeEngine, expected_text  # noqa: E402

from models.entrypoints.async_llm import AsyncLLM  # noqa: E402
from models.entrypoints.openai.api_server import build_app  # noqa: E402
from models.entrypoints.openai.drain import GracefulServer  # noqa: E402
from models.entrypoints.openai.limits import ServerLimits, json_depth  # noqa: E402
from tests.conftest import start_uvicorn  # noqa: E402

KEYS = ["key-one", "second-key"]
LIMITS = ServerLimits(max_request_body_bytes=256 * 1024, max_json_depth=8, max_stop_strings=3, max_stop_chars=20,
                      max_stop_token_ids=4, max_prompts_per_request=4, max_pending_requests=3, retry_after_s=2)
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


def _start(app, server_cls=None, **kwargs):
    return start_uvicorn(app, server_cls, config=dict(timeout_graceful_shutdown=5), **kwargs)


def _app(engine, **kwargs):
    tok = ByteTokenizer()
    return build_app(AsyncLLM(engine, tok, log_stats_interval_s=None), tok, served_model_names=[MODEL],
                     max_model_len=64, default_stop_token_ids=[EOS], **kwargs)


@pytest.fixture(scope="module")
def exposed():
    """``(base_url, port, engine)`` of a server with API keys and small limits; 20 ms engine steps, so a
    60-token stream stays in flight for over a second."""
    engine = FakeEngine(step_s=0.02)
    srv, thread, port = _start(_app(engine, limits=LIMITS, api_keys=KEYS))
    try:
        yield f"http://127.0.0.1:{port}", port, engine
    finally:
        srv.should_exit = True
        thread.join(10)


def _post(base, body, headers=AUTH, **kwargs):
    return httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=20, **kwargs)


def _raw_exchange(port: int, head: bytes, chunks=(), timeout: float = 10.0) -> bytes:
    """Send ``head`` and ``chunks`` on a raw socket (never finishing a chunked body); return what the
    server answers before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for c in chunks:
            s.sendall(c)
        data = b""
        while True:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            data += part
            if b"\r\n\r\n" in data:
                headers, _, body = data.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(body) >= length[0]:
                    break
        return data


# ------------------------------------------------------------------------------------------------ auth

def test_api_keys_with_the_openai_client(exposed):
    base, _, _ = exposed
    for key in KEYS:
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=20)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].text == expected_text(3)
        assert [m.id for m in client.models.list()] == [MODEL]
    wrong = openai.OpenAI(base_url=base + "/v1", api_key="key-one-but-longer", max_retries=0, timeout=20)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "key-one" not in e.value.message  # the key is never echoed
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    # no key at all: a plain HTTP client (the openai client always sends one)
    for path, method in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
                         ("/v1", "GET")):
        r = httpx.request(method, base + path, json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    for header in ("Basic a2V5LW9uZQ==", "Bearer", KEYS[0], f"Token {KEYS[0]}", f"Bearer {KEYS[0]}x"):
        assert _post(base, {"prompt": "hi"}, headers={"Authorization": header}).status_code == 401, header
    assert _post(base, {"prompt": "hi", "max_tokens": 2}, headers={"authorization": f"bearer {KEYS[1]}"}).status_code == 200
    # probes and scrapers carry no key
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200
    s = httpx.get(base + "/stats").json()
    assert s["api_key_required"] is True and KEYS[0] not in json.dumps(s)


# ---------------------------------------------------------------------------------------------- limits

def test_body_over_the_limit_is_refused_while_it_streams_in(exposed):
    base, port, _ = exposed
    limit = LIMITS.max_request_body_bytes
    auth = f"Authorization: Bearer {KEYS[0]}\r\n".encode()
    # a declared length past the limit: refused before a byte of the body is read
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
            + f"Content-Length: {limit + 1}\r\n\r\n".encode())
    answer = _raw_exchange(port, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer and b"connection: close" in answer.lower()
    # chunked, no length: refused after the chunk that passes the limit, although the body never ends
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
            + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    chunks = [f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"] * (limit // len(chunk) + 1)
    answer = _raw_exchange(port, head, chunks)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
    # the official client sees 413 for an oversized JSON body; a body just under the limit is served
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEYS[0], max_retries=0, timeout=20)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"pad": "y" * limit})
    assert e.value.status_code == 413
    pad = limit - len(json.dumps({"prompt": "hi", "max_tokens": 2, "pad": ""})) - 16
    r = _post(base, {"prompt": "hi", "max_tokens": 2, "pad": "y" * pad})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"


def _depth_reference(value) -> int:
    """Nesting of a parsed JSON value, by recursion (the independent reference for json_depth)."""
    if isinstance(value, list):
        return 1 + max(map(_depth_reference, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth_reference, value.values()), default=0)
    return 0


def test_json_depth_matches_a_recursive_count():
    import random
    rng = random.Random(0)
    tricky = ['"[', '{"', 'a\\"[', '\\\\', 'x]]}', '\\u005b', "ü[", ""]

    def gen(depth):
        r = rng.random()
        if depth > 12 or r < 0.3:
            return rng.choice([1, None, True, rng.choice(tricky), 2.5])
        if r < 0.65:
            return [gen(depth + 1) for _ in range(rng.randrange(0, 4))]
        return {rng.choice(tricky) + str(i): gen(depth + 1) for i in range(rng.randrange(0, 4))}

    for _ in range(300):
        value = gen(0)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
        assert json_depth(text.encode()) == _depth_reference(value), text
    assert json_depth(b"[" * 100_000) == 100_000
    assert json_depth(b'{"a": "[[[[[[[[[[[["}') == 1


def test_deep_json_is_400_not_500(exposed):
    base, _, _ = exposed
    r = httpx.post(base + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=AUTH, timeout=20)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "json_too_deep" and "100000" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", content=b'{"messages": ' + b"[" * 100_000, headers=AUTH, timeout=20)
    assert r.status_code == 400 and "--max-json-depth" in r.json()["error"]["message"]
    nested = 1
    for _ in range(7):
        nested = [nested]
    ok = {"prompt": "[[[[[[[[[[{{{{{{", "max_tokens": 2, "extra": nested}  # depth 8 = the limit
    assert _post(base, ok).status_code == 200
    assert _post(base, dict(ok, extra=[nested])).status_code == 400  # depth 9


@pytest.mark.parametrize("extra,param", [
    ({"stop": ["a", "b", "c", "d"]}, "stop"),
    ({"stop": ["0123456789", "0123456789", "x"]}, "stop"),  # 21 characters
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
])
def test_stop_and_prompt_limits(exposed, extra, param):
    base, _, _ = exposed
    r = _post(base, dict({"prompt": "hi", "max_tokens": 2}, **extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "this server accepts at most" in err["message"]


def test_stop_and_prompt_limits_allow_what_they_name(exposed):
    base, _, _ = exposed
    r = _post(base, {"prompt": ["a", "b", "c", "d"], "max_tokens": 30,
                     "stop": ["STOP", "0123456789", "ab"], "stop_token_ids": [250, 251, 252, 253]})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["Hello wörld 🙂 "] * 4  # cut before "STOP"


def test_pending_cap_answers_503_with_retry_after(exposed):
    base, _, engine = exposed

    async def scenario():
        async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=20) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "stream": True, "ignore_eos": True}
            held = []
            for _ in range(LIMITS.max_pending_requests):
                stream = client.stream("POST", "/v1/completions", json=body)
                response = await stream.__aenter__()
                lines = response.aiter_lines()
                assert (await lines.__anext__()).startswith("data: {")
                held.append((stream, lines))
            over = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert over.status_code == 503 and over.headers["retry-after"] == "2"
            assert over.json()["error"]["code"] == "server_busy"
            # monitoring is never gated
            stats = (await client.get("/stats")).json()
            assert stats["num_pending_requests"] == LIMITS.max_pending_requests and stats["num_rejected_busy"] >= 1
            assert (await client.get("/health")).status_code == 200
            # one client hangs up: its slot is free again
            stream, _ = held.pop()
            await stream.__aexit__(None, None, None)
            deadline = time.monotonic() + 10
            while (await client.get("/stats")).json()["num_pending_requests"] == LIMITS.max_pending_requests:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "He"
            for stream, _ in held:
                await stream.__aexit__(None, None, None)
            while (await client.get("/stats")).json()["num_pending_requests"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

    asyncio.run(scenario())


# ----------------------------------------------------------------------------------------------- drain

def test_drain_finishes_short_requests_and_aborts_long_ones_with_an_error():
    """SIGTERM's path (GracefulServer.handle_exit) in-process: a short stream finishes, a long stream ends
    in an error event, a long non-streaming request gets 503, new requests and /health get 503 meanwhile,
    then the server stops by itself."""
    engine = FakeEngine(step_s=0.02)
    app = _app(engine)
    srv, thread, port = _start(app, GracefulServer, admission=app.state.admission,
                               engine=app.state.aborting_engine, shutdown_timeout_s=0.4)
    base = f"http://127.0.0.1:{port}"

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=20) as client:
            async def stream(max_tokens):
                body = {"prompt": "x", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    started.set()
                    return [line async for line in r.aiter_lines() if line]

            started = asyncio.Event()
            short = asyncio.ensure_future(stream(10))  # 0.2 s: finishes within the 0.4 s timeout
            await started.wait()
            started = asyncio.Event()
            long = asyncio.ensure_future(stream(60))  # 1.2 s: aborted
            await started.wait()
            plain = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "y", "max_tokens": 60,
                                                                                "ignore_eos": True}))
            await asyncio.sleep(0.1)
            srv.handle_exit(signal.SIGTERM, None)
            await asyncio.sleep(0.05)
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert refused.headers["retry-after"] == "1"
            assert (await client.get("/health")).status_code == 503
            return await short, await long, await plain

    short, long, plain = asyncio.run(scenario())
    chunks = [json.loads(line[6:]) for line in short[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(10)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and short[-1] == "data: [DONE]"
    assert long[-1] == "data: [DONE]"
    error = json.loads(long[-2][6:])["error"]
    assert error["code"] == "server_shutting_down" and "--shutdown-timeout=0.4" in error["message"]
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in long[:-2])
    assert 0 < len(text) and expected_text(60).startswith(text)  # what was sent before the abort is intact
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
    thread.join(15)
    assert not thread.is_alive(), "the server did not stop after draining"
    assert srv.drain_result["in_flight"] == 3 and srv.drain_result["aborted"] == 2
    assert srv.drain_result["left"] == 0
    with engine.lock:
        assert len(engine.aborted) == 2 and not engine.running and not engine.waiting


# ------------------------------------------------------------------------------------- soak workload

def test_soak_workload_fits_the_context(tmp_path, capsys):
    """scripts/soak_server.py's prompts: saved requests are clipped to fit max_model_len (prompt + max_tokens),
    a missing dataset falls back to synthetic prompts, and the mix is validated."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
    import soak_server

    saved = tmp_path / "requests.json"
    saved.write_text(json.dumps([[list(range(1, 300)), 500], [[5, 6, 7], 3], [[9] * 60, 100]]))
    args = soak_server.parse_args(["--base-url", "http://x", "--requests", str(saved), "--max-output-tokens", "50",
                                   "--pool-size", "3"])
    pool, source = soak_server.load_pool(args, room=128)
    assert source == str(saved)
    assert [(len(p.prompt), p.max_tokens) for p in pool] == [(77, 50), (3, 3), (60, 50)]
    assert all(len(p.prompt) + p.max_tokens < 128 for p in pool)
    args = soak_server.parse_args(["--base-url", "http://x", "--dataset", str(tmp_path / "missing.json"),
                                   "--pool-size", "200", "--max-output-tokens", "16"])
    pool, source = soak_server.load_pool(args, room=64)
    assert source == "synthetic" and "using synthetic prompts" in capsys.readouterr().out
    tok = ByteTokenizer()  # one token per byte: the worst case for ASCII text
    assert all(len(tok.encode(p.prompt)) + 1 + p.max_tokens <= 64 and 1 <= p.max_tokens <= 16 for p in pool)
    with pytest.raises(ValueError, match="unknown kind 'evil'"):
        soak_server.parse_mix("good=1,evil=2")
    assert soak_server.parse_mix("good=1, bad=0.5") == {"good": 1.0, "bad": 0.5}


def test_soak_checks_fail_on_failures_growth_leaks_and_drift():
    """scripts/soak_server.py's verdicts on hand-made runs: a clean run passes; a failed request, memory
    growth past the bound, a block in use when idle, bursts without any 503 and a p99 drift each fail."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
    import soak_server
    from soak_server import Record

    args = soak_server.parse_args(["--base-url", "http://x", "--warmup", "10", "--min-drift-requests", "20",
                                   "--max-rss-growth-mib", "100", "--max-p99-drift", "2", "--p99-slack-ms", "10"])

    def run(ttft_late=0.05, rss_late=1000.0, leaked=0, refused=5, fail=False, absorbed=0):
        records = [Record(kind="good", start=10 + 0.3 * i, end=10.5 + 0.3 * i, ok=True,
                          ttft=0.05 if i < 100 else ttft_late, tpot=0.01) for i in range(300)]
        records.append(Record(kind="bad:not_json", start=20, end=20.1, ok=not fail, error="HTTP 500" * fail))
        samples = [{"phase": "warmup" if t < 10 else "load", "rss_mib": 1000.0 if t < 50 else rss_late,
                    "device_mib": None} for t in range(0, 100, 10)]
        idle = {"num_running": 0, "num_waiting": 0, "num_pending_requests": 0, "num_gpu_blocks": 64,
                "num_free_blocks": 64 - leaked}
        bursts = [{"t": 30, "sent": 10, "served": 10 - refused, "refused_503": refused, "failed": 0}]
        bursts += [{"t": 40 + i, "sent": 10, "served": 10, "refused_503": 0, "failed": 0} for i in range(absorbed)]
        checks, summary = soak_server.judge(args, records, samples, idle, bursts, None)
        assert summary["good"] == {"sent": 300, "ok": 300, "failed": 0, "retried_503": 0}
        return {name for name, ok, _ in checks if not ok}

    assert run() == set()
    assert run(fail=True) == {"every request did what it must"}
    assert run(rss_late=1101.0) == {"RSS flat"} and run(rss_late=1099.0) == set()
    assert run(leaked=1) == {"no KV block or request left when idle"}
    assert run(refused=0) == {"bursts over the pending cap get 503 + Retry-After"}
    assert run(refused=0, absorbed=3) == {"bursts over the pending cap get 503 + Retry-After"}
    assert run(absorbed=1) == set()  # a fast server may absorb one burst; the cap still refused another
    assert run(ttft_late=0.111) == {"p99 TTFT does not drift"}  # bound 2 x 50 ms + 10 ms
    assert run(ttft_late=0.109) == set()


def test_stats_before_the_first_step_is_json():
    """/stats answers JSON (null for a 0/0 ratio) before any step; /metrics too."""
    class FreshEngine(FakeEngine):
        @property
        def stats(self):
            return dict(super().stats, gpu_idle_share=float("nan"))

    srv, thread, port = _start(_app(FreshEngine()))
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5)
        assert r.status_code == 200 and r.json()["gpu_idle_share"] is None and r.json()["max_model_len"] == 64
        assert r.json()["process_rss_bytes"] > 0 and r.json()["num_pending_requests"] == 0
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    finally:
        srv.should_exit = True
        thread.join(10)
