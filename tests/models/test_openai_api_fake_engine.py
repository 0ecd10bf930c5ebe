"""The HTTP layer over a fake engine (no model): OpenAI formats, errors, stop strings, disconnects.

The server runs in-process (uvicorn in a thread, 127.0.0.1, free port); the engine is a stand-in with
``LLMEngine``'s contract that emits a fixed UTF-8 text one byte-token per step, so split multi-byte
characters, stop strings and aborts are exercised in milliseconds. tests/models/test_serve_e2e.py runs the
real server on the real model.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from jaxkv.sampling_params import SamplingParams
from models.entrypoints.async_llm import AsyncLLM  # noqa: E402
from models.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.conftest import serve  # noqa: E402

OUTPUT = "Hello wörld 🙂 STOP then more text; ".encode()
EOS = 0
MAX_MODEL_LEN = 64
MODEL = "fake-model"


class ByteTokenizer:
    """One token per UTF-8 byte; id 0 is EOS (a special token, skipped in text)."""

    vocab_size = 256
    eos_token_id = EOS

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != EOS or not skip_special_tokens).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" * add_generation_prompt)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list
    new_token_ids: list
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list
    finished: bool


class FakeEngine:
    """``LLMEngine``'s contract: ``max_num_seqs`` requests run, one token each per step (OUTPUT's bytes in
    turn; a prompt ending in '#' makes the 4th token EOS); a prompt containing '~' is rejected."""

    def __init__(self, max_num_seqs: int = 4, step_s: float = 0.002):
        self.max_num_seqs, self.step_s = max_num_seqs, step_s
        self.waiting: deque = deque()
        self.running: dict[str, tuple] = {}
        self.aborted: list[str] = []
        self.arrivals: list[list[int]] = []  # prompts in the order add_request got them
        self.lock = threading.Lock()  # the test thread reads; only the engine thread may write

    def add_request(self, request_id, prompt_token_ids, sampling_params):
        if ord("~") in prompt_token_ids:
            raise ValueError("prompt_token_ids contains the forbidden '~'")
        if any(r[0] == request_id for r in self.waiting) or request_id in self.running:
            raise ValueError(f"request_id={request_id!r} exists")
        self.arrivals.append(list(prompt_token_ids))
        self.waiting.append((request_id, list(prompt_token_ids), sampling_params, []))

    def abort_request(self, request_id):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self.lock:
            for rid in ids:
                self.running.pop(rid, None)
                self.waiting = deque(r for r in self.waiting if r[0] != rid)
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self):
        return len(self.waiting) + len(self.running)

    @property
    def stats(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": len(self.running) / self.max_num_seqs, "num_preemptions": 0}

    def step(self):
        time.sleep(self.step_s)
        with self.lock:
            while self.waiting and len(self.running) < self.max_num_seqs:
                r = self.waiting.popleft()
                self.running[r[0]] = r
            outputs = []
            for rid, (_, prompt, params, out) in list(self.running.items()):
                tok = OUTPUT[len(out) % len(OUTPUT)]
                if prompt[-1] == ord("#") and len(out) == 3:
                    tok = EOS
                out.append(tok)
                reason = stop_reason = None
                if tok in params.stop_token_ids and not params.ignore_eos and len(out) > params.min_tokens:
                    reason, stop_reason = "stop", tok
                elif len(out) >= params.max_tokens or len(prompt) + len(out) >= MAX_MODEL_LEN:
                    reason = "length"
                if reason:
                    del self.running[rid]
                outputs.append(RequestOutput(rid, prompt, [CompletionOutput(0, list(out), [tok], reason,
                                                                            stop_reason)], reason is not None))
            return outputs


def expected_text(n: int) -> str:
    return ByteTokenizer().decode([OUTPUT[i % len(OUTPUT)] for i in range(n)])


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    tok = ByteTokenizer()
    app = build_app(AsyncLLM(engine, tok, log_stats_interval_s=None), tok, served_model_names=[MODEL, "alias"],
                    max_model_len=MAX_MODEL_LEN, default_stop_token_ids=[EOS])
    with serve(app) as base:
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=20)


def stats(base):
    return httpx.get(base + "/stats", timeout=5).json()


def wait_idle(base, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        s = stats(base)
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def test_completion_plain_and_streamed_agree(client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=17, temperature=0)
    assert r.choices[0].text == expected_text(17) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 17, 19)
    assert r.object == "text_completion" and r.model == MODEL
    chunks = list(client.completions.create(model="alias", prompt="hi", max_tokens=17, stream=True,
                                            stream_options={"include_usage": True}))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == expected_text(17)
    assert all("\ufffd" not in d for d in deltas)  # 'ö' and '🙂' are several byte-tokens each
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 17


def test_stop_string_cuts_text_and_is_never_streamed(client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=40, stop=["STOP", "zzz"])
    assert r.choices[0].text == "Hello wörld 🙂 " and r.choices[0].finish_reason == "stop"
    assert r.model_extra.get("choices") is None and r.choices[0].model_extra["stop_reason"] == "STOP"
    deltas = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="hi", max_tokens=40,
                                                                   stop="STOP", stream=True)]
    assert "".join(deltas) == "Hello wörld 🙂 " and not any("S" in d for d in deltas)


def test_eos_ends_with_stop_unless_ignore_eos(client):
    r = client.completions.create(model=MODEL, prompt="go#", max_tokens=10)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("Hel", "stop", 4)
    r = client.completions.create(model=MODEL, prompt="go#", max_tokens=10, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10


def test_several_prompts_give_one_choice_each(client):
    r = client.completions.create(model=MODEL, prompt=["a", "bb", "hi"], max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.text == "Hel" for c in r.choices)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 9
    r = client.completions.create(model=MODEL, prompt=[[104, 105], [97]], max_tokens=2)
    assert [c.text for c in r.choices] == ["He", "He"] and r.usage.prompt_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "bb"], max_tokens=5, stream=True))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == "Hello"


def test_chat_plain_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "Hello"
    assert r.usage.prompt_tokens == len("<system>be brief<user>hi<assistant>")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5
    # no max_tokens: the room left in max_model_len
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert r.usage.completion_tokens == MAX_MODEL_LEN - r.usage.prompt_tokens


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -3}, 400, "top_k"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"prompt": "x" * MAX_MODEL_LEN}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 999]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "logprobs": -2}, 400, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "stream": True, "max_tokens": "many"}, 400, "max_tokens"),
])
def test_bad_completion_requests_get_openai_errors(server, client, body, status, param):
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text == "He"


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools.0.function"),
])
def test_bad_chat_requests_get_400(server, body, param):
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_malformed_bodies_and_engine_rejections_get_400(server, client):
    base = server[0]
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(base + "/v1/completions", content=content, timeout=10,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="forbidden"):  # raised by engine.add_request
        client.completions.create(model=MODEL, prompt="a~b", max_tokens=3)
    chunks = list(client.completions.create(model=MODEL, prompt="ok", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hel"
    wait_idle(base)


def test_disconnects_abort_their_requests(server, client):
    base, engine = server
    with httpx.stream("POST", base + "/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": "long", "max_tokens": 50, "stream": True}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: {")
        rid = json.loads(first[len("data: "):])["id"]
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
        httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "slow", "max_tokens": 60},
                   timeout=0.03)
    s = wait_idle(base)
    assert s["kv_cache_usage"] == 0
    with engine.lock:
        assert f"{rid}-0" in engine.aborted and len(engine.aborted) >= 2
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text == "He"


def test_health_models_stats_metrics(server):
    base = server[0]
    assert httpx.get(base + "/health").status_code == 200
    models = httpx.get(base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"] and models["data"][0]["max_model_len"] == 64
    s = stats(base)
    assert s["engine_alive"] and s["max_model_len"] == MAX_MODEL_LEN and s["num_generation_tokens_total"] > 0
    assert 'jaxkv:num_running{model_name="fake-model"} 0.0' in httpx.get(base + "/metrics").text


def test_sampling_params_contract():
    p = SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=(1,), ignore_eos=False, min_tokens=1)
    assert p.max_tokens == 3 and tuple(p.stop_token_ids) == (1,)


def test_bench_serving_measures_a_run(server):
    """``jaxkv bench serving``'s client and metrics against this server (the dataset part is tested with
    bench_throughput's loader)."""
    import asyncio
    import math
    pytest.importorskip("aiohttp")
    from models.benchmarks import serving as bench_serving

    args = bench_serving.parse_args(["--base-url", server[0], "--model", MODEL, "--request-rate", "200,inf",
                                     "--num-prompts", "6"])
    assert args.rates == [200.0, math.inf]
    reqs = [bench_serving.SampleRequest(prompt=f"p{i}", prompt_len=2, output_len=4 + i) for i in range(6)]
    reqs[0] = bench_serving.SampleRequest(prompt="p0", prompt_len=3, output_len=4)  # the server counts 2
    runs = [asyncio.run(bench_serving.run_rate(args, reqs, rate, seed=0)) for rate in args.rates]
    # the official openai client, the requests split over 2 client processes
    args.client_processes = 2
    runs.append(bench_serving.run_rate_openai(args, reqs, math.inf, seed=0))
    assert runs[-1]["client_processes"] == 2
    # the same through a pool of client processes kept for the warm-up and every run (their connections stay open)
    with bench_serving.ClientPool(args, 2) as pool:
        pids = [proc.pid for proc in pool._procs]
        warm, _ = pool.run(reqs, [0.0] * len(reqs), max_tokens=5)   # the warm-up's cap on max_tokens
        assert [r.output_len for r in warm] == [min(4 + i, 5) for i in range(6)]
        runs.append(bench_serving.run_rate_openai(args, reqs, math.inf, seed=0, pool=pool))
        assert [proc.pid for proc in pool._procs] == pids and all(proc.is_alive() for proc in pool._procs)
    assert not any(proc.is_alive() for proc in pool._procs)
    for m in runs:
        assert m["completed"] == 6 and m["failed"] == 0
        assert m["total_output_tokens"] == sum(4 + i for i in range(6)) and m["total_input_tokens"] == 13
        assert 0 < m["ttft_ms"]["median"] <= m["e2el_ms"]["p99"] and m["tpot_ms"]["mean"] > 0
        assert m["server"]["num_generation_tokens_total"] == m["total_output_tokens"]
        # the server's usage.prompt_tokens against each request's prompt_len (its fake tokenizer: 1 token per
        # character of "p<i>")
        assert m["prompt_len_mismatches"] == 1
    table = bench_serving.summary_table(runs, markdown=True)
    assert "| 200 | 6/6 |" in table and table.count("| inf | 6/6 |") == 3
    assert bench_serving.parse_rates("inf, 0.5x,2") == [math.inf, "0.5x", 2.0]
    for text in ("0.5x,inf", "0", "-1", "inf,0x"):
        with pytest.raises(ValueError):
            bench_serving.parse_rates(text)
    bad = bench_serving.RequestResult()
    assert not bad.success
    intervals = bench_serving.arrival_intervals(20000, 50.0, 1.0, __import__("numpy").random.default_rng(0))
    assert abs(intervals.mean() - 1 / 50) < 1e-3  # Poisson arrivals at 50 req/s


