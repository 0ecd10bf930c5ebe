"""Hugging Face ``config.json`` -> :class:`models.decoder_config.DecoderConfig`, and the built-in configs of the
real model sizes that ``load_format="dummy"`` builds without a download.

The architecture is the first entry of ``architectures`` that jaxkv knows (vLLM's names, :data:`ARCHITECTURES`).
Fields are read as ``transformers`` reads them (defaults included); a feature jaxkv does not implement
(``mlp_bias``, Llama's ``attention_bias`` on o_proj, logit soft-capping, another activation or RoPE type) is
refused with a message naming the field, its value and the file, rather than run wrongly.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from models.decoder_config import (
    FULL_ATTENTION,
    GEMMA3,
    LLAMA,
    QWEN2,
    QWEN3,
    SLIDING_ATTENTION,
    DecoderConfig,
    LlamaConfig,
    RopeScaling,
)
from models.gemma3_config import Gemma3Config

# vLLM architecture name -> (switches, HF defaults that differ between the families)
ARCHITECTURES: dict[str, tuple] = {
    "LlamaForCausalLM": (LLAMA, dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "MistralForCausalLM": (LLAMA, dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "Qwen2ForCausalLM": (QWEN2, dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "Qwen3ForCausalLM": (QWEN3, dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "Gemma3ForCausalLM": (GEMMA3, dict(tie_word_embeddings=True, rope_theta=1_000_000.0)),
}

# Built-in configs of real sizes (values of the public config.json files; vocabulary sizes included), for
# load_format="dummy" on a machine without the checkpoint. gemma-3-4b is the text part (``text_config``) of
# google/gemma-3-4b-it, which is a Gemma3ForConditionalGeneration checkpoint.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
    "llama-3.1-70b": dict(  # meta-llama/Llama-3.1-70B (140 GB of bf16 weights: tensor_parallel_size >= 2)
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
    "qwen2.5-7b": dict(  # Qwen/Qwen2.5-7B
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
        max_position_embeddings=131072, max_window_layers=28, rms_norm_eps=1e-6, rope_theta=1000000.0,
        sliding_window=131072, use_sliding_window=False, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151643, torch_dtype="bfloat16"),
    "qwen3-8b": dict(  # Qwen/Qwen3-8B
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        attention_bias=False, max_position_embeddings=40960, max_window_layers=36, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, sliding_window=None, use_sliding_window=False,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
    "mistral-7b": dict(  # mistralai/Mistral-7B-v0.1 (sliding window 4096 on every layer)
        architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
    "gemma-3-4b": dict(  # google/gemma-3-4b-it, text_config
        architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=1024,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0), max_position_embeddings=131072, rms_norm_eps=1e-6,
        final_logit_softcapping=None, attn_logit_softcapping=None, bos_token_id=2, eos_token_id=[1, 106],
        torch_dtype="bfloat16"),
}


def read_json(path: str | os.PathLike) -> dict:
    """A JSON file's object. Raises ``FileNotFoundError`` / ``ValueError`` naming the file."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p} does not hold a JSON object")
    return data


def architecture_of(hf: dict, source: str = "config.json") -> str:
    """The first of ``hf["architectures"]`` that jaxkv implements.

    Raises:
        ValueError: none is (the message lists the file's and the known architectures).
    """
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    raise ValueError(f"{source}: architectures={archs} is not supported; known architectures: "
                     f"{sorted(ARCHITECTURES)}")


