"""KV-cache configuration: how many blocks, which tensors, which groups (vLLM ``KVCacheConfig``).

:func:`get_kv_cache_config` follows vLLM v1 (``vllm/v1/core/kv_cache_utils.py``):

* one attention type (all layers share one ``type_id``): one group of all layers, one tensor per layer
  (``_get_kv_cache_config_uniform_type``);
* several types with one page size (a hybrid model, e.g. full + sliding window): layers of each type are cut
  into groups of ``group_size = min(layers per type)`` layers; tensor ``i`` is shared by the ``i``-th layer
  of every group, each group using its own blocks of it through its own block table
  (``_get_kv_cache_config_uniform_page_size``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

from jaxkv.kv_cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, _check_positive_int


def _str_tuple(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{name}={value!r} must be a sequence of layer names")
    value = tuple(value)
    if not value:
        raise ValueError(f"{name}={value!r} names no layer")
    for v in value:
        if not isinstance(v, str) or not v:
            raise ValueError(f"{name}={value!r} holds {v!r}, not a layer name")
    if len(set(value)) != len(value):
        raise ValueError(f"{name}={value!r} names a layer twice")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheTensor:
    """One allocation of ``size`` bytes, used by the layers in ``shared_by``. vLLM: ``KVCacheTensor``.

    Layers of different KV-cache groups share one tensor: their block tables hand out disjoint blocks.

    Attributes:
        size: bytes of the tensor (``num_blocks * page_size_bytes``).
        shared_by: names of the layers that use it (a list is stored as a tuple).

    Raises:
        ValueError: ``size`` not a positive int, ``shared_by`` empty / not names / with a repeat.
    """

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "size", _check_positive_int("size", self.size))
        object.__setattr__(self, "shared_by", _str_tuple("shared_by", self.shared_by))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheGroupSpec:
    """Layers that share one block table (and so one merged spec). vLLM: ``KVCacheGroupSpec``.

    Attributes:
        layer_names: the group's layers (a list is stored as a tuple).
        kv_cache_spec: the spec all of them follow.

    Raises:
        ValueError: no / repeated layer names, or a ``kv_cache_spec`` that is not a :class:`KVCacheSpec`.
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self):
        object.__setattr__(self, "layer_names", _str_tuple("layer_names", self.layer_names))
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise ValueError(f"kv_cache_spec={self.kv_cache_spec!r} is not a KVCacheSpec")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """The whole cache: capacity in blocks, its tensors and its groups. vLLM: ``KVCacheConfig``.

    Attributes:
        num_blocks: blocks in every tensor; the block ids ``0 .. num_blocks - 1`` are shared by all groups.
        kv_cache_tensors: the allocations (a list is stored as a tuple).
        kv_cache_groups: one per block table; one group for a model with one attention type; for a hybrid
            model with 10 full and 20 sliding-window layers, 3 groups of 10 layers.

    Raises:
        ValueError: ``num_blocks`` not a positive int, or elements of the wrong type. (That every layer
            has a tensor is checked where the cache is allocated.)
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self):
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"num_blocks={self.num_blocks!r} must be a positive int")
        for name, cls in (("kv_cache_tensors", KVCacheTensor), ("kv_cache_groups", KVCacheGroupSpec)):
            value = tuple(getattr(self, name))
            for i, item in enumerate(value):
                if not isinstance(item, cls):
                    raise ValueError(f"{name}[{i}]={item!r} is not a {cls.__name__}")
            object.__setattr__(self, name, value)


# ----------------------------------------------------------------------------------------------------


def _check_memory_bytes(name: str, value) -> int:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0):
        raise ValueError(f"{name}={value!r} must be a finite number of bytes >= 0")
    return int(value)


def _check_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> None:
    if not isinstance(kv_cache_specs, Mapping) or not kv_cache_specs:
        raise ValueError(f"kv_cache_specs={kv_cache_specs!r} names no layer")
    for name, spec in kv_cache_specs.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"kv_cache_specs has a key {name!r} that is not a layer name")
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(f"kv_cache_specs[{name!r}]={spec!r} is not a KVCacheSpec")


def unify_hybrid_kv_cache_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Specs of one type for a hybrid model when the hybrid KV-cache manager is disabled.

    If the model has both full-attention and sliding-window layers, every :class:`SlidingWindowSpec`
    becomes a :class:`FullAttentionSpec` that records its ``sliding_window`` (blocks are then kept for all
    tokens; the window only limits the compute). vLLM: ``unify_hybrid_kv_cache_specs`` (returns a new dict
    instead of changing its argument).

    Raises:
        ValueError: the specs still have more than one ``type_id`` afterwards (e.g. different block sizes,
            or sliding windows without any full-attention layer but with different windows).
    """
    _check_specs(kv_cache_specs)
    specs = dict(kv_cache_specs)
    if len({s.type_id for s in specs.values()}) == 1:
        return specs
    has_full = any(isinstance(s, FullAttentionSpec) for s in specs.values())
    has_sliding = any(isinstance(s, SlidingWindowSpec) for s in specs.values())
    if has_full and has_sliding:
        for name, s in specs.items():
            if isinstance(s, SlidingWindowSpec):
                specs[name] = FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                                                head_size=s.head_size, dtype=s.dtype,
                                                sliding_window=s.sliding_window)
    type_ids = sorted({s.type_id for s in specs.values()})
    if len(type_ids) > 1:
        raise ValueError(f"kv_cache_specs keep type_ids={type_ids} after unification; the hybrid KV-cache "
                         "manager is disabled but the specs cannot be converted to one type")
    return specs


