"""Allocation of the paged KV cache as a pytree of per-layer arrays.

vLLM: ``GPUModelRunner.initialize_kv_cache`` → ``_allocate_kv_cache`` / ``_reshape_kv_cache`` and
``bind_kv_cache``.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp

from jaxkv.backends.base import AttentionBackend, validate_backend_args
from jaxkv.kv_cache_config import KVCacheConfig
from jaxkv.spec import AttentionSpec

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def allocate_kv_cache(config: KVCacheConfig, backend: AttentionBackend, *,
                      device: jax.Device | None = None) -> dict[str, jax.Array]:
    """One zero-filled array per layer, in the backend's layout, keyed by layer name.

    vLLM: ``_allocate_kv_cache`` + ``_reshape_kv_cache``. vLLM allocates raw bytes and views them; JAX
    arrays cannot alias, so each layer's tensor is allocated directly with the backend's shape (the
    ``KVCacheTensor.size`` bytes of the config are checked against it).

    Args:
        config: the cache configuration (num_blocks, tensors, groups).
        backend: fixes the per-layer shape (``get_kv_cache_shape``).
        device: where to allocate; default device when ``None``.

    Returns:
        ``{layer_name: Array[backend.get_kv_cache_shape(...)]}`` in the spec's dtype.

    Raises:
        ValueError: a spec the backend cannot hold, a layer with no tensor, or a tensor whose size
            disagrees with the layout.
    """
    tensor_of = {name: t for t in config.kv_cache_tensors for name in t.shared_by}
    caches = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"kv_cache_spec={spec!r} is not an AttentionSpec")
        validate_backend_args(backend, block_size=spec.block_size, head_size=spec.head_size,
                              dtype=spec.dtype)
        shape = backend.get_kv_cache_shape(config.num_blocks, spec.block_size, spec.num_kv_heads,
                                           spec.head_size)
        nbytes = spec.dtype.itemsize * math.prod(shape)
        for name in group.layer_names:
            if name not in tensor_of:
                raise ValueError(f"layer {name!r} of the KV-cache groups has no KVCacheTensor")
            if tensor_of[name].size != nbytes:
                raise ValueError(f"KVCacheTensor.size={tensor_of[name].size} of layer {name!r} != "
                                 f"{nbytes} bytes of shape {shape} {spec.dtype}")
            caches[name] = jax.device_put(jnp.zeros(shape, spec.dtype), device)
    return caches


def extract_layer_index(layer_name: str) -> int:
    """Layer index in a name like ``model.layers.12.self_attn.attn``. vLLM: ``extract_layer_index``.

    Raises:
        ValueError: the name holds no ``layers.<int>`` component.
    """
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"layer_name={layer_name!r} has no 'layers.<index>' component")
    return int(match.group(1))


def bind_kv_cache(kv_caches: dict[str, jax.Array]) -> list[jax.Array]:
    """The caches as a list ordered by layer index (what a model's forward takes).

    vLLM: ``bind_kv_cache`` (the ``forward_context`` half has no JAX analogue: our caches are passed
    explicitly). Raises ``ValueError`` when two layers share an index or indices are not ``0..n-1``
    (several attention modules per layer index are issue 3's).
    """
    by_index: dict[int, str] = {}
    for name in kv_caches:
        index = extract_layer_index(name)
        if index in by_index:
            raise ValueError(f"layers {by_index[index]!r} and {name!r} share layer index {index}")
        by_index[index] = name
    if sorted(by_index) != list(range(len(by_index))):
        raise ValueError(f"layer indices {sorted(by_index)} are not 0..{len(by_index) - 1}")
    return [kv_caches[by_index[i]] for i in range(len(by_index))]
