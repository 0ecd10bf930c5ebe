"""vLLM's attention backends' KV-cache layouts (API parity), and the registry of every layout by name.

The engine allocates the Pallas layout only (:mod:`jaxkv.kv_cache.backends.pallas`); the others give vLLM's
``get_kv_cache_shape`` / ``get_kv_cache_stride_order`` for the seeds' backends and are tested, not served.
``get_backend(name)`` looks a backend class up by its ``name`` (vLLM: the backend registry /
``_Backend`` enum). Layouts (logical shape → memory order):

==================  =============================================================  ==============
name                logical shape                                                  stride order
==================  =============================================================  ==============
PALLAS              [2, num_blocks, num_kv_heads, block_size, head_size]           identity
PAGED_ATTN          [2, num_blocks, block_size * num_kv_heads * head_size]          identity
FLASH_ATTN          [2, num_blocks, block_size, num_kv_heads, head_size]           identity (NHD)
FLASH_ATTN_HND      [2, num_blocks, block_size, num_kv_heads, head_size]           (0, 1, 3, 2, 4)
FLASHINFER          [num_blocks, 2, block_size, num_kv_heads, head_size]           identity (NHD)
FLASHINFER_HND      [num_blocks, 2, block_size, num_kv_heads, head_size]           (0, 1, 3, 2, 4)
MLA                 [num_blocks, block_size, head_size]                            identity
==================  =============================================================  ==============
"""

from jaxkv.kv_cache.backends.base import (
    AttentionBackend,
    MultipleOf,
    inverse_stride_order,
    physical_kv_cache_shape,
    supports_block_size,
    to_logical,
    to_physical,
    validate_backend_args,
)
from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.vllm_parity.backends.flash_attn import FlashAttentionBackend, FlashAttentionHNDBackend
from jaxkv.vllm_parity.backends.flashinfer import FlashInferBackend, FlashInferHNDBackend
from jaxkv.vllm_parity.backends.mla import MLAAttentionBackend
from jaxkv.vllm_parity.backends.paged_attention_legacy import (
    PagedAttentionLegacyBackend,
    reshape_and_cache_legacy,
    write_to_paged_cache_legacy,
)

_BACKENDS = {b.name: b for b in (PallasAttentionBackend, PagedAttentionLegacyBackend,
                                 FlashAttentionBackend, FlashAttentionHNDBackend, FlashInferBackend,
                                 FlashInferHNDBackend, MLAAttentionBackend)}

BACKEND_NAMES = tuple(_BACKENDS)
"""Names :func:`get_backend` accepts."""


def get_backend(name: str) -> type:
    """The backend class registered under ``name`` (case-insensitive).

    vLLM: ``get_attn_backend`` / ``_Backend[name]`` (layout part only: no platform selection).

    Raises:
        ValueError: ``name`` is not a string or names no backend (the message lists the known names).
    """
    if not isinstance(name, str) or name.upper() not in _BACKENDS:
        raise ValueError(f"name={name!r} is not a known attention backend; known: {BACKEND_NAMES}")
    return _BACKENDS[name.upper()]


__all__ = [
    "AttentionBackend", "BACKEND_NAMES", "FlashAttentionBackend", "FlashAttentionHNDBackend",
    "FlashInferBackend", "FlashInferHNDBackend", "MLAAttentionBackend", "MultipleOf",
    "PagedAttentionLegacyBackend", "PallasAttentionBackend", "get_backend", "inverse_stride_order",
    "physical_kv_cache_shape", "reshape_and_cache_legacy", "supports_block_size", "to_logical",
    "to_physical", "validate_backend_args", "write_to_paged_cache_legacy",
]
