"""The device mesh of a served model: axes ``dp`` (data parallel) and ``tp`` (tensor parallel).

vLLM: ``--tensor-parallel-size`` / ``--data-parallel-size`` and its process groups
(``vllm/distributed/parallel_state.py``). Here the mesh is JAX's own: a :class:`jax.sharding.Mesh` of
shape ``(dp, tp)``; arrays carry :class:`jax.sharding.NamedSharding` s over it, XLA's SPMD partitioner
inserts the collectives, and per-shard code (the paged attention kernels) runs under
:func:`jax.shard_map`. jaxkv writes one collective of its own: the ``psum`` of an fp8 row-parallel projection's
partial sums (:func:`models.parallel.row_parallel`), so that each rank can scale its slice as vLLM does.

Several hosts: call ``jax.distributed.initialize(coordinator_address, num_processes, process_id)`` in
every process before anything else touches JAX (on SLURM / Cloud TPU the arguments are detected), then
``make_mesh`` over ``jax.devices()`` (all processes' devices, in process order) builds the same mesh in
every process; each process runs the same program (SPMD). Keep ``tp`` inside one host (NVLink) and put
``dp`` across hosts. Not exercised in this repository (one host only).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DP, TP = "dp", "tp"


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return int(value)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(dp, tp)`` mesh over the first ``dp * tp`` devices (``tp`` neighbours share a ``dp`` row).

    Both axes are ``AxisType.Auto`` (XLA's partitioner decides what is not pinned by a sharding).

    Args:
        tensor_parallel_size: devices a model's heads and MLP are split over (vLLM ``tensor_parallel_size``).
        data_parallel_size: the ``dp`` axis (1 for an engine: vLLM's ``data_parallel_size`` is engine-core
            processes, :mod:`jaxkv.engine.core_client`).
        devices: the devices to use (default ``jax.devices()``).

    Raises:
        ValueError: a size below 1, or fewer devices than ``tp * dp`` (names the sizes and the devices).
    """
    tp = _check_size("tensor_parallel_size", tensor_parallel_size)
    dp = _check_size("data_parallel_size", data_parallel_size)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp * dp:
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} devices, "
                         f"{len(devices)} available ({devices[0].platform if devices else 'none'})")
    grid = np.array(devices[:tp * dp], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP, TP), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_sizes(mesh: Mesh | None) -> tuple[int, int]:
    """``(dp, tp)`` of ``mesh`` (``(1, 1)`` for ``None``)."""
    if mesh is None:
        return 1, 1
    return int(mesh.shape.get(DP, 1)), int(mesh.shape.get(TP, 1))


def num_kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each ``tp`` rank keeps: ``max(1, num_kv_heads // tp)`` (vLLM's rule; below one head per
    rank the heads are replicated)."""
    return max(1, num_kv_heads // tensor_parallel_size)


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int | None = None) -> list[int]:
    """Every ``tp`` that :func:`check_tensor_parallel` accepts (up to ``num_heads``)."""
    return [tp for tp in range(1, num_heads + 1)
            if _tp_problem(num_heads, num_kv_heads, intermediate_size, tp) is None]


def _tp_problem(num_heads, num_kv_heads, intermediate_size, tp) -> str | None:
    if num_heads % tp:
        return f"num_heads={num_heads} is not divisible by tensor_parallel_size={tp}"
    if num_kv_heads >= tp and num_kv_heads % tp:
        return f"num_kv_heads={num_kv_heads} is not divisible by tensor_parallel_size={tp}"
    if num_kv_heads < tp and tp % num_kv_heads:
        return (f"tensor_parallel_size={tp} is not a multiple of num_kv_heads={num_kv_heads} (needed to "
                "replicate the KV heads)")
    if intermediate_size is not None and intermediate_size % tp:
        return f"intermediate_size={intermediate_size} is not divisible by tensor_parallel_size={tp}"
    return None


def check_tensor_parallel(num_heads: int, num_kv_heads: int, tensor_parallel_size: int,
                          intermediate_size: int | None = None) -> None:
    """Raise unless the heads (and the MLP's intermediate dimension) split evenly over ``tp`` ranks.

    Rules (vLLM's): ``num_heads % tp == 0``; ``num_kv_heads % tp == 0`` when ``num_kv_heads >= tp``,
    else ``tp % num_kv_heads == 0`` (each rank keeps one replicated KV head); ``intermediate_size % tp
    == 0``.

    Raises:
        ValueError: names the counts that do not divide and lists the valid ``tp`` sizes.
    """
    tp = _check_size("tensor_parallel_size", tensor_parallel_size)
    problem = _tp_problem(num_heads, num_kv_heads, intermediate_size, tp)
    if problem is not None:
        raise ValueError(f"{problem}; valid tensor_parallel_size values for num_heads={num_heads}, "
                         f"num_kv_heads={num_kv_heads}"
                         + (f", intermediate_size={intermediate_size}" if intermediate_size else "")
                         + f": {valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)}")


def kv_head_map(num_kv_heads: int, tensor_parallel_size: int) -> np.ndarray | None:
    """When KV heads are replicated (``num_kv_heads < tp``): ``int32[tp]``, the model KV head that ``tp``
    rank ``r`` keeps (``r * num_kv_heads // tp``, the head of its query heads); ``None`` otherwise."""
    if num_kv_heads >= tensor_parallel_size:
        return None
    return (np.arange(tensor_parallel_size) * num_kv_heads // tensor_parallel_size).astype(np.int32)


def kv_cache_partition_spec() -> P:
    """The cache ``[2, num_blocks, num_kv_heads, block_size, head_size]``: blocks over ``dp`` (each
    ``dp`` rank its own pool), KV heads over ``tp``."""
    return P(None, DP, TP, None, None)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, kv_cache_partition_spec())


def global_kv_cache_shape(num_blocks_per_rank: int, block_size: int, num_kv_heads: int, head_size: int,
                          mesh: Mesh | None) -> tuple[int, ...]:
    """Global shape of one layer's cache on ``mesh``: ``[2, dp * num_blocks_per_rank, tp *
    num_kv_heads_per_rank, block_size, head_size]`` (with ``num_kv_heads < tp`` the global head dim
    holds ``tp`` replicas, one per rank)."""
    dp, tp = mesh_sizes(mesh)
    return (2, dp * num_blocks_per_rank, tp * num_kv_heads_per_rank(num_kv_heads, tp), block_size,
            head_size)


def allocate_sharded_kv_caches(num_layers: int, num_blocks_per_rank: int, block_size: int,
                               num_kv_heads: int, head_size: int, dtype, mesh: Mesh) -> list[jax.Array]:
    """Zeroed caches, one per layer, created directly in their shards (no host copy, no gather)."""
    shape = global_kv_cache_shape(num_blocks_per_rank, block_size, num_kv_heads, head_size, mesh)
    make = jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=kv_cache_sharding(mesh))
    return [make() for _ in range(num_layers)]