def _eos(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _rope(hf: dict, source: str) -> tuple[float | None, RopeScaling | None, float | None]:
    """``(rope_theta, scaling of the full-attention layers, local base)`` from ``rope_theta`` /
    ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5, possibly per layer type)."""
    theta, local, raw = hf.get("rope_theta"), hf.get("rope_local_base_freq"), hf.get("rope_scaling")
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
            full, sliding = params.get(FULL_ATTENTION) or {}, params.get(SLIDING_ATTENTION) or {}
            theta = full.get("rope_theta", theta)
            local = sliding.get("rope_theta", local)
            if sliding.get("rope_type", "default") != "default":
                raise ValueError(f"{source}: rope_parameters.sliding_attention.rope_type="
                                 f"{sliding.get('rope_type')!r} is not supported (only 'default')")
            raw = full
        else:
            theta = params.get("rope_theta", theta)
            raw = params
    scaling = None
    if isinstance(raw, dict):
        kind = raw.get("rope_type", raw.get("type", "default"))
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        try:
            scaling = RopeScaling(rope_type=kind, **{k: raw[k] for k in keys if k in raw and raw[k] is not None})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        if kind == "default":
            scaling = None
    return (None if theta is None else float(theta)), scaling, (None if local is None else float(local))


def _refuse(hf: dict, source: str, arch: str, field: str, allowed) -> None:
    value = hf.get(field)
    if value is not None and value not in allowed:
        raise ValueError(f"{source}: {field}={value!r} is not supported for {arch} (supported: {list(allowed)})")


def config_from_hf(hf: dict, *, source: str = "config.json") -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF ``config.json`` object (a :class:`Gemma3Config` for Gemma 3, a
    :class:`LlamaConfig` with the family's switches otherwise).

    Raises:
        ValueError: an unknown architecture (listing the known ones), a missing required field, or a
            feature jaxkv does not implement (naming the field, its value and ``source``).
    """
    arch = architecture_of(hf, source)
    switches, defaults = ARCHITECTURES[arch]

    def need(key):
        if hf.get(key) is None:
            raise ValueError(f"{source}: field {key!r} is missing (architecture {arch})")
        return hf[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    act_field = "hidden_activation" if arch == "Gemma3ForCausalLM" and "hidden_activation" in hf else "hidden_act"
    _refuse(hf, source, arch, act_field, ("gelu_pytorch_tanh",) if switches.hidden_act != "silu" else ("silu",))
    _refuse(hf, source, arch, "mlp_bias", (False,))
    if arch != "Qwen2ForCausalLM":  # Qwen 2 has q/k/v bias always; the others' attention_bias adds o_proj's too
        _refuse(hf, source, arch, "attention_bias", (False,))
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        _refuse(hf, source, arch, field, ())
    theta, scaling, local = _rope(hf, source)
    common = dict(
        vocab_size=int(need("vocab_size")), hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_size=int(hf.get("head_dim") or hidden // heads),
        rope_theta=theta if theta is not None else defaults["rope_theta"], rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
        bos_token_id=None if hf.get("bos_token_id") is None else int(hf["bos_token_id"]),
        eos_token_id=_eos(hf.get("eos_token_id")), architecture=arch)
    layer_types = hf.get("layer_types")
    window = hf.get("sliding_window")
    try:
        if arch == "Gemma3ForCausalLM":
            return Gemma3Config(**common, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
                                sliding_window=int(need("sliding_window")),
                                sliding_window_pattern=int(hf.get("sliding_window_pattern") or 6),
                                layer_types=layer_types, rope_local_base_freq=local or 10_000.0)
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            if not hf.get("use_sliding_window", False):
                window, layer_types = None, None
            elif layer_types is None and window is not None:  # HF: layers from max_window_layers on slide
                first = int(hf.get("max_window_layers", common["num_layers"]))
                layer_types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                               for i in range(common["num_layers"])]
        elif arch == "LlamaForCausalLM":
            window, layer_types = None, None
        if window is not None and layer_types is not None and SLIDING_ATTENTION not in layer_types:
            window, layer_types = None, None
        return LlamaConfig(**common, sliding_window=None if window is None else int(window),
                           layer_types=layer_types, arch=switches)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_hf_config(path: str | os.PathLike) -> DecoderConfig:
    """:func:`config_from_hf` of a ``config.json`` file or of a directory holding one.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: as :func:`config_from_hf`.
    """
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / "config.json"
    return config_from_hf(read_json(p), source=str(p))


def builtin_config(name: str) -> DecoderConfig:
    """The config of a built-in name of :data:`BUILTIN_CONFIGS` (case-insensitive)."""
    key = name.lower()
    if key not in BUILTIN_CONFIGS:
        raise ValueError(f"model={name!r} is not a built-in config; known: {sorted(BUILTIN_CONFIGS)}")
    return config_from_hf(BUILTIN_CONFIGS[key], source=f"built-in {key}")


def checkpoint_dtype(hf: dict) -> str | None:
    """The dtype the checkpoint was saved in (``torch_dtype`` / ``dtype``: ``"bfloat16"``, ...), or ``None``."""
    value = hf.get("torch_dtype") or hf.get("dtype")
    return value if isinstance(value, str) else None
