"""Hugging Face checkpoint directories of the five architectures (tiny, random, written by the test): load
through ``LLM(model=DIR)`` and match the project's dense (cache-free) reference forward in f32 over a prefill and
16 paged decode steps; config, tokenizer, chat template, EOS ids and default sampling come from the files;
bad checkpoints fail with messages naming the file and the tensor.

The reference model is built by :func:`models.decoder.from_weights` from the test's own ``x @ W`` arrays
(:func:`tests.models.hf_checkpoints.reference_weights`), not by the loader under test, and its config is written
out here by hand. The comparison against Hugging Face ``transformers`` itself is tests/models/test_hf_transformers.py
(opt-in extra ``hf-test``).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from jaxkv import SamplingParams
from models import engine_setup, registry
from models.decoder import from_weights
from models.decoder_config import GEMMA3, LLAMA, QWEN2, QWEN3, LlamaConfig, RopeScaling
from models.fused import member
from models.gemma3_config import Gemma3Config
from tests.models import hf_checkpoints as hfc

ARCHS = list(hfc.ARCHS)
PROMPTS = ["The capital of France is", "Hello"]
DECODE_STEPS = 16


def expected_config(arch: str, vocab: int):
    """``arch``'s tiny config.json as a jaxkv config, written out by hand."""
    common = dict(vocab_size=vocab, hidden_size=hfc.HIDDEN, intermediate_size=hfc.INTER, num_layers=hfc.LAYERS,
                  num_heads=hfc.HEADS, num_kv_heads=hfc.KV_HEADS, max_position_embeddings=128, bos_token_id=0,
                  eos_token_id=1, architecture=arch)
    if arch == "LlamaForCausalLM":
        return LlamaConfig(**common, head_size=16, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=True,
                           rope_scaling=RopeScaling(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=16),
                           arch=LLAMA)
    if arch == "Qwen2ForCausalLM":
        return LlamaConfig(**common, head_size=16, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           arch=QWEN2)
    if arch == "Qwen3ForCausalLM":
        return LlamaConfig(**common, head_size=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           arch=QWEN3)
    if arch == "MistralForCausalLM":
        return LlamaConfig(**common, head_size=16, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False,
                           sliding_window=8, arch=LLAMA)
    return Gemma3Config(**common, head_size=16, rope_theta=1e6, rope_local_base_freq=1e4, rms_norm_eps=1e-6,
                        query_pre_attn_scalar=24.0, sliding_window=8, sliding_window_pattern=2,
                        layer_types=("sliding_attention", "full_attention"), arch=GEMMA3)


@pytest.fixture(scope="module")
def tokenizer():
    return hfc.build_tokenizer()


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory, tokenizer):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    stored = hfc.write_checkpoint(d, arch, seed=ARCHS.index(arch), tokenizer=tokenizer)
    return arch, d, stored, json.loads((d / "config.json").read_text())


