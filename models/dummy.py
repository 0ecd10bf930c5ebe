"""Random weights made on the device (vLLM's ``--load-format dummy``): a model of real size without a checkpoint.

Each parameter is made by a small jitted program on its device(s): ``out_shardings`` places it where
:func:`models.parallel.partition_spec` puts it (one device, or sharded over a ``(dp, tp)`` mesh), so there are
no host-side random numbers, no host copy and no transfer. One program per distinct (shape, dtype, kind,
sharding): the layers share their shapes, so a model of any depth compiles about ten small programs. (Until
session 16 the whole initialisation was one program; its GPU compile took 41-47 s in bf16 and 2-3.7 min in
float32, most of a cold start: docs/perf-notes.md.)

Values, in the spirit of the modules' own initialisers: norm scales ones, biases zeros, embeddings and
projection kernels normal with standard deviation ``1/sqrt(fan_in)`` (LeCun; ``fan_in`` = the hidden size for
an embedding, the input size for an ``x @ W`` kernel). Each parameter's key is ``fold_in(key(seed),
crc32(path))``, and JAX's partitionable threefry makes the values independent of the sharding, so the same
seed gives the same weights on one device and on any mesh (tp=2 greedy text equals tp=1's).

With ``quantization`` (fp8 projections, :class:`models.quantization.Fp8Linear`) each projection's program draws
the float kernel the unquantized model would get (same key, same ``[in, out]`` values), transposes it to
``[out, in]`` and quantizes it per output channel, returning the fp8 weight and its scales in their shardings:
the fp8 dummy model is the bf16 dummy model quantized, and the float copy lives only inside that program (one
layer's projection at a time; an 8B model's fp8 weights take ~7 GB instead of bf16's ~14 GB).
"""

from __future__ import annotations

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import DecoderForCausalLM
from models.decoder_config import DecoderConfig
from models.parallel import param_shardings
from models.quantization import FP8_DTYPE, Fp8Config, quantize_weight


def dummy_model(config: DecoderConfig, *, dtype=jnp.bfloat16, seed: int = 0, mesh=None,
                cls=DecoderForCausalLM, quantization: Fp8Config | None = None) -> DecoderForCausalLM:
    """A ``cls`` of ``config`` with random weights created on the device(s).

    Args:
        config: the model's config (any size: built-in, from a ``config.json``, ...).
        dtype: the model dtype (norm weights stay float32).
        seed: the root of the parameters' keys.
        mesh: a ``(dp, tp)`` mesh to create the parameters in their shards, or ``None`` (the default device).
        cls: the model class.
        quantization: an online :class:`models.quantization.Fp8Config`: fp8 projections (``f8e4m3[out, in]``
            weights + ``f32[out]`` scales), the quantized values of the unquantized model's random kernels.

    Raises:
        ValueError: the heads / intermediate size do not split over the mesh's ``tp`` (names the field); a
            static-activation ``quantization`` (its input scales need a checkpoint).
    """
    dtype = jnp.dtype(dtype)
    if quantization is not None and quantization.static_input_scale:
        raise ValueError("quantization.activation_scheme='static' needs a checkpoint's input scales; "
                         "load_format='dummy' makes dynamic-activation fp8 weights only")
    quant = {} if quantization is None else dict(quantization=quantization)
    graphdef, abstract = nnx.eval_shape(lambda: nnx.split(cls(config, dtype=dtype, rngs=nnx.Rngs(seed), **quant)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shardings = ([None] * len(leaves) if mesh is None
                 else treedef.flatten_up_to(param_shardings(abstract, config, mesh)))
    root = jax.random.key(seed)
    programs: dict = {}
    values = []
    fp8 = _fp8_pairs(leaves, shardings, root, dtype, quantization, programs) if quantization is not None else {}
    for (path, leaf), sharding in zip(leaves, shardings):
        names = _path_names(path)
        if tuple(names) in fp8:
            values.append(fp8[tuple(names)])
            continue
        kind, std = _initializer(names, leaf.shape)
        signature = (tuple(leaf.shape), jnp.dtype(leaf.dtype), kind, std, sharding)
        if signature not in programs:
            make = functools.partial(_make, shape=tuple(leaf.shape), dtype=jnp.dtype(leaf.dtype), kind=kind, std=std)
            # one device: no out_shardings, so the parameters stay uncommitted on the default device, as every
            # other single-device path makes them (committed ones made each step's dispatch take 130 ms of host
            # time on an H200: docs/perf-notes.md, session 15)
            programs[signature] = jax.jit(make) if sharding is None else jax.jit(make, out_shardings=sharding)
        # the key is derived inside the program: an eager fold_in per parameter cost 4 ms each (1.1 s of a
        # SmolLM2 warm start's 2.6 s dummy init on the CPU machine)
        values.append(programs[signature](root, np.uint32(zlib.crc32("/".join(names).encode()))))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))