def check_enough_kv_cache_memory(kv_cache_specs: Mapping[str, KVCacheSpec], available_memory_bytes: int,
                                 *, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
    """Check that one request of ``max_model_len`` tokens fits; return the bytes it needs.

    ``needed = sum(spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens))`` over the layers.
    vLLM: ``check_enough_kv_cache_memory``.

    Raises:
        ValueError: ``available_memory_bytes`` is 0 or less than ``needed`` (the message gives both).
    """
    _check_specs(kv_cache_specs)
    available = _check_memory_bytes("available_memory_bytes", available_memory_bytes)
    if available == 0:
        raise ValueError("available_memory_bytes=0: no memory for the cache blocks; raise "
                         "gpu_memory_utilization or free memory")
    needed = sum(s.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
                 for s in kv_cache_specs.values())
    if needed > available:
        raise ValueError(f"max_model_len={max_model_len} needs {needed} bytes of KV cache for one request, "
                         f"more than available_memory_bytes={available}; raise gpu_memory_utilization or "
                         "lower max_model_len")
    return needed


def _group_layers(kv_cache_specs: Mapping[str, KVCacheSpec]) -> list[list[str]]:
    """Layers cut into groups of ``min(layers per type_id)``; a type's last group may be shorter."""
    same_type: dict[str, list[str]] = collections.defaultdict(list)
    for name, spec in kv_cache_specs.items():
        same_type[spec.type_id].append(name)
    group_size = min(len(names) for names in same_type.values())
    return [names[i:i + group_size] for names in same_type.values()
            for i in range(0, len(names), group_size)]


def get_kv_cache_config(kv_cache_specs: Mapping[str, KVCacheSpec], available_memory_bytes: int,
                        *, num_blocks: int | None = None, disable_hybrid_kv_cache_manager: bool = False,
                        max_model_len: int | None = None,
                        max_num_batched_tokens: int | None = None) -> KVCacheConfig:
    """The KV-cache config of a model from its per-layer specs and a byte budget.

    vLLM: ``get_kv_cache_config`` → ``_get_kv_cache_config_uniform_type`` (one attention type) or
    ``_get_kv_cache_config_uniform_page_size`` (hybrid model with one page size).

    Layers are grouped by ``type_id`` (in order of first appearance); each type's layers are cut, in order,
    into groups of ``group_size = min(number of layers of a type)`` layers (the last group of a type may be
    shorter: vLLM's "padding"). Each group's spec is ``merge`` of its layers' specs. There are
    ``group_size`` tensors of ``num_blocks * page_size_bytes`` bytes; tensor ``i`` is shared by layer ``i``
    of every group that has one, and
    ``num_blocks = available_memory_bytes // page_size_bytes // group_size``.
    A uniform model is the case of one type: one group, one tensor per layer, ``group_size = num_layers``.
    Example: 10 full + 20 sliding-window layers → ``group_size = 10``: groups ``[full 0-9]``,
    ``[sliding 0-9]``, ``[sliding 10-19]``; tensor ``i`` is shared by full ``i``, sliding ``i``, sliding
    ``10 + i``.

    Args:
        kv_cache_specs: layer name → spec, in layer order.
        available_memory_bytes: bytes the cache may use, all layers together.
        num_blocks: use this many blocks instead of filling the budget (must still fit; vLLM
            ``num_gpu_blocks_override``).
        disable_hybrid_kv_cache_manager: first make the specs one type with
            :func:`unify_hybrid_kv_cache_specs` (one group, sliding windows kept as compute-only windows).
        max_model_len, max_num_batched_tokens: if ``max_model_len`` is given, first check that one request
            of that length fits (:func:`check_enough_kv_cache_memory`).

    Returns:
        The frozen :class:`KVCacheConfig`.

    Raises:
        ValueError: no layers or a value that is not a spec; specs with different ``page_size_bytes`` (the
            message names two layers and their page sizes); specs of one group that do not merge; a budget
            holding less than one block per tensor, or fewer than ``num_blocks``; not enough memory for
            ``max_model_len``.
    """
    _check_specs(kv_cache_specs)
    available = _check_memory_bytes("available_memory_bytes", available_memory_bytes)
    specs = dict(kv_cache_specs)
    if disable_hybrid_kv_cache_manager:
        specs = unify_hybrid_kv_cache_specs(specs)
    if max_model_len is not None:
        check_enough_kv_cache_memory(specs, available, max_model_len=max_model_len,
                                     max_num_batched_tokens=max_num_batched_tokens)

    page_sizes: dict[int, str] = {}
    for name, spec in specs.items():
        page_sizes.setdefault(spec.page_size_bytes, name)
    if len(page_sizes) > 1:
        (p0, n0), (p1, n1) = list(page_sizes.items())[:2]
        raise ValueError(f"kv_cache_specs: layer {n0!r} has page_size_bytes={p0} but layer {n1!r} has "
                         f"page_size_bytes={p1}; every layer's spec must have the same page size "
                         "(vLLM supports uniform page sizes only)")
    (page_size,) = page_sizes

    grouped = _group_layers(specs)
    groups = []
    for names in grouped:
        members = [specs[n] for n in names]
        try:
            merged = type(members[0]).merge(members)
        except ValueError as e:
            raise ValueError(f"kv_cache_specs of group {names} do not agree: {e}") from e
        groups.append(KVCacheGroupSpec(layer_names=tuple(names), kv_cache_spec=merged))
    group_size = max(len(names) for names in grouped)

    fit = available // page_size // group_size
    if num_blocks is None:
        num_blocks = fit
    elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise ValueError(f"num_blocks={num_blocks!r} must be a positive int")
    if num_blocks < 1 or num_blocks > fit:
        raise ValueError(
            f"available_memory_bytes={available_memory_bytes} holds {fit} blocks of {page_size} bytes for "
            f"each of {group_size} tensors; asked for num_blocks={num_blocks}")
    # Tensor i holds layer i of every group (a shorter last group of a type has no layer i).
    tensors = tuple(KVCacheTensor(size=num_blocks * page_size,
                                  shared_by=tuple(names[i] for names in grouped if i < len(names)))
                    for i in range(group_size))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=tuple(groups))
