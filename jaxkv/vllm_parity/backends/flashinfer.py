"""FlashInfer's layout: ``(num_blocks, 2, block_size, num_kv_heads, head_size)``, NHD or HND.

vLLM: ``FlashInferBackend.get_kv_cache_shape`` / ``get_kv_cache_stride_order``. K and V of one block sit
next to each other (block outermost), which is what FlashInfer's paged kernels take. "NHD" = identity;
"HND" = ``(0, 1, 3, 2, 4)``. Here the two layouts are two backend classes.
"""

from __future__ import annotations

import jax

from jaxkv.kv_cache.backends.base import FLOAT_DTYPES, check_positive_dims
from jaxkv.kv_cache.dtypes import FP8_DTYPES


class FlashInferBackend:
    """Logical ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (dim 1: 0 = K, 1 = V), NHD memory.

    vLLM: ``FlashInferBackend`` with ``kv_cache_layout="NHD"``. Block sizes 16/32/64 and head sizes
    64/128/256, as vLLM's FlashInfer backend.
    """

    name = "FLASHINFER"
    kv_cache_layout = "NHD"
    supported_block_sizes = (16, 32, 64)
    supported_head_sizes = (64, 128, 256)
    supported_dtypes = FLOAT_DTYPES + FP8_DTYPES

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, int, int, int, int]:
        """``(num_blocks, 2, block_size, num_kv_heads, head_size)``.

        vLLM: ``FlashInferBackend.get_kv_cache_shape``. Raises ``ValueError`` on non-positive sizes.
        """
        check_positive_dims(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size)
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """NHD: identity. vLLM: ``FlashInferBackend.get_kv_cache_stride_order``."""
        return (0, 1, 2, 3, 4)

    @staticmethod
    def split_kv_cache(kv_cache: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(kv_cache[:, 0], kv_cache[:, 1])``, each ``[num_blocks, block_size, num_kv_heads, head_size]``.

        Takes the logical view. Raises ``ValueError`` unless ``kv_cache`` is ``[num_blocks, 2, ...]`` of
        rank 5.
        """
        if kv_cache.ndim != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache.shape={kv_cache.shape} must be "
                             "[num_blocks, 2, block_size, num_kv_heads, head_size]")
        return kv_cache[:, 0], kv_cache[:, 1]


class FlashInferHNDBackend(FlashInferBackend):
    """Same logical shape as :class:`FlashInferBackend`; memory ``[num_blocks, 2, num_kv_heads,
    block_size, head_size]`` (stride order ``(0, 1, 3, 2, 4)``).

    vLLM: ``FlashInferBackend`` with ``kv_cache_layout="HND"``.
    """

    name = "FLASHINFER_HND"
    kv_cache_layout = "HND"

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """HND: ``(0, 1, 3, 2, 4)``. vLLM: ``FlashInferBackend.get_kv_cache_stride_order``."""
        return (0, 1, 3, 2, 4)