def test_loads_and_matches_the_dense_reference(checkpoint):
    """Prefill + 16 paged decode steps of two prompts (greedy), every step's logits vs a cache-free forward
    of the same weights (f32, 1e-4). Mistral's and Gemma's window (8) is shorter than the sequences (~22)."""
    arch, d, stored, cfg = checkpoint
    llm = models.LLM(d, dtype="float32", attention_impl="reference", max_model_len=64, num_gpu_blocks=24,
                     block_size=8, max_num_seqs=2, max_num_batched_tokens=32, num_scheduler_steps=DECODE_STEPS,
                     return_logits=True, max_admission_delay_steps=0)
    want = expected_config(arch, cfg["vocab_size"])
    assert llm.config == want
    default = llm.get_default_sampling_params()  # generation_config.json's
    assert (default.temperature, default.top_p, default.top_k) == (0.6, 0.9, -1)
    assert llm.engine.eos_token_ids == {1, 2}
    assert type(llm.model).__name__ == ("Gemma3ForCausalLM" if arch.startswith("Gemma") else "LlamaForCausalLM")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    ref = from_weights(want, hfc.reference_weights(stored, cfg), dtype=jnp.float32)
    seqs = [out.prompt_token_ids + out.outputs[0].token_ids for out in outs]
    width = max(map(len, seqs))  # one batch, right-padded (causal: padding cannot change earlier logits)
    ids = np.array([s + [0] * (width - len(s)) for s in seqs])
    dense_all = np.asarray(engine_setup.dense_logits(ref, ids, ids * 0 == 0))
    for out, dense in zip(outs, dense_all):
        c = out.outputs[0]
        assert out.prompt_token_ids[0] == 0  # BOS from tokenizer.json's post-processor
        assert c.logits.shape == (DECODE_STEPS + 1, cfg["vocab_size"])
        start = len(out.prompt_token_ids) - 1
        np.testing.assert_allclose(c.logits, dense[start:start + DECODE_STEPS + 1], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(c.token_ids, dense[start:start + DECODE_STEPS + 1].argmax(-1))
    if want.has_sliding_layers:  # sliding-window groups through the hybrid KV-cache manager
        assert any(type(g.kv_cache_spec).__name__ == "SlidingWindowSpec" for g in llm.engine.kv_cache_groups)


def test_tokenizer_files(tmp_path, tokenizer):
    """tokenizer.json ids, BOS from its post-processor, the chat template of tokenizer_config.json, EOS ids of
    generation_config.json + config.json, and its default sampling."""
    hfc.write_checkpoint(tmp_path, "Qwen2ForCausalLM", tokenizer=tokenizer, num_shards=1)
    tok = registry.load_tokenizer(registry.resolve_model(tmp_path))
    text = "The capital of France is Paris."
    assert tok.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True)[0] == tok.bos_token_id == 0
    assert tok.decode(tok.encode(text)) == text
    assert tok.stop_token_ids == {1, 2} and tok.eos_token_id == 1
    assert tok.vocab_size == tokenizer.get_vocab_size()
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<s><|user|>Hi<|eot|><|assistant|>"
    assert tok.generation_config == {"temperature": 0.6, "top_p": 0.9}


def test_tokenizer_directory_without_config(tmp_path, tokenizer):
    """vLLM's --tokenizer: a directory of tokenizer files only (no config.json), or its tokenizer.json path."""
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for source in (tmp_path, tmp_path / "tokenizer.json"):
        assert registry.resolve_tokenizer(source) == tmp_path
        tok = registry.load_tokenizer(registry.resolve_tokenizer(source))
        assert tok.encode("Paris.") == tokenizer.encode("Paris.", add_special_tokens=False).ids
    assert registry.resolve_tokenizer("smollm2-135m") == registry.resolve_model("smollm2-135m")
    with pytest.raises(ValueError, match=r"tokenizer='.*' is not a directory holding tokenizer.json.*without config"):
        registry.resolve_tokenizer(tmp_path / "..")


def test_bf16_checkpoint_into_bf16_model_keeps_the_bits(tmp_path, tokenizer):
    """A bfloat16 checkpoint loaded as bfloat16: every parameter holds exactly the stored bits (no f32 detour
    that rounds), norms in float32; on the one device."""
    cfg = hfc.hf_config("Qwen3ForCausalLM", tokenizer.get_vocab_size())
    stored = hfc.write_checkpoint(tmp_path, "Qwen3ForCausalLM", cfg=cfg, tokenizer=tokenizer, num_shards=2)
    config, weights, _ = registry.load_checkpoint(tmp_path)
    model = registry.build_model(config, weights, dtype="bfloat16")
    q = member(model.layers[1].self_attn, "q_proj").kernel[...]  # its columns of the fused q/k/v
    assert q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(q), stored["model.layers.1.self_attn.q_proj.weight"].T)
    kn = model.layers[0].self_attn.k_norm.scale[...]
    assert kn.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(kn), stored["model.layers.0.self_attn.k_norm.weight"].astype(np.float32))


