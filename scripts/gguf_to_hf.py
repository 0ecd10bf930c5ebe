"""Write a Llama-family GGUF (e.g. SmolLM2-135M-Instruct) as a Hugging Face checkpoint directory.

    python scripts/gguf_to_hf.py [--gguf PATH | --model smollm2-135m] --out DIR [--dtype float32|bfloat16]
        [--num-shards N]

The weights are the GGUF's, dequantised by the ``gguf`` library (llama.cpp's q/k row permutation undone, so
they are the ``rotate_half`` layout HF checkpoints use) and written in PyTorch orientation (``[out, in]``) under
HF names into ``*.safetensors`` shards with ``model.safetensors.index.json``; ``config.json`` from the GGUF's
metadata; ``tokenizer.json`` is the GGUF tokenizer rebuilt by :class:`models.GGUFTokenizer` (BOS added by a
post-processor when the GGUF asks for it); ``tokenizer_config.json`` carries its special tokens and chat
template, ``generation_config.json`` its EOS. With ``float32`` the directory holds the GGUF's dequantised values
exactly: ``LLM(model=DIR)`` then generates the same greedy text as ``LLM(model=GGUF)``
(tests/models/test_gguf_hf_equal.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import processors

import models
from models import registry
from models.gguf_loader import load_llama_gguf


def hf_config_json(config) -> dict:
    """``config.json`` of a :class:`models.LlamaConfig` (``LlamaForCausalLM``)."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=config.vocab_size,
                hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                num_key_value_heads=config.num_kv_heads, head_dim=config.head_size, hidden_act="silu",
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
                rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
                bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, attention_bias=False,
                mlp_bias=False, torch_dtype="float32")


def hf_tensors(weights: dict) -> dict[str, np.ndarray]:
    """Our flat ``x @ W`` names -> HF names and ``[out, in]`` orientation."""
    out = {}
    for name, w in weights.items():
        if name == "embed_tokens":
            out["model.embed_tokens.weight"] = w
        elif name == "norm":
            out["model.norm.weight"] = w
        elif name == "lm_head":
            out["lm_head.weight"] = np.ascontiguousarray(w.T)
        else:
            _, i, leaf = name.split(".")
            prefix = f"model.layers.{i}."
            if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[prefix + f"self_attn.{leaf}.weight"] = np.ascontiguousarray(w.T)
            elif leaf in ("gate_proj", "up_proj", "down_proj"):
                out[prefix + f"mlp.{leaf}.weight"] = np.ascontiguousarray(w.T)
            else:
                out[prefix + f"{leaf}.weight"] = w
    return out


def write_hf_checkpoint(gguf_path, out_dir, *, dtype: str = "float32", num_shards: int = 2) -> pathlib.Path:
    """Convert ``gguf_path`` into the HF directory ``out_dir`` (created); returns it.

    Raises:
        ValueError: a GGUF of another architecture than ``llama``, or an unknown ``dtype``.
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not one of float32, bfloat16, float16")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = registry.open_gguf(gguf_path)
    if registry.architecture(reader) != "llama":
        raise ValueError(f"{gguf_path}: only general.architecture='llama' GGUFs are converted")
    config, weights = load_llama_gguf(reader, progress=False)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {k: v.astype(np_dtype) for k, v in hf_tensors(weights).items()}
    del weights
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        group = names[s::num_shards]
        save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, indent=1))
    cfg = hf_config_json(config) | {"torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tok = models.GGUFTokenizer.from_gguf(reader)
    inner = tok._tok  # the tokenizers.Tokenizer the GGUF tokenizer runs
    bos = None if tok.bos_token_id is None else tok.id_to_token(tok.bos_token_id)
    eos = None if tok.eos_token_id is None else tok.id_to_token(tok.eos_token_id)
    if tok._add_bos and bos is not None:
        inner.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])
    inner.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token=bos, eos_token=eos, chat_template=tok.chat_template, tokenizer_class="PreTrainedTokenizerFast")))
    (out / "generation_config.json").write_text(json.dumps(dict(
        bos_token_id=config.bos_token_id, eos_token_id=sorted(tok.stop_token_ids))))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model name or GGUF path (llama architecture)")
    p.add_argument("--gguf", default=None, help="a GGUF path (overrides --model)")
    p.add_argument("--out", required=True, help="the HF directory to write")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--num-shards", type=int, default=2)
    args = p.parse_args(argv)
    try:
        out = write_hf_checkpoint(registry.resolve_model(args.gguf or args.model), args.out, dtype=args.dtype,
                                  num_shards=args.num_shards)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {out}: {sorted(f.name for f in out.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
