"""scripts/serve.py as a user runs it, on SmolLM2 (CPU, f32), through the official ``openai`` client.

One server subprocess (127.0.0.1, free port, killed at the end whatever happens) serves every test here;
the last two run the short soak (scripts/soak_server.py) against it and then stop it with SIGTERM (drain).
The reference outputs come from ``LLM.generate`` with the same engine options in a second subprocess that
runs while the server loads; both share a JAX compilation cache, so the server mostly finds the step
shapes the reference compiled (CPU compiles dominate this test's time). Every request is greedy (one
sampling mode, one set of compiled steps).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import jaxkv_command

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

REFERENCE = """
import json, sys
from jaxkv.sampling_params import SamplingParams
from models.entrypoints.llm import LLM
engine, prompts, max_tokens = (json.loads(a) for a in sys.argv[2:])
llm = LLM(model=sys.argv[1], enable_multiprocessing=False, **engine)  # the server runs core processes
outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens], use_tqdm=False)
print(json.dumps([[o.outputs[0].text, o.outputs[0].finish_reason] for o in outs]))
"""
MODEL = "smollm2-135m"
ROOT = pathlib.Path(__file__).parents[2]
ENGINE = dict(max_model_len=128, max_num_seqs=8, num_gpu_blocks=48, block_size=16, max_num_batched_tokens=64)
MAX_PENDING = 16  # = the concurrent requests of the first test; the soak's burst goes past it
SHUTDOWN_TIMEOUT = 1.0
SERVER_ARGS = [a for k, v in ENGINE.items() for a in (f"--{k.replace('_', '-')}", str(v))] + [
    "--log-stats-interval", "2", "--compile-ahead", "off", "--max-pending-requests", str(MAX_PENDING),
    "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
PROMPTS = ["The capital of France is", "Water is made of hydrogen and", "1, 2, 3, 4,",
           "The largest planet in the solar system is", "Once upon a time", "def fibonacci(n):",
           "The color of the sky is", "My favourite food is", "Paris is a city in", "The sun rises in the",
           "Cats and dogs are", "import numpy as", "The opposite of hot is", "Monday, Tuesday,",
           "A haiku about the sea:", "Photosynthesis converts"]
MAX_TOKENS = [3 + (7 * i) % 13 for i in range(len(PROMPTS))]  # 3..15, all different neighbours


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(gguf_path, tmp_path_factory):
    """``(base_url, reference [(text, finish_reason)], server_log_path, server Popen)``; the server is
    stopped afterwards (if the drain test has not stopped it)."""
    tmp = tmp_path_factory.mktemp("serve")
    log_path = tmp / "server.log"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp / "jax-cache"), JAXKV_ENABLE_MULTIPROCESSING="1",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    port = _free_port()
    procs = []
    try:
        with open(log_path, "w") as log:
            server = subprocess.Popen([*jaxkv_command(), "serve", MODEL, "--gguf", str(gguf_path),
                                       "--port", str(port), *SERVER_ARGS], stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True)
        procs.append(server)
        ref = subprocess.Popen([sys.executable, "-c", REFERENCE, str(gguf_path), json.dumps(ENGINE),
                                json.dumps(PROMPTS), json.dumps(MAX_TOKENS)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        procs.append(ref)
        out, err = ref.communicate(timeout=300)
        assert ref.returncode == 0, err[-3000:]
        reference = [tuple(r) for r in json.loads(out.strip().splitlines()[-1])]
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"server exited:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server did not start:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        stats = httpx.get(base + "/stats", timeout=5)  # before any request too (0/0 ratios are null)
        assert stats.status_code == 200 and stats.json()["max_model_len"] == ENGINE["max_model_len"], stats.text
        yield base, reference, log_path, server
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)


def _wait_idle(base: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(base + "/stats", timeout=5).json()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.1)


def test_16_concurrent_completions_equal_offline_greedy(served):
    base, reference, _, _ = served
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i):
        kwargs = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)
        if i % 2:  # every other one streams
            text, finish = "", None
            async for chunk in await client.completions.create(stream=True, **kwargs):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish
        r = await client.completions.create(**kwargs)
        assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= MAX_TOKENS[i]
        return r.choices[0].text, r.choices[0].finish_reason

    async def all_of_them():
        try:
            return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])
        finally:
            await client.close()

    got = asyncio.run(all_of_them())
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g == want, (i, PROMPTS[i])
    assert "Paris" in got[0][0]


def test_chat_completion(served):
    base, _, _, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8
    assert "<|im_start|>" not in r.choices[0].message.content


def test_disconnect_mid_stream_frees_every_block(served):
    base, _, _, _ = served
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Tell me a long story about", "max_tokens": 100,
                            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
    s = _wait_idle(base)
    assert s["kv_cache_usage"] == 0, s
    assert s["num_requests_aborted"] >= 1


def test_bad_requests_get_status_codes_and_the_server_keeps_serving(served):
    base, reference, log_path, _ = served
    cases = [({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
             ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
             ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
             ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
             ({"model": MODEL, "prompt": "word " * 200}, 400, "prompt"),
             ({"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens")]
    for body, status, param in cases:
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == reference[0]
    assert httpx.get(base + "/health").status_code == 200
    log = log_path.read_text()
    assert "Traceback" not in log
    assert "jaxkv server:" in log  # the start-up line


def test_short_soak(served, tmp_path):
    """scripts/soak_server.py's CI variant against this server: Poisson load with disconnects, aborts, bad
    requests and a burst past --max-pending-requests; no good request fails, no block is left."""
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    import soak_server

    base, _, _, _ = served
    before = httpx.get(base + "/stats", timeout=5).json()
    out = tmp_path / "soak.json"
    rc = soak_server.main(["--base-url", base, "--duration", "12", "--warmup", "2", "--request-rate", "2",
                           "--dataset", "synthetic", "--synthetic-prompt-chars", "24", "--max-output-tokens", "4",
                           "--sampled-share", "0", "--first-burst", "6", "--burst-interval", "1000",
                           "--burst-extra", "4", "--burst-max-tokens", "4", "--sample-interval", "4",
                           "--min-drift-requests", "3",
                           "--max-p99-drift", "10", "--p99-slack-ms", "3000", "--max-rss-growth-mib", "512",
                           "--idle-timeout", "60", "--request-timeout", "120", "--result-json", str(out)])
    result = json.loads(out.read_text())
    failed = [c for c in result["checks"] if not c[1]]
    assert rc == 0, (failed, result["failures"][:3])
    summary = result["summary"]
    assert summary["good"]["ok"] >= 5 and summary["good"]["failed"] == 0
    assert any(k.startswith("bad:") for k in summary) and all(v["failed"] == 0 for v in summary.values())
    (burst,) = result["bursts"]
    assert burst["sent"] == MAX_PENDING + 4 and burst["refused_503"] >= 4 and burst["failed"] == 0
    idle = result["samples"][-1]
    assert idle["phase"] == "idle" and idle["blocks_in_use"] == 0 and idle["rss_mib"] > 0
    after = httpx.get(base + "/stats", timeout=5).json()
    assert after["num_rejected_busy"] - before["num_rejected_busy"] >= burst["refused_503"]
    print(f"soak: {result['requests']} requests, compiles {before.get('num_compiles')} -> "
          f"{after.get('num_compiles')}")


def test_sigterm_drains_and_exits_0(served):
    """SIGTERM with a long stream in flight: new requests and /health get 503 while it drains, the stream
    ends in [DONE] (finished, or cut by --shutdown-timeout with an error event), the process exits 0 and
    leaves no process behind. Runs last: it stops the module's server."""
    base, _, log_path, server = served
    body = {"model": MODEL, "prompt": "Tell me a long story about", "max_tokens": 110, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        lines.append(next(it))
        assert lines[0].startswith("data: {")
        server.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health", timeout=5).status_code != 503:  # draining: still listening
            assert time.monotonic() < deadline, "the server did not start draining"
            time.sleep(0.05)
        refused = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                             timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_shutting_down"
        lines += [line for line in it if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][len("data: "):])
    if "error" in last:  # cut by the drain
        assert last["error"]["code"] == "server_shutting_down", last
    else:
        assert last["choices"][0]["finish_reason"] == "length", last
    assert server.wait(SHUTDOWN_TIMEOUT + 30) == 0, log_path.read_text()[-3000:]
    with pytest.raises(ProcessLookupError):  # nothing left in the server's session (engine processes too)
        os.killpg(server.pid, 0)
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/health", timeout=2)
    log = log_path.read_text()
    assert "Traceback" not in log and "drained in" in log
    print("drain:", "error event" if "error" in last else "finished", f"after {len(lines) - 2} chunks")
