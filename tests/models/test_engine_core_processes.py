"""Engine-core processes (vLLM V1's ``EngineCoreProc`` + ``SyncMPClient``) behind the offline ``LLM``.

References: the in-process engine (``enable_multiprocessing=False``) on the same tiny dummy model (random
weights from the seed, so every process builds the same model). Checked: identical greedy and seeded tokens
with one core, with two data-parallel ranks over TCP loopback (one of them started as a separate "host"),
a core killed mid-generate, and that no process outlives its ``LLM``.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time

import pytest

from jaxkv import SamplingParams
from jaxkv.engine.core_client import DataParallelConfig, EngineDeadError, launch_engine_cores, stop_processes
from models import LLM
from models.entrypoints.engine_args import EngineArgs, EngineCoreFactory
from tests.tiny_gguf import write_tiny_llama_gguf

ENGINE = dict(load_format="dummy", dtype="float32", max_model_len=128, max_num_seqs=4, num_gpu_blocks=64,
              max_num_batched_tokens=64, seed=3)
PROMPTS = ["Hello the world", "abc", "The quick brown fox jumps over the lazy dog", "x", "in on re",
           "Once upon a time there was"]
PARAMS = [SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS) - 1)] + [
    SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:  # a zombie has exited: it holds no device
                    if f.read().split(") ")[1].startswith("Z"):
                        continue
                alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny, enable_multiprocessing=False, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_one_core_process_equals_the_in_process_engine(tiny, reference):
    llm = LLM(tiny, enable_multiprocessing=True, **ENGINE)
    pids = llm.engine_pids
    assert len(pids) == 1 and pids[0] != os.getpid()
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outs) == reference
    assert [len(t) for t in reference] == [p.max_tokens for p in PARAMS]
    assert outs[0].prompt == PROMPTS[0] and outs[0].outputs[0].text == llm.tokenizer.decode(reference[0])
    # the second call reuses the prefix cache of the first, in the core
    again = llm.generate(PROMPTS[:3], PARAMS[:3], use_tqdm=False)
    assert _tokens(again) == reference[:3] and again[2].num_cached_tokens > 0
    stats = llm.get_engine_stats()[0]
    assert stats["num_generated_tokens"] == sum(len(t) for t in reference + reference[:3])
    # more requests than LLM.generate keeps outstanding (2 x max_num_seqs = 8): the rest go as others finish
    assert _tokens(llm.generate(PROMPTS * 3, PARAMS * 3, use_tqdm=False)) == reference * 3
    # a request a core rejects after the first window: the others are aborted, nothing is left queued
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["abc"] * 9 + ["word " * 200], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert llm.get_engine_stats()[0]["num_unfinished_requests"] == 0 and llm._client.outstanding == [0]
    # a rejected batch leaves nothing queued and the engine serves on
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["abc", "word " * 200], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.get_engine_stats()[0]["num_unfinished_requests"] == 0
    assert _tokens(llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)) == reference[:1]
    # n, logprobs, prompt logprobs, stop strings and sleep cross the process boundary as they run in process
    sp = SamplingParams(n=2, max_tokens=6, seed=5, logprobs=2, prompt_logprobs=1, stop=["e"], ignore_eos=True)
    local = LLM(tiny, enable_multiprocessing=False, **ENGINE).generate(PROMPTS[:2], sp, use_tqdm=False)
    remote = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    for a, b in zip(local, remote):
        assert [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in a.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in b.outputs]
        assert a.prompt_logprobs == b.prompt_logprobs and len(b.prompt_logprobs) == len(b.prompt_token_ids)
    llm.sleep()
    llm.wake_up()
    assert _tokens(llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)) == reference[:1]
    del llm, outs  # out of scope: the core goes too
    gc.collect()
    assert _gone(pids)


def test_two_ranks_over_tcp_equal_one_rank(tiny, reference):
    """Rank 0 started by the front end, rank 1 by a separate launcher (a second host's ``--headless``),
    both over TCP on loopback; each rank has its own scheduler, blocks and ``max_num_seqs``."""
    port = _free_port()
    other = DataParallelConfig(data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=1,
                               data_parallel_address="127.0.0.1", data_parallel_rpc_port=port)
    procs = launch_engine_cores(EngineCoreFactory(EngineArgs(model=tiny, **ENGINE)), other, *other.addresses())
    llm = None
    try:
        llm = LLM(tiny, data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="127.0.0.1",
                  data_parallel_rpc_port=port, enable_multiprocessing=True, **ENGINE)
        assert [i["max_num_seqs"] for i in llm.engine_info] == [4, 4]  # per rank, as vLLM
        assert len(llm.engine_pids) == 1  # rank 1 is the other "host"'s
        assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
        per_rank = [s["num_generated_tokens"] for s in llm.get_engine_stats()]
        assert sum(per_rank) == sum(len(t) for t in reference) and min(per_rank) > 0, per_rank
        # 18 requests, 16 outstanding at most (2 x max_num_seqs per rank): two sent as others finish
        assert _tokens(llm.generate(PROMPTS * 3, PARAMS * 3, use_tqdm=False)) == reference * 3
        assert llm._client.outstanding == [0, 0]
        pids = llm.engine_pids + [p.pid for p in procs.values()]
    finally:
        if llm is not None:
            llm.shutdown()
        stop_processes(list(procs.values()))
    assert _gone(pids)


def test_killed_core_fails_generate_within_a_second(tiny):
    llm = LLM(tiny, enable_multiprocessing=True, **dict(ENGINE, max_model_len=512, num_gpu_blocks=128))
    pid = llm.engine_pids[0]
    llm.generate(["warm"], SamplingParams(max_tokens=2), use_tqdm=False)  # compiled: the kill lands mid-run
    errors = []

    def run():
        try:
            llm.generate(["a long one"] * 4, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - what the caller sees
            errors.append((e, time.monotonic()))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    t.join(10)
    assert not t.is_alive()
    (error, when), = errors
    assert isinstance(error, EngineDeadError) and "exited with code -9" in str(error)
    assert when - killed < 1.0
    with pytest.raises(EngineDeadError):  # and so does every later call
        llm.generate(["b"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()


def test_core_start_up_errors_reach_the_caller(tiny):
    with pytest.raises(ValueError, match="max_model_len=100000"):
        LLM(tiny, enable_multiprocessing=True, **dict(ENGINE, max_model_len=100000))


def test_core_binds_to_its_gpus_numa_node(monkeypatch):
    """gpu_local_cpus reads NVML's CPU mask of the first visible GPU (by its index) and keeps the CPUs this
    process may use; no NVML, a UUID device list or an empty intersection leave the affinity alone."""
    import sys
    import types

    from jaxkv.engine import core

    allowed = sorted(os.sched_getaffinity(0))
    masks = {0: [1 << allowed[0]], 1: [0]}  # GPU 0: the first allowed CPU; GPU 1: a node with none of ours
    asked = []

    class NVMLError(Exception):
        pass

    def cpu_affinity(handle, words):
        asked.append((handle, words))
        return masks[handle] + [0] * (words - 1)
    fake = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetCpuAffinity=cpu_affinity)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert core.gpu_local_cpus("0,1") == {allowed[0]}
    assert asked == [(0, (os.cpu_count() + 63) // 64)]
    assert core.gpu_local_cpus("1") is None
    assert core.gpu_local_cpus("GPU-8f2c") is None and core.gpu_local_cpus("") is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert core.gpu_local_cpus("0") is None
