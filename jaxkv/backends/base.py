"""The attention-backend protocol (vLLM ``AttentionBackend``: the layout half of it)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class AttentionBackend(Protocol):
    """What the cache allocator needs to know of a backend.

    vLLM: ``AttentionBackend.get_kv_cache_shape`` / ``get_kv_cache_stride_order`` and the backend's
    ``get_supported_head_sizes`` / supported block sizes / dtypes.
    """

    name: str
    supported_block_sizes: tuple[int, ...]
    supported_head_sizes: tuple[int, ...]
    supported_dtypes: tuple[np.dtype, ...]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """Logical shape of one layer's cache."""
        ...

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Order of the logical dims in memory, outermost first (identity = row-major logical shape)."""
        ...


def validate_backend_args(backend: AttentionBackend, *, block_size: int, head_size: int,
                          dtype) -> None:
    """Raise ``ValueError`` naming the value when ``backend`` cannot hold such a cache."""
    if block_size not in backend.supported_block_sizes:
        raise ValueError(f"block_size={block_size} not supported by backend {backend.name}; "
                         f"supported: {backend.supported_block_sizes}")
    if head_size not in backend.supported_head_sizes:
        raise ValueError(f"head_size={head_size} not supported by backend {backend.name}; "
                         f"supported: {backend.supported_head_sizes}")
    if np.dtype(dtype) not in backend.supported_dtypes:
        raise ValueError(f"dtype={np.dtype(dtype)} not supported by backend {backend.name}; "
                         f"supported: {[str(d) for d in backend.supported_dtypes]}")
