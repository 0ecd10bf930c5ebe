"""Gemma 3 logits: jaxkv (dense forward and hybrid paged engine) vs Hugging Face transformers' Gemma3.

Two halves, because transformers needs torch and jaxkv needs jax (they can live in different venvs):

    # 1. jaxkv side (this repo's venv): token ids + our logits of the last positions
    python scripts/dev/compare_hf_gemma3.py ours --out /tmp/g3 [--prompt-file docs/prompts/gemma3-long-qa.txt]
    # 2. transformers side (a venv with torch, transformers >= 4.50, gguf, numpy; no jax needed):
    python scripts/dev/compare_hf_gemma3.py hf --out /tmp/g3 --gguf PATH
    # 3. compare (either venv)
    python scripts/dev/compare_hf_gemma3.py compare --out /tmp/g3

The transformers side builds ``Gemma3ForCausalLM`` from a ``Gemma3TextConfig`` with Gemma-3-270M's
published hyper-parameters and loads the GGUF's tensors, dequantised by the ``gguf`` library, under HF
names: linear weights as stored (GGUF keeps PyTorch's ``[out, in]`` orientation), norm weights minus 1
(llama.cpp's converter stored ``1 + w``; HF's ``Gemma3RMSNorm`` multiplies by ``1 + w``). The
architecture (sandwich norms, q/k norms, GELU-tanh, embedding scale, query scale, local/global RoPE,
sliding-window masks) is then HF's code, independent of models/gemma3.py.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAST = 16  # positions whose logits are compared


def ours(args) -> None:
    sys.path.insert(0, str(ROOT))
    import jax

    import jaxkv
    from models import engine_setup, registry
    path = args.gguf or registry.resolve_model("gemma3-270m")
    config, weights, tok = registry.load_checkpoint(path)
    model = registry.build_model(config, weights, dtype="float32")
    ids = tok.encode(pathlib.Path(args.prompt_file).read_text(), add_special_tokens=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "ids.npy", np.asarray(ids, np.int32))
    with jax.default_matmul_precision("highest"):
        dense = np.asarray(engine_setup.dense_logits(model, np.asarray([ids]), first_logit=len(ids) - LAST))[0]
        # the paged engine: the prompt minus its last LAST tokens as a prefill, then the last tokens one
        # by one as "decodes" is not what the engine does; instead compare the prefill's last logits
        engine = engine_setup.make_engine(model, attention_impl="reference", block_size=16,
                                           num_blocks=6 * (len(ids) // 16 + 4), max_model_len=len(ids) + 2,
                                           max_num_seqs=1, max_num_batched_tokens=512,
                                           enable_prefix_caching=False, return_logits=True)
        paged = engine.generate([ids], jaxkv.SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].logits
    np.save(out / "ours_dense.npy", dense.astype(np.float32))
    np.save(out / "ours_paged_last.npy", np.asarray(paged, np.float32))
    print(f"ours: {len(ids)} tokens, dense logits of the last {LAST} positions and the paged last logits saved")


def hf(args) -> None:
    import gguf
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    reader = gguf.GGUFReader(args.gguf)
    kw = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
              num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
              sliding_window=512, rms_norm_eps=1e-6, max_position_embeddings=32768,
              hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
              tie_word_embeddings=True, attn_implementation="eager")
    try:  # transformers >= 5: per-layer-type RoPE parameters
        cfg = Gemma3TextConfig(**kw, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    except TypeError:
        cfg = Gemma3TextConfig(**kw, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None)
    print("HF config:", {k: getattr(cfg, k, None) for k in ("layer_types", "rope_parameters", "rope_theta",
                                                          "rope_local_base_freq", "sliding_window")})
    model = Gemma3ForCausalLM(cfg).eval().to(torch.float32)
    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    state = {}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        stem = t.name.removesuffix(".weight")
        if stem == "token_embd":
            hf_name = "model.embed_tokens.weight"
        elif stem == "output_norm":
            hf_name = "model.norm.weight"
        else:
            _, layer, kind = stem.split(".")
            hf_name = f"model.layers.{layer}.{names[kind]}.weight"
        if "norm" in hf_name:
            w = w - 1.0
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(w))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise SystemExit(f"HF state dict mismatch: missing={missing} unexpected={unexpected}")
    out = pathlib.Path(args.out)
    ids = torch.from_numpy(np.load(out / "ids.npy").astype(np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=LAST).logits[0].float().numpy()
    np.save(out / "hf.npy", logits)
    print(f"hf: {ids.shape[1]} tokens, logits of the last {LAST} positions saved")


def compare(args) -> None:
    out = pathlib.Path(args.out)
    hf_logits = np.load(out / "hf.npy").astype(np.float64)
    dense = np.load(out / "ours_dense.npy").astype(np.float64)
    paged = np.load(out / "ours_paged_last.npy").astype(np.float64)
    n = len(np.load(out / "ids.npy"))
    scale = np.abs(hf_logits).max()
    rel = np.abs(dense - hf_logits).max() / scale
    print(f"{n} tokens; last {LAST} positions: max|ours_dense - hf| / max|hf| = {rel:.2e}; "
          f"argmax agree {(dense.argmax(-1) == hf_logits.argmax(-1)).mean():.2f}")
    print(f"last position: max|ours_paged - hf| / max|hf| = "
          f"{np.abs(paged[0] - hf_logits[-1]).max() / np.abs(hf_logits[-1]).max():.2e}; "
          f"max|ours_paged - ours_dense| = {np.abs(paged[0] - dense[-1]).max():.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("side", choices=("ours", "hf", "compare"))
    p.add_argument("--out", required=True, help="folder for ids and logits (.npy)")
    p.add_argument("--gguf", default=None, help="the Gemma 3 GGUF (hf side: required)")
    p.add_argument("--prompt-file", default=str(ROOT / "docs/prompts/gemma3-long-qa.txt"))
    args = p.parse_args(argv)
    {"ours": ours, "hf": hf, "compare": compare}[args.side](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
