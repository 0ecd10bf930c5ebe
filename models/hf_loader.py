"""Weights of a Hugging Face checkpoint directory (``*.safetensors``, one file or shards with
``model.safetensors.index.json``), read with the ``safetensors`` library and placed straight onto their
devices.

No full host copy of the model is made: each parameter is built by
:func:`jax.make_array_from_callback`, whose callback reads, for one device, only that device's slice of the
tensor (``safe_open(..., framework="numpy").get_slice(name)[index]``; the files are memory-mapped), casts it to
the model dtype (bfloat16 through ``ml_dtypes``, which numpy lacks) and hands it to the device; so the host holds
at most one shard of one tensor at a time. Linear weights are stored ``[out_features, in_features]``
(PyTorch); the transpose to the model's ``x @ W`` ``[in, out]`` runs on the device (one jitted transpose per
tensor, out-sharded as the parameter). On a ``(dp, tp)`` mesh each parameter lands in the sharding of
:func:`models.parallel.partition_spec`. vLLM: ``model_loader/default_loader.py`` +
``weight_utils.safetensors_weights_iterator`` + each model's ``load_weights``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from models.decoder import DecoderForCausalLM, get_param
from models.decoder_config import DecoderConfig
from models.hf_config import read_json
from models.parallel import partition_spec

INDEX_FILE = "model.safetensors.index.json"
# names a checkpoint may carry that the model does not use
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one model parameter comes from: the checkpoint tensor ``name``, transposed (a Linear weight)
    or not, plus 1 (a Gemma RMSNorm weight stored as ``w - 1``) or not."""

    name: str
    path: tuple
    transpose: bool
    unit_offset: bool = False


def hf_tensor_plan(config: DecoderConfig) -> dict[str, HFTensor]:
    """Checkpoint tensor name -> :class:`HFTensor` for every parameter of ``config``'s model (HF names:
    ``model.layers.{i}.self_attn.q_proj.weight``, ...)."""
    offset = config.arch.rms_norm_unit_offset
    plan = {}

    def add(name, path, transpose=False, norm=False):
        plan[name] = HFTensor(name, path, transpose, norm and offset)

    add("model.embed_tokens.weight", ("embed_tokens", "embedding"))
    add("model.norm.weight", ("norm", "scale"), norm=True)
    if not config.tie_word_embeddings:
        add("lm_head.weight", ("lm_head", "kernel"), transpose=True)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.arch.sandwich_norm:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for n in norms:
            add(p + n + ".weight", ("layers", i, n, "scale"), norm=True)
        if config.arch.qk_norm:
            for n in ("q_norm", "k_norm"):
                add(p + f"self_attn.{n}.weight", ("layers", i, "self_attn", n, "scale"), norm=True)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            add(p + f"self_attn.{n}.weight", ("layers", i, "self_attn", n, "kernel"), transpose=True)
        if config.arch.qkv_bias:
            for n in ("q_proj", "k_proj", "v_proj"):
                add(p + f"self_attn.{n}.bias", ("layers", i, "self_attn", n, "bias"))
        for n in ("gate_proj", "up_proj", "down_proj"):
            add(p + f"mlp.{n}.weight", ("layers", i, "mlp", n, "kernel"), transpose=True)
    return plan


def safetensors_files(directory: str | os.PathLike) -> dict[str, pathlib.Path]:
    """Checkpoint tensor name -> the ``.safetensors`` file holding it.

    With ``model.safetensors.index.json`` its ``weight_map``; otherwise every ``*.safetensors`` file of the
    directory (usually the one ``model.safetensors``), their tensor names read from the headers.

    Raises:
        FileNotFoundError: no safetensors file, or a shard the index names that is missing (names both).
        ValueError: an index without ``weight_map``; a tensor in two files.
    """
    d = pathlib.Path(directory)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        files = {}
        for name, shard in weight_map.items():
            path = d / shard
            if not path.is_file():
                raise FileNotFoundError(f"shard {shard!r} (tensor {name!r}) listed in {index} does not exist: {path}")
            files[name] = path
        return files
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{d} holds no *.safetensors file (and no {INDEX_FILE})")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="numpy") as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"tensor {name!r} is in both {files[name]} and {shard}")
                files[name] = shard
    return files


def _sharding(path: tuple, config: DecoderConfig, mesh) -> jax.sharding.Sharding:
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    _, tp = mesh.shape.get("dp", 1), mesh.shape.get("tp", 1)
    keys = tuple(jax.tree_util.GetAttrKey(k) if isinstance(k, str) else jax.tree_util.SequenceKey(k) for k in path)
    return NamedSharding(mesh, partition_spec(keys, config, tp))


