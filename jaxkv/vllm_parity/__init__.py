"""vLLM API parity: the seeds' functions that the serving engine does not call, kept and tested.

Each module reimplements a vLLM function of ``../shared/seeds`` with vLLM's semantics, for users who port
code written against vLLM's API (``docs/api.md`` maps each one). The engine does these jobs another way,
named in each module's docstring:

* ``backends`` -- FlashAttention, FlashInfer, MLA and legacy PagedAttention layouts, and the by-name
  registry (the engine allocates the Pallas layout, :mod:`jaxkv.kv_cache.backends.pallas`).
* ``block_ops`` -- ``copy_blocks`` / ``zero_blocks`` of whole blocks (the engine shares blocks through the
  prefix cache and never copies or zeroes a block: a fresh block is written before it is read).
* ``swap`` -- ``swap_blocks`` between device and host caches with JAX memory kinds (the engine's host tier,
  :mod:`jaxkv.worker.kv_offload`, copies through pinned staging buffers on threads, overlapping the step).
* ``block_sizes`` -- kernel block sizes and virtual block splitting (the engine's kernels take the cache's
  ``block_size`` as is).
* ``graph_buckets`` -- CUDA-graph capture sizes and fixed-shape decode metadata (the engine pads every step
  to power-of-two token and request buckets, :class:`jaxkv.worker.model_runner.ModelRunner`).
* ``enc_dec_metadata`` -- encoder-decoder attention metadata (the engine serves decoder-only models).
* ``kv_sharing`` -- cross-layer KV sharing (no served model shares KV across layers).

Nothing under :mod:`jaxkv.kv_cache`, :mod:`jaxkv.attention`, :mod:`jaxkv.core`, :mod:`jaxkv.worker` or
:mod:`jaxkv.engine` imports this package.
"""