def _fp8_pairs(leaves, shardings, root, dtype, quantization: Fp8Config, programs: dict) -> dict:
    """Path names -> value of every fp8 projection's ``weight`` and ``weight_scale``: one program per distinct
    (shape, shardings) draws the float ``[in, out]`` kernel under the unquantized model's key (its path with
    ``kernel`` for ``weight``), in ``dtype`` as that model holds it, and quantizes its transpose."""
    index = {tuple(_path_names(p)): (leaf, s) for (p, leaf), s in zip(leaves, shardings)}
    out = {}
    for names, (leaf, sharding) in index.items():
        if _leaf_name(list(names)) != "weight" or jnp.dtype(leaf.dtype) != jnp.dtype(FP8_DTYPE):
            continue
        stem = names[:names.index("weight")]
        scale_names = stem + ("weight_scale",) + names[len(stem) + 1:]
        scale_sharding = index[scale_names][1]
        out_features, in_features = leaf.shape
        kernel_path = "/".join(stem + ("kernel",) + names[len(stem) + 1:])
        signature = ("fp8", (in_features, out_features), dtype, quantization.weight_strategy, sharding,
                     scale_sharding)
        if signature not in programs:
            make = functools.partial(_make_fp8, shape=(in_features, out_features), dtype=dtype,
                                     std=1.0 / math.sqrt(in_features), strategy=quantization.weight_strategy)
            programs[signature] = (jax.jit(make) if sharding is None
                                   else jax.jit(make, out_shardings=(sharding, scale_sharding)))
        w, s = programs[signature](root, np.uint32(zlib.crc32(kernel_path.encode())))
        out[names], out[scale_names] = w, s
    return out


def _make_fp8(root, path_hash, *, shape, dtype, std, strategy):
    kernel = _make(root, path_hash, shape=shape, dtype=dtype, kind="normal", std=std)
    return quantize_weight(kernel.T, strategy)


def _leaf_name(names: list[str]) -> str:
    return next((n for n in reversed(names) if n not in (".value", "value", "raw_value")), "")


def _path_names(path) -> list[str]:
    """The parts of a pytree key path as strings (``["layers", "0", "mlp", "down_proj", "kernel", ".value"]``)."""
    return [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]


def _initializer(names: list[str], shape) -> tuple[str, float]:
    """``(kind, standard deviation)`` of the parameter at path ``names``: ``"ones"`` for norm scales,
    ``"zeros"`` for biases, ``"normal"`` with LeCun's ``1/sqrt(fan_in)`` otherwise."""
    name = _leaf_name(names)
    if name == "scale":
        return "ones", 0.0
    if name == "bias" or len(shape) == 0:
        return "zeros", 0.0
    fan_in = shape[-1] if name == "embedding" or len(shape) == 1 else math.prod(shape[:-1])
    return "normal", 1.0 / math.sqrt(fan_in)


def _make(root, path_hash, *, shape, dtype, kind, std):
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    key = jax.random.fold_in(root, path_hash)
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
