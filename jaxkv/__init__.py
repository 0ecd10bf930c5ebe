"""jaxkv: vLLM's paged KV-cache system and the serving engine around it, in JAX.

The folders follow one step of the engine (docs/architecture.md draws the tree):

* :mod:`jaxkv.kv_cache` -- what the cache is: per-layer specs, the KV-cache config (groups, tensors, block
  count), dtypes (fp8), memory sizing, allocation, the cache write (``reshape_and_cache``), slot mapping,
  the backends' layouts.
* :mod:`jaxkv.attention` -- how a layer reads it: the per-step attention metadata and the attention op that
  picks a kernel (``pallas_kernels``) or the XLA implementation.
* :mod:`jaxkv.core` -- the host side of a step (vLLM ``v1/core``): the block pool, prefix cache, requests,
  KV-cache managers and the continuous-batching scheduler.
* :mod:`jaxkv.worker` -- the device side of a step (vLLM ``v1/worker``): the model runner's jitted step
  (cache donated, updated in place), the sampler, the host KV tier's copies, the executable cache.
* :mod:`jaxkv.engine` -- the loop (vLLM ``v1/engine``): ``LLMEngine``, the engine-core process, its clients,
  the data-parallel load balancer and their messages.
* :mod:`jaxkv.parallel` -- the ``(dp, tp)`` mesh and a layer's sharded attention.
* :mod:`jaxkv.vllm_parity` -- vLLM API parity for the seeds' functions the engine does not call.

Flat modules: ``sampling_params`` and ``outputs`` (vLLM's top-level ``sampling_params.py`` and ``outputs.py``),
``checks`` (value checks of every op, on the host or inside ``jax.jit``), ``_lazy``.

The public names below are imported on first use; code inside the packages imports from the defining
modules. ``docs/api.md`` maps every vLLM function of the seeds to its jaxkv counterpart.
"""

from jaxkv._lazy import lazy_exports as _lazy_exports

