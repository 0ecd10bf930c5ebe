"""KV-cache configuration: how many blocks, which tensors, which groups (vLLM ``KVCacheConfig``)."""

from __future__ import annotations

import dataclasses

from jaxkv.spec import KVCacheSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheTensor:
    """One allocation of ``size`` bytes, used by the layers in ``shared_by``. vLLM: ``KVCacheTensor``."""

    size: int
    shared_by: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheGroupSpec:
    """Layers that share one block table (same spec). vLLM: ``KVCacheGroupSpec``."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """The whole cache: capacity in blocks, its tensors and its groups. vLLM: ``KVCacheConfig``."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self):
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"num_blocks={self.num_blocks!r} must be a positive int")


def get_kv_cache_config(kv_cache_specs: dict[str, KVCacheSpec], available_memory_bytes: int,
                        *, num_blocks: int | None = None) -> KVCacheConfig:
    """Config for a model whose layers all have the same spec (one KV-cache group).

    vLLM: ``get_kv_cache_config`` → ``_get_kv_cache_config_uniform_type``: every layer gets its own tensor
    of ``num_blocks * page_size_bytes`` and ``num_blocks = available_memory_bytes // page_size_bytes //
    num_layers``.

    Args:
        kv_cache_specs: layer name → spec, in layer order.
        available_memory_bytes: bytes the cache may use, all layers together.
        num_blocks: use this many blocks instead of filling the budget (must still fit).

    Raises:
        ValueError: no layers, specs differ between layers, or the budget holds less than one block per
            layer (or less than ``num_blocks``).
    """
    if not kv_cache_specs:
        raise ValueError("kv_cache_specs={} names no layer")
    specs = set(kv_cache_specs.values())
    if len(specs) != 1:
        raise ValueError(f"kv_cache_specs has {len(specs)} different specs; only uniform models are "
                         f"supported here: {sorted(map(repr, specs))}")
    (spec,) = specs
    num_layers = len(kv_cache_specs)
    fit = int(available_memory_bytes) // spec.page_size_bytes // num_layers
    if num_blocks is None:
        num_blocks = fit
    if num_blocks < 1 or num_blocks > fit:
        raise ValueError(
            f"available_memory_bytes={available_memory_bytes} holds {fit} blocks of "
            f"{spec.page_size_bytes} bytes for each of {num_layers} layers; asked for num_blocks={num_blocks}")
    names = tuple(kv_cache_specs)
    tensors = tuple(KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=(n,)) for n in names)
    group = KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=(group,))
