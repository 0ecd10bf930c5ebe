"""How a Llama-family model's parameters lie on a ``(dp, tp)`` mesh (Megatron-style tensor parallelism).

vLLM: ``ColumnParallelLinear`` / ``QKVParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding``. Here the rules are :class:`jax.sharding.PartitionSpec` s on the weights
(``nnx.Linear`` kernels are ``[in, out]``); XLA's partitioner derives the computation from them and
inserts the collectives (docs/serving.md, "The mesh", lists what the compiled step contains):

==========================================  =====================  ===========================
weight                                      spec                   parallel style
==========================================  =====================  ===========================
q_proj, gate_proj, up_proj ``[hidden, out]``  ``P(None, "tp")``      column (heads / intermediate)
k_proj, v_proj                              ``P(None, "tp")``      column; replicated ``P()`` when
                                                                   ``num_kv_heads < tp``
o_proj, down_proj ``[in, hidden]``          ``P("tp", None)``      row (one all-reduce each)
embed_tokens ``[vocab, hidden]``            ``P()``                replicated
lm_head ``[hidden, vocab]``                 ``P()``                replicated
norms                                       ``P()``                replicated
==========================================  =====================  ===========================

Every weight is replicated over ``dp``. The embedding and LM head are replicated, so every ``tp`` rank
computes full-vocabulary logits and sampling needs no gather (a vocab-parallel head would save memory
on large vocabularies; not done).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv.parallel import TP, check_tensor_parallel, mesh_sizes
from models.config import LlamaConfig

_COLUMN = {"q_proj", "gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}


def check_llama_tensor_parallel(config: LlamaConfig, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` naming the head counts and the valid sizes unless ``tp`` splits the model."""
    check_tensor_parallel(config.num_heads, config.num_kv_heads, tensor_parallel_size,
                          config.intermediate_size)


def llama_partition_spec(path: tuple, config: LlamaConfig, tensor_parallel_size: int) -> P:
    """The :class:`PartitionSpec` of the parameter at pytree ``path`` (keys of ``nnx.split``'s state)."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if "kernel" not in names:
        return P()
    layer = names[names.index("kernel") - 1]
    if layer in _COLUMN or (layer in ("k_proj", "v_proj") and config.num_kv_heads >= tensor_parallel_size):
        return P(None, TP)
    if layer in _ROW:
        return P(TP, None)
    return P()


def shard_llama_params(state, config: LlamaConfig, mesh: Mesh):
    """``state`` (from ``nnx.split``) placed on ``mesh`` by :func:`llama_partition_spec`.

    Raises:
        ValueError: the model's heads / intermediate size do not split over the mesh's ``tp``.
    """
    _, tp = mesh_sizes(mesh)
    check_llama_tensor_parallel(config, tp)
    shardings = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, llama_partition_spec(path, config, tp)), state)
    return jax.device_put(state, shardings)
