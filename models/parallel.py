"""How a decoder's parameters lie on a ``(dp, tp)`` mesh (Megatron-style tensor parallelism), every family.

vLLM: ``ColumnParallelLinear`` / ``QKVParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding``. Here the rules are :class:`jax.sharding.PartitionSpec` s on the weights
(``nnx.Linear`` kernels are ``[in, out]``); XLA's partitioner derives the computation from them and
inserts the collectives (docs/serving.md, "The mesh", lists what the compiled step contains):

==========================================  =====================  ===========================
weight                                      spec                   parallel style
==========================================  =====================  ===========================
q_proj, gate_proj, up_proj ``[hidden, out]``  ``P(None, "tp")``      column (heads / intermediate)
qkv_proj, gate_up_proj (:mod:`models.fused`)  ``P(None, "tp")``      column (stacked rank-major)
k_proj, v_proj                              ``P(None, "tp")``      column; replicated ``P()`` when
                                                                   ``num_kv_heads < tp``
q/k/v_proj bias ``[out]`` (Qwen 2)          ``P("tp")``            as its kernel's columns
q_norm, k_norm ``[head_size]`` (Qwen 3,     ``P()``                replicated (one weight for all heads)
Gemma 3)
o_proj, down_proj ``[in, hidden]``          ``P("tp", None)``      row (one all-reduce each)
embed_tokens ``[vocab, hidden]``            ``P()``                replicated
lm_head ``[hidden, vocab]``                 ``P()``                replicated
norms                                       ``P()``                replicated
==========================================  =====================  ===========================

fp8 projections (:class:`models.quantization.Fp8Linear`) hold ``weight`` ``f8e4m3[out, in]`` (PyTorch's
orientation) and ``weight_scale`` ``f32[out]``: column-parallel ``weight`` ``P("tp", None)`` with its scales split
alike ``P("tp")``; row-parallel (o_proj, down_proj) ``weight`` ``P(None, "tp")`` with the scales replicated
``P()`` (every rank's partial sums have all output channels); a static ``input_scale`` ``f32[]`` is replicated.
k/v replicated when ``num_kv_heads < tp``: weight and scales ``P()``. A row-parallel fp8 layer runs per rank
(:func:`row_parallel`, vLLM's ``RowParallelLinear``): each rank's slice gets its own per-token activation scales and
the partial sums are all-reduced in the model dtype; the cache-free ``dense`` path (tests, references) leaves it
to the partitioner, which scales whole rows as one device does.

Every weight is replicated over ``dp``. The embedding and LM head are replicated, so every ``tp`` rank
computes full-vocabulary logits and sampling needs no gather (a vocab-parallel head would save memory
on large vocabularies; not done).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.parallel.mesh import DP, TP, check_tensor_parallel, mesh_sizes
from models.decoder_config import DecoderConfig
from models.quantization import Fp8Linear, fp8_linear

_COLUMN = {"q_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj"}  # the last two: models.fused
_ROW = {"o_proj", "down_proj"}


def check_model_tensor_parallel(config: DecoderConfig, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` naming the field, its value and the valid sizes unless ``tp`` splits the model
    (vLLM's rules: ``num_heads``, ``num_kv_heads`` (or ``tp`` a multiple of it), ``intermediate_size``)."""
    check_tensor_parallel(config.num_heads, config.num_kv_heads, tensor_parallel_size,
                          config.intermediate_size)


check_llama_tensor_parallel = check_model_tensor_parallel


def partition_spec(path: tuple, config: DecoderConfig, tensor_parallel_size: int) -> P:
    """The :class:`PartitionSpec` of the parameter at pytree ``path`` (keys of ``nnx.split``'s state)."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    leaf = next((n for n in ("kernel", "bias", "weight", "weight_scale") if n in names), None)
    if leaf is None:
        return P()
    layer = names[names.index(leaf) - 1]
    column = layer in _COLUMN or (layer in ("k_proj", "v_proj") and config.num_kv_heads >= tensor_parallel_size)
    if column:
        return {"kernel": P(None, TP), "weight": P(TP, None)}.get(leaf, P(TP))  # bias, weight_scale: P(TP)
    if layer in _ROW and leaf in ("kernel", "weight"):
        return P(TP, None) if leaf == "kernel" else P(None, TP)
    return P()


llama_partition_spec = partition_spec


def param_shardings(state, config: DecoderConfig, mesh: Mesh):
    """A tree like ``state`` (from ``nnx.split`` or ``nnx.eval_shape``) of the parameters' :class:`NamedSharding` s.

    Raises:
        ValueError: the model's heads / intermediate size do not split over the mesh's ``tp``.
    """
    _, tp = mesh_sizes(mesh)
    check_model_tensor_parallel(config, tp)
    return jax.tree_util.tree_map_with_path(lambda path, _: NamedSharding(mesh, partition_spec(path, config, tp)),
                                            state)


def shard_params(state, config: DecoderConfig, mesh: Mesh):
    """``state`` (from ``nnx.split``) placed on ``mesh`` by :func:`partition_spec` (a no-op for parameters
    already placed so, e.g. loaded by :mod:`models.hf_loader` onto the mesh).

    Raises:
        ValueError: the model's heads / intermediate size do not split over the mesh's ``tp``.
    """
    return jax.device_put(state, param_shardings(state, config, mesh))


shard_llama_params = shard_params


TP_ALL_REDUCE_ENV = "JAXKV_TP_ALL_REDUCE"
"""``two-shot`` in the environment sums a row-parallel layer's partial outputs as a reduce-scatter over the rows
then an all-gather (bf16 layers then run per rank too); unset or ``psum``: one all-reduce, which XLA runs as its
one-shot kernel at decode sizes (4x H200, session 32: 24 us for 1 MB a rank, 49 us for 4 MB). A maintainer's A/B."""