def test_async_llm_abort_early_close_and_dead_engine():
    import asyncio

    from models.entrypoints.async_llm import EngineDeadError

    class CrashingEngine(FakeEngine):
        def step(self):
            if any(ord("!") in r[1] for r in list(self.waiting) + list(self.running.values())):
                raise RuntimeError("boom")
            return super().step()

    async def scenario():
        engine = CrashingEngine()
        llm = AsyncLLM(engine, ByteTokenizer(), log_stats_interval_s=None)
        llm.start()
        params = SamplingParams(max_tokens=30, temperature=0.0)
        try:
            # AsyncLLM.abort ends the stream with finish_reason "abort"
            gen = llm.generate([104, 105], params, "a")
            first = await gen.__anext__()
            llm.abort("a")
            rest = [o async for o in gen]
            assert not first.finished and rest[-1].finished and rest[-1].finish_reason == "abort"
            # closing a stream early aborts the request in the engine
            gen = llm.generate([104, 105], params, "b")
            await gen.__anext__()
            await gen.aclose()
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert "b" in engine.aborted and not engine.has_unfinished_requests()
            # a rejected request raises ValueError and leaves the engine as it was
            with pytest.raises(ValueError, match="forbidden"):
                [o async for o in llm.generate([ord("~")], params, "c")]
            # an engine error kills the thread: every request fails, health says so
            with pytest.raises(EngineDeadError):
                [o async for o in llm.generate([ord("!")], params, "d")]
            assert not llm.is_running and llm.stats()["engine_alive"] is False
            with pytest.raises(EngineDeadError):
                [o async for o in llm.generate([104], params, "e")]
        finally:
            llm.shutdown()

    asyncio.run(scenario())