# public name -> the module that defines it; imported on first use (jaxkv/_lazy.py)
_EXPORTS = {
    # the KV cache: specs, configs, dtypes, sizing, allocation, the cache write, slot mapping, layouts
    **dict.fromkeys(("AttentionSpec", "FullAttentionSpec", "KVCacheSpec", "MLAAttentionSpec",
                    "SlidingWindowSpec"), "jaxkv.kv_cache.specs"),
    **dict.fromkeys(("KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor", "check_enough_kv_cache_memory",
                    "get_kv_cache_config", "unify_hybrid_kv_cache_specs"), "jaxkv.kv_cache.config"),
    **dict.fromkeys(("FP8_DTYPES", "KV_CACHE_DTYPES", "dequantize_from_cache", "quantize_to_cache",
                    "resolve_kv_cache_dtype"), "jaxkv.kv_cache.dtypes"),
    **dict.fromkeys(("MemorySnapshot", "available_kv_cache_memory_bytes", "memory_snapshot",
                    "num_blocks_from_device_memory", "request_memory"), "jaxkv.kv_cache.memory"),
    **dict.fromkeys(("AttentionLayerDescription", "get_kv_cache_spec", "get_shared_kv_cache_layers"
                   ), "jaxkv.kv_cache.layer_specs"),
    **dict.fromkeys(("allocate_kv_cache", "allocate_kv_cache_raw", "bind_kv_cache", "extract_layer_index",
                    "init_kv_cache", "reshape_kv_cache"), "jaxkv.kv_cache.allocation"),
    **dict.fromkeys(("write_to_paged_cache",), "jaxkv.kv_cache.write"),
    **dict.fromkeys(("PAD_SLOT_ID", "compute_slot_mapping", "compute_slot_mapping_batch",
                    "compute_slot_mapping_into", "compute_slot_mapping_start_idx", "is_block_tables_empty",
                    "slot_mapping_from_positions"), "jaxkv.kv_cache.slot_mapping"),
    **dict.fromkeys(("AttentionBackend", "MultipleOf", "to_logical", "to_physical"), "jaxkv.kv_cache.backends.base"),
    **dict.fromkeys(("PallasAttentionBackend",), "jaxkv.kv_cache.backends.pallas"),
    # attention: per-step metadata and the attention op
    **dict.fromkeys(("AttentionMetadata", "CommonAttentionMetadata", "build_attn_metadata",
                    "build_attn_metadata_for_groups"), "jaxkv.attention.metadata"),
    **dict.fromkeys(("ATTENTION_IMPLS", "default_attention_impl", "paged_attention"), "jaxkv.attention.dispatch"),
    **dict.fromkeys(("checked", "checks_are_enabled", "checks_enabled", "raise_if_error"), "jaxkv.checks"),
    # the serving core (host): block pool, requests, KV-cache managers, scheduler
    **dict.fromkeys(("BlockAllocator", "OutOfBlocksError"), "jaxkv.core.block_pool"),
    **dict.fromkeys(("Request", "RequestStatus"), "jaxkv.core.request"),
    **dict.fromkeys(("KVCacheManager",), "jaxkv.core.kv_cache_manager"),
    **dict.fromkeys(("HybridKVCacheManager",), "jaxkv.core.hybrid_kv_cache_manager"),
    **dict.fromkeys(("Scheduler", "SchedulerConfig", "SchedulerOutput"), "jaxkv.core.scheduler"),
    # the device side of a step, and the engine
    **dict.fromkeys(("SamplingArrays", "sample_tokens", "sample_tokens_per_row"), "jaxkv.worker.sampler"),
    **dict.fromkeys(("ModelRunner",), "jaxkv.worker.model_runner"),
    **dict.fromkeys(("SamplingParams",), "jaxkv.sampling_params"),
    **dict.fromkeys(("CompletionOutput", "RequestOutput"), "jaxkv.outputs"),
    **dict.fromkeys(("EngineStats", "LLMEngine"), "jaxkv.engine.llm_engine"),
    # vLLM API parity for the seeds' functions the engine does not call (jaxkv/vllm_parity/)
    **dict.fromkeys(("BACKEND_NAMES", "get_backend"), "jaxkv.vllm_parity.backends"),
    **dict.fromkeys(("FlashAttentionBackend", "FlashAttentionHNDBackend"), "jaxkv.vllm_parity.backends.flash_attn"),
    **dict.fromkeys(("FlashInferBackend", "FlashInferHNDBackend"), "jaxkv.vllm_parity.backends.flashinfer"),
    **dict.fromkeys(("MLAAttentionBackend",), "jaxkv.vllm_parity.backends.mla"),
    **dict.fromkeys(("PagedAttentionLegacyBackend", "reshape_and_cache_legacy", "write_to_paged_cache_legacy"
                   ), "jaxkv.vllm_parity.backends.paged_attention_legacy"),
    **dict.fromkeys(("copy_blocks", "copy_blocks_donated", "zero_blocks", "zero_blocks_donated"
                   ), "jaxkv.vllm_parity.block_ops"),
    **dict.fromkeys(("blocks_per_kv_block", "prepare_kernel_block_sizes", "select_common_block_size",
                    "split_block_table", "split_slot_mapping"), "jaxkv.vllm_parity.block_sizes"),
    **dict.fromkeys(("AttentionType", "EncoderDecoderMetadata", "build_encoder_decoder_metadata",
                    "get_num_prefill_decode_query_kv_tokens", "get_seq_len_block_table_args",
                    "is_all_cross_attn_metadata_set", "is_all_encoder_attn_metadata_set"
                   ), "jaxkv.vllm_parity.enc_dec_metadata"),
    **dict.fromkeys(("DecodeGraphState", "capture_batch_sizes", "graph_batch_size", "pad_decode_metadata"
                   ), "jaxkv.vllm_parity.graph_buckets"),
    **dict.fromkeys(("add_kv_sharing_layers_to_kv_cache_groups", "is_kv_sharing_layer",
                    "kv_sharing_source_indices", "unique_kv_caches"), "jaxkv.vllm_parity.kv_sharing"),
    **dict.fromkeys(("allocate_host_kv_cache", "host_memory_kind", "swap_blocks", "swap_blocks_donated",
                    "to_host"), "jaxkv.vllm_parity.swap"),
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
__all__ = ["add_kv_sharing_layers_to_kv_cache_groups", "allocate_host_kv_cache", "allocate_kv_cache",
           "allocate_kv_cache_raw", "ATTENTION_IMPLS", "AttentionBackend", "AttentionLayerDescription",
           "AttentionMetadata", "AttentionSpec", "AttentionType", "available_kv_cache_memory_bytes",
           "BACKEND_NAMES", "bind_kv_cache", "BlockAllocator", "blocks_per_kv_block",
           "build_attn_metadata", "build_attn_metadata_for_groups", "build_encoder_decoder_metadata",
           "capture_batch_sizes", "check_enough_kv_cache_memory", "checked", "checks_are_enabled",
           "checks_enabled", "CommonAttentionMetadata", "CompletionOutput", "compute_slot_mapping",
           "compute_slot_mapping_batch", "compute_slot_mapping_into", "compute_slot_mapping_start_idx",
           "copy_blocks", "copy_blocks_donated", "DecodeGraphState", "default_attention_impl",
           "dequantize_from_cache", "EncoderDecoderMetadata", "EngineStats", "extract_layer_index",
           "FlashAttentionBackend", "FlashAttentionHNDBackend", "FlashInferBackend", "FlashInferHNDBackend",
           "FP8_DTYPES", "FullAttentionSpec", "get_backend", "get_kv_cache_config", "get_kv_cache_spec",
           "get_num_prefill_decode_query_kv_tokens", "get_seq_len_block_table_args", "get_shared_kv_cache_layers",
           "graph_batch_size", "host_memory_kind", "HybridKVCacheManager", "init_kv_cache",
           "is_all_cross_attn_metadata_set", "is_all_encoder_attn_metadata_set", "is_block_tables_empty",
           "is_kv_sharing_layer", "KV_CACHE_DTYPES", "kv_sharing_source_indices", "KVCacheConfig",
           "KVCacheGroupSpec", "KVCacheManager", "KVCacheSpec", "KVCacheTensor", "LLMEngine", "memory_snapshot",
           "MemorySnapshot", "MLAAttentionBackend", "MLAAttentionSpec", "ModelRunner", "MultipleOf",
           "num_blocks_from_device_memory", "OutOfBlocksError", "pad_decode_metadata", "PAD_SLOT_ID",
           "paged_attention", "PagedAttentionLegacyBackend", "PallasAttentionBackend",
           "prepare_kernel_block_sizes", "quantize_to_cache", "raise_if_error", "Request", "request_memory",
           "RequestOutput", "RequestStatus", "reshape_and_cache_legacy", "reshape_kv_cache",
           "resolve_kv_cache_dtype", "sample_tokens", "sample_tokens_per_row", "SamplingArrays", "SamplingParams",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "select_common_block_size", "SlidingWindowSpec",
           "slot_mapping_from_positions", "split_block_table", "split_slot_mapping", "swap_blocks",
           "swap_blocks_donated", "to_host", "to_logical", "to_physical", "unify_hybrid_kv_cache_specs",
           "unique_kv_caches", "write_to_paged_cache", "write_to_paged_cache_legacy", "zero_blocks",
           "zero_blocks_donated"]
