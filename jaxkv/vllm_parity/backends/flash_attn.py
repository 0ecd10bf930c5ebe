"""FlashAttention's layout: ``(2, num_blocks, block_size, num_kv_heads, head_size)``, NHD or HND.

vLLM: ``FlashAttentionBackend.get_kv_cache_shape`` / ``get_kv_cache_stride_order`` (the layout is
chosen by ``get_kv_cache_layout()``: "NHD" = tokens before heads inside a block, identity order;
"HND" = heads before tokens, order ``(0, 1, 3, 2, 4)``). Here the two layouts are two backend classes.
"""

from __future__ import annotations

import jax

from jaxkv.kv_cache.backends.base import FLOAT_DTYPES, MultipleOf, check_positive_dims
from jaxkv.kv_cache.dtypes import FP8_DTYPES


class FlashAttentionBackend:
    """Logical ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (0 = K, 1 = V), NHD memory.

    vLLM: ``FlashAttentionBackend`` with ``kv_cache_layout="NHD"`` (its default). Block sizes: multiples
    of 16 (vLLM raises otherwise); head sizes: multiples of 8 up to 256.
    """

    name = "FLASH_ATTN"
    kv_cache_layout = "NHD"
    supported_block_sizes = (MultipleOf(16),)
    supported_head_sizes = tuple(range(8, 257, 8))
    supported_dtypes = FLOAT_DTYPES + FP8_DTYPES

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, int, int, int, int]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``.

        vLLM: ``FlashAttentionBackend.get_kv_cache_shape``.

        Raises:
            ValueError: a non-positive size, or ``block_size`` not a multiple of 16 (as vLLM).
        """
        check_positive_dims(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size)
        if block_size % 16:
            raise ValueError(f"block_size={block_size} must be a multiple of 16")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """NHD: identity. vLLM: ``FlashAttentionBackend.get_kv_cache_stride_order``."""
        return (0, 1, 2, 3, 4)

    @staticmethod
    def split_kv_cache(kv_cache: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(kv_cache[0], kv_cache[1])``, each ``[num_blocks, block_size, num_kv_heads, head_size]``.

        vLLM: ``key_cache, value_cache = kv_cache.unbind(0)`` in ``FlashAttentionImpl.forward``.
        Takes the logical view. Raises ``ValueError`` unless ``kv_cache`` is ``[2, ...]`` of rank 5.
        """
        if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"kv_cache.shape={kv_cache.shape} must be "
                             "[2, num_blocks, block_size, num_kv_heads, head_size]")
        return kv_cache[0], kv_cache[1]


class FlashAttentionHNDBackend(FlashAttentionBackend):
    """Same logical shape as :class:`FlashAttentionBackend`; memory ``[2, num_blocks, num_kv_heads,
    block_size, head_size]`` (stride order ``(0, 1, 3, 2, 4)``).

    vLLM: ``FlashAttentionBackend`` with ``kv_cache_layout="HND"``.
    """

    name = "FLASH_ATTN_HND"
    kv_cache_layout = "HND"

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """HND: ``(0, 1, 3, 2, 4)``. vLLM: ``FlashAttentionBackend.get_kv_cache_stride_order``."""
        return (0, 1, 3, 2, 4)
