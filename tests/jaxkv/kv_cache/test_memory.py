"""Device-memory budget: memory_snapshot, request_memory (vLLM), num_blocks_from_device_memory."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxkv.kv_cache.config import get_kv_cache_config
from jaxkv.kv_cache.memory import (
    MemorySnapshot,
    available_kv_cache_memory_bytes,
    memory_snapshot,
    num_blocks_from_device_memory,
    request_memory,
)
from jaxkv.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec

GIB = 1 << 30


class FakeDevice:
    """Answers memory_stats() like XLA's GPU client (bytes_limit / bytes_in_use), or None like the CPU."""

    def __init__(self, stats):
        self._stats = stats
        self.calls = 0

    def memory_stats(self):
        self.calls += 1
        return None if self._stats is None else dict(self._stats)

    def __str__(self):
        return "fake:0"


def gpu(limit=16 * GIB, in_use=1 * GIB):
    return FakeDevice({"bytes_limit": limit, "bytes_in_use": in_use, "peak_bytes_in_use": in_use})


SPEC = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=jnp.bfloat16)
PAGE = 2 * 16 * 8 * 128 * 2  # 65536


# ----------------------------------------------------------------------------------------------------
# memory_snapshot
# ----------------------------------------------------------------------------------------------------

def test_snapshot_from_stats():
    snap = memory_snapshot(gpu())
    assert snap == MemorySnapshot(total_bytes=16 * GIB, free_bytes=15 * GIB, device="fake:0")


def test_snapshot_overrides():
    assert memory_snapshot(gpu(), total_bytes=8 * GIB).free_bytes == 7 * GIB  # in-use still counted
    assert memory_snapshot(gpu(), free_bytes=GIB) == MemorySnapshot(total_bytes=16 * GIB, free_bytes=GIB,
                                                                    device="fake:0")
    # in use beyond an explicit total: nothing free
    assert memory_snapshot(gpu(in_use=10 * GIB), total_bytes=4 * GIB).free_bytes == 0


def test_snapshot_without_stats():
    cpu_like = FakeDevice(None)
    with pytest.raises(ValueError, match="pass total_bytes="):
        memory_snapshot(cpu_like)
    snap = memory_snapshot(cpu_like, total_bytes=1000)
    assert (snap.total_bytes, snap.free_bytes) == (1000, 1000)
    assert memory_snapshot(object(), total_bytes=10, free_bytes=3).free_bytes == 3  # no memory_stats at all


def test_snapshot_of_the_real_default_device():
    device = jax.devices()[0]
    stats = device.memory_stats()
    if stats is None:  # CPU
        with pytest.raises(ValueError, match="total_bytes"):
            memory_snapshot()
        assert memory_snapshot(total_bytes=123).total_bytes == 123
    else:
        assert memory_snapshot().total_bytes == stats["bytes_limit"]


