"""The host side of a step (vLLM ``vllm/v1/core/``): NumPy and Python only.

* ``block_pool`` -- the free-list block pool; ``prefix_cache`` -- full blocks by the hash of their prefix.
* ``request`` -- a request's state through the scheduler.
* ``kv_cache_manager`` -- blocks for requests on demand, freed at once, cached prefixes reused;
  ``hybrid_kv_cache_manager`` -- one block table per KV-cache group over one pool (sliding windows);
  ``host_kv_pool`` -- the host tier's bookkeeping.
* ``scheduler`` -- continuous batching: which requests run this step, with how many tokens each; preemption.
"""
