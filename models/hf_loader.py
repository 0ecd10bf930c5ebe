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

fp8 (:mod:`models.quantization`): a compressed-tensors checkpoint's projections are ``weight`` ``F8_E4M3``
``[out, in]`` (kept in that orientation: no transpose), ``weight_scale`` (``[out, 1]``, ``[out]`` or a scalar,
read to ``f32[out]``) and, with static activations, ``input_scale`` (a scalar). ``safetensors``' NumPy reader
has no float8 dtype, so F8_E4M3 tensors are read through the file's header (:func:`read_safetensors_header`:
dtype string and byte offsets) as a memory map viewed as ``ml_dtypes.float8_e4m3fn``. With online
quantization (``quantization="fp8"`` on a float checkpoint) each projection's float ``[out, in]`` weight is
read as stored, one device's slice at a time, and quantized on its device(s) per output channel.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import struct

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
from models.quantization import Fp8Config, quantize_weight_jit, quantize_weight_to

INDEX_FILE = "model.safetensors.index.json"
# names a checkpoint may carry that the model does not use
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one model parameter comes from: the checkpoint tensor ``name``, transposed (a Linear weight)
    or not, plus 1 (a Gemma RMSNorm weight stored as ``w - 1``) or not.

    ``kind`` (fp8 projections): ``"plain"`` (everything unquantized), ``"fp8"`` (an ``F8_E4M3`` weight
    ``[out, in]``), ``"weight_scale"`` / ``"input_scale"`` (its scales), ``"quantize"`` (a float ``[out, in]``
    weight quantized at load time into ``path`` (the ``weight``) and its sibling ``weight_scale``)."""

    name: str
    path: tuple
    transpose: bool
    unit_offset: bool = False
    kind: str = "plain"


def hf_tensor_plan(config: DecoderConfig, quantization: Fp8Config | None = None) -> dict[str, HFTensor]:
    """Checkpoint tensor name -> :class:`HFTensor` for every parameter of ``config``'s model (HF names:
    ``model.layers.{i}.self_attn.q_proj.weight``, ...). With ``quantization`` the fp8 projections' entries:
    ``weight`` (+ ``weight_scale``, + ``input_scale`` for static activations) of an fp8 checkpoint, or the
    float ``weight`` to quantize (online); with its ``kv_cache_scales`` each attention layer's ``self_attn.k_scale``
    and ``self_attn.v_scale``."""
    offset = config.arch.rms_norm_unit_offset
    plan = {}

    def add(name, path, transpose=False, norm=False):
        plan[name] = HFTensor(name, path, transpose, norm and offset)

    def linear(i, stem, module_path, name):
        if quantization is None or not quantization.quantizes(i, name):
            add(stem + ".weight", module_path + ("kernel",), transpose=True)
        elif not quantization.checkpoint_fp8:
            plan[stem + ".weight"] = HFTensor(stem + ".weight", module_path + ("weight",), False, kind="quantize")
        else:
            for suffix, kind in (("weight", "fp8"), ("weight_scale", "weight_scale"), ("input_scale", "input_scale")):
                if kind != "input_scale" or quantization.static_input_scale:
                    plan[f"{stem}.{suffix}"] = HFTensor(f"{stem}.{suffix}", module_path + (suffix,), False, kind=kind)

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
            linear(i, p + f"self_attn.{n}", ("layers", i, "self_attn", n), n)
        if config.arch.qkv_bias:
            for n in ("q_proj", "k_proj", "v_proj"):
                add(p + f"self_attn.{n}.bias", ("layers", i, "self_attn", n, "bias"))
        for n in ("gate_proj", "up_proj", "down_proj"):
            linear(i, p + f"mlp.{n}", ("layers", i, "mlp", n), n)
        if quantization is not None and quantization.kv_cache_scales:  # kv_cache_scheme: a scalar each
            for n in ("k_scale", "v_scale"):
                plan[p + f"self_attn.{n}"] = HFTensor(p + f"self_attn.{n}", ("layers", i, "self_attn", n), False,
                                                      kind="input_scale")
    return plan


# -- tensors safetensors' NumPy reader cannot type (F8_E4M3) ----------------------------------------------------
RAW_DTYPES = {"F8_E4M3": "float8_e4m3fn"}
"""safetensors dtype strings read through the header, and their ``ml_dtypes`` names."""


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """``(header, data_start)`` of a ``.safetensors`` file: the header's tensor entries (name -> ``{"dtype",
    "shape", "data_offsets": [begin, end]}``, without ``__metadata__``) and the byte offset of the data section
    (offsets are relative to it).

    Raises:
        ValueError: a file too short for its header, or a header that is not a JSON object (names the file).
    """
    p = pathlib.Path(path)
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{p} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        text = f.read(n)
    try:
        header = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{p}: the safetensors header is not JSON ({e})") from None
    if len(text) != n or not isinstance(header, dict):
        raise ValueError(f"{p}: truncated or invalid safetensors header")
    header.pop("__metadata__", None)
    return header, 8 + n


class RawSlice:
    """One tensor of a safetensors file as a read-only memory map of its bytes viewed as its ``ml_dtypes``
    dtype (F8_E4M3 -> ``float8_e4m3fn``): ``get_shape()``, ``get_dtype()`` and ``[index]`` like the
    ``safetensors`` slice it stands in for.

    Raises:
        ValueError: an unknown dtype string, or data offsets that do not match the shape (names the tensor).
    """

    def __init__(self, path: str | os.PathLike, name: str, entry: dict, data_start: int):
        import ml_dtypes
        self.name, self.dtype_str = name, entry["dtype"]
        if self.dtype_str not in RAW_DTYPES:
            raise ValueError(f"tensor {name!r} in {pathlib.Path(path).name} has dtype {self.dtype_str}; read "
                             f"through the header: {sorted(RAW_DTYPES)}")
        self.shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        dtype = np.dtype(getattr(ml_dtypes, RAW_DTYPES[self.dtype_str]))
        if end - begin != int(np.prod(self.shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"tensor {name!r} in {pathlib.Path(path).name}: data_offsets {[begin, end]} do not "
                             f"hold shape {list(self.shape)} of {self.dtype_str}")
        self._path, self._offset, self._dtype = str(path), data_start + begin, dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype_str

    def __getitem__(self, index) -> np.ndarray:
        if not self.shape or 0 in self.shape:
            return np.zeros(self.shape, self._dtype)[index]
        mm = np.memmap(self._path, dtype=np.uint8, mode="r", offset=self._offset,
                       shape=(int(np.prod(self.shape, dtype=np.int64)) * self._dtype.itemsize,))
        # a copy of the slice: the mapping is closed when ``mm`` goes
        return np.array(mm.view(self._dtype).reshape(self.shape)[index])


def raw_slice(path: str | os.PathLike, name: str) -> RawSlice:
    """:class:`RawSlice` of tensor ``name`` of the file at ``path``."""
    header, start = read_safetensors_header(path)
    if name not in header:
        raise ValueError(f"tensor {name!r} is not in {pathlib.Path(path).name}")
    return RawSlice(path, name, header[name], start)


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
                    cls=DecoderForCausalLM, progress: bool = False, quantization: Fp8Config | None = None
                    ) -> DecoderForCausalLM:
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
        quantization: fp8 projections (:class:`models.quantization.Fp8Config`): read from an fp8 checkpoint
            (``checkpoint_fp8``) or quantized from the float weights as they are loaded; ``None``: none.

    Raises:
        FileNotFoundError: no safetensors file, or a missing shard (names the file).
        ValueError: a tensor of the wrong shape (names the tensor, the expected and the found shape, and
            its file), a tensor the model lacks or one it needs that no file holds (names them); an fp8
            projection whose weight is not ``F8_E4M3`` or whose scale's shape is neither ``[out, 1]``,
            ``[out]`` nor a scalar (names the tensor).
    """
    if mesh is not None:
        from models.parallel import check_model_tensor_parallel
        check_model_tensor_parallel(config, mesh.shape.get("tp", 1))
    files = safetensors_files(directory)
    plan = hf_tensor_plan(config, quantization)
    unexpected = sorted(n for n in files if n not in plan and not n.endswith(_IGNORED_SUFFIXES)
                        and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if unexpected:
        raise ValueError(f"{directory}: {len(unexpected)} tensors the {config.architecture} model does not have, "
                         f"e.g. {unexpected[:6]} (in {files[unexpected[0]].name})")
    missing = sorted(n for n in plan if n not in files)
    if missing:
        raise ValueError(f"{directory}: {len(missing)} tensors of the {config.architecture} model are in no "
                         f"safetensors file, e.g. {missing[:6]}")
    quant = {} if quantization is None else dict(quantization=quantization)
    model = nnx.eval_shape(lambda: cls(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0), **quant))
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
                if entry.kind != "plain":
                    _load_fp8_entry(f, path, entry, model, config, mesh)
                    if bar is not None:
                        bar.update(1)
                    continue
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


