"""How an attention layer reads the paged cache.

* ``metadata`` -- the per-step batch description every attention layer reads (vLLM
  ``CommonAttentionMetadata`` and the metadata builders).
* ``dispatch`` -- the attention op the model calls, :func:`jaxkv.attention.dispatch.paged_attention`: picks
  the Pallas kernels (``pallas_kernels``, Triton or Mosaic GPU) or the XLA implementation and runs it.
* ``xla`` -- paged attention in plain XLA, the CPU implementation.

Imports :mod:`jaxkv.kv_cache` and :mod:`pallas_kernels`.
"""