def test_single_file_checkpoint_without_index(tmp_path, tokenizer):
    """``model.safetensors`` alone (no index) loads the same tensors."""
    stored = hfc.write_checkpoint(tmp_path, "LlamaForCausalLM", tokenizer=tokenizer, num_shards=1)
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model-00001-of-00001.safetensors").rename(tmp_path / "model.safetensors")
    config, weights, _ = registry.load_checkpoint(tmp_path)
    model = registry.build_model(config, weights, dtype="float32")
    np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.down_proj.kernel[...]),
                                  stored["model.layers.0.mlp.down_proj.weight"].T)
    # on one device every loader's parameters are uncommitted (no device sharding in the step programs):
    # committed ones cost 130 ms of host time per step's dispatch on an H200 (docs/perf-notes.md, session 15)
    dummy = registry.build_model(config, None, dtype="float32")
    for m in (model, dummy):
        assert not any(leaf.committed for leaf in jax.tree.leaves(nnx.state(m))), type(m)


def _load(d):
    config, weights, _ = registry.load_checkpoint(d)
    return registry.build_model(config, weights, dtype="float32")


def test_errors_name_the_file_and_the_tensor(tmp_path, tokenizer):
    d = tmp_path / "ckpt"
    hfc.write_checkpoint(d, "MistralForCausalLM", tokenizer=tokenizer)
    # unknown architecture: lists the known ones
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures=\['FalconForCausalLM'\] is not supported; known "
                                         r"architectures: \['Gemma3ForCausalLM', 'LlamaForCausalLM'"):
        models.LLM(d, dtype="float32", num_gpu_blocks=8)
    # a feature the model lacks: names the field and the value
    (d / "config.json").write_text(json.dumps(cfg | {"mlp_bias": True}))
    with pytest.raises(ValueError, match=r"config.json: mlp_bias=True is not supported for MistralForCausalLM"):
        registry.load_config(d)
    (d / "config.json").write_text(json.dumps(cfg))
    # a tensor of the wrong shape: names it, the file, both shapes
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    shard = index["weight_map"][name]
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(d / shard))
    tensors[name] = np.zeros((hfc.INTER, hfc.HIDDEN + 1), tensors[name].dtype)
    save_file(tensors, str(d / shard))
    with pytest.raises(ValueError, match=rf"tensor '{name}' in {shard} has shape \[128, 65\], expected \[128, 64\]"):
        _load(d)
    # a missing shard: names the shard file and the index
    (d / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard '{shard}' .* listed in .*model.safetensors.index.json "
                                                 "does not exist"):
        _load(d)
    # no tokenizer.json
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist"):
        registry.load_tokenizer(d)


def test_tensor_parallel_size_that_does_not_split_names_the_field(tmp_path, tokenizer):
    hfc.write_checkpoint(tmp_path, "Qwen2ForCausalLM", tokenizer=tokenizer, num_shards=1)
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by tensor_parallel_size=3"):
        from models.parallel import check_model_tensor_parallel
        check_model_tensor_parallel(registry.load_config(tmp_path), 3)


def test_llm_with_another_tokenizer(tmp_path, tokenizer):
    """LLM(tokenizer=...) (vLLM's): dummy weights of a bare config.json, a tokenizer-only directory beside them;
    prompts are encoded and outputs decoded with it. A tokenizer larger than the model's vocabulary is refused."""
    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    model_dir.mkdir()
    tok_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hfc.hf_config("LlamaForCausalLM", tokenizer.get_vocab_size())))
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    with models.LLM(model_dir, load_format="dummy", tokenizer=str(tok_dir), dtype="float32",
                    attention_impl="reference", enable_multiprocessing=False, num_gpu_blocks=16,
                    max_model_len=64) as llm:
        prompt = "The capital of France"
        assert llm.tokenizer.encode(prompt) == tokenizer.encode(prompt, add_special_tokens=False).ids
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert out.prompt_token_ids[0] == 0  # BOS from the given tokenizer.json's post-processor
        assert len(out.outputs[0].token_ids) == 4
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
    (model_dir / "config.json").write_text(json.dumps(hfc.hf_config("LlamaForCausalLM", 100)))
    with pytest.raises(ValueError, match=r"tok'? has \d+ tokens, more than the model's vocab_size=100"):
        models.LLM(model_dir, load_format="dummy", tokenizer=str(tok_dir), enable_multiprocessing=False)
