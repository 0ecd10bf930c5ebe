"""Host side of the mesh (no devices needed): tensor-parallel size checks, per-rank KV managers and
request placement, per-rank memory sizing."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import Request, SamplingParams
from jaxkv.parallel import (DataParallelKVCacheManager, check_tensor_parallel, global_kv_cache_shape, kv_head_map,
                            make_mesh, num_kv_heads_per_rank, valid_tp_sizes)

BLOCK = 4


def _req(i, n=10, tokens=None):
    return Request(f"r{i}", tokens or list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=4),
                   arrival_index=i, seed=0, max_model_len=64, eos_token_ids=frozenset())


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


def test_placement_least_loaded_per_rank_pools_local_ids():
    kv = DataParallelKVCacheManager(6, BLOCK, data_parallel_size=2, max_num_seqs_per_rank=2,
                                    enable_prefix_caching=False)
    reqs = [_req(i) for i in range(5)]
    assert kv.allocate_slots(reqs[0], 10)            # 3 blocks on rank 0
    assert kv.allocate_slots(reqs[1], 5)             # rank 1 has fewer requests
    assert kv.allocate_slots(reqs[2], 4)             # tie on requests: rank 1 has more free blocks (4 > 3)
    assert [kv.rank_of[r.request_id] for r in reqs[:3]] == [0, 1, 1]
    assert kv.allocate_slots(reqs[3], 4)             # rank 1 is full (2 requests): rank 0
    assert kv.rank_of["r3"] == 0
    for r in reqs[:4]:                               # ids are local to the rank's pool of 6
        assert all(0 <= b < 6 for b in r.block_ids)
    for d in range(2):                               # no block handed out twice within a rank
        ids = [b for r in reqs[:4] if kv.rank_of[r.request_id] == d for b in r.block_ids]
        assert len(ids) == len(set(ids)) == 6 - kv.managers[d].num_free_blocks
    assert not kv.can_allocate(reqs[4], 1) and not kv.allocate_slots(reqs[4], 1)  # every rank full
    assert "r4" not in kv.rank_of and reqs[4].block_ids == []
    assert kv.usage == pytest.approx(7 / 12)             # 3 + 1 blocks on rank 0, 2 + 1 on rank 1
    kv.free(reqs[1])                                 # back to rank 1; r4 goes there
    assert "r1" not in kv.rank_of and reqs[1].block_ids == []
    assert kv.allocate_slots(reqs[4], 8) and kv.rank_of["r4"] == 1
    assert not kv.allocate_slots(reqs[0], 30)        # 8 more blocks; rank 0 has 2 free: r0 cannot grow
    assert kv.rank_of["r0"] == 0 and len(reqs[0].block_ids) == 3
    assert kv.num_blocks == 6 and kv.num_placed == [2, 3]


def test_prefix_cache_hits_only_on_the_requests_rank():
    kv = DataParallelKVCacheManager(8, BLOCK, data_parallel_size=2, max_num_seqs_per_rank=4)
    a = _req(0, tokens=list(range(12)))
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    kv.free(a)                                       # rank 0 keeps 3 cached blocks
    b = _req(1, tokens=list(range(12)) + [99])
    hits, n = kv.get_computed_blocks(b)              # both ranks empty of requests: rank 0 (more free? tie
    assert kv._rank(b) == 0 and n == 12              # -> lowest index), where the prefix is
    assert kv.allocate_slots(b, 1, hits) and kv.rank_of["r1"] == 0
    c = _req(2, tokens=list(range(12)) + [98])
    hits, n = kv.get_computed_blocks(c)              # rank 1 is now less loaded: no hit there
    assert kv._rank(c) == 1 and (hits, n) == ([], 0)


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
