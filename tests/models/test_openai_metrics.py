"""``GET /metrics``: Prometheus exposition parsed with prometheus_client's parser.

* in-process over test_openai_features.py's fake engine: vLLM's histograms (buckets, counts, sums) and
  counters move by exactly what a request did; the ``/stats`` fields keep their names, typed as gauges or
  counters; every family has HELP text;
* ``jaxkv serve --api-server-count 2`` on the tiny dummy model (test_serve_faults.py's server): both
  API-server processes answer the same totals (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess

import httpx
import pytest

prometheus_client = pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_openai_features import MODEL, make_app, serve  # noqa: E402


def scrape(base: str, client: httpx.Client | None = None) -> dict:
    """``{family name: Metric}`` of ``/metrics``."""
    r = (client or httpx).get(base + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    """One sample's value (``sample`` defaults to the family name; labels must match those given)."""
    sample = sample or family
    hits = [s.value for s in families[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, sample, labels, families[family].samples)
    return hits[0]


def check_histogram(families: dict, name: str) -> tuple[float, float]:
    """Buckets cumulative and ending at +Inf == _count; returns ``(count, sum)``."""
    f = families[name]
    assert f.type == "histogram" and f.documentation
    buckets = [(float(s.labels["le"]), s.value) for s in f.samples if s.name == name + "_bucket"]
    assert buckets == sorted(buckets) and buckets[-1][0] == float("inf") and len(buckets) > 5
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
    count = value(families, name, name + "_count")
    assert buckets[-1][1] == count
    return count, value(families, name, name + "_sum")


@pytest.fixture(scope="module")
def server():
    app, engine = make_app()
    with serve(app) as base:
        yield base, engine


def test_request_metrics_move_by_what_the_requests_did(server):
    base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=20)
    before = scrape(base)
    client.completions.create(model=MODEL, prompt=["abc", "de"], n=2, max_tokens=5)  # 2 engine requests
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        stream=True))
    chat_prompt = len("<user>x</user><assistant>")
    after = scrape(base)
    for name in ("jaxkv:time_to_first_token_seconds", "jaxkv:e2e_request_latency_seconds",
                 "jaxkv:request_prompt_tokens", "jaxkv:request_generation_tokens", "jaxkv:request_params_n",
                 "jaxkv:inter_token_latency_seconds"):
        check_histogram(after, name)
    delta = {name: tuple(a - b for a, b in zip(check_histogram(after, name), check_histogram(before, name)))
             for name in ("jaxkv:time_to_first_token_seconds", "jaxkv:e2e_request_latency_seconds",
                          "jaxkv:request_prompt_tokens", "jaxkv:request_generation_tokens",
                          "jaxkv:request_params_n", "jaxkv:inter_token_latency_seconds")}
    assert delta["jaxkv:time_to_first_token_seconds"][0] == 3 and delta["jaxkv:e2e_request_latency_seconds"][0] == 3
    assert delta["jaxkv:request_prompt_tokens"] == (3, 3 + 2 + chat_prompt)
    assert delta["jaxkv:request_generation_tokens"] == (3, 10 + 10 + 3)
    assert delta["jaxkv:request_params_n"] == (3, 2 + 2 + 1)
    # one observation per output after a completion's first (an output may carry several tokens)
    assert 1 <= delta["jaxkv:inter_token_latency_seconds"][0] <= (4 + 4 + 4 + 4 + 2)
    for name, want in (("jaxkv:generation_tokens", 23), ("jaxkv:prompt_tokens", 5 + chat_prompt)):
        assert after[name].type == "counter" and after[name].documentation
        assert value(after, name, name + "_total") - value(before, name, name + "_total") == want
    success = "jaxkv:request_success"
    grown = value(after, success, success + "_total", finished_reason="length") - \
        value(before, success, success + "_total", finished_reason="length")
    assert grown == 5  # 2 prompts x n=2, and the chat completion
    assert value(after, success, success + "_total", model_name=MODEL, finished_reason="length") > 0


