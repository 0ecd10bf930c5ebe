"""Tensor parallelism over a ``(dp, tp)`` device mesh with JAX's own SPMD (docs/serving.md, "The mesh").

Data parallelism is not a mesh axis of one engine: each data-parallel rank is an engine of its own in an
engine-core process (:mod:`jaxkv.engine.core_client`), so the engine's mesh always has ``dp == 1``.
"""

from jaxkv.parallel.attention import gather_logits_rows, paged_attention_layer
from jaxkv.parallel.mesh import (DP, TP, allocate_sharded_kv_caches, check_tensor_parallel,
                                 global_kv_cache_shape, kv_cache_partition_spec, kv_cache_sharding,
                                 kv_head_map, make_mesh, mesh_sizes, num_kv_heads_per_rank, valid_tp_sizes)

__all__ = ["DP", "TP", "allocate_sharded_kv_caches",
           "check_tensor_parallel", "gather_logits_rows", "global_kv_cache_shape", "kv_cache_partition_spec",
           "kv_cache_sharding",
           "kv_head_map", "make_mesh", "mesh_sizes", "num_kv_heads_per_rank", "paged_attention_layer",
           "valid_tp_sizes"]
