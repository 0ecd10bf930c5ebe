"""Allocation of the paged KV cache as a pytree of per-layer arrays, and binding to a layer list.

vLLM: ``vllm/v1/worker/gpu/attn_utils.py`` (``_allocate_kv_cache``, ``_reshape_kv_cache``,
``init_kv_cache``) and ``vllm/v1/worker/utils.py`` (``bind_kv_cache``), ``extract_layer_index``.
Cross-layer KV sharing (``add_kv_sharing_layers_to_kv_cache_groups`` and helpers) is in
:mod:`jaxkv.vllm_parity.kv_sharing`; :func:`init_kv_cache` gives the sharing layers their target's array.

JAX arrays are values: they cannot alias and have no strides. Consequences, all documented where they
apply:

* a raw byte buffer viewed as a layer's cache (:func:`reshape_kv_cache`) is a new array, not a view;
  layers that share one ``KVCacheTensor`` *and* one layout get the same array object, others get
  separate arrays holding the same bytes (vLLM's block pool gives a block to one group at a time, so
  separate arrays are correct; they cost the memory that sharing saves in vLLM);
* the logical view of a non-identity stride order is a transposed copy; in-place updates (donation)
  work on the physical array (``physical=True``);
* one buffer may appear only once among a jitted call's donated arguments: pass
  :func:`jaxkv.vllm_parity.kv_sharing.unique_kv_caches` of a bound list whose layers share caches.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv_cache.backends.base import (
    AttentionBackend,
    inverse_stride_order,
    physical_kv_cache_shape,
    validate_backend_args,
)
from jaxkv.kv_cache.config import KVCacheConfig
from jaxkv.kv_cache.specs import AttentionSpec

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
MULTIPLE_PER_INDEX = ("error", "first", "all")
"""Policies of :func:`bind_kv_cache` for several attention modules with one layer index."""

_SPEC_FIELDS = ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes")


# ----------------------------------------------------------------------------------------------
# allocate_kv_cache (one backend, zero-filled, exact size check)
# ----------------------------------------------------------------------------------------------

def allocate_kv_cache(config: KVCacheConfig, backend: AttentionBackend, *,
                      device: jax.Device | None = None, physical: bool = False) -> dict[str, jax.Array]:
    """One zero-filled array per layer, in the backend's layout, keyed by layer name.

    vLLM: ``_allocate_kv_cache`` + ``_reshape_kv_cache`` with one backend for every layer. Zero bytes
    are zeros of every float dtype, so the arrays are allocated directly in their final shape (no raw
    buffer, no transient copy). Layers listed in one ``KVCacheTensor.shared_by`` with the same layout get
    the same array object. Stricter than :func:`init_kv_cache`: each tensor must hold exactly
    ``config.num_blocks`` blocks.

    Args:
        config: the cache configuration (num_blocks, tensors, groups).
        backend: fixes the per-layer shape (``get_kv_cache_shape``) and memory order.
        device: where to allocate; default device when ``None``.
        physical: return arrays in memory order (the logical shape permuted by the backend's stride
            order) instead of the logical shape. Same for identity-order backends (Pallas).

    Returns:
        ``{layer_name: Array[backend.get_kv_cache_shape(...)]}`` in the spec's dtype, in group order.

    Raises:
        ValueError: a spec the backend cannot hold, a layer with no tensor, or a tensor whose size
            disagrees with the layout.
    """
    tensor_of = {name: i for i, t in enumerate(config.kv_cache_tensors) for name in t.shared_by}
    plan = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"kv_cache_spec={spec!r} is not an AttentionSpec")
        validate_backend_args(backend, block_size=spec.block_size, head_size=spec.head_size,
                              dtype=spec.dtype)
        shape = backend.get_kv_cache_shape(config.num_blocks, spec.block_size, spec.num_kv_heads,
                                           spec.head_size)
        phys = physical_kv_cache_shape(backend, config.num_blocks, spec.block_size, spec.num_kv_heads,
                                       spec.head_size)
        nbytes = spec.dtype.itemsize * math.prod(shape)
        for name in group.layer_names:
            if name not in tensor_of:
                raise ValueError(f"layer {name!r} of the KV-cache groups has no KVCacheTensor")
            size = config.kv_cache_tensors[tensor_of[name]].size
            if size != nbytes:
                raise ValueError(f"KVCacheTensor.size={size} of layer {name!r} != "
                                 f"{nbytes} bytes of shape {shape} {spec.dtype}")
            out_shape = phys if physical else shape
            plan[name] = (tensor_of[name], spec.dtype, out_shape)
    made: dict[tuple, jax.Array] = {}
    caches = {}
    for name, key in plan.items():
        if key not in made:
            made[key] = jax.device_put(jnp.zeros(key[2], key[1]), device)
        caches[name] = made[key]
    return caches


# ----------------------------------------------------------------------------------------------
# raw allocation + reshape (vLLM's two-step init)
# ----------------------------------------------------------------------------------------------

def _layer_tensors(config: KVCacheConfig, skip: frozenset[str]) -> dict[str, int]:
    """``{layer: index of its KVCacheTensor}``; checks every group layer not in ``skip`` has exactly one."""
    tensor_of: dict[str, int] = {}
    for i, tensor in enumerate(config.kv_cache_tensors):
        size = tensor.size
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"kv_cache_tensors[{i}].size={size!r} must be a positive int")
        for name in tensor.shared_by:
            if name in tensor_of:
                raise ValueError(f"layer {name!r} is in shared_by of kv_cache_tensors[{tensor_of[name]}] "
                                 f"and kv_cache_tensors[{i}]")
            tensor_of[name] = i
    expected = {name for g in config.kv_cache_groups for name in g.layer_names} - skip
    missing, extra = expected - set(tensor_of), set(tensor_of) - expected
    if missing:
        raise ValueError(f"layers {sorted(missing)} of the KV-cache groups have no KVCacheTensor")
    if extra:
        raise ValueError(f"KVCacheTensor.shared_by names layers {sorted(extra)} that are in no "
                         "KV-cache group (or that are runner-only / KV-sharing layers)")
    return tensor_of


def allocate_kv_cache_raw(config: KVCacheConfig, *, runner_only_attn_layers: Iterable[str] = (),
                          device: jax.Device | None = None) -> dict[str, jax.Array]:
    """One zero-filled raw byte buffer per ``KVCacheTensor``, keyed by every layer that uses it.

    vLLM: ``_allocate_kv_cache`` (``torch.zeros(size, dtype=torch.int8)`` per tensor, the same tensor
    for every layer of its ``shared_by``; the assert that the layers of the groups are exactly the
    layers that got a tensor is a ``ValueError`` here). Layers in ``runner_only_attn_layers`` (KV-sharing
    layers, vLLM's ``runner_only_attn_layers``) get no buffer.

    Args:
        config: the cache configuration.
        runner_only_attn_layers: layers of the groups that own no tensor.
        device: where to allocate; default device when ``None``.

    Returns:
        ``{layer_name: int8[size]}``; layers of one tensor map to the same array object.

    Raises:
        ValueError: a group layer without a tensor, a tensor naming a layer of no group, a layer in two
            tensors, or a non-positive size (names the layers / the field). Nothing is allocated then.
    """
    tensor_of = _layer_tensors(config, frozenset(runner_only_attn_layers))
    buffers = {i: jax.device_put(jnp.zeros(t.size, jnp.int8), device)
               for i, t in enumerate(config.kv_cache_tensors)}
    return {name: buffers[i] for name, i in tensor_of.items()}


def _spec_fields(spec) -> tuple[int, int, int, np.dtype, int]:
    # duck-typed (AttentionSpec and subclasses: sliding window, MLA); page_size_bytes last: it is a
    # property that may raise on specs without the other fields
    missing = [f for f in _SPEC_FIELDS[:-1] if not hasattr(spec, f)]
    if missing:
        raise ValueError(f"kv_cache_spec={spec!r} is not an attention spec (no {missing})")
    return (spec.block_size, spec.num_kv_heads, spec.head_size, np.dtype(spec.dtype),
            spec.page_size_bytes)


def _plan_layouts(config: KVCacheConfig, nbytes_of: Mapping[str, int],
                  backends: Mapping[str, AttentionBackend], skip: frozenset[str]) -> dict[str, tuple]:
    """Per layer ``(dtype, physical_shape, inverse_order)``; validates every layer first."""
    plans = {}
    for group in config.kv_cache_groups:
        block_size, num_kv_heads, head_size, dtype, page_size_bytes = _spec_fields(group.kv_cache_spec)
        for name in group.layer_names:
            if name in skip:
                continue
            if name not in nbytes_of:
                raise ValueError(f"layer {name!r} of the KV-cache groups has no raw tensor")
            if name not in backends:
                raise ValueError(f"layer {name!r} has no entry in backends")
            backend = backends[name]
            validate_backend_args(backend, block_size=block_size, head_size=head_size, dtype=dtype)
            nbytes = nbytes_of[name]
            if nbytes % page_size_bytes:
                raise ValueError(f"raw tensor of layer {name!r} has {nbytes} bytes (KVCacheTensor.size), "
                                 f"not a multiple of page_size_bytes={page_size_bytes}")
            num_blocks = nbytes // page_size_bytes
            phys = physical_kv_cache_shape(backend, num_blocks, block_size, num_kv_heads, head_size)
            if math.prod(phys) * dtype.itemsize != nbytes:
                raise ValueError(
                    f"backend {backend.name} lays {num_blocks} blocks of layer {name!r} out as {phys} "
                    f"{dtype} = {math.prod(phys) * dtype.itemsize} bytes, but the raw tensor has {nbytes} "
                    f"(page_size_bytes={page_size_bytes} disagrees with the layout)")
            inv = inverse_stride_order(backend.get_kv_cache_stride_order())
            plans[name] = (dtype, phys, inv)
    return plans


@functools.partial(jax.jit, static_argnames=("dtype", "shape", "inv"))
def _view_bytes(raw, *, dtype, shape, inv):
    # [n * itemsize] bytes → [n, itemsize] → bitcast → dtype[n] → physical shape → logical order
    items = raw if dtype.itemsize == 1 else raw.reshape(-1, dtype.itemsize)
    out = jax.lax.bitcast_convert_type(items, dtype).reshape(shape)
    return out if inv is None else out.transpose(inv)


def reshape_kv_cache(config: KVCacheConfig, kv_cache_raw_tensors: Mapping[str, jax.Array],
                     backends: Mapping[str, AttentionBackend], *,
                     runner_only_attn_layers: Iterable[str] = (),
                     physical: bool = False) -> dict[str, jax.Array]:
    """View each layer's raw bytes as its cache: bitcast to the spec dtype, reshape, logical order.

    vLLM: ``_reshape_kv_cache``: ``num_blocks = raw.numel() // page_size_bytes``, the backend's
    ``get_kv_cache_shape`` permuted by ``get_kv_cache_stride_order`` is the memory shape, and the result
    is ``raw.view(dtype).view(physical_shape).permute(*inv_order)``. Here the bytes are reinterpreted
    with ``jax.lax.bitcast_convert_type`` on an ``[n, itemsize]`` view (native byte order), which makes
    a new array: JAX cannot alias. Layers that share one raw buffer and one layout (dtype, shape, order)
    get the same array object; with a non-identity stride order the logical view is a transposed copy
    (pass ``physical=True`` for the memory-order arrays that in-place updates must use).

    Args:
        config: the cache configuration (groups give each layer's spec).
        kv_cache_raw_tensors: ``{layer_name: int8/uint8[size]}`` from :func:`allocate_kv_cache_raw`.
        backends: ``{layer_name: backend}`` for every layer that owns a cache.
        runner_only_attn_layers: layers of the groups to skip (KV-sharing layers).
        physical: return the memory-order arrays instead of the logical views.

    Returns:
        ``{layer_name: dtype[backend.get_kv_cache_shape(num_blocks, ...)]}`` (physical shape when
        ``physical``), in group order.

    Raises:
        ValueError: a layer without a raw tensor or a backend, a raw tensor that is not 1-D int8/uint8,
            a size not a multiple of ``page_size_bytes``, a spec the backend cannot hold, or a backend
            layout whose bytes per block differ from ``page_size_bytes`` (e.g. the MLA layout with a
            K/V spec).
    """
    skip = frozenset(runner_only_attn_layers)
    for name, raw in kv_cache_raw_tensors.items():
        if raw.ndim != 1 or np.dtype(raw.dtype) not in (np.dtype(np.int8), np.dtype(np.uint8)):
            raise ValueError(f"kv_cache_raw_tensors[{name!r}] is {raw.dtype}{list(raw.shape)}; "
                             "must be a 1-D int8/uint8 byte buffer")
    nbytes_of = {name: int(raw.shape[0]) for name, raw in kv_cache_raw_tensors.items()}
    plans = _plan_layouts(config, nbytes_of, backends, skip)
    made: dict[tuple, jax.Array] = {}
    caches = {}
    for name, (dtype, phys, inv) in plans.items():
        raw = kv_cache_raw_tensors[name]
        use_inv = None if physical or inv == tuple(range(len(inv))) else inv
        key = (id(raw), dtype, phys, use_inv)
        if key not in made:
            made[key] = _view_bytes(raw, dtype=dtype, shape=phys, inv=use_inv)
        caches[name] = made[key]
    return caches


def init_kv_cache(config: KVCacheConfig, backends: Mapping[str, AttentionBackend], *,
                  shared_kv_cache_layers: Mapping[str, str] | None = None,
                  runner_only_attn_layers: Iterable[str] = (), physical: bool = False,
                  device: jax.Device | None = None) -> dict[str, jax.Array]:
    """Allocate every layer's cache and give KV-sharing layers their target's array.

    vLLM: ``init_kv_cache`` = ``_allocate_kv_cache`` + ``_reshape_kv_cache`` (+ ``bind_kv_cache``, see
    :func:`bind_kv_cache`), and ``GPUModelRunner.initialize_kv_cache_tensors``' cross-layer sharing
    ``kv_caches[layer] = kv_caches[target]``. The result equals
    ``reshape_kv_cache(config, allocate_kv_cache_raw(config), backends)``, but zero bytes are zeros of
    every dtype, so each array is allocated directly as zeros in its final shape: no raw buffer, no
    bitcast/transpose copies (a 2-3x transient peak for a cache that fills the device).

    A KV-sharing layer (a key of ``shared_kv_cache_layers``) owns no tensor and maps to the very array
    object of its target. It reads that cache and must never write it
    (:func:`jaxkv.vllm_parity.kv_sharing.is_kv_sharing_layer`, :func:`jaxkv.vllm_parity.kv_sharing.kv_sharing_source_indices`).

    Args:
        config: the cache configuration. Sharing layers may already be in the groups (after
            :func:`jaxkv.vllm_parity.kv_sharing.add_kv_sharing_layers_to_kv_cache_groups`) or not.
        backends: ``{layer_name: backend}`` for every layer that owns a cache.
        shared_kv_cache_layers: ``{sharing_layer: target_layer}``.
        runner_only_attn_layers: other group layers that own no cache (skipped).
        physical: memory-order arrays instead of logical views (see :func:`reshape_kv_cache`).
        device: where to allocate; default device when ``None``.

    Returns:
        ``{layer_name: Array}``: group layers in group order, then the sharing layers.

    Raises:
        ValueError: everything :func:`allocate_kv_cache_raw` and :func:`reshape_kv_cache` reject, and a
            sharing target that owns no cache. Nothing is allocated then.
    """
    shared = dict(shared_kv_cache_layers or {})
    skip = frozenset(runner_only_attn_layers) | frozenset(shared)
    tensor_of = _layer_tensors(config, skip)
    nbytes_of = {name: config.kv_cache_tensors[i].size for name, i in tensor_of.items()}
    plans = _plan_layouts(config, nbytes_of, backends, skip)
    for layer, target in shared.items():
        if target not in plans:
            raise ValueError(f"shared_kv_cache_layers[{layer!r}]={target!r} owns no KV cache "
                             "(not a group layer with a tensor)")
    made: dict[tuple, jax.Array] = {}
    caches = {}
    for name, (dtype, phys, inv) in plans.items():
        use_inv = None if physical or inv == tuple(range(len(inv))) else inv
        key = (tensor_of[name], dtype, phys, use_inv)
        if key not in made:
            shape = phys if use_inv is None else tuple(phys[i] for i in use_inv)
            made[key] = jax.device_put(jnp.zeros(shape, dtype), device)
        caches[name] = made[key]
    for layer, target in shared.items():
        caches[layer] = caches[target]
    return caches


# ----------------------------------------------------------------------------------------------
# layer index and binding
# ----------------------------------------------------------------------------------------------

def extract_layer_index(layer_name: str, num_attn_module: int = 1) -> int:
    """Layer index in a name like ``model.layers.12.self_attn.attn``. vLLM: ``extract_layer_index``.

    With ``num_attn_module > 1`` (several attention modules per decoder layer, vLLM's
    ``longcat_flash``) and ``"attn"`` in the name, the first integer after ``layers.<i>`` is the module
    ``j`` and the index is ``i * num_attn_module + j`` (``j = 0`` when there is none). vLLM takes the
    integers anywhere in the name; we require the ``layers.<i>`` component.

    Raises:
        ValueError: no ``layers.<int>`` component, ``num_attn_module`` not a positive int, more than one
            module integer, or a module integer ``>= num_attn_module``.
    """
    if not isinstance(num_attn_module, int) or isinstance(num_attn_module, bool) or num_attn_module < 1:
        raise ValueError(f"num_attn_module={num_attn_module!r} must be a positive int")
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"layer_name={layer_name!r} has no 'layers.<index>' component")
    index = int(match.group(1))
    if num_attn_module == 1 or "attn" not in layer_name:
        return index
    modules = [int(part) for part in layer_name[match.end():].split(".") if part.isdigit()]
    if len(modules) > 1:
        raise ValueError(f"layer_name={layer_name!r} has more than one attention-module index")
    module = modules[0] if modules else 0
    if module >= num_attn_module:
        raise ValueError(f"layer_name={layer_name!r}: module {module} >= num_attn_module={num_attn_module}")
    return index * num_attn_module + module


def _bound_layer_names(names: list[str], num_attn_module: int, multiple_per_index: str) -> list[str]:
    if multiple_per_index not in MULTIPLE_PER_INDEX:
        raise ValueError(f"multiple_per_index={multiple_per_index!r} must be one of {MULTIPLE_PER_INDEX}")
    by_index: dict[int, list[str]] = {}
    for name in names:
        index = extract_layer_index(name, num_attn_module)
        if index in by_index and multiple_per_index == "error":
            raise ValueError(f"layers {by_index[index][0]!r} and {name!r} share layer index {index} "
                             "(pass multiple_per_index='first' or 'all')")
        by_index.setdefault(index, []).append(name)
    indices = sorted(by_index)
    if indices != list(range(len(indices))):
        raise ValueError(f"layer indices {indices} are not 0..{len(indices) - 1}")
    if multiple_per_index == "first":
        return [by_index[i][0] for i in indices]
    return [name for i in indices for name in by_index[i]]


def bind_kv_cache(kv_caches: dict[str, jax.Array], *, num_attn_module: int = 1,
                  multiple_per_index: str = "error") -> list[jax.Array]:
    """The caches as a list ordered by layer index (what a model's forward takes).

    vLLM: ``bind_kv_cache`` (the ``forward_context`` half has no JAX analogue: our caches are passed
    explicitly; layers keep their by-name access through ``kv_caches``). Several attention modules with
    one layer index (encoder-decoder self- and cross-attention) are handled as vLLM does, chosen by
    ``multiple_per_index``:

    * ``"error"`` (default): ``ValueError`` (vLLM raises ``NotImplementedError`` on platforms other
      than CUDA/XPU);
    * ``"first"``: the first module of each index (in ``kv_caches`` order) is bound, the others are
      left out of the list (vLLM up to v0.11 on CUDA/XPU: the GPU runner does not use the list for
      them);
    * ``"all"``: every module, by index then ``kv_caches`` order (newer vLLM).

    Unlike vLLM, the indices must be ``0..n-1`` (with ``"first"``/``"all"``: the distinct indices).

    Args:
        kv_caches: ``{layer_name: cache}``.
        num_attn_module: attention modules per decoder layer (see :func:`extract_layer_index`).
        multiple_per_index: ``"error"`` | ``"first"`` | ``"all"``.

    Raises:
        ValueError: a name without a layer index, two layers with one index under ``"error"``, indices
            not ``0..n-1``, or an unknown ``multiple_per_index``.
    """
    return [kv_caches[name]
            for name in _bound_layer_names(list(kv_caches), num_attn_module, multiple_per_index)]