def test_stats_fields_keep_their_names_typed(server):
    base, _ = server
    openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0).completions.create(
        model=MODEL, prompt="abc", max_tokens=2)
    f = scrape(base)
    stats = httpx.get(base + "/stats").json()
    for name, kind in (("jaxkv:num_running", "gauge"), ("jaxkv:kv_cache_usage", "gauge"),
                       ("jaxkv:num_requests_running", "gauge"), ("jaxkv:num_requests_waiting", "gauge"),
                       ("jaxkv:kv_cache_usage_perc", "gauge"), ("jaxkv:max_model_len", "gauge"),
                       ("jaxkv:num_preemptions", "counter"), ("jaxkv:num_requests_finished", "counter"),
                       ("jaxkv:num_generation_tokens", "counter"), ("jaxkv:num_pending_requests", "gauge")):
        assert f[name].type == kind and f[name].documentation, name
    assert value(f, "jaxkv:num_preemptions", "jaxkv:num_preemptions_total") == 3  # the fake engine's
    assert value(f, "jaxkv:num_requests_finished", "jaxkv:num_requests_finished_total") == \
        stats["num_requests_finished"]
    assert value(f, "jaxkv:num_generation_tokens", "jaxkv:num_generation_tokens_total") == \
        stats["num_generation_tokens_total"]
    assert value(f, "jaxkv:max_model_len") == stats["max_model_len"]
    assert "jaxkv:pid" not in f and not any(name.endswith("_created") for name in f)
    assert all(fam.documentation for fam in f.values())


def test_two_api_server_processes_report_one_total(tmp_path):
    """Both API-server processes of ``--api-server-count 2`` answer the same totals, whichever served the
    requests (requests and scrapes go over fresh connections, which the kernel hands to either process)."""
    pytest.importorskip("uvicorn")
    from test_serve_faults import Server, _children

    from tests.tiny_gguf import write_tiny_llama_gguf

    model = str(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    server = Server(tmp_path, model, "--api-server-count", "2")
    try:
        requests, max_tokens = 6, 4
        for i in range(requests):
            r = httpx.post(server.base + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
        answers = {}
        for _ in range(60):
            with httpx.Client() as c:  # one connection: /stats says which process answers /metrics
                index = c.get(server.base + "/stats", timeout=10).json()["api_server_index"]
                f = scrape(server.base, c)
            answers[index] = (value(f, "jaxkv:generation_tokens", "jaxkv:generation_tokens_total"),
                              value(f, "jaxkv:request_success", "jaxkv:request_success_total", finished_reason="length"),
                              check_histogram(f, "jaxkv:e2e_request_latency_seconds")[0],
                              check_histogram(f, "jaxkv:request_queue_time_seconds")[0],  # the engine's, per request
                              value(f, "jaxkv:num_requests_finished", "jaxkv:num_requests_finished_total"))
            if len(answers) == 2:
                break
        assert sorted(answers) == [0, 1], answers
        assert answers[0] == answers[1] == (requests * max_tokens, requests, requests, requests, requests), answers
        # the supervisor made the metrics directory and removes it when it stops
        environ = [e for pid in _children(server.proc.pid)  # the API servers' (the engine core has none)
                   for e in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
        dirs = {e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PROMETHEUS_MULTIPROC_DIR=")}
        assert len(dirs) == 1, dirs
        metrics_dir = dirs.pop()
        assert os.path.isdir(metrics_dir) and os.listdir(metrics_dir)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0 and not os.path.exists(metrics_dir)
    finally:
        server.stop()


def test_stale_metrics_dirs_of_dead_supervisors_are_removed(tmp_path):
    from models.entrypoints.openai.server import PROMETHEUS_DIR_PREFIX, remove_stale_metrics_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{PROMETHEUS_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{PROMETHEUS_DIR_PREFIX}{os.getpid()}-abc"
    other = tmp_path / "jaxkv-prometheus-notapid"
    for d in (stale, live, other):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    assert remove_stale_metrics_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
