"""Tensor parallelism over a ``(dp, tp)`` device mesh with JAX's own SPMD (docs/serving.md, "The mesh").

* ``mesh`` -- the mesh, the per-rank KV heads and the caches' shardings.
* ``attention`` -- a layer's paged-cache write + attention, run per shard.

Data parallelism is not a mesh axis of one engine: each data-parallel rank is an engine of its own in an
engine-core process (:mod:`jaxkv.engine.core_client`), so the engine's mesh always has ``dp == 1``.
"""
