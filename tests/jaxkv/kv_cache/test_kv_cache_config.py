"""KVCacheTensor / KVCacheGroupSpec / KVCacheConfig and get_kv_cache_config's hybrid grouping (vLLM v1)."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest

from jaxkv.kv_cache.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    check_enough_kv_cache_memory,
    get_kv_cache_config,
    unify_hybrid_kv_cache_specs,
)
from jaxkv.kv_cache.specs import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
SW = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16, sliding_window=128)
PAGE = 2 * 16 * 2 * 64 * 2  # 8192 bytes, same for both


def name(i):
    return f"model.layers.{i}.self_attn.attn"


def check_every_layer_once(cfg, layer_names):
    """Each layer is in exactly one group and exactly one tensor."""
    in_groups = [n for g in cfg.kv_cache_groups for n in g.layer_names]
    in_tensors = [n for t in cfg.kv_cache_tensors for n in t.shared_by]
    assert sorted(in_groups) == sorted(layer_names)
    assert sorted(in_tensors) == sorted(layer_names)


# ----------------------------------------------------------------------------------------------------
# the dataclasses
# ----------------------------------------------------------------------------------------------------

def test_dataclasses_store_tuples_and_hash():
    t = KVCacheTensor(size=10, shared_by=["a", "b"])
    g = KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=FULL)
    cfg = KVCacheConfig(num_blocks=3, kv_cache_tensors=[t], kv_cache_groups=[g])
    assert t.shared_by == ("a", "b") and g.layer_names == ("a", "b")
    assert cfg.kv_cache_tensors == (t,) and cfg.kv_cache_groups == (g,)
    same = KVCacheConfig(num_blocks=3, kv_cache_tensors=(KVCacheTensor(size=10, shared_by=("a", "b")),),
                         kv_cache_groups=(KVCacheGroupSpec(layer_names=("a", "b"), kv_cache_spec=FULL),))
    assert cfg == same and hash(cfg) == hash(same)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_blocks = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        KVCacheTensor(10, ("a",))  # keyword-only


@pytest.mark.parametrize("make,needle", [
    (lambda: KVCacheTensor(size=0, shared_by=("a",)), "size=0"),
    (lambda: KVCacheTensor(size=8, shared_by=()), "shared_by=()"),
    (lambda: KVCacheTensor(size=8, shared_by="abc"), "shared_by='abc'"),
    (lambda: KVCacheTensor(size=8, shared_by=("a", "a")), "twice"),
    (lambda: KVCacheGroupSpec(layer_names=("a",), kv_cache_spec="full"), "kv_cache_spec='full'"),
    (lambda: KVCacheGroupSpec(layer_names=("a", 3), kv_cache_spec=FULL), "holds 3"),
    (lambda: KVCacheConfig(num_blocks=0, kv_cache_tensors=(), kv_cache_groups=()), "num_blocks=0"),
    (lambda: KVCacheConfig(num_blocks=2, kv_cache_tensors=("t",), kv_cache_groups=()), "kv_cache_tensors[0]"),
    (lambda: KVCacheConfig(num_blocks=2, kv_cache_tensors=(), kv_cache_groups=(FULL,)), "kv_cache_groups[0]"),
])
def test_dataclass_validation(make, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        make()


# ----------------------------------------------------------------------------------------------------
# hybrid grouping
# ----------------------------------------------------------------------------------------------------

def test_vllm_docstring_example_2_full_3_sliding():
    # vLLM: (full.0, full.1), (sw.0, sw.1), (sw.2, padding); tensors {full.0, sw.0, sw.2}, {full.1, sw.1}
    specs = {"full.0": FULL, "sw.0": SW, "full.1": FULL, "sw.1": SW, "sw.2": SW}
    budget = PAGE * 2 * 50 + 100
    cfg = get_kv_cache_config(specs, budget)
    assert [g.layer_names for g in cfg.kv_cache_groups] == [("full.0", "full.1"), ("sw.0", "sw.1"), ("sw.2",)]
    assert [g.kv_cache_spec for g in cfg.kv_cache_groups] == [FULL, SW, SW]
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [("full.0", "sw.0", "sw.2"), ("full.1", "sw.1")]
    assert cfg.num_blocks == 50  # budget // page // group_size(2)
    assert all(t.size == 50 * PAGE for t in cfg.kv_cache_tensors)


def test_10_full_20_sliding_pattern():
    # pattern (full, sw, sw) x 10: layer 3k is full, 3k+1 and 3k+2 are sliding
    specs = {name(i): FULL if i % 3 == 0 else SW for i in range(30)}
    budget = 1_000_000_003
    cfg = get_kv_cache_config(specs, budget)

    full_layers = [name(i) for i in (0, 3, 6, 9, 12, 15, 18, 21, 24, 27)]
    sw_first = [name(i) for i in (1, 2, 4, 5, 7, 8, 10, 11, 13, 14)]
    sw_second = [name(i) for i in (16, 17, 19, 20, 22, 23, 25, 26, 28, 29)]
    assert len(cfg.kv_cache_groups) == 3
    assert [list(g.layer_names) for g in cfg.kv_cache_groups] == [full_layers, sw_first, sw_second]
    assert [type(g.kv_cache_spec) for g in cfg.kv_cache_groups] == [FullAttentionSpec, SlidingWindowSpec,
                                                                      SlidingWindowSpec]
    # group_size = 10 tensors; tensor i is shared by the i-th layer of each of the 3 groups
    assert len(cfg.kv_cache_tensors) == 10
    for i, t in enumerate(cfg.kv_cache_tensors):
        assert t.shared_by == (full_layers[i], sw_first[i], sw_second[i])
    want_blocks = 1_000_000_003 // 8192 // 10  # = 12207
    assert cfg.num_blocks == want_blocks == 12207
    assert all(t.size == want_blocks * 8192 for t in cfg.kv_cache_tensors)
    assert sum(t.size for t in cfg.kv_cache_tensors) <= budget
    check_every_layer_once(cfg, list(specs))


def test_gemma3_like_5_to_1():
    # 12 layers: every 6th is full (5 sliding : 1 full) -> 2 full, 10 sliding; group_size 2
    specs = {name(i): FULL if i % 6 == 5 else SW for i in range(12)}
    cfg = get_kv_cache_config(specs, PAGE * 2 * 7)
    sw = [name(i) for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)]
    groups = [list(g.layer_names) for g in cfg.kv_cache_groups]
    # the first layer is sliding, so the sliding type comes first
    assert groups == [sw[0:2], sw[2:4], sw[4:6], sw[6:8], sw[8:10], [name(5), name(11)]]
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [
        (sw[0], sw[2], sw[4], sw[6], sw[8], name(5)), (sw[1], sw[3], sw[5], sw[7], sw[9], name(11))]
    assert cfg.num_blocks == 7
    check_every_layer_once(cfg, list(specs))


def test_three_types_two_windows():
    sw_small = SW.replace(sliding_window=64)
    specs = {"a": FULL, "b": SW, "c": sw_small, "d": FULL, "e": SW, "f": sw_small, "g": SW, "h": SW}
    cfg = get_kv_cache_config(specs, PAGE * 2 * 3)
    # full: a d; sw128: b e g h -> (b e), (g h); sw64: c f
    assert [g.layer_names for g in cfg.kv_cache_groups] == [("a", "d"), ("b", "e"), ("g", "h"), ("c", "f")]
    assert [g.kv_cache_spec.sliding_window for g in cfg.kv_cache_groups] == [None, 128, 128, 64]
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [("a", "b", "g", "c"), ("d", "e", "h", "f")]
    assert cfg.num_blocks == 3


@pytest.mark.parametrize("blocks", [1, 2, 9])
def test_budget_boundary_hybrid(blocks):
    specs = {"f0": FULL, "s0": SW, "s1": SW}  # group_size 1: one tensor shared by all three
    exact = PAGE * blocks
    assert get_kv_cache_config(specs, exact).num_blocks == blocks
    if blocks > 1:
        assert get_kv_cache_config(specs, exact - 1).num_blocks == blocks - 1
    cfg = get_kv_cache_config(specs, exact)
    assert cfg.kv_cache_tensors == (KVCacheTensor(size=exact, shared_by=("f0", "s0", "s1")),)


def test_explicit_num_blocks_hybrid():
    specs = {"f0": FULL, "s0": SW, "f1": FULL, "s1": SW}
    cfg = get_kv_cache_config(specs, PAGE * 2 * 10, num_blocks=4)
    assert cfg.num_blocks == 4 and all(t.size == 4 * PAGE for t in cfg.kv_cache_tensors)
    with pytest.raises(ValueError, match="num_blocks=11"):
        get_kv_cache_config(specs, PAGE * 2 * 10, num_blocks=11)
    with pytest.raises(ValueError, match="num_blocks=2.5"):
        get_kv_cache_config(specs, PAGE * 2 * 10, num_blocks=2.5)


def test_uniform_full_with_windows_is_one_group_keeping_the_window():
    windowed = FULL.replace(sliding_window=4096)
    specs = {"a": FULL, "b": windowed, "c": FULL}
    cfg = get_kv_cache_config(specs, PAGE * 3 * 5)
    assert len(cfg.kv_cache_groups) == 1
    assert cfg.kv_cache_groups[0].kv_cache_spec == windowed
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [("a",), ("b",), ("c",)]
    assert cfg.num_blocks == 5


def test_mla_model():
    m = MLAAttentionSpec(block_size=16, head_size=576, dtype=jnp.bfloat16)
    cfg = get_kv_cache_config({name(i): m for i in range(4)}, 16 * 576 * 2 * 4 * 3)
    assert cfg.num_blocks == 3
    assert cfg.kv_cache_groups[0].kv_cache_spec == m
    assert all(t.size == 3 * 18432 for t in cfg.kv_cache_tensors)


# ----------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------

def test_different_page_sizes_named():
    specs = {"a": FULL, "b": SW, "c": FULL.replace(head_size=128)}
    with pytest.raises(ValueError, match=r"layer 'a' has page_size_bytes=8192 but layer 'c' has "
                                         r"page_size_bytes=16384"):
        get_kv_cache_config(specs, 10 ** 9)


def test_same_type_that_does_not_merge():
    # same type_id (page 8192, block 16) but a different head split: one group cannot hold both
    specs = {"a": FULL, "b": FULL.replace(num_kv_heads=4, head_size=32)}
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        get_kv_cache_config(specs, 10 ** 9)


@pytest.mark.parametrize("specs,budget,needle", [
    ({}, 100, "names no layer"),
    ({"a": "full"}, 100, r"kv_cache_specs\['a'\]"),
    ({"a": FULL}, -1, "available_memory_bytes=-1"),
    ({"a": FULL}, float("nan"), "available_memory_bytes=nan"),
    ({"a": FULL, "b": SW}, PAGE - 1, "holds 0 blocks"),
])
def test_bad_inputs(specs, budget, needle):
    with pytest.raises(ValueError, match=needle):
        get_kv_cache_config(specs, budget)


# ----------------------------------------------------------------------------------------------------
# hybrid manager disabled, memory check
# ----------------------------------------------------------------------------------------------------

def test_disable_hybrid_makes_one_group_of_full_attention():
    specs = {name(i): FULL if i % 3 == 0 else SW for i in range(30)}
    cfg = get_kv_cache_config(specs, PAGE * 30 * 4, disable_hybrid_kv_cache_manager=True)
    assert len(cfg.kv_cache_groups) == 1
    assert cfg.kv_cache_groups[0].layer_names == tuple(name(i) for i in range(30))
    assert cfg.kv_cache_groups[0].kv_cache_spec == FULL.replace(sliding_window=128)
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [(name(i),) for i in range(30)]
    assert cfg.num_blocks == 4
    # the argument is not changed
    assert isinstance(specs[name(1)], SlidingWindowSpec)


def test_unify_rules():
    specs = {"a": FULL, "b": SW}
    unified = unify_hybrid_kv_cache_specs(specs)
    assert unified == {"a": FULL, "b": FULL.replace(sliding_window=128)}
    assert specs["b"] is SW
    assert unify_hybrid_kv_cache_specs({"a": SW, "b": SW}) == {"a": SW, "b": SW}
    with pytest.raises(ValueError, match="type_ids"):
        unify_hybrid_kv_cache_specs({"a": SW, "b": SW.replace(sliding_window=64)})
    # different windows unify to full, then fail to merge into the one group
    with pytest.raises(ValueError, match="sliding_window"):
        get_kv_cache_config({"a": FULL, "b": SW, "c": SW.replace(sliding_window=64)}, 10 ** 9,
                            disable_hybrid_kv_cache_manager=True)


def test_enough_memory_check():
    specs = {"f": FULL, "s": SW}
    # one request of 1000 tokens, 64 per step: full ceil(1000/16)=63 blocks; sliding min(127+64,1000)=191
    # tokens -> 12 + 1 = 13 blocks
    needed = (63 + 13) * PAGE
    got = check_enough_kv_cache_memory(specs, needed, max_model_len=1000, max_num_batched_tokens=64)
    assert got == needed
    with pytest.raises(ValueError, match=f"needs {needed} bytes"):
        check_enough_kv_cache_memory(specs, needed - 1, max_model_len=1000, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="available_memory_bytes=0"):
        check_enough_kv_cache_memory(specs, 0, max_model_len=1000)
    cfg = get_kv_cache_config(specs, needed, max_model_len=1000, max_num_batched_tokens=64)
    assert cfg.num_blocks == needed // PAGE // 1
    with pytest.raises(ValueError, match="max_model_len=1000"):
        get_kv_cache_config(specs, needed - 1, max_model_len=1000, max_num_batched_tokens=64)
