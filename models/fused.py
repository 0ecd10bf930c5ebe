"""Fused projections: q/k/v in one Linear and gate/up in another, built once after the weights load.

vLLM: ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` (its models load checkpoints' separate
``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` into one stacked weight each).

Why: a decoder layer's q, k and v (and gate and up) read the same input. Three GEMMs are three kernel launches and
three reads of the input; one GEMM over the stacked weight is one. With fp8 weights XLA's dot merger merged the
separate fp8 dots on its own, by concatenating their weights inside the step, so every decode step copied the
layer's q/k/v and gate/up weights again (3.5 s of an 18.2 s run at 8B on an H200, session 30).

Layout, for a ``tp``-way tensor-parallel mesh: the stacked output dimension is rank-major,
``[rank 0: q_0 | k_0 | v_0, rank 1: q_1 | k_1 | v_1, ...]`` (``q_r`` the ``r``-th of ``tp`` equal column blocks of
q), so splitting it ``P("tp")`` like any column-parallel Linear gives each rank its own heads of all three, and
the outputs split back per rank with no communication. The layout is a permutation of the output columns, so the
product is the same on any mesh; only a mesh of a different ``tp`` would need XLA to move data.

What is fused: a layer's q/k/v when their Linears are of one kind (all ``nnx.Linear`` or all dynamic-scale
:class:`models.quantization.Fp8Linear`) and k/v split over ``tp`` (``num_kv_heads >= tp``; replicated k/v stay
separate); gate/up likewise. A static-scale fp8 checkpoint's projections keep their own ``input_scale`` and stay
separate (vLLM would requantize them to the largest of the three). Fused weights are exact: per-channel fp8 scales
stack with their channels, and a per-tensor scale is already held per channel.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.parallel.mesh import TP
from models.quantization import Fp8Linear

FUSED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj"), "fused_qkv"),
         "gate_up_proj": ("mlp", ("gate_proj", "up_proj"), "fused_gate_up")}
"""Fused Linear name -> (the decoder layer's submodule, the Linears it stacks in order, the submodule's static
attribute holding the layout ``(tp, per-rank sizes)`` that :func:`split_fused` reads)."""

FUSE_ENV = "JAXKV_FUSED_PROJECTIONS"
"""``0`` in the environment keeps the projections separate (a maintainer's A/B; fused is the default)."""


def fusion_enabled() -> bool:
    """Whether :func:`models.registry.build_model` fuses (``JAXKV_FUSED_PROJECTIONS`` unset or not ``0``)."""
    return os.environ.get(FUSE_ENV, "1") != "0"


def split_fused(y: jax.Array, fused: tuple) -> tuple[jax.Array, ...]:
    """The member outputs of a fused Linear's ``y`` (``[..., tp * sum(sizes)]``), each ``[..., tp * size]``;
    ``fused`` is the module's ``(tp, sizes)`` (per-rank column counts of the members, in order)."""
    tp, sizes = fused
    lead = y.shape[:-1]
    y = y.reshape(*lead, tp, sum(sizes))
    out, start = [], 0
    for size in sizes:
        out.append(y[..., start:start + size].reshape(*lead, tp * size))
        start += size
    return tuple(out)


def _kind(linear) -> str | None:
    if isinstance(linear, Fp8Linear):
        return "fp8" if linear.input_scale is None else None  # static scales: not fused
    if isinstance(linear, nnx.Linear):
        return "float"
    return None


@functools.lru_cache(maxsize=64)
def _stack_program(axis: int, tp: int, n: int, out_sharding):
    """A jitted ``(*arrays) -> stacked`` of ``n`` arrays along ``axis`` in rank-major order, placed by
    ``out_sharding`` (``None``: where jit puts it)."""

    def stack(*xs):
        parts = []
        for x in xs:
            x = jnp.moveaxis(x, axis, 0)
            parts.append(x.reshape(tp, x.shape[0] // tp, *x.shape[1:]))
        y = jnp.concatenate(parts, axis=1)
        return jnp.moveaxis(y.reshape(-1, *y.shape[2:]), 0, axis)

    return jax.jit(stack, out_shardings=out_sharding)


def _stack(arrays: list, axis: int, tp: int, spec: P) -> jax.Array:
    sharding = arrays[0].sharding
    out = NamedSharding(sharding.mesh, spec) if isinstance(sharding, NamedSharding) else None
    return _stack_program(axis, tp, len(arrays), out)(*arrays)


def _out_features(linear) -> int:
    return linear.out_features if isinstance(linear, Fp8Linear) else linear.kernel[...].shape[1]


def _empty_like(linear, out_features: int) -> nnx.Module:
    """An abstract Linear (shapes only, no arrays) of ``linear``'s kind, input size and dtypes with
    ``out_features`` outputs: its parameters are set by the caller."""
    use_bias = linear.bias is not None
    if isinstance(linear, Fp8Linear):
        return nnx.eval_shape(lambda: Fp8Linear(linear.in_features, out_features, use_bias=use_bias))
    kernel = linear.kernel[...]
    return nnx.eval_shape(lambda: nnx.Linear(kernel.shape[0], out_features, use_bias=use_bias, dtype=linear.dtype,
                                             param_dtype=kernel.dtype, rngs=nnx.Rngs(0)))


def _fused_linear(members: list, tp: int) -> nnx.Module:
    """One Linear of ``members``' kind whose outputs are theirs, stacked rank-major over ``tp``."""
    first = members[0]
    fused = _empty_like(first, sum(_out_features(m) for m in members))
    if isinstance(first, Fp8Linear):
        fused.weight = nnx.Param(_stack([m.weight[...] for m in members], 0, tp, P(TP, None)))
        fused.weight_scale = nnx.Param(_stack([m.weight_scale[...] for m in members], 0, tp, P(TP)))
    else:
        fused.kernel = nnx.Param(_stack([m.kernel[...] for m in members], 1, tp, P(None, TP)))
    if first.bias is not None:
        fused.bias = nnx.Param(_stack([m.bias[...] for m in members], 0, tp, P(TP)))
    return fused


def fuse_projections(model, *, tensor_parallel_size: int = 1):
    """Replace each decoder layer's q/k/v and gate/up Linears by one fused Linear each (in place; returns
    ``model``), laid out for a ``tensor_parallel_size``-way mesh (module docstring: which layers fuse).

    A fused submodule holds ``qkv_proj`` (or ``gate_up_proj``) and the static ``fused_qkv`` (``fused_gate_up``)
    ``(tp, per-rank sizes)`` that :func:`split_fused` reads; its separate Linears are removed. Weights placed on a
    mesh stay there, in the fused Linear's column-parallel sharding.

    Raises:
        ValueError: ``tensor_parallel_size`` does not divide a member's output features.
    """
    tp = tensor_parallel_size
    config = model.config
    for layer in model.layers:
        for fused_name, (parent_name, names, layout) in FUSED.items():
            parent = getattr(layer, parent_name)
            if getattr(parent, fused_name, None) is not None:
                continue  # fused already
            members = [getattr(parent, n) for n in names]
            kinds = {_kind(m) for m in members}
            if len(kinds) != 1 or None in kinds:
                continue
            if fused_name == "qkv_proj" and config.num_kv_heads < tp:
                continue  # k/v replicated over tp: the stacked columns would not split per rank
            outs = [_out_features(m) for m in members]
            if any(o % tp for o in outs):
                raise ValueError(f"tensor_parallel_size={tp} does not divide {fused_name}'s members' output "
                                 f"features {outs}")
            setattr(parent, fused_name, _fused_linear(members, tp))
            setattr(parent, layout, (tp, tuple(o // tp for o in outs)))
            for n in names:
                delattr(parent, n)
    return model


def _unstack(y: jax.Array, axis: int, fused: tuple, index: int) -> jax.Array:
    tp, sizes = fused
    start = sum(sizes[:index])
    y = jnp.moveaxis(y, axis, 0)
    y = y.reshape(tp, sum(sizes), *y.shape[1:])[:, start:start + sizes[index]]
    return jnp.moveaxis(y.reshape(-1, *y.shape[2:]), 0, axis)


def member(parent, name: str) -> nnx.Module:
    """Linear ``name`` (``"q_proj"``, ``"up_proj"``, ...) of a decoder layer's ``parent`` (``self_attn`` or
    ``mlp``): the module itself when not fused, else a new Linear of its kind holding its columns of the fused
    one (copies, on one device). For tests and tools that read one projection's weights."""
    for fused_name, (_, names, layout) in FUSED.items():
        fused = getattr(parent, layout, None)
        if name in names and fused is not None:
            break
    else:
        return getattr(parent, name)
    index, whole = names.index(name), getattr(parent, fused_name)
    tp, sizes = fused
    lin = _empty_like(whole, tp * sizes[index])
    if isinstance(whole, Fp8Linear):
        lin.weight = nnx.Param(_unstack(whole.weight[...], 0, fused, index))
        lin.weight_scale = nnx.Param(_unstack(whole.weight_scale[...], 0, fused, index))
    else:
        lin.kernel = nnx.Param(_unstack(whole.kernel[...], 1, fused, index))
    if whole.bias is not None:
        lin.bias = nnx.Param(_unstack(whole.bias[...], 0, fused, index))
    return lin


def _tensor_parallel_size(model) -> int | None:
    """The ``tp`` ``model``'s layers were fused for, or ``None`` when none is fused."""
    for layer in model.layers:
        for parent_name, _, layout in FUSED.values():
            fused = getattr(getattr(layer, parent_name), layout, None)
            if fused is not None:
                return fused[0]
    return None


def fused_params(params, model):
    """``params`` in ``model``'s layout: an ``nnx.Module`` or ``nnx.State`` of a decoder of ``model``'s config
    with separate q/k/v and gate/up Linears (a JAX trainer's) fused as ``model`` is (new arrays for the fused
    weights; ``params`` itself is left as it was), as ``nnx.State``. ``params`` already in ``model``'s layout,
    or any other pytree, comes back as given (a module as its state). vLLM: ``load_weights`` stacking a
    checkpoint's ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``."""
    tp = _tensor_parallel_size(model)
    if isinstance(params, nnx.Module):
        graphdef, state = nnx.split(params)
    elif isinstance(params, nnx.State):
        if tp is None or jax.tree.structure(params) == jax.tree.structure(nnx.state(model)):
            return params
        quant = {"quantization": model.quantization} if hasattr(model, "quantization") else {}
        abstract = nnx.eval_shape(lambda: type(model)(model.config, dtype=model.dtype, rngs=nnx.Rngs(0), **quant))
        graphdef, unfused = nnx.split(abstract)
        if jax.tree.structure(params) != jax.tree.structure(unfused):
            return params  # neither layout: the engine's check names the first leaf that differs
        state = params
    else:
        return params
    if tp is None:
        return state
    copy = nnx.merge(graphdef, state)
    return nnx.state(fuse_projections(copy, tensor_parallel_size=tp))
