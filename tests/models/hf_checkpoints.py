"""Tiny random Hugging Face checkpoint directories of the five supported architectures, written the way
``transformers``' ``save_pretrained`` lays them out: ``config.json``, sharded ``*.safetensors`` with
``model.safetensors.index.json``, ``tokenizer.json`` (a byte-level BPE trained here), ``tokenizer_config.json``
with a chat template, ``generation_config.json`` with a list of EOS ids and default sampling.

Everything is written from this file's own tables (HF tensor names, ``[out, in]`` Linear weights, Gemma's
``w - 1`` norm weights), independently of the loader under test; :func:`reference_weights` turns the same
arrays into the flat ``x @ W`` dict of :func:`models.decoder.from_weights` by hand, so a mapping, transpose or
offset bug in :mod:`models.hf_loader` shows as a logits mismatch.

:func:`write_fp8_checkpoint` writes the compressed-tensors fp8 form of such a checkpoint (what llm-compressor's
``FP8_DYNAMIC`` / ``FP8`` schemes save): every decoder projection quantized here in NumPy float64 to
``F8_E4M3`` with a ``weight_scale`` (``[out, 1]`` per channel or a scalar per tensor) and, for static
activations, an ``input_scale``; written by :func:`write_safetensors` (``safetensors.numpy`` has no float8).
"""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np
import tokenizers
from safetensors.numpy import save_file
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 128, 2
SPECIALS = ["<s>", "</s>", "<|eot|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|eot|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
CORPUS = ["The capital of France is Paris.", "Hello world, hello tokens!", "Once upon a time, there was a cat.",
          "x = [i ** 2 for i in range(10)]", "naïve café 日本語"] * 4

# architecture -> (config.json fields beyond the common ones, checkpoint dtype)
ARCHS = {
    "LlamaForCausalLM": (dict(  # Llama 3.2 style: tied embeddings, llama3 RoPE scaling
        tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)), "float32"),
    "Qwen2ForCausalLM": (dict(tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                              use_sliding_window=False, sliding_window=32768, max_window_layers=2), "float32"),
    "Qwen3ForCausalLM": (dict(tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=32,
                              attention_bias=False), "bfloat16"),
    "MistralForCausalLM": (dict(tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-5, sliding_window=8),
                           "float16"),
    "Gemma3ForCausalLM": (dict(tie_word_embeddings=True, rope_theta=1e6, rope_local_base_freq=1e4, head_dim=16,
                               query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2,
                               layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6,
                               hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
                               attn_logit_softcapping=None), "float32"),
}


def build_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE of ~300 tokens trained on :data:`CORPUS`, BOS added by its post-processor."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def hf_config(arch: str, vocab_size: int) -> dict:
    extra, dtype = ARCHS[arch]
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "MistralForCausalLM": "mistral", "Gemma3ForCausalLM": "gemma3_text"}[arch]
    cfg = dict(architectures=[arch], model_type=model_type, vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTER,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
               max_position_embeddings=128, bos_token_id=0, eos_token_id=1, torch_dtype=dtype)
    if arch != "Gemma3ForCausalLM":
        cfg["hidden_act"] = "silu"
    cfg.update(extra)
    return cfg


def random_hf_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 tensors (``[out, in]`` Linear weights; Gemma norms stored as ``w - 1``)."""
    rng = np.random.default_rng(seed)
    arch = cfg["architectures"][0]
    gemma = arch == "Gemma3ForCausalLM"
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    hs = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hs, cfg["num_key_value_heads"] * hs

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    def norm(n):  # around 1 (HF Gemma stores w - 1: around 0)
        x = 1.0 + 0.2 * rng.standard_normal(n)
        return (x - 1.0 if gemma else x).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d, scale=0.5), "model.norm.weight": norm(d)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        if gemma:
            t[p + "pre_feedforward_layernorm.weight"] = norm(d)
            t[p + "post_feedforward_layernorm.weight"] = norm(d)
        if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            t[p + "self_attn.q_norm.weight"] = norm(hs)
            t[p + "self_attn.k_norm.weight"] = norm(hs)
        for n, (o, i_) in dict(q_proj=(q, d), k_proj=(kv, d), v_proj=(kv, d), o_proj=(d, q)).items():
            t[p + f"self_attn.{n}.weight"] = w(o, i_)
        if arch == "Qwen2ForCausalLM":
            for n, o in dict(q_proj=q, k_proj=kv, v_proj=kv).items():
                t[p + f"self_attn.{n}.bias"] = (0.3 * rng.standard_normal(o)).astype(np.float32)
        for n, (o, i_) in dict(gate_proj=(INTER, d), up_proj=(INTER, d), down_proj=(d, INTER)).items():
            t[p + f"mlp.{n}.weight"] = w(o, i_)
    return t


def as_stored(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The tensors in the checkpoint's dtype (bfloat16 through ml_dtypes); fp8 weights and their ``*_scale``
    tensors stay as they are."""
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    return {k: v if v.dtype == FP8 or k.endswith("_scale") else v.astype(np_dtype) for k, v in tensors.items()}


FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                      np.dtype(ml_dtypes.bfloat16): "BF16", FP8: "F8_E4M3"}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    """A ``.safetensors`` file written by hand (format: 8-byte little-endian header length, JSON header of
    ``{name: {dtype, shape, data_offsets}}``, the raw little-endian bytes), so that F8_E4M3 tensors can be
    written (``safetensors.numpy`` has no float8 dtype)."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw)


def quantize_fp8_numpy(w: np.ndarray, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """``w`` (``[out, in]``) -> ``(F8_E4M3 [out, in], f32 scale)`` in float64 NumPy, as llm-compressor saves
    them: ``scale = amax / 448`` per output row (``[out, 1]``, ``strategy="channel"``) or over the tensor
    (``[]``, ``"tensor"``), ``q = e4m3(clip(w / scale, -448, 448))``."""
    w64 = np.asarray(w, np.float64)
    amax = np.abs(w64).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w64).max()
    scale = np.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
    return np.clip(w64 / scale, -448.0, 448.0).astype(FP8), np.asarray(scale, np.float32)


def fp8_quantization_config(strategy: str = "channel", static: bool = False) -> dict:
    """``config.json``'s ``quantization_config`` of a compressed-tensors fp8 checkpoint (the form
    ``RedHatAI/*-FP8-dynamic`` ships: channel weights, dynamic per-token activations; or per-tensor weights
    with static activation scales, llm-compressor's ``FP8``)."""
    acts = (dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="tensor", observer="minmax")
            if static else dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token",
                                observer=None))
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "global_compression_ratio": None, "kv_cache_scheme": None, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                          "weights": dict(num_bits=8, type="float", symmetric=True, dynamic=False,
                                                          strategy=strategy, observer="minmax"),
                                          "input_activations": acts}}}


def fp8_tensors(tensors: dict[str, np.ndarray], strategy: str = "channel", input_scale: float | None = None
                ) -> dict[str, np.ndarray]:
    """The float checkpoint ``tensors`` with every decoder projection's ``weight`` replaced by its F8_E4M3
    form plus ``weight_scale`` (and ``input_scale = input_scale`` when given: static activations)."""
    out = {}
    for name, value in tensors.items():
        stem = name.removesuffix(".weight")
        if name.endswith(".weight") and stem.endswith(PROJECTIONS):
            out[name], out[stem + ".weight_scale"] = quantize_fp8_numpy(value, strategy)
            if input_scale is not None:
                out[stem + ".input_scale"] = np.asarray(input_scale, np.float32)
        else:
            out[name] = value
    return out


def write_checkpoint(directory: pathlib.Path, arch: str, *, seed: int = 0, num_shards: int = 3,
                     tensors: dict[str, np.ndarray] | None = None, cfg: dict | None = None,
                     tokenizer: tokenizers.Tokenizer | None = None) -> dict[str, np.ndarray]:
    """Write a checkpoint directory of ``arch``; returns the stored tensors (in the checkpoint dtype; fp8
    tensors, if any, as given, the files then written by :func:`write_safetensors`)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or build_tokenizer()
    cfg = cfg or hf_config(arch, tok.get_vocab_size())
    stored = as_stored(tensors or random_hf_tensors(cfg, seed), cfg.get("torch_dtype", "float32"))
    names = sorted(stored)
    shards = [names[i::num_shards] for i in range(num_shards)]
    weight_map = {}
    for s, group in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        if any(stored[n].dtype == FP8 for n in group):
            write_safetensors(directory / fname, {n: stored[n] for n in group})
        else:
            save_file({n: stored[n] for n in group}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    total = sum(a.nbytes for a in stored.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token="<s>", eos_token={"content": "</s>", "special": True}, chat_template=CHAT_TEMPLATE,
        tokenizer_class="PreTrainedTokenizerFast")))
    (directory / "generation_config.json").write_text(json.dumps(dict(
        bos_token_id=0, eos_token_id=[1, 2], temperature=0.6, top_p=0.9, do_sample=True)))
    return stored


KV_CACHE_SCHEME = dict(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="tensor")
"""llm-compressor's calibrated fp8 KV cache (``quantization_config.kv_cache_scheme``)."""


def write_fp8_checkpoint(directory: pathlib.Path, arch: str, *, strategy: str = "channel",
                         input_scale: float | None = None, seed: int = 0, num_shards: int = 2,
                         tokenizer: tokenizers.Tokenizer | None = None,
                         kv_scales: tuple[float, float] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """A compressed-tensors fp8 checkpoint of ``arch``'s tiny random model (projections quantized by
    :func:`fp8_tensors`, ``quantization_config`` of :func:`fp8_quantization_config`; static activations when
    ``input_scale`` is given; with ``kv_scales = (k, v)`` a :data:`KV_CACHE_SCHEME` and every layer's
    ``self_attn.k_scale`` (stored ``[]``) and ``v_scale`` (stored ``[1]``)). Returns ``(stored tensors, config.json
    object)``."""
    tok = tokenizer or build_tokenizer()
    cfg = hf_config(arch, tok.get_vocab_size())
    cfg["quantization_config"] = fp8_quantization_config(strategy, static=input_scale is not None)
    tensors = fp8_tensors(as_stored(random_hf_tensors(cfg, seed), cfg["torch_dtype"]), strategy, input_scale)
    if kv_scales is not None:
        cfg["quantization_config"]["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
        for i in range(cfg["num_hidden_layers"]):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(kv_scales[0], np.float32)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = np.asarray([kv_scales[1]], np.float32)
    stored = write_checkpoint(directory, arch, num_shards=num_shards, tensors=tensors, cfg=cfg, tokenizer=tok)
    return stored, cfg


def reference_weights(stored: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """The flat ``x @ W`` float32 dict of :func:`models.decoder.from_weights` from the HF tensors, by hand:
    Linear weights transposed, Gemma norm weights plus 1."""
    gemma = cfg["architectures"][0] == "Gemma3ForCausalLM"
    out = {}
    for name, value in stored.items():
        x = np.asarray(value, np.float32)
        stem = name.removeprefix("model.").removesuffix(".weight")
        stem = stem.replace("self_attn.", "").replace("mlp.", "")
        if name.endswith(".bias"):
            out[stem] = x  # layers.{i}.q_proj.bias
            continue
        if x.ndim == 2 and name != "model.embed_tokens.weight":
            x = x.T
        elif x.ndim == 1 and gemma:
            x = x + 1.0
        out[stem] = x
    return out