def _load_fp8_entry(f, path: pathlib.Path, entry: HFTensor, model, config: DecoderConfig, mesh) -> None:
    """Place one fp8 projection's tensor (``entry.kind``: ``"fp8"``, ``"weight_scale"``, ``"input_scale"`` or
    ``"quantize"``, see :class:`HFTensor`) into ``model``."""
    param = get_param(model, entry.path)
    shape = tuple(param.get_value().shape)
    sl = f.get_slice(entry.name)
    if sl.get_dtype() in RAW_DTYPES:
        sl = raw_slice(path, entry.name)
    got = tuple(sl.get_shape())
    sharding = _sharding(entry.path, config, mesh)
    if entry.kind in ("weight_scale", "input_scale"):
        out = shape[0] if shape else 1
        if got not in ((out, 1), (out,), (), (1,), (1, 1)):
            want = "[out, 1], [out] or a scalar" if shape else "a scalar"
            raise ValueError(f"tensor {entry.name!r} in {path.name} has shape {list(got)}, expected {want} "
                             f"(out={out})")
        value = np.asarray(f.get_tensor(entry.name), np.float32).reshape(-1)  # small; never F8
        if not shape:
            value = value.reshape(())
        elif value.size == 1:
            value = np.broadcast_to(value, shape)  # per-tensor scale: every channel the same
        else:
            value = value.reshape(shape)
        value = np.array(value, np.float32)  # a contiguous copy (np.ascontiguousarray makes a scalar 1-D)
        arr = jax.device_put(value) if isinstance(sharding, SingleDeviceSharding) else jax.device_put(value, sharding)
        param.set_value(arr)
        return
    if got != shape:
        raise ValueError(f"tensor {entry.name!r} in {path.name} has shape {list(got)}, expected {list(shape)} "
                         f"for this config.json")
    if entry.kind == "fp8":
        if sl.get_dtype() != "F8_E4M3":
            raise ValueError(f"tensor {entry.name!r} in {path.name} has dtype {sl.get_dtype()}, expected F8_E4M3 "
                             "(config.json's quantization_config makes this projection fp8)")
        value = _place(sl, entry, shape, param.get_value().dtype, sharding)
        value.block_until_ready()
        param.set_value(value)
        return
    # "quantize": the float weight as stored ([out, in]), one device's slice at a time, quantized on the device
    scale_param = get_param(model, entry.path[:-1] + ("weight_scale",))
    strategy = model.quantization.weight_strategy if hasattr(model, "quantization") else "channel"

    def read(index):
        return np.asarray(sl[index] if index else sl[:])

    if isinstance(sharding, SingleDeviceSharding):
        weight, scale = quantize_weight_jit(jax.device_put(read(())), strategy)
    else:
        scale_sharding = _sharding(entry.path[:-1] + ("weight_scale",), config, mesh)
        src = jax.make_array_from_callback(shape, sharding, read)
        weight, scale = quantize_weight_to(sharding, scale_sharding, strategy)(src)
    weight.block_until_ready()
    param.set_value(weight)
    scale_param.set_value(scale)
