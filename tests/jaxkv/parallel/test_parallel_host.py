"""Host side of the mesh (no devices needed): tensor-parallel size checks, per-rank memory sizing."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.parallel.mesh import (
    check_tensor_parallel,
    global_kv_cache_shape,
    kv_head_map,
    make_mesh,
    num_kv_heads_per_rank,
    valid_tp_sizes,
)

BLOCK = 4


def test_tp_rules_and_errors():
    assert valid_tp_sizes(9, 3, 1536) == [1, 3]                      # SmolLM2-135M
    assert valid_tp_sizes(4, 1) == [1, 2, 4]                         # Gemma 3 270M: KV replicated
    assert valid_tp_sizes(32, 8, 14336) == [1, 2, 4, 8, 16, 32]      # Llama 3 8B (16, 32: KV replicated)
    assert [num_kv_heads_per_rank(8, tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    assert kv_head_map(8, 4) is None
    np.testing.assert_array_equal(kv_head_map(2, 8), [0, 0, 0, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"num_heads=9 is not divisible by tensor_parallel_size=2; valid "
                                         r"tensor_parallel_size values for num_heads=9, num_kv_heads=3, "
                                         r"intermediate_size=1536: \[1, 3\]"):
        check_tensor_parallel(9, 3, 2, 1536)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 is not a multiple of num_kv_heads=3"):
        check_tensor_parallel(12, 3, 4)
    with pytest.raises(ValueError, match=r"intermediate_size=1000 is not divisible by tensor_parallel_size=3"):
        check_tensor_parallel(9, 3, 3, 1000)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be an int >= 1"):
        check_tensor_parallel(9, 3, 0)
    assert global_kv_cache_shape(10, 16, 1, 64, types.SimpleNamespace(shape={"dp": 2, "tp": 4})) == (
        2, 20, 4, 16, 64)


def test_make_mesh_needs_enough_devices():
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n + 1} x data_parallel_size=1 needs {n + 1} "
                                         rf"devices, {n} available"):
        make_mesh(n + 1, 1)
    with pytest.raises(ValueError, match="data_parallel_size=0 must be an int >= 1"):
        make_mesh(1, 0)
    assert dict(make_mesh(1, 1).shape) == {"dp": 1, "tp": 1}


def test_memory_sizing_per_rank():
    spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=np.float16)
    budget = dict(total_bytes=1 << 30, free_bytes=1 << 30, gpu_memory_utilization=1.0)
    dev = jax.devices()[0]
    solo = jaxkv.num_blocks_from_device_memory(spec, num_layers=4, **budget)
    mesh = types.SimpleNamespace(shape={"dp": 2, "tp": 4}, devices=np.array([dev]))
    assert jaxkv.num_blocks_from_device_memory(spec, num_layers=4, mesh=mesh, **budget) == 4 * solo
    mesh16 = types.SimpleNamespace(shape={"dp": 1, "tp": 16}, devices=np.array([dev]))  # 1 head per rank
    assert jaxkv.num_blocks_from_device_memory(spec, num_layers=4, mesh=mesh16, **budget) == 8 * solo
    assert solo == (1 << 30) // (2 * 16 * 8 * 128 * 2 * 4)