def test_async_llm_folds_outputs_a_slow_stream_missed():
    """A stream that falls behind gets the steps it missed as one output (vLLM's RequestOutputCollector):
    fewer outputs, the same text as a stream that kept up; a stop string inside the folded steps still cuts
    the text there and aborts the request; an abort queued behind outputs still delivers their text."""
    import asyncio

    async def run(prompt, *, slow, stop=(), abort_after=None, max_tokens=24):
        engine = FakeEngine(step_s=0.001)
        llm = AsyncLLM(engine, ByteTokenizer(), log_stats_interval_s=None)
        llm.start()
        outs = []
        try:
            gen = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), "r", stop=stop)
            async for out in gen:
                outs.append(out)
                if abort_after is not None and len(outs) == 1:
                    await asyncio.sleep(0.015)  # several steps queue up ahead of the abort marker
                    llm.abort("r")
                if slow:
                    time.sleep(0.02)  # blocks the loop: the engine thread queues ~10 steps meanwhile
        finally:
            llm.shutdown()
        return outs, engine

    async def scenario():
        fast, _ = await run([104], slow=False)
        slow, _ = await run([104], slow=True)
        assert fast[-1].text == slow[-1].text == OUTPUT[:24].decode("utf-8", errors="replace")
        assert len(slow) < len(fast) and slow[-1].finish_reason == "length"
        assert [len(o.text) for o in slow] == sorted(len(o.text) for o in slow)  # cumulative, never back
        cut, engine = await run([104], slow=True, stop=["STOP"], max_tokens=30)
        assert cut[-1].text == "Hello wörld 🙂 " and cut[-1].finish_reason == "stop" and "r" in engine.aborted
        aborted, _ = await run([104], slow=False, abort_after=1, max_tokens=60)
        assert aborted[-1].finish_reason == "abort" and len(aborted[-1].text) > len(aborted[0].text)

    asyncio.run(scenario())


