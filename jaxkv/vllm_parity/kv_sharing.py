"""Cross-layer KV sharing: layers that read an earlier layer's KV cache and write none of their own.

vLLM: ``add_kv_sharing_layers_to_kv_cache_groups`` (``vllm/v1/worker/utils.py``), the
``kv_sharing_target_layer_name`` of ``Attention`` (the forward skips ``reshape_and_cache``), and the
de-duplication of shared cache buffers before an in-place update.

The pairs ``{sharing_layer: target_layer}`` come from :func:`jaxkv.kv_cache.layer_specs.get_shared_kv_cache_layers`;
:func:`jaxkv.kv_cache.allocation.init_kv_cache` gives a sharing layer its target's array object. In a functional forward
the target's updated array replaces its list entry, so a sharing layer must read through
:func:`kv_sharing_source_indices` rather than its own (stale) entry; a list whose entries share arrays is
donated through :func:`unique_kv_caches` (JAX refuses to donate one buffer twice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import jax

from jaxkv.kv_cache.allocation import _bound_layer_names, extract_layer_index
from jaxkv.kv_cache.config import KVCacheGroupSpec


def add_kv_sharing_layers_to_kv_cache_groups(
        shared_kv_cache_layers: Mapping[str, str], kv_cache_groups: Sequence[KVCacheGroupSpec],
        runner_only_attn_layers: set[str] | None = None) -> tuple[KVCacheGroupSpec, ...]:
    """Add each KV-sharing layer to its target's group (so it gets the group's attention metadata).

    vLLM: ``add_kv_sharing_layers_to_kv_cache_groups``. vLLM appends to the groups' lists in place;
    our groups are frozen, so new groups are returned (use ``dataclasses.replace(config,
    kv_cache_groups=...)`` for a config). Like vLLM, ``runner_only_attn_layers`` (a ``set``), when
    given, gets the sharing layers added. Also checks what vLLM checks when the model is built
    (``validate_kv_sharing_target``): the target is another, earlier layer.

    Args:
        shared_kv_cache_layers: ``{sharing_layer: target_layer}``; a sharing layer reads the target's
            cache and never writes.
        kv_cache_groups: the groups; not modified.
        runner_only_attn_layers: optional set updated in place with the sharing layers.

    Returns:
        The groups with every sharing layer appended to its target's group (in mapping order).

    Raises:
        ValueError: a layer sharing with itself, a target in no group or that is itself a sharing
            layer, a sharing layer already in a group, a target whose layer index is not smaller than
            the sharing layer's, a name without a layer index, or ``runner_only_attn_layers`` not a
            ``set``. Nothing is changed then.
    """
    group_of = {name: gi for gi, g in enumerate(kv_cache_groups) for name in g.layer_names}
    for layer, target in shared_kv_cache_layers.items():
        if layer == target:
            raise ValueError(f"shared_kv_cache_layers[{layer!r}] is the layer itself")
        if target in shared_kv_cache_layers:
            raise ValueError(f"shared_kv_cache_layers[{layer!r}]={target!r} is itself a KV-sharing "
                             "layer; share with the layer that owns the cache")
        if target not in group_of:
            raise ValueError(f"shared_kv_cache_layers[{layer!r}]={target!r} is in no KV-cache group")
        if layer in group_of:
            raise ValueError(f"KV-sharing layer {layer!r} is already in kv_cache_groups[{group_of[layer]}]")
        if extract_layer_index(target) >= extract_layer_index(layer):
            raise ValueError(f"shared_kv_cache_layers[{layer!r}]={target!r} must come before the layer")
    if runner_only_attn_layers is not None and not isinstance(runner_only_attn_layers, set):
        raise ValueError(f"runner_only_attn_layers={runner_only_attn_layers!r} must be a set")
    added: dict[int, list[str]] = {}
    for layer, target in shared_kv_cache_layers.items():
        added.setdefault(group_of[target], []).append(layer)
    groups = tuple(dataclasses.replace(g, layer_names=tuple(g.layer_names) + tuple(added[gi]))
                   if gi in added else g for gi, g in enumerate(kv_cache_groups))
    if runner_only_attn_layers is not None:
        runner_only_attn_layers.update(shared_kv_cache_layers)
    return groups


def is_kv_sharing_layer(layer_name: str, shared_kv_cache_layers: Mapping[str, str] | None) -> bool:
    """Whether ``layer_name`` reads another layer's cache (and must skip its K/V write).

    vLLM: ``Attention.kv_sharing_target_layer_name is not None`` (the forward then skips
    ``reshape_and_cache``).
    """
    return bool(shared_kv_cache_layers) and layer_name in shared_kv_cache_layers


def kv_sharing_source_indices(layer_names: Iterable[str],
                              shared_kv_cache_layers: Mapping[str, str] | None, *,
                              num_attn_module: int = 1,
                              multiple_per_index: str = "error") -> tuple[int, ...]:
    """For each position of the :func:`~jaxkv.kv_cache.allocation.bind_kv_cache` list, the position of the cache it reads.

    ``sources[i] == i`` for a layer that owns its cache (it writes it); ``sources[i] < i`` for a
    KV-sharing layer, which reads ``caches[sources[i]]`` (the target's *updated* cache: in a functional
    forward the target's new array replaces its list entry, so a sharing layer must read through the
    index, not through its own stale entry) and skips the write.

    Args:
        layer_names: the layers bound (e.g. the keys of :func:`~jaxkv.kv_cache.allocation.init_kv_cache`'s result).
        shared_kv_cache_layers: ``{sharing_layer: target_layer}``.
        num_attn_module, multiple_per_index: as in :func:`~jaxkv.kv_cache.allocation.bind_kv_cache` (the same order).

    Raises:
        ValueError: what :func:`~jaxkv.kv_cache.allocation.bind_kv_cache` rejects, or a sharing layer whose target is
            not bound.
    """
    shared = dict(shared_kv_cache_layers or {})
    order = _bound_layer_names(list(layer_names), num_attn_module, multiple_per_index)
    position = {name: i for i, name in enumerate(order)}
    sources = []
    for name in order:
        target = shared.get(name, name)
        if target not in position:
            raise ValueError(f"shared_kv_cache_layers[{name!r}]={target!r} is not among the bound layers")
        sources.append(position[target])
    return tuple(sources)


def unique_kv_caches(caches: Sequence[jax.Array]) -> tuple[tuple[jax.Array, ...], tuple[int, ...]]:
    """Distinct arrays of a cache list (by identity) and, per position, the index of its array.

    JAX refuses to donate one buffer twice in a call, so a list whose entries share an array (KV-sharing
    layers, layers of one ``KVCacheTensor``) is donated as ``buffers``. Inside the step, layer ``i``
    reads and writes ``buffers[index[i]]`` and puts its updated array back there, so layers that share
    an array see each other's writes (hybrid groups write disjoint blocks of it; KV-sharing layers only
    read). vLLM: the de-duplication by ``data_ptr`` of ``copy_kv_cache_blocks_inplace``.

    Returns:
        ``(buffers, index)`` with ``caches[i] is buffers[index[i]]``.
    """
    first: dict[int, int] = {}
    buffers, index = [], []
    for cache in caches:
        if id(cache) not in first:
            first[id(cache)] = len(buffers)
            buffers.append(cache)
        index.append(first[id(cache)])
    return tuple(buffers), tuple(index)
