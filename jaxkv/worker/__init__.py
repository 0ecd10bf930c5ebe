"""The device side of a step (vLLM ``vllm/v1/worker/``).

* ``model_runner`` -- flat step inputs padded to buckets, the jitted step (cache donated, updated in place)
  and the sampled tokens back.
* ``sampler`` -- next-token sampling on the device, per row.
* ``kv_offload`` -- the host KV tier's memory and block copies (swap preemption, second-tier prefix cache).
* ``executable_cache`` -- compiled step programs on disk for the warm start.

Imports :mod:`jaxkv.kv_cache`, :mod:`jaxkv.attention` and :mod:`jaxkv.core` (a scheduled step's requests).
"""
