"""Cross-layer KV sharing: groups, allocation, source indices, a donated step that skips shared writes.

vLLM: ``add_kv_sharing_layers_to_kv_cache_groups`` and ``initialize_kv_cache_tensors``'
``kv_caches[layer] = kv_caches[target]``: a sharing layer is added to its target's group (so it gets the
group's metadata), owns no tensor, reads the target's cache and never writes it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv_cache.allocation import bind_kv_cache, init_kv_cache
from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.kv_cache.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, get_kv_cache_config
from jaxkv.kv_cache.layer_specs import AttentionLayerDescription, get_kv_cache_spec, get_shared_kv_cache_layers
from jaxkv.kv_cache.specs import FullAttentionSpec
from jaxkv.kv_cache.write import write_to_paged_cache
from jaxkv.vllm_parity.backends.flash_attn import FlashAttentionHNDBackend
from jaxkv.vllm_parity.kv_sharing import (
    add_kv_sharing_layers_to_kv_cache_groups,
    is_kv_sharing_layer,
    kv_sharing_source_indices,
    unique_kv_caches,
)

L = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.float32)
SPEC_B = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype=jnp.float32)
GROUPS = (KVCacheGroupSpec(layer_names=(L[0], L[1]), kv_cache_spec=SPEC),
          KVCacheGroupSpec(layer_names=(L[2],), kv_cache_spec=SPEC_B))

# ----------------------------------------------------------------------------------------------
# add_kv_sharing_layers_to_kv_cache_groups
# ----------------------------------------------------------------------------------------------


def test_sharing_layers_join_their_targets_group():
    runner_only = {"already.there"}
    shared = {L[3]: L[2], L[4]: L[0], L[5]: L[1]}
    groups = add_kv_sharing_layers_to_kv_cache_groups(shared, GROUPS, runner_only)
    assert [g.layer_names for g in groups] == [(L[0], L[1], L[4], L[5]), (L[2], L[3])]
    assert [g.kv_cache_spec for g in groups] == [SPEC, SPEC_B]
    assert runner_only == {"already.there", L[3], L[4], L[5]}
    # the input groups are frozen and unchanged
    assert [g.layer_names for g in GROUPS] == [(L[0], L[1]), (L[2],)]
    assert add_kv_sharing_layers_to_kv_cache_groups({}, GROUPS) == GROUPS


@pytest.mark.parametrize("shared,needle", [
    ({L[3]: L[3]}, "itself"),
    ({L[3]: "model.layers.1.cross_attn.attn"}, "no KV-cache group"),
    ({L[3]: L[0], L[4]: L[3]}, "itself a KV-sharing layer"),
    ({L[1]: L[0]}, "already in kv_cache_groups"),
    ({"model.layers.0.other.attn": L[2]}, "must come before"),
    ({"lm_head.attn": L[0]}, "lm_head"),
])
def test_sharing_rejects_bad_pairs_and_changes_nothing(shared, needle):
    runner_only = set()
    with pytest.raises(ValueError, match=needle):
        add_kv_sharing_layers_to_kv_cache_groups(shared, GROUPS, runner_only)
    assert runner_only == set()


def test_sharing_runner_only_must_be_a_set():
    with pytest.raises(ValueError, match="runner_only_attn_layers"):
        add_kv_sharing_layers_to_kv_cache_groups({L[3]: L[0]}, GROUPS, frozenset())


def test_is_kv_sharing_layer():
    shared = {L[3]: L[0]}
    assert is_kv_sharing_layer(L[3], shared)
    assert not is_kv_sharing_layer(L[0], shared)
    assert not is_kv_sharing_layer(L[3], None) and not is_kv_sharing_layer(L[3], {})


# ----------------------------------------------------------------------------------------------
# init_kv_cache with sharing
# ----------------------------------------------------------------------------------------------


def two_owner_config(num_blocks=3):
    tensors = tuple(KVCacheTensor(size=num_blocks * SPEC.page_size_bytes, shared_by=(n,)) for n in L[:2])
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=(KVCacheGroupSpec(layer_names=tuple(L[:2]), kv_cache_spec=SPEC),))


@pytest.mark.parametrize("groups_include_sharing_layers", [False, True])
def test_init_gives_sharing_layers_the_target_array(groups_include_sharing_layers):
    cfg = two_owner_config()
    shared = {L[2]: L[0], L[3]: L[1]}
    if groups_include_sharing_layers:
        cfg = dataclasses.replace(cfg, kv_cache_groups=add_kv_sharing_layers_to_kv_cache_groups(
            shared, cfg.kv_cache_groups))
    caches = init_kv_cache(cfg, {n: FlashAttentionHNDBackend for n in L[:2]}, shared_kv_cache_layers=shared)
    assert list(caches) == L[:4]
    assert caches[L[2]] is caches[L[0]] and caches[L[3]] is caches[L[1]]
    assert caches[L[0]] is not caches[L[1]]
    assert caches[L[0]].shape == (2, 3, 16, 2, 64)


def test_init_sharing_errors():
    cfg = two_owner_config()
    backends = {n: PallasAttentionBackend for n in L[:2]}
    with pytest.raises(ValueError, match="owns no KV cache"):
        init_kv_cache(cfg, backends, shared_kv_cache_layers={L[3]: L[5]})
    # a sharing layer must not own a tensor
    with_tensor = dataclasses.replace(cfg, kv_cache_tensors=cfg.kv_cache_tensors + (
        KVCacheTensor(size=3 * SPEC.page_size_bytes, shared_by=(L[2],)),))
    with pytest.raises(ValueError, match=r"layers\.2"):
        init_kv_cache(with_tensor, backends, shared_kv_cache_layers={L[2]: L[0]})
    # runner-only layers of the groups get nothing; without the flag they lack a tensor
    grouped = dataclasses.replace(cfg, kv_cache_groups=add_kv_sharing_layers_to_kv_cache_groups(
        {L[2]: L[0]}, cfg.kv_cache_groups))
    with pytest.raises(ValueError, match=r"layers\.2"):
        init_kv_cache(grouped, backends)
    assert set(init_kv_cache(grouped, backends, runner_only_attn_layers={L[2]})) == set(L[:2])


def test_from_layer_descriptions_to_bound_caches():
    """get_kv_cache_spec / get_shared_kv_cache_layers → config → sharing groups → init → bind."""
    layers = [AttentionLayerDescription(name=L[0], num_kv_heads=2, head_size=64),
              AttentionLayerDescription(name=L[1], num_kv_heads=2, head_size=64),
              AttentionLayerDescription(name=L[2], num_kv_heads=2, head_size=64,
                                        kv_sharing_target_layer_name=L[0]),
              AttentionLayerDescription(name=L[3], num_kv_heads=2, head_size=64,
                                        kv_sharing_target_layer_name=L[1])]
    specs = get_kv_cache_spec(layers, block_size=16, dtype=jnp.bfloat16)
    shared = get_shared_kv_cache_layers(layers)
    cfg = get_kv_cache_config(specs, 10**8, num_blocks=5)
    runner_only: set[str] = set()
    cfg = dataclasses.replace(cfg, kv_cache_groups=add_kv_sharing_layers_to_kv_cache_groups(
        shared, cfg.kv_cache_groups, runner_only))
    assert cfg.kv_cache_groups[0].layer_names == tuple(L[:4])
    caches = init_kv_cache(cfg, {n: PallasAttentionBackend for n in L[:2]}, shared_kv_cache_layers=shared,
                           runner_only_attn_layers=runner_only)
    bound = bind_kv_cache(caches)
    assert [bound[i] is bound[j] for i, j in [(0, 2), (1, 3), (0, 1)]] == [True, True, False]
    assert kv_sharing_source_indices(caches, shared) == (0, 1, 0, 1)


# ----------------------------------------------------------------------------------------------
# source indices, unique buffers
# ----------------------------------------------------------------------------------------------


def test_kv_sharing_source_indices():
    names = [L[3], L[0], L[2], L[1]]  # any order: positions follow the layer index
    assert kv_sharing_source_indices(names, {L[2]: L[0], L[3]: L[1]}) == (0, 1, 0, 1)
    assert kv_sharing_source_indices(names, None) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match=r"layers\.5"):
        kv_sharing_source_indices(names, {L[3]: L[5]})
    enc_dec = ["model.layers.0.self_attn.attn", "model.layers.0.cross_attn.attn",
               "model.layers.1.self_attn.attn"]
    assert kv_sharing_source_indices(enc_dec, {enc_dec[2]: enc_dec[1]}, multiple_per_index="all") == (0, 1, 1)
    with pytest.raises(ValueError, match="cross_attn.*not among the bound"):  # "first" drops it
        kv_sharing_source_indices(enc_dec, {enc_dec[2]: enc_dec[1]}, multiple_per_index="first")


def test_unique_kv_caches():
    a, b, c = jnp.zeros(1), jnp.zeros(1), jnp.zeros(1)
    buffers, index = unique_kv_caches([b, a, b, c, a])
    assert index == (0, 1, 0, 2, 1)
    assert [x is y for x, y in zip(buffers, (b, a, c))] == [True] * 3
    assert unique_kv_caches([]) == ((), ())


# ----------------------------------------------------------------------------------------------
# a donated step: owners write, sharing layers read the owner's updated cache and never write
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("index", "sources"), donate_argnums=0)
def toy_step(buffers, keys, values, slot_mapping, *, index, sources):
    """Layer i writes its K/V unless it shares, then reads K of every slot from its cache."""
    buffers = list(buffers)
    reads = []
    for i in range(len(index)):
        if sources[i] == i:  # owns its cache: write
            buffers[index[i]] = write_to_paged_cache(buffers[index[i]], keys[i], values[i], slot_mapping)
        cache = buffers[index[sources[i]]]
        block, offset = slot_mapping // cache.shape[3], slot_mapping % cache.shape[3]
        reads.append(cache[0, block, :, offset, :])  # [num_tokens, num_kv_heads, head_size]
    return tuple(buffers), jnp.stack(reads)


def test_donated_step_with_kv_sharing(rng):
    cfg = two_owner_config(num_blocks=3)
    shared = {L[2]: L[0], L[3]: L[1]}
    caches = init_kv_cache(cfg, {n: PallasAttentionBackend for n in L[:2]}, shared_kv_cache_layers=shared)
    bound = bind_kv_cache(caches)
    buffers, index = unique_kv_caches(bound)
    sources = kv_sharing_source_indices(caches, shared)
    num_tokens = 5
    keys = rng.standard_normal((4, num_tokens, 2, 64)).astype(np.float32)
    values = rng.standard_normal((4, num_tokens, 2, 64)).astype(np.float32)
    slots = np.array([0, 17, 18, 33, 47], np.int32)
    new_buffers, reads = toy_step(buffers, jnp.asarray(keys), jnp.asarray(values), jnp.asarray(slots),
                                  index=index, sources=sources)
    assert all(b.is_deleted() for b in buffers)  # donated, each exactly once
    # NumPy reference: only layers 0 and 1 write; layers 2 and 3 read their targets' keys
    expected = [np.zeros((2, 3, 2, 16, 64), np.float32) for _ in range(2)]
    for layer in (0, 1):
        for t, slot in enumerate(slots):
            b, o = divmod(int(slot), 16)
            expected[layer][0, b, :, o, :] = keys[layer, t]
            expected[layer][1, b, :, o, :] = values[layer, t]
    for layer in (0, 1):
        np.testing.assert_array_equal(new_buffers[layer], expected[layer])
    np.testing.assert_array_equal(reads, keys[[0, 1, 0, 1]])
