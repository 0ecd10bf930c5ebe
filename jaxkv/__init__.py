"""jaxkv: vLLM's paged KV-cache system in JAX.

Flow of a step: the host allocates blocks (:class:`BlockAllocator`), builds block tables and slot
mappings (:func:`build_attn_metadata`); inside ``jax.jit`` each attention layer writes its new K/V with
:func:`write_to_paged_cache` and reads with :func:`paged_attention`; the cache is donated, so it is
updated in place. ``docs/api.md`` maps every vLLM function of the seeds to its jaxkv counterpart.
"""

import types as _types

from jaxkv.attention import ATTENTION_IMPLS, default_attention_impl, paged_attention
from jaxkv.backends import (BACKEND_NAMES, AttentionBackend, FlashAttentionBackend,
                            FlashAttentionHNDBackend, FlashInferBackend, FlashInferHNDBackend,
                            MLAAttentionBackend, MultipleOf, PagedAttentionLegacyBackend,
                            PallasAttentionBackend, get_backend, reshape_and_cache_legacy, to_logical,
                            to_physical, write_to_paged_cache_legacy)
from jaxkv.block_allocator import BlockAllocator, OutOfBlocksError
from jaxkv.block_ops import copy_blocks, copy_blocks_donated, zero_blocks, zero_blocks_donated
from jaxkv.block_sizes import (blocks_per_kv_block, prepare_kernel_block_sizes, select_common_block_size,
                               split_block_table, split_slot_mapping)
from jaxkv.checks import checked, checks_are_enabled, checks_enabled, raise_if_error
from jaxkv.cache import (allocate_kv_cache, allocate_kv_cache_raw, bind_kv_cache, extract_layer_index,
                         init_kv_cache, reshape_kv_cache)
from jaxkv.enc_dec_metadata import (AttentionType, EncoderDecoderMetadata, build_encoder_decoder_metadata,
                                    get_num_prefill_decode_query_kv_tokens, get_seq_len_block_table_args,
                                    is_all_cross_attn_metadata_set, is_all_encoder_attn_metadata_set)
from jaxkv.core import (HybridKVCacheManager, KVCacheManager, Request, RequestStatus, Scheduler,
                        SchedulerConfig, SchedulerOutput)
from jaxkv.engine import CompletionOutput, EngineStats, LLMEngine, RequestOutput, SamplingParams
from jaxkv.graph_buckets import DecodeGraphState, capture_batch_sizes, graph_batch_size, pad_decode_metadata
from jaxkv.kv_cache_config import (KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                   check_enough_kv_cache_memory, get_kv_cache_config,
                                   unify_hybrid_kv_cache_specs)
from jaxkv.kv_cache_dtype import (FP8_DTYPES, KV_CACHE_DTYPES, dequantize_from_cache, quantize_to_cache,
                                  resolve_kv_cache_dtype)
from jaxkv.kv_sharing import (add_kv_sharing_layers_to_kv_cache_groups, is_kv_sharing_layer,
                              kv_sharing_source_indices, unique_kv_caches)
from jaxkv.layer_specs import AttentionLayerDescription, get_kv_cache_spec, get_shared_kv_cache_layers
from jaxkv.memory import (MemorySnapshot, available_kv_cache_memory_bytes, memory_snapshot,
                          num_blocks_from_device_memory, request_memory)
from jaxkv.metadata import (AttentionMetadata, CommonAttentionMetadata, build_attn_metadata,
                            build_attn_metadata_for_groups)
from jaxkv.ops import write_to_paged_cache
from jaxkv.sampling import SamplingArrays, sample_tokens, sample_tokens_per_row
from jaxkv.slot_mapping import (PAD_SLOT_ID, compute_slot_mapping, compute_slot_mapping_batch,
                                compute_slot_mapping_into, compute_slot_mapping_start_idx,
                                is_block_tables_empty, slot_mapping_from_positions)
from jaxkv.spec import AttentionSpec, FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec
from jaxkv.swap import (allocate_host_kv_cache, host_memory_kind, swap_blocks, swap_blocks_donated,
                        to_host)

__all__ = [_name for _name, _obj in dict(globals()).items()
           if not _name.startswith("_") and not isinstance(_obj, _types.ModuleType)]
