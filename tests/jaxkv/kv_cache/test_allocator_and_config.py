"""BlockAllocator, KV-cache specs, get_kv_cache_config, allocate_kv_cache, bind_kv_cache."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.core.block_pool import BlockAllocator, OutOfBlocksError
from jaxkv.kv_cache.allocation import allocate_kv_cache, bind_kv_cache, extract_layer_index
from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.kv_cache.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, get_kv_cache_config
from jaxkv.kv_cache.specs import FullAttentionSpec

# ----------------------------------------------------------------------------------------------
# BlockAllocator
# ----------------------------------------------------------------------------------------------


def test_allocator_hands_out_distinct_ids_in_order():
    a = BlockAllocator(6)
    assert a.num_free_blocks == 6
    got = a.allocate(4)
    assert got == [0, 1, 2, 3]
    assert a.num_free_blocks == 2
    assert a.allocate(0) == []
    assert a.allocate(2) == [4, 5]
    assert a.num_free_blocks == 0


def test_allocator_reuses_first_freed_first():
    a = BlockAllocator(5)
    a.allocate(5)
    a.free([3])
    a.free([0, 4])
    a.free([1])
    assert a.allocate(4) == [3, 0, 4, 1]
    # freed blocks queue behind the never-used ones
    b = BlockAllocator(4)
    first = b.allocate(2)  # [0, 1]
    b.free([first[1]])
    assert b.allocate(3) == [2, 3, 1]


def test_allocator_model_random_ops():
    """Random allocate/free sequence vs. a list-based FIFO model."""
    rng = np.random.default_rng(0)
    a = BlockAllocator(32)
    free_model = list(range(32))
    owned: list[int] = []
    for _ in range(300):
        if owned and rng.random() < 0.5:
            k = int(rng.integers(1, len(owned) + 1))
            chosen = [owned[i] for i in rng.choice(len(owned), k, replace=False)]
            a.free(chosen)
            for blk in chosen:
                owned.remove(blk)
            free_model.extend(chosen)
        else:
            n = int(rng.integers(0, 8))
            if n > len(free_model):
                with pytest.raises(OutOfBlocksError):
                    a.allocate(n)
                continue
            got = a.allocate(n)
            assert got == free_model[:n]
            del free_model[:n]
            owned.extend(got)
        assert a.num_free_blocks == len(free_model)
        assert len(set(owned)) == len(owned)


def test_out_of_blocks_leaves_pool_unchanged():
    a = BlockAllocator(4)
    a.allocate(1)
    with pytest.raises(OutOfBlocksError):
        a.allocate(4)
    assert issubclass(OutOfBlocksError, ValueError)
    assert a.num_free_blocks == 3
    assert a.allocate(3) == [1, 2, 3]


def test_free_foreign_or_unallocated_block_frees_nothing():
    a = BlockAllocator(4)
    a.allocate(2)  # [0, 1]
    with pytest.raises(ValueError):
        a.free([99])
    with pytest.raises(ValueError):
        a.free([0, 2])  # 2 is free: nothing freed, 0 stays in use
    assert a.num_free_blocks == 2
    with pytest.raises(ValueError):
        a.free([1, 1])  # duplicate
    assert a.num_free_blocks == 2
    a.free([0, 1])  # both still in use
    assert a.num_free_blocks == 4
    with pytest.raises(ValueError):
        a.free([0])  # double free
    assert a.num_free_blocks == 4
    assert a.allocate(4) == [2, 3, 0, 1]


def test_allocator_bad_args():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        BlockAllocator(3).allocate(-1)


# ----------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


@pytest.mark.parametrize("dtype_name", list(ITEMSIZE))
@pytest.mark.parametrize("block_size,num_kv_heads,head_size", [(16, 8, 128), (8, 1, 64), (32, 3, 80)])
def test_page_size_bytes(dtype_name, block_size, num_kv_heads, head_size):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=getattr(jnp, dtype_name))
    # K and V, every token slot of the block, every KV head, every channel
    want = 2 * block_size * num_kv_heads * head_size * ITEMSIZE[dtype_name]
    assert spec.page_size_bytes == want
    # whole blocks per sequence
    assert spec.max_memory_usage_bytes(block_size * 3 + 1) == 4 * want
    assert spec.max_memory_usage_bytes(block_size * 3) == 3 * want


def test_page_size_bytes_hand_value():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=jnp.bfloat16)
    assert spec.page_size_bytes == 65536  # 2 * 16 * 8 * 128 * 2


def test_spec_is_frozen_and_hashable():
    s1 = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
    s2 = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    s3 = s1.replace(num_kv_heads=4)
    assert s1 == s2 and hash(s1) == hash(s2)
    assert s3 != s1 and s3.num_kv_heads == 4 and s1.num_kv_heads == 2
    assert len({s1, s2, s3}) == 2
    assert {s1: "a"}[s2] == "a"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s1.block_size = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 2, 64, jnp.bfloat16)  # keyword-only


@pytest.mark.parametrize("field,value", [("block_size", 0), ("block_size", -16), ("num_kv_heads", 0),
                                         ("head_size", -1), ("head_size", 64.0)])
def test_spec_validation(field, value):
    kwargs = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.float32)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        FullAttentionSpec(**kwargs)
    ok = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match=field):
        ok.replace(**{field: value})


def test_spec_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="not_a_dtype")


# ----------------------------------------------------------------------------------------------
# get_kv_cache_config
# ----------------------------------------------------------------------------------------------

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
PAGE = 2 * 16 * 2 * 64 * 2  # 8192 bytes


def layer_specs(n, spec=SPEC):
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(n)}


@pytest.mark.parametrize("num_layers,budget", [(1, PAGE * 10), (3, PAGE * 23 + 5), (4, PAGE * 4),
                                               (5, 10 ** 7 + 123)])
def test_num_blocks_from_budget(num_layers, budget):
    cfg = get_kv_cache_config(layer_specs(num_layers), budget)
    want = budget // PAGE // num_layers
    assert cfg.num_blocks == want
    assert want * PAGE * num_layers <= budget < (want + 1) * PAGE * num_layers
    names = tuple(layer_specs(num_layers))
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [(n,) for n in names]
    assert all(t.size == want * PAGE for t in cfg.kv_cache_tensors)
    assert len(cfg.kv_cache_groups) == 1
    assert cfg.kv_cache_groups[0].layer_names == names
    assert cfg.kv_cache_groups[0].kv_cache_spec == SPEC


def test_explicit_num_blocks():
    cfg = get_kv_cache_config(layer_specs(3), PAGE * 30, num_blocks=7)
    assert cfg.num_blocks == 7
    assert all(t.size == 7 * PAGE for t in cfg.kv_cache_tensors)
    assert get_kv_cache_config(layer_specs(3), PAGE * 30, num_blocks=10).num_blocks == 10
    with pytest.raises(ValueError, match="num_blocks"):
        get_kv_cache_config(layer_specs(3), PAGE * 30, num_blocks=11)


def test_budget_below_one_block_per_layer():
    with pytest.raises(ValueError):
        get_kv_cache_config(layer_specs(3), PAGE * 3 - 1)


def test_mixed_specs_raise():
    specs = layer_specs(3)
    specs["model.layers.1.self_attn.attn"] = SPEC.replace(num_kv_heads=4)
    with pytest.raises(ValueError, match="spec"):
        get_kv_cache_config(specs, PAGE * 100)


def test_no_layers_raise():
    with pytest.raises(ValueError):
        get_kv_cache_config({}, PAGE * 100)


# ----------------------------------------------------------------------------------------------
# allocate_kv_cache (Pallas backend)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size,num_kv_heads,head_size,dtype",
                         [(16, 2, 64, jnp.bfloat16), (8, 3, 128, jnp.float32), (32, 1, 32, jnp.float16)])
def test_allocate_shapes_and_dtype(block_size, num_kv_heads, head_size, dtype):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=dtype)
    specs = layer_specs(3, spec)
    cfg = get_kv_cache_config(specs, spec.page_size_bytes * 3 * 6)
    assert cfg.num_blocks == 6
    caches = allocate_kv_cache(cfg, PallasAttentionBackend)
    assert list(caches) == list(specs)
    for arr in caches.values():
        # [2, num_blocks, num_kv_heads, block_size, head_size]
        assert arr.shape == (2, 6, num_kv_heads, block_size, head_size)
        assert arr.dtype == jnp.dtype(dtype)
        assert arr.nbytes == cfg.kv_cache_tensors[0].size
        assert not np.asarray(arr).any()


def test_pallas_layout_and_stride_order():
    assert PallasAttentionBackend.get_kv_cache_shape(10, 16, 4, 64) == (2, 10, 4, 16, 64)
    assert PallasAttentionBackend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        PallasAttentionBackend.get_kv_cache_shape(0, 16, 4, 64)


@pytest.mark.parametrize("field,value,needle", [("block_size", 12, "block_size=12"),
                                                ("block_size", 256, "block_size=256"),
                                                ("head_size", 72, "head_size=72"),  # 80 is served since 641e5a5
                                                ("dtype", jnp.int8, "dtype=int8")])
def test_allocate_unsupported_raises(field, value, needle):
    kwargs = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
    kwargs[field] = value
    spec = FullAttentionSpec(**kwargs)
    cfg = get_kv_cache_config(layer_specs(2, spec), spec.page_size_bytes * 2 * 4)
    with pytest.raises(ValueError, match=needle):
        allocate_kv_cache(cfg, PallasAttentionBackend)


def test_allocate_tensor_size_mismatch_raises():
    names = tuple(layer_specs(2))
    cfg = KVCacheConfig(num_blocks=4,
                        kv_cache_tensors=(KVCacheTensor(size=4 * PAGE, shared_by=(names[0],)),
                                          KVCacheTensor(size=4 * PAGE - 2, shared_by=(names[1],))),
                        kv_cache_groups=(KVCacheGroupSpec(layer_names=names, kv_cache_spec=SPEC),))
    with pytest.raises(ValueError, match="KVCacheTensor.size"):
        allocate_kv_cache(cfg, PallasAttentionBackend)


def test_allocate_layer_without_tensor_raises():
    names = tuple(layer_specs(2))
    cfg = KVCacheConfig(num_blocks=4,
                        kv_cache_tensors=(KVCacheTensor(size=4 * PAGE, shared_by=(names[0],)),),
                        kv_cache_groups=(KVCacheGroupSpec(layer_names=names, kv_cache_spec=SPEC),))
    with pytest.raises(ValueError, match="layers.1"):
        allocate_kv_cache(cfg, PallasAttentionBackend)


# ----------------------------------------------------------------------------------------------
# extract_layer_index / bind_kv_cache
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,index", [("model.layers.12.self_attn.attn", 12), ("layers.0", 0),
                                        ("layers.3.attn", 3), ("transformer.layers.7", 7),
                                        ("model.decoder.layers.105.self_attn", 105)])
def test_extract_layer_index(name, index):
    assert extract_layer_index(name) == index


@pytest.mark.parametrize("name", ["model.embed_tokens", "model.layers.x.attn", "model.layers",
                                  "model.layer.3.attn", ""])
def test_extract_layer_index_errors(name):
    with pytest.raises(ValueError, match="layer"):
        extract_layer_index(name)


def test_bind_orders_by_layer_index():
    arrays = {i: jnp.full((2,), float(i)) for i in range(11)}
    order = [3, 10, 0, 7, 1, 2, 9, 5, 4, 8, 6]  # 10 before 2 alphabetically: index, not string order
    caches = {f"model.layers.{i}.self_attn.attn": arrays[i] for i in order}
    bound = bind_kv_cache(caches)
    assert len(bound) == 11
    for i, arr in enumerate(bound):
        assert arr is arrays[i]


def test_bind_duplicate_index_raises():
    caches = {"model.layers.0.self_attn.attn": jnp.zeros(1), "model.layers.1.self_attn.attn": jnp.zeros(1),
              "model.layers.0.cross_attn.attn": jnp.zeros(1)}
    with pytest.raises(ValueError, match=r"layers\.0\.cross_attn"):
        bind_kv_cache(caches)


def test_bind_gap_raises():
    caches = {"model.layers.0.attn": jnp.zeros(1), "model.layers.2.attn": jnp.zeros(1)}
    with pytest.raises(ValueError, match="2"):
        bind_kv_cache(caches)
    with pytest.raises(ValueError):
        bind_kv_cache({"model.layers.1.attn": jnp.zeros(1)})  # does not start at 0


def test_bind_name_without_layer_index_raises():
    caches = {"model.layers.0.attn": jnp.zeros(1), "lm_head.attn": jnp.zeros(1)}
    with pytest.raises(ValueError, match="lm_head"):
        bind_kv_cache(caches)
