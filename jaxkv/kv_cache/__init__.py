"""What the KV cache is: specs, the KV-cache config, dtypes, sizing, allocation, the cache write, slot mapping.

* ``specs`` -- per-layer specs (vLLM ``vllm/v1/kv_cache_interface.py``); ``layer_specs`` builds them from
  a model's attention layers.
* ``config`` -- ``KVCacheConfig``: groups of layers sharing a block table, cache tensors, block count.
* ``dtypes`` -- ``kv_cache_dtype`` strings, fp8 quantisation on write and dequantisation on read.
* ``memory`` -- how many blocks fit in device memory.
* ``allocation`` -- the cache as a pytree of per-layer arrays, bound to the layers.
* ``write`` -- ``write_to_paged_cache``, vLLM's ``reshape_and_cache`` as a functional scatter.
* ``slot_mapping`` -- where each new token's K/V goes (``PAD_SLOT_ID``).
* ``backends`` -- the memory layout of a layer's cache (the Pallas kernels' layout; the other vLLM
  backends' layouts are API parity in :mod:`jaxkv.vllm_parity.backends`).

Imports only :mod:`pallas_kernels` and :mod:`jaxkv.checks` from the project.
"""