def tp_all_reduce_mode() -> str:
    """``"psum"`` or ``"two-shot"`` (``$JAXKV_TP_ALL_REDUCE``).

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    mode = os.environ.get(TP_ALL_REDUCE_ENV, "psum")
    if mode not in ("psum", "two-shot"):
        raise ValueError(f"{TP_ALL_REDUCE_ENV}={mode!r} is not one of ('psum', 'two-shot')")
    return mode


def _sum_over_tp(y: jax.Array, tp: int, mode: str) -> jax.Array:
    """Inside ``shard_map``: the sum of every ``tp`` rank's ``y`` (``[rows, out]``), replicated. ``two-shot`` when
    the rows split over ``tp`` (each rank sums its ``rows / tp`` rows of all ranks, then all gather them), else one
    ``psum``."""
    if mode == "two-shot" and y.shape[0] % tp == 0:
        part = jax.lax.psum_scatter(y, TP, scatter_dimension=0, tiled=True)
        return jax.lax.all_gather(part, TP, axis=0, tiled=True)
    return jax.lax.psum(y, TP)


def row_parallel(proj, x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """``proj(x)`` for a row-parallel projection (o_proj, down_proj: ``x`` ``[tokens, in]`` split over ``tp``).

    A plain ``nnx.Linear`` is left to XLA's partitioner (one all-reduce of its partial sums), or with
    ``$JAXKV_TP_ALL_REDUCE=two-shot`` runs per rank with its sums as :func:`tp_all_reduce_mode` says. An fp8
    :class:`models.quantization.Fp8Linear` on a ``tp > 1`` mesh runs per rank, as vLLM's ``RowParallelLinear``
    with ``Fp8LinearMethod``: each rank quantizes its ``[tokens, in / tp]`` slice with its own per-token scales,
    takes its fp8 GEMM times its scales in the model dtype, and the ranks' partial sums are all-reduced in that
    dtype (bf16 on the wire), then the bias is added. Left to the partitioner the same layer all-reduced its
    ``[tokens]`` absmax (one more collective per projection) and its f32 partial sums (twice the bytes).

    Args:
        proj: the layer (``nnx.Linear`` or ``Fp8Linear``).
        x: ``[num_tokens, in]`` activations (tokens over ``dp``, features over ``tp``).
        mesh: the ``(dp, tp)`` mesh or ``None``.

    Returns:
        ``[num_tokens, out]`` in ``x.dtype``, replicated over ``tp``.
    """
    _, tp = mesh_sizes(mesh)
    mode = tp_all_reduce_mode()
    if tp == 1 or x.ndim != 2:
        return proj(x)
    if isinstance(proj, Fp8Linear):
        static = proj.input_scale is not None

        def product(x, weight, weight_scale, *input_scale):
            return fp8_linear(x, weight, weight_scale, input_scale=input_scale[0] if static else None)

        args = (x, proj.weight[...], proj.weight_scale[...]) + ((proj.input_scale[...],) if static else ())
        specs = (P(DP, TP), P(None, TP), P()) + ((P(),) if static else ())
    elif mode == "two-shot":  # a float nnx.Linear, kernel [in, out] split over its rows
        def product(x, kernel):
            return jnp.dot(x, kernel.astype(x.dtype))

        args, specs = (x, proj.kernel[...]), (P(DP, TP), P(TP, None))
    else:
        return proj(x)
    y = jax.shard_map(lambda *a: _sum_over_tp(product(*a), tp, mode), mesh=mesh, in_specs=specs,
                      out_specs=P(DP, None), check_vma=False)(*args)
    if proj.bias is not None:
        y = (y.astype(jnp.float32) + proj.bias[...].astype(jnp.float32)).astype(x.dtype)
    return y