@pytest.mark.parametrize("stats,kw,needle", [
    ({"bytes_in_use": 0}, {}, "bytes_limit"),
    ({"bytes_limit": 100}, {}, "bytes_in_use"),
    (None, dict(total_bytes=-1), "total_bytes=-1"),
    (None, dict(total_bytes=100, free_bytes=101), "free_bytes=101 exceeds total_bytes=100"),
    (None, dict(total_bytes=1.5e9), "total_bytes=1500000000.0"),
])
def test_snapshot_errors(stats, kw, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        memory_snapshot(FakeDevice(stats), **kw)


# ----------------------------------------------------------------------------------------------------
# request_memory
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("total,free,util,want", [
    (1000, 1000, 0.9, 900),
    (1001, 1000, 0.9, 901),      # ceil(900.9)
    (1000, 900, 0.9, 900),       # exactly enough free
    (16 * GIB, 15 * GIB, 0.9, 15461882266),  # ceil(17179869184 * 0.9 = 15461882265.6)
    (7, 7, 1, 7),
])
def test_request_memory_values(total, free, util, want):
    snap = MemorySnapshot(total_bytes=total, free_bytes=free)
    assert request_memory(snap, util) == want


def test_request_memory_exceeds_free():
    snap = MemorySnapshot(total_bytes=16 * GIB, free_bytes=15 * GIB, device="cuda:0")
    # 0.95 * 16 GiB = 15.2 GiB > 15 GiB free
    with pytest.raises(ValueError) as e:
        request_memory(snap, 0.95)
    msg = str(e.value)
    assert "requested gpu_memory_utilization=0.95 × total_bytes=17179869184" in msg
    assert "= 16320875725 bytes" in msg  # ceil(17179869184 * 0.95) = ceil(16320875724.8)
    assert "exceeds free_bytes=16106127360" in msg and "cuda:0" in msg
    # one byte short of the boundary
    with pytest.raises(ValueError, match="exceeds free_bytes=899"):
        request_memory(MemorySnapshot(total_bytes=1000, free_bytes=899), 0.9)


@pytest.mark.parametrize("util", [0, 0.0, -0.1, 1.01, True, "0.9", None])
def test_request_memory_bad_utilization(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization="):
        request_memory(MemorySnapshot(total_bytes=1000, free_bytes=1000), util)


# ----------------------------------------------------------------------------------------------------
# available_kv_cache_memory_bytes / num_blocks_from_device_memory
# ----------------------------------------------------------------------------------------------------

def test_available_subtracts_reserved():
    assert available_kv_cache_memory_bytes(device=gpu(), reserved_bytes=2 * GIB) == 15461882266 - 2 * GIB
    assert available_kv_cache_memory_bytes(total_bytes=1000, gpu_memory_utilization=0.5,
                                           device=FakeDevice(None)) == 500
    with pytest.raises(ValueError, match="reserved_bytes=15461882266 leaves no KV-cache memory"):
        available_kv_cache_memory_bytes(device=gpu(), reserved_bytes=15461882266)
    with pytest.raises(ValueError, match="reserved_bytes=-1"):
        available_kv_cache_memory_bytes(device=gpu(), reserved_bytes=-1)


def test_num_blocks_one_spec_many_layers():
    device = gpu()
    got = num_blocks_from_device_memory(SPEC, num_layers=32, device=device, reserved_bytes=2 * GIB)
    budget = 15461882266 - 2 * GIB  # 13314398618
    assert got == budget // (PAGE * 32) == 6348
    assert device.calls == 1


def test_num_blocks_layer_dict_uses_hybrid_grouping():
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=jnp.bfloat16,
                           sliding_window=512)
    specs = {f"model.layers.{i}.attn": SPEC if i % 3 == 0 else sw for i in range(30)}  # group_size 10
    got = num_blocks_from_device_memory(specs, device=FakeDevice(None), total_bytes=10 * GIB,
                                        gpu_memory_utilization=0.5)
    assert got == (5 * GIB) // PAGE // 10 == 8192


def test_num_blocks_resizes_a_config():
    specs = {f"l.{i}": SPEC for i in range(4)}
    cfg = get_kv_cache_config(specs, PAGE * 4 * 3)  # 3 blocks, 4 tensors: 4 * PAGE bytes per block
    got = num_blocks_from_device_memory(cfg, device=FakeDevice(None), total_bytes=100 * PAGE * 4,
                                        gpu_memory_utilization=0.5)
    assert got == 50


@pytest.mark.parametrize("kwargs,needle", [
    (dict(kv_cache=SPEC), "num_layers=None"),
    (dict(kv_cache=SPEC, num_layers=0), "num_layers=0"),
    (dict(kv_cache={"a": SPEC}, num_layers=2), "num_layers=2 applies only"),
    (dict(kv_cache="spec"), "kv_cache='spec'"),
    (dict(kv_cache=SPEC, num_layers=1, total_bytes=PAGE - 1, gpu_memory_utilization=1.0),
     "less than one block of 65536 bytes"),
    (dict(kv_cache={"a": SPEC}, total_bytes=PAGE - 1, gpu_memory_utilization=1.0), "holds 0 blocks"),
    (dict(kv_cache=SPEC, num_layers=1, gpu_memory_utilization=0.95), "exceeds free_bytes"),
])
def test_num_blocks_errors(kwargs, needle):
    device = gpu(limit=16 * GIB, in_use=1 * GIB) if "total_bytes" not in kwargs else FakeDevice(None)
    with pytest.raises(ValueError, match=re.escape(needle)):
        num_blocks_from_device_memory(device=device, **kwargs)
