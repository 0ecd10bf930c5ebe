"""scripts/serve.py's process structure under faults, on a tiny dummy model (CPU).

* a core killed with SIGKILL mid-stream: the stream ends with an error event, ``/health`` stops
  answering 200 within 5 s, the server exits with code 1 and leaves no process;
* SIGTERM to the server while it streams: it exits 0 and no engine-core process is left;
* bad requests get their 4xx while other requests stream on;
* ``--api-server-count 2``: two API-server processes share the port, both serve, concurrent streams get
  the tokens of the same requests sent one at a time, SIGTERM drains both and leaves no process, and a
  killed core makes every process exit (code 1).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.conftest import jaxkv_command  # noqa: E402
from tests.tiny_gguf import write_tiny_llama_gguf  # noqa: E402

ROOT = pathlib.Path(__file__).parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of process ``pid`` from ``/proc/PID/stat``, or ``None`` once it is gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid``."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            stat = _state_and_parent(int(d.name))
            if stat is not None and stat[1] == pid and stat[0] != "Z":
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Process ``pid`` runs (exists and is not a zombie)."""
    stat = _state_and_parent(pid)
    return stat is not None and stat[0] != "Z"


class Server:
    def __init__(self, tmp: pathlib.Path, model: str, *extra: str):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        env = dict(os.environ, JAXKV_ENABLE_MULTIPROCESSING="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                [*jaxkv_command(), "serve", "--model", model, "--served-model-name", "m", "--load-format", "dummy",
                 "--dtype", "float32",
                 "--port", str(self.port), "--max-model-len", "512", "--max-num-seqs", "4", "--num-gpu-blocks",
                 "128", "--max-num-batched-tokens", "64", "--compile-ahead", "off", *extra],
                stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)
        self.cores = _children(self.proc.pid)

    def stream(self, prompt: str, max_tokens: int, lines: list, started: threading.Event | None = None):
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", self.base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if started is not None:
                            started.set()
        except httpx.HTTPError as e:
            lines.append(f"transport error: {e}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.cores:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def test_sigkill_of_the_core_fails_streams_and_stops_the_server(tiny, tmp_path):
    server = Server(tmp_path, tiny)
    try:
        assert len(server.cores) == 1
        httpx.post(server.base + "/v1/completions", json={"model": "m", "prompt": "warm", "max_tokens": 2},
                   timeout=60).raise_for_status()  # compiled, so the stream below is mid-run when killed
        lines, started = [], threading.Event()
        t = threading.Thread(target=server.stream, args=("a long story", 400, lines, started))
        t.start()
        assert started.wait(30)
        os.kill(server.cores[0], signal.SIGKILL)
        killed = time.monotonic()
        health = 200
        while health == 200 and time.monotonic() - killed < 5:
            try:
                health = httpx.get(server.base + "/health", timeout=1).status_code
            except httpx.TransportError:
                health = None
        assert health != 200
        t.join(30)
        assert any('"code": "engine_dead"' in l for l in lines), lines[-3:]
        assert server.proc.wait(30) == 1
        assert not _children(server.proc.pid)
    finally:
        server.stop()


def test_bad_requests_while_streaming_then_sigterm_leaves_no_process(tiny, tmp_path):
    server = Server(tmp_path, tiny)
    try:
        streams = [[] for _ in range(3)]
        threads = [threading.Thread(target=server.stream, args=(f"story {i}", 60, streams[i])) for i in range(3)]
        for t in threads:
            t.start()
        bad = [({"model": "m", "prompt": "x" * 4000}, 400), ({"model": "m", "prompt": "hi", "top_p": 7}, 400),
               ({"model": "m", "prompt": [99999]}, 400)]
        for body, status in bad:
            r = httpx.post(server.base + "/v1/completions", json=body, timeout=30)
            assert r.status_code == status, r.text
        for t in threads:
            t.join(60)
        for lines in streams:
            assert lines[-1] == "data: [DONE]" and not any("error" in l for l in lines), lines[-3:]
            text = "".join(json.loads(l[6:])["choices"][0]["text"] for l in lines[:-1])
            assert text  # 60 tokens of the tiny vocabulary
        # SIGTERM while a request streams: the server exits 0 and takes its core with it
        lines = []
        t = threading.Thread(target=server.stream, args=("one more", 400, lines))
        t.start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        t.join(30)
        deadline = time.monotonic() + 10
        while any(map(_alive, server.cores)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, server.cores))
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def test_two_api_server_processes(tiny, tmp_path):
    server = Server(tmp_path, tiny, "--api-server-count", "2")
    try:
        kids = _children(server.proc.pid)
        assert len(kids) == 3, kids  # one engine core, two API servers
        seen = set()
        for _ in range(40):  # fresh connections: the kernel hands them to either process
            seen.add(httpx.get(server.base + "/stats", timeout=10).json().get("api_server_index"))
            if seen == {0, 1}:
                break
        assert seen == {0, 1}, seen
        prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(8)]
        streams = [[] for _ in prompts]
        threads = [threading.Thread(target=server.stream, args=(p, 24, streams[i])) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        texts = []
        for lines in streams:
            assert lines[-1] == "data: [DONE]" and not any("error" in l for l in lines), lines[-3:]
            texts.append("".join(json.loads(l[6:])["choices"][0]["text"] for l in lines[:-1]))
        for p, text in zip(prompts, texts):  # one at a time, not streamed: the same greedy text
            r = httpx.post(server.base + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            assert r.json()["choices"][0]["text"] == text
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 4.5, "the supervisor waited on cores that do not stop by themselves"
        assert not [k for k in kids if _alive(k)]
    finally:
        server.stop()


def test_two_api_servers_exit_1_when_the_core_dies(tiny, tmp_path):
    server = Server(tmp_path, tiny, "--api-server-count", "2")
    try:
        kids = _children(server.proc.pid)
        cores = [k for k in kids if b"jaxkv.engine.core" in pathlib.Path(f"/proc/{k}/cmdline").read_bytes()]
        assert len(cores) == 1 and len(kids) == 3, kids
        os.kill(cores[0], signal.SIGKILL)
        assert server.proc.wait(30) == 1  # both API servers see the core gone and exit 1; so does the supervisor
        assert not [k for k in kids if _alive(k)]
    finally:
        server.stop()