def test_bench_serving_samples_like_bench_throughput(tmp_path, gguf_reader):
    """The serving benchmark's requests are bench_throughput's (same loader, rule, seed), sent as ids."""
    from models.benchmarks import serving as bench_serving
    from models.benchmarks import throughput as bench_throughput
    from models.tokenizer import GGUFTokenizer

    words = "the cat sat on a mat and looked at the big red sun over the hill".split()
    records = [{"id": str(i), "conversations": [
        {"from": "human", "value": " ".join(words[:(3 + 5 * i) % 15 + 1])},
        {"from": "gpt", "value": " ".join(words[:(7 * i) % 15 + 1])}]} for i in range(30)]
    text = json.dumps(records)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-40])  # truncated mid-record, as the packaged file is
    tok = GGUFTokenizer.from_gguf(gguf_reader)
    saved = tmp_path / "requests.json"
    args = bench_serving.parse_args(["--dataset", str(path), "--seed", "3", "--save-requests", str(saved)])
    got = bench_serving.load_requests(args, tok, 5)
    if hasattr(bench_throughput, "load_sharegpt"):
        records = bench_throughput.load_sharegpt(str(path))
    else:
        records, _ = bench_throughput.read_complete_records(path)
    want = [(r.prompt_token_ids, r.output_len) if hasattr(r, "prompt_token_ids") else r
            for r in bench_throughput.sample_requests(records, tok, 5, seed=3)]
    assert [(r.prompt, r.output_len) for r in got] == [(list(ids), n) for ids, n in want]
    assert all(r.prompt_len == len(r.prompt) >= 4 and r.output_len >= 4 for r in got)
    # a machine without the dataset reuses the saved token ids
    again = bench_serving.load_requests(bench_serving.parse_args(["--requests", str(saved)]), None, 3)
    assert again == got[:3]


