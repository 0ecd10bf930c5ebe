"""The MLA layout: one latent vector per token, ``(num_blocks, block_size, head_size)``.

vLLM: ``MLACommonBackend.get_kv_cache_shape``. Multi-head latent attention caches one compressed
vector per token (``kv_lora_rank + qk_rope_head_dim`` channels, 512 + 64 = 576 for DeepSeek-V2/V3) shared
by every head, so there is no K/V split and no head dim: ``head_size`` is the latent dim and the spec's
``num_kv_heads`` is 1 (vLLM: ``MLAAttentionSpec``, whose ``page_size_bytes`` has no factor 2).
"""

from __future__ import annotations

from jaxkv.kv_cache.backends.base import FLOAT_DTYPES, MultipleOf, check_positive_dims
from jaxkv.kv_cache.dtypes import FP8_DTYPES


class MLAAttentionBackend:
    """Logical ``[num_blocks, block_size, head_size]`` (``head_size`` = latent dim), identity order.

    vLLM: ``MLACommonBackend``. Head size 576 (``kv_lora_rank`` 512 + rope dim 64), the one vLLM's MLA
    kernels take; block sizes: multiples of 16.
    """

    name = "MLA"
    supported_block_sizes = (MultipleOf(16),)
    supported_head_sizes = (576,)
    supported_dtypes = FLOAT_DTYPES + FP8_DTYPES

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        """vLLM: ``MLACommonBackend.get_supported_head_sizes``."""
        return list(MLAAttentionBackend.supported_head_sizes)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, int, int]:
        """``(num_blocks, block_size, head_size)``.

        vLLM: ``MLACommonBackend.get_kv_cache_shape``.

        Raises:
            ValueError: a non-positive size, or ``num_kv_heads != 1`` (the latent is shared by all
                heads; vLLM ignores the argument, we reject what would silently drop heads).
        """
        check_positive_dims(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size)
        if num_kv_heads != 1:
            raise ValueError(f"num_kv_heads={num_kv_heads} must be 1 for the MLA latent cache")
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, int, int]:
        """Identity. vLLM: ``MLACommonBackend.get_kv_cache_stride_order``."""
        return (0, 1, 2)
