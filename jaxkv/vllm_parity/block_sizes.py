"""Kernel block sizes and virtual block splitting (vLLM ``vllm/v1/worker/utils.py``, ``block_table.py``).

The KV-cache manager hands out blocks of ``kv_manager_block_size`` tokens (the spec's ``block_size``). An
attention kernel may only support smaller blocks. When the kernel block size divides the manager's, each
manager block ``b`` is viewed as ``ratio = manager_block_size // kernel_block_size`` consecutive kernel
blocks ``b * ratio + j`` (``j = 0 .. ratio - 1``): the memory is the same, only the block table is rewritten
(:func:`split_block_table`). A slot is a token index into the cache
(``block_id * block_size + offset``), so it has the same value under both views (:func:`split_slot_mapping`),
and a manager block ``b`` starts at element ``b * PAGE_SIZE_EL`` with
``PAGE_SIZE_EL = ratio * elements per kernel block`` (what vLLM's ``KVBlockZeroer`` uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv_cache.backends.base import MultipleOf  # vLLM ``MultipleOf``; re-exported here
from jaxkv.kv_cache.config import KVCacheConfig
from jaxkv.kv_cache.specs import AttentionSpec, _check_positive_int

__all__ = ["MultipleOf", "block_size_is_supported", "blocks_per_kv_block", "prepare_kernel_block_sizes",
           "select_common_block_size", "split_block_table", "split_slot_mapping",
           "supported_kernel_block_sizes"]


def supported_kernel_block_sizes(backend: Any) -> tuple[int | MultipleOf, ...]:
    """The block sizes a backend's kernels accept: ints and :class:`MultipleOf` entries.

    Read from ``backend.supported_block_sizes`` (jaxkv's :class:`~jaxkv.vllm_parity.backends.AttentionBackend`) or,
    if absent, ``backend.get_supported_kernel_block_sizes()`` (vLLM's name).

    Raises:
        ValueError: the backend declares neither, or an entry is neither a positive int nor a
            :class:`MultipleOf`.
    """
    sizes = getattr(backend, "supported_block_sizes", None)
    if sizes is None and hasattr(backend, "get_supported_kernel_block_sizes"):
        sizes = backend.get_supported_kernel_block_sizes()
    name = getattr(backend, "name", backend)
    if sizes is None:
        raise ValueError(f"backend={name!r} declares no supported_block_sizes")
    sizes = tuple(sizes)
    for s in sizes:
        if isinstance(s, MultipleOf):
            continue
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0:
            raise ValueError(f"backend={name!r} has supported block size {s!r}: not a positive int or "
                             "MultipleOf")
    return tuple(s if isinstance(s, MultipleOf) else int(s) for s in sizes)


def block_size_is_supported(backends: Sequence[Any], block_size: int) -> bool:
    """Whether every backend accepts ``block_size`` (equal to an int entry, or a multiple of a
    :class:`MultipleOf` base). vLLM: the inner ``block_size_is_supported`` of ``select_common_block_size``.
    """
    for backend in backends:
        sizes = supported_kernel_block_sizes(backend)
        if not any(block_size % s.base == 0 if isinstance(s, MultipleOf) else block_size == s
                   for s in sizes):
            return False
    return True


def select_common_block_size(kv_manager_block_size: int, backends: Sequence[Any]) -> int:
    """A kernel block size every backend supports that divides ``kv_manager_block_size``.

    vLLM: ``select_common_block_size``. Case 1: if every backend supports ``kv_manager_block_size`` itself,
    return it. Case 2: otherwise try the int entries of all backends, largest first, and return the first
    that divides ``kv_manager_block_size`` and every backend supports. (A :class:`MultipleOf` entry alone
    cannot give a smaller size: if ``b`` divides the manager size and is a multiple of every base, so is
    the manager size, and case 1 would have returned it.)

    Args:
        kv_manager_block_size: block size of the KV-cache manager (the spec's ``block_size``).
        backends: the attention backends of one KV-cache group (objects or classes with
            ``supported_block_sizes``); at least one.

    Returns:
        The selected kernel block size.

    Raises:
        ValueError: ``kv_manager_block_size`` not a positive int, no backends, a bad supported-size entry,
            or no common size (the message names the manager size and each backend's sizes).
    """
    kv_manager_block_size = _check_positive_int("kv_manager_block_size", kv_manager_block_size)
    backends = list(backends)
    if not backends:
        raise ValueError("backends=[] is empty; select_common_block_size needs at least one backend")
    if block_size_is_supported(backends, kv_manager_block_size):
        return kv_manager_block_size
    int_sizes = {s for b in backends for s in supported_kernel_block_sizes(b) if isinstance(s, int)}
    for size in sorted(int_sizes, reverse=True):
        if kv_manager_block_size % size == 0 and block_size_is_supported(backends, size):
            return size
    declared = {str(getattr(b, "name", b)): supported_kernel_block_sizes(b) for b in backends}
    raise ValueError(f"kv_manager_block_size={kv_manager_block_size} has no common kernel block size that "
                     f"divides it among the backends' supported sizes {declared}")


def prepare_kernel_block_sizes(kv_cache_config: KVCacheConfig,
                               backends_per_group: Sequence[Any]) -> list[int]:
    """The kernel block size of each KV-cache group. vLLM: ``prepare_kernel_block_sizes``.

    An attention group (its spec an :class:`~jaxkv.kv_cache.specs.AttentionSpec`) gets
    :func:`select_common_block_size` of its spec's ``block_size`` over its backends (virtual block
    splitting); any other cache (vLLM: Mamba) keeps its ``block_size`` (no splitting).

    Args:
        kv_cache_config: the config whose ``kv_cache_groups`` are sized.
        backends_per_group: indexed by group id: the backends of that group's layers, either a sequence of
            backends or one backend (vLLM: ``attn_groups[group_id]``, a list of ``AttentionGroup`` with a
            ``backend`` each).

    Returns:
        ``list[int]``, one kernel block size per group, each dividing the group's ``block_size``.

    Raises:
        ValueError: ``backends_per_group`` does not have one entry per group (lengths named), or a group
            without a common block size (see :func:`select_common_block_size`).
    """
    groups = kv_cache_config.kv_cache_groups
    backends_per_group = list(backends_per_group)
    if len(backends_per_group) != len(groups):
        raise ValueError(f"len(backends_per_group)={len(backends_per_group)} must equal the "
                         f"{len(groups)} kv_cache_groups")
    sizes = []
    for gid, (group, backends) in enumerate(zip(groups, backends_per_group)):
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            sizes.append(spec.block_size)
            continue
        if not isinstance(backends, Sequence) or isinstance(backends, str):
            backends = [backends]
        try:
            sizes.append(select_common_block_size(spec.block_size, backends))
        except ValueError as e:
            raise ValueError(f"kv_cache_groups[{gid}] ({group.layer_names[0]}, ...): {e}") from e
    return sizes


# ----------------------------------------------------------------------------------------------------
# Virtual block splitting
# ----------------------------------------------------------------------------------------------------


def blocks_per_kv_block(manager_block_size: int, kernel_block_size: int) -> int:
    """``manager_block_size // kernel_block_size``, the kernel blocks per manager block.

    vLLM: ``BlockTable.blocks_per_kv_block``.

    Raises:
        ValueError: a size that is not a positive int, or ``kernel_block_size`` not dividing
            ``manager_block_size``.
    """
    manager_block_size = _check_positive_int("manager_block_size", manager_block_size)
    kernel_block_size = _check_positive_int("kernel_block_size", kernel_block_size)
    if manager_block_size % kernel_block_size:
        raise ValueError(f"kernel_block_size={kernel_block_size} does not divide "
                         f"manager_block_size={manager_block_size}")
    return manager_block_size // kernel_block_size


def _check_int_array(name: str, x):
    if isinstance(x, jax.Array):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={x.dtype} must be an integer dtype")
        if x.ndim < 1:
            raise ValueError(f"{name}.ndim={x.ndim} must be >= 1")
        return x, jnp
    x = np.asarray(x)
    if x.dtype == object or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{name}.dtype={x.dtype} must be an integer dtype")
    if x.ndim < 1:
        raise ValueError(f"{name}.ndim={x.ndim} must be >= 1")
    return x, np


def split_block_table(block_tables, manager_block_size: int, kernel_block_size: int):
    """Rewrite manager block ids as kernel block ids: block ``b`` → ``b * ratio + j``, ``j < ratio``.

    vLLM: ``BlockTable.map_to_kernel_blocks`` (applied to every row of the block table).
    ``ratio = manager_block_size // kernel_block_size``. Negative entries (padding) stay padding: each of
    their ``ratio`` copies keeps the value. NumPy in → NumPy out (host); a ``jax.Array`` in →
    ``jax.Array`` out (works under ``jax.jit``, ratio static).

    Args:
        block_tables: ``int[..., max_num_blocks_per_seq]`` manager block ids, usually
            ``int32[num_seqs, max_num_blocks_per_seq]``; a 1-D list of block ids works too.
        manager_block_size: tokens per manager block (the spec's ``block_size``).
        kernel_block_size: tokens per kernel block; must divide ``manager_block_size``.

    Returns:
        ``int[..., max_num_blocks_per_seq * ratio]`` kernel block ids, same dtype. Token at position ``p``
        of a sequence lives in kernel block ``out[..., p // kernel_block_size]`` at offset
        ``p % kernel_block_size``.

    Raises:
        ValueError: bad sizes (see :func:`blocks_per_kv_block`), a non-integer or 0-d table, or (NumPy) a
            block id whose kernel ids overflow the dtype.
    """
    ratio = blocks_per_kv_block(manager_block_size, kernel_block_size)
    block_tables, xp = _check_int_array("block_tables", block_tables)
    if xp is np:
        top = int(block_tables.max(initial=0))
        if top * ratio + ratio - 1 > np.iinfo(block_tables.dtype).max:
            raise ValueError(f"block_tables holds block id {top}; with ratio={ratio} its kernel block ids "
                             f"overflow {block_tables.dtype}")
        block_tables = block_tables.copy()
    if ratio == 1:
        return block_tables
    ids = block_tables[..., None]
    offsets = xp.arange(ratio, dtype=block_tables.dtype)
    kernel = xp.where(ids < 0, ids, ids * ratio + offsets)
    return kernel.reshape(*block_tables.shape[:-1], block_tables.shape[-1] * ratio).astype(block_tables.dtype)


def split_slot_mapping(slot_mapping, manager_block_size: int, kernel_block_size: int):
    """The slot mapping under kernel blocks: the same values.

    A slot is a token's index into the cache viewed as ``[num_blocks * block_size]`` tokens:
    ``block_id * manager_block_size + offset`` = ``(block_id * ratio + offset // kernel_block_size) *
    kernel_block_size + offset % kernel_block_size``, the kernel block ``split_block_table`` gives that
    token. So the slot mapping needs no rewrite (vLLM computes it from the kernel block table with the kernel
    block size, which gives the same numbers; ``PAD_SLOT_ID = -1`` stays -1). This function checks the
    sizes and returns a copy, so callers can treat block tables and slot mappings alike.

    Args:
        slot_mapping: ``int32/int64[num_tokens]`` slots, ``-1`` for padding.
        manager_block_size, kernel_block_size: as in :func:`split_block_table`.

    Returns:
        The slots, same dtype and shape (NumPy copy, or the same ``jax.Array``).

    Raises:
        ValueError: bad sizes, or a non-integer / 0-d ``slot_mapping``.
    """
    blocks_per_kv_block(manager_block_size, kernel_block_size)
    slot_mapping, xp = _check_int_array("slot_mapping", slot_mapping)
    return slot_mapping.copy() if xp is np else slot_mapping