def _transposed(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*reversed(tuple(sharding.spec) + (None,) * (2 - len(sharding.spec)))))
    return sharding


_transpose = jax.jit(lambda x: x.T)


@functools.lru_cache(maxsize=64)
def _transpose_to(sharding):
    return jax.jit(lambda x: x.T, out_shardings=sharding)


def _place(sl, entry: HFTensor, shape: tuple, dtype, sharding) -> jax.Array:
    """The parameter: the checkpoint slice each device needs, read from the memory-mapped file, cast on the
    host (one shard at a time), transposed on the device when ``entry.transpose``."""
    hf_shape = tuple(reversed(shape)) if entry.transpose else shape
    src_sharding = _transposed(sharding) if entry.transpose else sharding

    def read(index):
        block = sl[index] if index else sl[:]
        if entry.unit_offset:
            block = block.astype(np.float32) + 1.0
        return np.asarray(block).astype(dtype, copy=False)

    if isinstance(sharding, SingleDeviceSharding):  # one device: uncommitted, as models/dummy.py says why
        arr = jax.device_put(read(()))
        return _transpose(arr) if entry.transpose else arr
    arr = jax.make_array_from_callback(hf_shape, src_sharding, read)
    return _transpose_to(sharding)(arr) if entry.transpose else arr


def load_hf_weights(directory: str | os.PathLike, config: DecoderConfig, *, dtype=jnp.bfloat16, mesh=None,
                    cls=DecoderForCausalLM, progress: bool = False) -> DecoderForCausalLM:
    """The model of ``config`` (a ``cls``) with the weights of the checkpoint in ``directory``, each parameter
    on its device (one device, or sharded over ``mesh`` as :func:`models.parallel.shard_params` would).

    Args:
        directory: an HF checkpoint directory (``*.safetensors`` with or without an index).
        config: the model's config (:func:`models.hf_config.load_hf_config`).
        dtype: the model dtype (``float32``/``bfloat16``/``float16``); norm weights stay float32. Checkpoints
            of any of the three dtypes load into any of them.
        mesh: a ``(dp, tp)`` mesh or ``None``.
        cls: the model class.
        progress: a tqdm bar over tensors.

    Raises:
        FileNotFoundError: no safetensors file, or a missing shard (names the file).
        ValueError: a tensor of the wrong shape (names the tensor, the expected and the found shape, and
            its file), a tensor the model lacks or one it needs that no file holds (names them).
    """
    if mesh is not None:
        from models.parallel import check_model_tensor_parallel
        check_model_tensor_parallel(config, mesh.shape.get("tp", 1))
    files = safetensors_files(directory)
    plan = hf_tensor_plan(config)
    unexpected = sorted(n for n in files if n not in plan and not n.endswith(_IGNORED_SUFFIXES)
                        and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if unexpected:
        raise ValueError(f"{directory}: {len(unexpected)} tensors the {config.architecture} model does not have, "
                         f"e.g. {unexpected[:6]} (in {files[unexpected[0]].name})")
    missing = sorted(n for n in plan if n not in files)
    if missing:
        raise ValueError(f"{directory}: {len(missing)} tensors of the {config.architecture} model are in no "
                         f"safetensors file, e.g. {missing[:6]}")
    model = nnx.eval_shape(lambda: cls(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    by_file: dict[pathlib.Path, list[HFTensor]] = {}
    for name, entry in plan.items():
        by_file.setdefault(files[name], []).append(entry)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(plan), desc="loading safetensors")
    for path, entries in by_file.items():
        for entry in entries:
            # one mapping per tensor: its pages leave the process's RSS when the file is closed (a shard of
            # several GB stays mapped otherwise, every page read counted, until the shard is done)
            with safe_open(str(path), framework="numpy") as f:
                param = get_param(model, entry.path)
                shape, want = tuple(param.get_value().shape), param.get_value().dtype
                sl = f.get_slice(entry.name)
                got = tuple(sl.get_shape())
                expected = tuple(reversed(shape)) if entry.transpose else shape
                if got != expected:
                    raise ValueError(f"tensor {entry.name!r} in {path.name} has shape {list(got)}, expected "
                                     f"{list(expected)} for this config.json")
                value = _place(sl, entry, shape, want, _sharding(entry.path, config, mesh))
                value.block_until_ready()  # the host slices are freed before the next tensor is read
                param.set_value(value)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return model