def test_bench_serving_server_delta_across_api_server_processes():
    """With ``serve.py --api-server-count N`` the /stats reads before and after a run may come from different
    API-server processes: their own counters are not subtracted then; the engine cores' still are."""
    from models.benchmarks import serving as bench_serving

    before = {"num_preemptions": 2, "num_generation_tokens_total": 900, "api_server_index": 0}
    after = {"num_preemptions": 5, "num_generation_tokens_total": 100, "api_server_index": 1}
    assert bench_serving._server_delta(before, after) == {"num_preemptions": 3}
    after["api_server_index"] = 0
    assert bench_serving._server_delta(before, after) == {"num_preemptions": 3, "num_generation_tokens_total": -800}


def test_bench_serving_json_schema_fraction_marks_an_even_share():
    """``--json-schema-fraction``: the requests keep their fields; an evenly spread share gets the schema."""
    from models.benchmarks import serving as bench_serving

    reqs = [bench_serving.SampleRequest(prompt=f"p{i}", prompt_len=2, output_len=4,
                                        extra={"seed": i} if i == 1 else None) for i in range(10)]
    marked = bench_serving.mark_structured(reqs, 0.5)
    with_schema = [i for i, r in enumerate(marked) if r.extra and "response_format" in r.extra]
    assert with_schema == [1, 3, 5, 7, 9]  # request i when floor((i + 1) / 2) > floor(i / 2)
    assert marked[1].extra["seed"] == 1 and marked[3].extra["response_format"]["type"] == "json_schema"
    assert [r.prompt for r in marked] == [r.prompt for r in reqs] and reqs[3].extra is None  # inputs untouched
    ordered = bench_serving.with_priority_by_order(marked)
    assert [r.extra["priority"] for r in ordered] == list(range(10)) and ordered[1].extra["seed"] == 1
    assert ordered[3].extra["response_format"] == marked[3].extra["response_format"]



def test_bench_serving_starts_due_requests_in_the_dataset_order(monkeypatch):
    """At rate inf the openai client process starts its requests in their order (vLLM's benchmark creates its
    tasks the same way); sleeping each request until its own, equal, deadline woke them in heap order. (Over the
    network, racing connections may still reorder them a little.)"""
    import asyncio

    from models.benchmarks import serving as bench_serving

    started = []

    async def fake_send(client, model, req, *, ignore_eos, max_tokens=None):
        started.append(req.prompt)
        await asyncio.sleep(0.001)
        return bench_serving.RequestResult()

    monkeypatch.setattr(bench_serving, "send_request_openai", fake_send)
    args = bench_serving.parse_args(["--base-url", "http://127.0.0.1:9", "--model", MODEL])
    reqs = [bench_serving.SampleRequest(prompt=f"q{i:02d}", prompt_len=3, output_len=2) for i in range(60)]
    arrivals = [0.0] * 30 + [0.001 * i for i in range(30)]  # a burst, then spaced requests
    out = asyncio.run(bench_serving._send_scheduled(args, reqs, arrivals, time.time() + 0.05))
    assert len(out) == 60 and started == [r.prompt for r in reqs]


def test_priority_reaches_a_priority_engine_and_is_400_on_fcfs(server):
    """vLLM's ``priority`` field: 400 naming it unless the engine runs ``scheduling_policy="priority"``; then
    each request's priority reaches ``add_request`` (completions and chat, streamed or not)."""
    import types

    class PriorityEngine(FakeEngine):
        config = types.SimpleNamespace(policy="priority")

        def __init__(self):
            super().__init__()
            self.priorities = []

        def add_request(self, request_id, prompt_token_ids, sampling_params, priority=0):
            self.priorities.append(priority)
            super().add_request(request_id, prompt_token_ids, sampling_params)

    r = httpx.post(server[0] + "/v1/completions", timeout=10,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    engine = PriorityEngine()
    tok = ByteTokenizer()
    app = build_app(AsyncLLM(engine, tok, log_stats_interval_s=None), tok, served_model_names=[MODEL],
                    max_model_len=MAX_MODEL_LEN, default_stop_token_ids=[EOS])
    from starlette.testclient import TestClient
    with TestClient(app) as c:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for stream, prio in ((False, -3), (True, 7), (False, 0)):
                r = c.post(path, json={"model": MODEL, "max_tokens": 2, "stream": stream, "priority": prio, **body})
                assert r.status_code == 200, r.text
    assert engine.priorities == [-3, 7, 0, -3, 7, 0]
