"""jaxkv: vLLM's paged KV-cache system in JAX.

Flow of a step: the host allocates blocks (:class:`BlockAllocator`), builds block tables and slot
mappings (:func:`build_attn_metadata`); inside ``jax.jit`` each attention layer writes its new K/V with
:func:`write_to_paged_cache` and reads with :func:`paged_attention`; the cache is donated, so it is
updated in place.
"""

from jaxkv.attention import ATTENTION_IMPLS, default_attention_impl, paged_attention
from jaxkv.backends import AttentionBackend, PallasAttentionBackend
from jaxkv.block_allocator import BlockAllocator, OutOfBlocksError
from jaxkv.cache import allocate_kv_cache, bind_kv_cache, extract_layer_index
from jaxkv.engine import Completion, Engine, GenerationStats, SamplingParams
from jaxkv.kv_cache_config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, get_kv_cache_config
from jaxkv.metadata import AttentionMetadata, build_attn_metadata
from jaxkv.ops import write_to_paged_cache
from jaxkv.sampling import sample_tokens
from jaxkv.slot_mapping import (PAD_SLOT_ID, compute_slot_mapping, compute_slot_mapping_batch,
                                compute_slot_mapping_start_idx, slot_mapping_from_positions)
from jaxkv.spec import AttentionSpec, FullAttentionSpec, KVCacheSpec

__all__ = [
    "ATTENTION_IMPLS", "AttentionBackend", "AttentionMetadata", "AttentionSpec", "BlockAllocator",
    "Completion", "Engine", "FullAttentionSpec", "GenerationStats", "KVCacheConfig", "KVCacheGroupSpec",
    "KVCacheSpec", "KVCacheTensor", "OutOfBlocksError", "PAD_SLOT_ID", "PallasAttentionBackend",
    "SamplingParams", "allocate_kv_cache", "bind_kv_cache", "build_attn_metadata",
    "compute_slot_mapping", "compute_slot_mapping_batch", "compute_slot_mapping_start_idx",
    "default_attention_impl", "extract_layer_index", "get_kv_cache_config", "paged_attention",
    "sample_tokens", "slot_mapping_from_positions", "write_to_paged_cache",
]
