"""``GET /metrics``: Prometheus metrics with vLLM's names under a ``jaxkv:`` prefix.

vLLM: ``v1/metrics/loggers.py`` (``PrometheusStatLogger``) and ``entrypoints/openai/api_server.py``
(``mount_metrics``, ``PROMETHEUS_MULTIPROC_DIR``). Two sources:

* **per request**, recorded by the handlers (:class:`RequestTracker`): the histograms
  ``jaxkv:time_to_first_token_seconds``, ``jaxkv:inter_token_latency_seconds``,
  ``jaxkv:e2e_request_latency_seconds``, ``jaxkv:request_prompt_tokens``, ``jaxkv:request_generation_tokens``,
  ``jaxkv:request_params_n``, ``jaxkv:request_params_max_tokens`` and the counters
  ``jaxkv:prompt_tokens_total``, ``jaxkv:generation_tokens_total``,
  ``jaxkv:request_success_total{finished_reason}``; every metric carries ``model_name``;
* **the engine's and the server's stats** (what ``/stats`` shows), read when scraped
  (:class:`StatsCollector`): vLLM's ``jaxkv:num_requests_running``, ``jaxkv:num_requests_waiting``,
  ``jaxkv:kv_cache_usage_perc``, and every numeric ``/stats`` field as ``jaxkv:<field>``: a gauge for a
  value now (``num_running``, ``kv_cache_usage``, ...), a counter (``_total`` suffix) for a running total
  (``num_preemptions`` → ``jaxkv:num_preemptions_total``, ``step_s`` → ``jaxkv:step_s_total``).

With several API-server processes (``--api-server-count``) each process answers the scrapes that reach it.
``server.py`` gives them one ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode): the
per-request metrics and the per-process counters of ``/stats`` (``num_requests_finished``, ...) are kept in
files there and summed over the processes at every scrape, so any process reports the same totals; the
engine's stats reach every API server from the engine cores, so they are the same in each.
Queue time (vLLM's ``request_queue_time_seconds``) is the engine's: from a request's arrival in the engine to
its first step, sent with its first output.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

prometheus_client.disable_created_metrics()  # no *_created series (vLLM scrapes look the same)

PREFIX = "jaxkv:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# vLLM's buckets (v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

# /stats fields that are running totals (exported as counters); every other numeric field is a gauge
COUNTER_STATS = frozenset({
    "num_preemptions", "num_compiles", "steps", "model_steps", "num_generated_tokens",
    "num_prompt_tokens_computed", "step_s", "device_wait_s", "device_idle_s", "decode_s", "decode_steps",
    "decode_tokens", "schedule_s", "execute_s", "update_s", "transfer_s", "call_s", "num_swaps_out",
    "num_swaps_in", "num_blocks_swapped_out", "num_blocks_swapped_in", "num_swap_recompute_fallbacks",
    "num_blocks_offloaded", "num_host_prefix_hit_tokens", "kv_offload_bytes_to_host",
    "kv_offload_bytes_to_device", "kv_offload_copy_s", "kv_offload_write_s", "kv_offload_load_s", "step_mask_calls",
    "step_mask_wait_s"})
# /stats fields each API-server process counts for itself: summed over the processes (multiprocess files)
PROCESS_COUNTERS = {
    "num_prompt_tokens_total": "Prompt tokens of the requests this server sent to the engine",
    "num_generation_tokens_total": "Tokens the engine generated for this server's requests",
    "num_requests_finished": "Engine requests (completions) that finished (not aborted)",
    "num_requests_aborted": "Engine requests aborted (client gone, stop string, drain)",
    "num_steps": "Engine steps (or engine-core output messages) the server received",
    "num_rejected_busy": "Requests answered 503 because --max-pending-requests were in the server",
    "num_rejected_draining": "Requests answered 503 because the server was draining",
}
PROCESS_GAUGES = {  # summed over the live API-server processes
    "num_pending_requests": "POST /v1/* requests in the server now (reading, waiting, running, streaming)",
    "num_outstanding_requests": "Requests this server has in the engine cores now",
    "process_rss_bytes": "Resident memory of the API-server process(es)",
}
NOT_EXPORTED = frozenset({"pid", "api_server_index"})  # facts of the answering process, not metrics
VLLM_ALIASES = {"num_running": ("num_requests_running", "Requests running in the engine now (vLLM's name)"),
                "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled (vLLM's name)"),
                "kv_cache_usage": ("kv_cache_usage_perc", "KV-cache usage, 1 = full (vLLM's name)")}
STAT_HELP = {
    "num_running": "Requests running in the engine now", "num_waiting": "Requests waiting in the engine now",
    "kv_cache_usage": "Share of KV-cache blocks held by live requests (0..1)",
    "num_preemptions": "Preemptions so far (recompute and swap)",
    "prefix_cache_hit_rate": "Prompt tokens found in the prefix cache / prompt tokens looked up",
    "num_compiles": "Compilations of the jitted step", "steps": "Engine step() calls that ran the model",
    "num_generated_tokens": "Tokens the engine generated", "num_prompt_tokens_computed":
    "Prompt tokens run through the model (re-prefills included)", "num_free_blocks": "Free KV-cache blocks",
    "num_gpu_blocks": "KV-cache blocks", "max_model_len": "Longest prompt + completion in tokens",
    "step_mask_calls": "Steps whose structured-output masks the host computed inside the step",
    "step_mask_wait_s": "Seconds those steps waited for their masks after the forward pass",
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when set (several API-server processes share their metrics there)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class StatsCollector:
    """The numeric ``/stats`` fields the engine (or the constants) give, read at scrape time: gauges, and
    counters for :data:`COUNTER_STATS`. Per-process fields are left to :class:`ServerMetrics`' own
    (multiprocess-safe) metrics.

    Args:
        stats: ``() -> dict`` (the server's ``/stats`` dict).
        model_name: the ``model_name`` label.
    """

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        labels = [self.model_name]
        for key, value in sorted(self.stats().items()):
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or key in NOT_EXPORTED
                    or key in PROCESS_COUNTERS or key in PROCESS_GAUGES):
                continue
            help_ = STAT_HELP.get(key, f"The /stats field {key}")
            if key in COUNTER_STATS:
                family = CounterMetricFamily(PREFIX + key, help_, labels=["model_name"])
            else:
                family = GaugeMetricFamily(PREFIX + key, help_, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family
            if key in VLLM_ALIASES:
                name, alias_help = VLLM_ALIASES[key]
                alias = GaugeMetricFamily(PREFIX + name, alias_help, labels=["model_name"])
                alias.add_metric(labels, float(value))
                yield alias


class ServerMetrics:
    """The server's Prometheus metrics (module docstring) and their exposition.

    Args:
        model_name: the ``model_name`` label (the first served name).
        max_model_len: sets the token-count buckets.
        stats: ``() -> dict``: the ``/stats`` dict, read at each scrape (and, with several API-server
            processes, when a request ends, to publish this process's counters).

    vLLM: ``PrometheusStatLogger``.
    """

    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], dict[str, Any]]):
        self.model_name = model_name
        self.stats = stats
        self.multiprocess = multiprocess_dir() is not None
        # one process, one registry per app (tests build several apps); several: the files are the registry
        self.registry = None if self.multiprocess else CollectorRegistry()
        reg = dict(registry=self.registry)
        labels = ["model_name"]
        tokens = build_1_2_5_buckets(max(1, max_model_len))

        def hist(name, help_, buckets):
            return Histogram(PREFIX + name, help_, labels, buckets=buckets, **reg).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to the first generated token, from the request's "
                         "arrival at the handler", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens of a completion (an engine "
                        "output carrying k tokens counts its interval / k once)", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token of the request",
                        E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited in the engine before its first "
                          "step", E2E_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per engine request", tokens)
        self.generation_len = hist("request_generation_tokens", "Generated tokens per engine request (all n "
                                   "completions)", tokens)
        self.param_n = hist("request_params_n", "The n of each engine request", (1, 2, 5, 10, 20))
        self.param_max_tokens = hist("request_params_max_tokens", "The max_tokens of each engine request", tokens)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished or aborted requests",
                                     labels, **reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished or "
                                         "aborted requests", labels, **reg).labels(model_name)
        success = Counter(PREFIX + "request_success", "Completions that ended, by finish reason",
                          labels + ["finished_reason"], **reg)
        self.success = {r: success.labels(model_name, r) for r in ("stop", "length", "abort")}
        self._success_family = success
        self._reg, self._labels = reg, labels
        self.process_counters: dict[str, Any] = {}  # made when their /stats field first shows up
        self.process_gauges: dict[str, Any] = {}
        self._published: dict[str, float] = {}
        self._last_stats: dict[str, Any] = {}
        self.collector = StatsCollector(self._shared_stats, model_name)
        if self.registry is not None:
            self.registry.register(self.collector)

    def _shared_stats(self) -> dict[str, Any]:
        return self._last_stats

    def publish_process_stats(self, stats: dict[str, Any] | None = None) -> None:
        """Move this process's counters and gauges of ``/stats`` into their metrics (a counter grows by
        what it grew since the last call)."""
        stats = self.stats() if stats is None else stats
        for key, help_ in PROCESS_COUNTERS.items():
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                counter = self.process_counters.get(key)
                if counter is None:
                    counter = self.process_counters[key] = Counter(
                        PREFIX + key.removesuffix("_total"), help_, self._labels, **self._reg).labels(self.model_name)
                grown = value - self._published.get(key, 0)
                if grown > 0:
                    counter.inc(grown)
                    self._published[key] = value
        for key, help_ in PROCESS_GAUGES.items():
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge = self.process_gauges.get(key)
                if gauge is None:
                    gauge = self.process_gauges[key] = Gauge(PREFIX + key, help_, self._labels, multiprocess_mode="livesum",
                                                             **self._reg).labels(self.model_name)
                gauge.set(value)

    def render(self) -> bytes:
        """The exposition text of every metric (this process's or, with several processes, all of theirs)."""
        stats = self.stats()
        self.publish_process_stats(stats)
        self._last_stats = stats
        if self.registry is not None:
            return prometheus_client.generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(self.collector)
        return prometheus_client.generate_latest(registry)

    def track(self, num_prompt_tokens: int, n: int, max_tokens: int | None) -> RequestTracker:
        """A :class:`RequestTracker` for one engine request arriving now."""
        return RequestTracker(self, num_prompt_tokens, n, max_tokens)


class RequestTracker:
    """The metrics of one engine request (its ``n`` completions): feed it every :class:`StreamOutput`
    (:meth:`on_output`), then call :meth:`finish` once (also for an aborted or failed request).
    ``on_output`` costs a clock read and, when tokens arrived, one histogram observation."""

    __slots__ = ("m", "t0", "first", "last", "ntok", "reasons", "prompt_tokens", "n", "max_tokens", "done", "queued")

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int, n: int, max_tokens: int | None):
        self.m = metrics
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last = [0.0] * n
        self.ntok = [0] * n
        self.reasons: list[str | None] = [None] * n
        self.prompt_tokens, self.n, self.max_tokens = prompt_tokens, n, max_tokens
        self.done = False
        self.queued = False

    def on_output(self, out) -> None:
        """Note one :class:`~models.entrypoints.async_llm.StreamOutput` (TTFT at the first tokens, then the
        inter-token latency of its completion)."""
        i = out.index
        if not self.queued and getattr(out, "queue_time_s", None) is not None:
            self.queued = True
            self.m.queue.observe(out.queue_time_s)
        count = len(out.token_ids)
        new = count - self.ntok[i]
        if out.finished:
            self.reasons[i] = out.finish_reason
        if new <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.t0)
        elif self.ntok[i]:
            self.m.itl.observe((now - self.last[i]) / new)
        self.last[i] = now
        self.ntok[i] = count

    def finish(self) -> None:
        """Record the request's totals (idempotent)."""
        if self.done:
            return
        self.done = True
        m = self.m
        generated = sum(self.ntok)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(generated)
        for reason in self.reasons:
            counter = m.success.get(reason or "abort")
            if counter is None:
                counter = m._success_family.labels(m.model_name, reason)
            counter.inc()
        if self.first is not None:
            m.e2e.observe(max(self.last) - self.t0)
        m.prompt_len.observe(self.prompt_tokens)
        m.generation_len.observe(generated)
        m.param_n.observe(self.n)
        if self.max_tokens is not None:
            m.param_max_tokens.observe(self.max_tokens)
        if m.multiprocess:  # the per-process /stats counters: published as requests end, not only when scraped
            m.publish_process_stats()
