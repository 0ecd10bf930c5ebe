"""KV-cache capacity from device memory (vLLM ``request_memory`` in ``vllm/v1/worker/utils.py``).

vLLM takes a snapshot of the GPU's free and total memory at start-up, asks for
``ceil(total * gpu_memory_utilization)`` bytes (failing if less than that is free), subtracts what the model
needs besides the cache (weights, activations: found by profiling) and gives the rest to the KV cache.
jaxkv reads the snapshot from ``device.memory_stats()`` (XLA's allocator: ``bytes_limit`` = memory XLA may
use, ``bytes_in_use`` = allocated now); the non-cache memory is the caller's ``reserved_bytes``.

Semantic difference from vLLM: ``total_bytes`` is XLA's ``bytes_limit``, not the GPU's physical memory.
The limit is already a fraction of the GPU (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 by default, with or
without preallocation), so ``gpu_memory_utilization`` is a fraction of what XLA may use. Seen on an H100
80GB (JAX 0.11.2): ``bytes_limit`` = 63,763,906,560 bytes (59.4 GiB) by default and with
``XLA_PYTHON_CLIENT_PREALLOCATE=false``, 42,509,271,040 with ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.5``;
``bytes_in_use`` grows by exactly the bytes of each live array. Devices without memory statistics (CPU:
``memory_stats()`` returns ``None``) need an explicit ``total_bytes``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax

from jaxkv.kv_cache.config import KVCacheConfig, get_kv_cache_config
from jaxkv.kv_cache.specs import KVCacheSpec

_GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def _check_bytes(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int number of bytes >= 0")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySnapshot:
    """Free and total memory of one device at one moment. vLLM: ``MemorySnapshot`` (the part used here).

    Attributes:
        total_bytes: memory the allocator may hand out (XLA ``bytes_limit``).
        free_bytes: of that, not in use (``bytes_limit - bytes_in_use``).
        device: the device's name, for messages.

    Raises:
        ValueError: a negative or non-int size, or ``free_bytes > total_bytes``.
    """

    total_bytes: int
    free_bytes: int
    device: str = ""

    def __post_init__(self):
        _check_bytes("total_bytes", self.total_bytes)
        _check_bytes("free_bytes", self.free_bytes)
        if self.free_bytes > self.total_bytes:
            raise ValueError(f"free_bytes={self.free_bytes} exceeds total_bytes={self.total_bytes}")


def memory_snapshot(device: Any = None, *, total_bytes: int | None = None,
                    free_bytes: int | None = None) -> MemorySnapshot:
    """Snapshot of ``device``'s memory from ``device.memory_stats()``, or from explicit sizes.

    ``total_bytes`` defaults to ``stats["bytes_limit"]``; ``free_bytes`` defaults to ``total_bytes -
    stats["bytes_in_use"]`` (clamped at 0), or to ``total_bytes`` when the device has no statistics.

    Args:
        device: a ``jax.Device`` or any object with ``memory_stats()``; ``None``: ``jax.devices()[0]``.
        total_bytes: overrides the device's limit (required where ``memory_stats()`` is ``None``, e.g. CPU).
        free_bytes: overrides the free memory.

    Returns:
        The :class:`MemorySnapshot`.

    Raises:
        ValueError: no statistics and no ``total_bytes``; statistics without ``bytes_limit`` /
            ``bytes_in_use``; bad sizes.
    """
    if device is None:
        device = jax.devices()[0]
    stats_fn = getattr(device, "memory_stats", None)
    stats = stats_fn() if callable(stats_fn) else None
    if total_bytes is None:
        if not stats or "bytes_limit" not in stats:
            raise ValueError(f"device={device} reports no memory_stats()['bytes_limit'] (stats={stats!r}); "
                             "pass total_bytes= explicitly")
        total_bytes = int(stats["bytes_limit"])
    total_bytes = _check_bytes("total_bytes", total_bytes)
    if free_bytes is None:
        if stats:
            if "bytes_in_use" not in stats:
                raise ValueError(f"device={device} memory_stats() has no 'bytes_in_use' (stats={stats!r}); "
                                 "pass free_bytes= explicitly")
            free_bytes = max(total_bytes - int(stats["bytes_in_use"]), 0)
        else:
            free_bytes = total_bytes
    return MemorySnapshot(total_bytes=total_bytes, free_bytes=_check_bytes("free_bytes", free_bytes),
                          device=str(device))


def _check_utilization(gpu_memory_utilization: Any) -> float:
    u = gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise ValueError(f"gpu_memory_utilization={u!r} must be a number in (0, 1]")
    return float(u)


def request_memory(snapshot: MemorySnapshot, gpu_memory_utilization: float) -> int:
    """Bytes jaxkv may use: ``ceil(total_bytes * gpu_memory_utilization)``, checked against free memory.

    vLLM: ``request_memory`` (same condition: fail when ``free < ceil(total * utilization)``).

    Args:
        snapshot: the device's memory at start-up.
        gpu_memory_utilization: fraction in ``(0, 1]`` of ``total_bytes`` to use.

    Returns:
        The requested bytes.

    Raises:
        ValueError: utilization outside ``(0, 1]``, or the requested bytes exceed ``free_bytes`` (the
            message gives the fraction, total, requested and free sizes).
    """
    u = _check_utilization(gpu_memory_utilization)
    requested = math.ceil(snapshot.total_bytes * u)
    if snapshot.free_bytes < requested:
        raise ValueError(
            f"requested gpu_memory_utilization={gpu_memory_utilization} × "
            f"total_bytes={snapshot.total_bytes} "
            f"= {requested} bytes ({_gib(requested)}) exceeds free_bytes={snapshot.free_bytes} "
            f"({_gib(snapshot.free_bytes)}) on device {snapshot.device or '?'}; decrease "
            "gpu_memory_utilization or free memory used by other buffers/processes")
    return requested


def available_kv_cache_memory_bytes(*, gpu_memory_utilization: float = 0.9, device: Any = None,
                                    reserved_bytes: int = 0, total_bytes: int | None = None,
                                    free_bytes: int | None = None) -> int:
    """Bytes left for the KV cache: ``request_memory(...) - reserved_bytes``.

    vLLM: ``Worker.determine_available_memory`` (``requested_memory - non_kv_cache_memory``), with the
    profiled non-cache memory given as ``reserved_bytes``.

    Args:
        gpu_memory_utilization: fraction of the device's memory to use, in ``(0, 1]``.
        device, total_bytes, free_bytes: as in :func:`memory_snapshot`.
        reserved_bytes: bytes of the requested memory kept for everything but the cache (weights,
            activations, workspace).

    Returns:
        The KV-cache budget in bytes (> 0).

    Raises:
        ValueError: see :func:`memory_snapshot` and :func:`request_memory`; ``reserved_bytes`` negative or
            leaving nothing for the cache.
    """
    reserved_bytes = _check_bytes("reserved_bytes", reserved_bytes)
    snapshot = memory_snapshot(device, total_bytes=total_bytes, free_bytes=free_bytes)
    requested = request_memory(snapshot, gpu_memory_utilization)
    available = requested - reserved_bytes
    if available <= 0:
        raise ValueError(f"reserved_bytes={reserved_bytes} leaves no KV-cache memory out of the "
                         f"{requested} requested bytes (gpu_memory_utilization={gpu_memory_utilization})")
    return available


def num_blocks_from_device_memory(kv_cache: KVCacheSpec | Mapping[str, KVCacheSpec] | KVCacheConfig, *,
                                  num_layers: int | None = None, gpu_memory_utilization: float = 0.9,
                                  device: Any = None, reserved_bytes: int = 0,
                                  total_bytes: int | None = None, free_bytes: int | None = None,
                                  mesh: Any = None) -> int:
    """How many blocks fit in the device memory left for the KV cache.

    With a ``(dp, tp)`` ``mesh`` (:func:`jaxkv.parallel.mesh.make_mesh`) the count is per device, i.e. the
    block pool of one ``dp`` rank: every spec keeps ``max(1, num_kv_heads // tp)`` KV heads (what one
    ``tp`` rank stores), the budget is the smallest over the mesh's devices (``device`` ignored;
    ``reserved_bytes`` is per device: that device's share of the weights and activations), and the
    engine's cache holds ``dp`` times the result.

    The budget is :func:`available_kv_cache_memory_bytes`; then

    * ``{layer_name: spec}``: ``get_kv_cache_config(specs, budget).num_blocks`` (hybrid grouping included:
      ``budget // page_size_bytes // group_size``);
    * one spec and ``num_layers`` (a uniform model): ``budget // page_size_bytes // num_layers``;
    * a :class:`KVCacheConfig`: ``budget // bytes_per_block`` where one block costs
      ``sum(tensor.size) // config.num_blocks`` bytes over all its tensors (resizing an existing config).

    vLLM: ``request_memory`` + ``determine_available_memory`` + ``get_num_blocks``.

    Args:
        kv_cache: per-layer specs, one spec (with ``num_layers``), or an existing config.
        num_layers: layers sharing the spec (only with a single spec).
        mesh: a mesh with axes ``tp`` / ``dp`` (or ``None``: one device).
        gpu_memory_utilization, device, reserved_bytes, total_bytes, free_bytes: see
            :func:`available_kv_cache_memory_bytes`.

    Returns:
        ``num_blocks`` (>= 1).

    Raises:
        ValueError: the memory errors of :func:`available_kv_cache_memory_bytes`; ``num_layers`` missing or
            given where it does not apply; a budget below one block (the message gives budget and block
            bytes); a mesh with a :class:`KVCacheConfig` (size the config per device instead).
    """
    if mesh is not None:
        tp = int(mesh.shape.get("tp", 1))
        per_rank = lambda s: s.replace(num_kv_heads=max(1, s.num_kv_heads // tp))  # noqa: E731
        if isinstance(kv_cache, KVCacheSpec):
            kv_cache = per_rank(kv_cache)
        elif isinstance(kv_cache, Mapping):
            kv_cache = {name: per_rank(s) for name, s in kv_cache.items()}
        else:
            raise ValueError(f"mesh={mesh} needs per-layer specs or one spec, not kv_cache={kv_cache!r}")
        return min(num_blocks_from_device_memory(
            kv_cache, num_layers=num_layers, gpu_memory_utilization=gpu_memory_utilization, device=d,
            reserved_bytes=reserved_bytes, total_bytes=total_bytes, free_bytes=free_bytes)
            for d in mesh.devices.flat)
    if isinstance(kv_cache, KVCacheSpec):
        if num_layers is None:
            raise ValueError("num_layers=None: give the number of layers that share the spec")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers={num_layers!r} must be a positive int")
        block_bytes = kv_cache.page_size_bytes * num_layers
    elif num_layers is not None:
        raise ValueError(f"num_layers={num_layers} applies only to a single KVCacheSpec")
    elif isinstance(kv_cache, KVCacheConfig):
        block_bytes = sum(t.size for t in kv_cache.kv_cache_tensors) // kv_cache.num_blocks
        if block_bytes <= 0:
            raise ValueError(f"kv_cache has kv_cache_tensors={kv_cache.kv_cache_tensors!r}: "
                             "no bytes per block")
    elif isinstance(kv_cache, Mapping):
        block_bytes = None
    else:
        raise ValueError(f"kv_cache={kv_cache!r} is not a KVCacheSpec, a {{layer: spec}} dict or a "
                         "KVCacheConfig")

    budget = available_kv_cache_memory_bytes(gpu_memory_utilization=gpu_memory_utilization, device=device,
                                             reserved_bytes=reserved_bytes, total_bytes=total_bytes,
                                             free_bytes=free_bytes)
    if block_bytes is None:
        return get_kv_cache_config(kv_cache, budget).num_blocks
    if budget < block_bytes:
        raise ValueError(f"KV-cache budget of {budget} bytes (gpu_memory_utilization="
                         f"{gpu_memory_utilization}, reserved_bytes={reserved_bytes}) is less than one block "
                         f"of {block_bytes} bytes over all layers")
    return budget // block_bytes
