"""``load_format="dummy"`` (vLLM's ``--load-format dummy``) from a header-only GGUF
(``scripts/make_header_gguf.py``): same config, tokenizer and cache geometry as the real checkpoint,
random weights; what GPU speed runs use instead of carrying the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

import models
from jaxkv import SamplingParams
from models import registry
from models.dummy import dummy_model
from tests.conftest import load_script, slow
from tests.models.test_llama_paged import TINY, _tiny_model


def _script():
    return load_script("make_header_gguf")


@pytest.fixture(scope="module")
def header(gguf_path, tmp_path_factory):
    dst = tmp_path_factory.mktemp("hdr") / "smollm2-header.gguf"
    _script().write_header_gguf(str(gguf_path), str(dst))
    return dst


def test_header_copy_keeps_every_key_and_no_tensor(gguf_path, gguf_reader, header):
    src, dst = gguf_reader, registry.open_gguf(header)   # the readers LLM(...) uses (parsed once)
    keys = lambda r: {k for k in r.fields if not k.startswith("GGUF.")}  # noqa: E731
    assert keys(dst) == keys(src)
    for k in ("general.architecture", "llama.block_count", "tokenizer.ggml.tokens"):
        assert dst.fields[k].contents() == src.fields[k].contents(), k
    assert len(dst.tensors) == 0 and len(src.tensors) > 0
    assert header.stat().st_size < gguf_path.stat().st_size / 10


def test_dummy_llm_has_the_real_geometry_and_generates(gguf_path, gguf_reader, header):
    real = registry.load_config(gguf_path)
    # the engine options of test_smollm2_generate.py's LLM: the same step programs (compiled once a run)
    llm = models.LLM(header, load_format="dummy", dtype="float32", attention_impl="reference",
                     max_model_len=64, num_gpu_blocks=16, max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.config == real
    assert llm.tokenizer.encode("The capital of France is") == \
        models.GGUFTokenizer.from_gguf(gguf_reader).encode("The capital of France is")
    outs = llm.generate(["The capital of France is", "Hi"], SamplingParams(max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert all(0 <= t < real.vocab_size for o in outs for t in o.outputs[0].token_ids)
    assert llm.model.embed_tokens.embedding[...].shape == (real.vocab_size, real.hidden_size)


def test_unknown_load_format_is_refused(gguf_path):
    with pytest.raises(ValueError, match="load_format='safetensors'"):
        registry.load_checkpoint(gguf_path, load_format="safetensors")
    with pytest.raises(ValueError, match="load_format='safetensors'"):
        models.LLM(gguf_path, load_format="safetensors", dtype="float32", num_gpu_blocks=4)


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2-dummy", marks=slow)])
def test_block_size_64_gives_the_tokens_of_block_size_16(request, model):
    """The Pallas backend's larger pages (64, 128: covered by the kernels' compiled fuzz) through the whole
    engine: greedy tokens of a small batch equal those with 16-token blocks (same random weights). By
    default on the tiny random Llama of test_llama_paged.py, whose logits must agree as well; with
    ``JAXKV_SLOW=1`` also through ``LLM(load_format="dummy")`` at SmolLM2's geometry."""
    prompts = [list(range(5, 75)), list(range(100, 103)), list(range(7, 40))]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    got, logits = {}, {}
    for block_size in (16, 64):
        if model == "tiny":
            eng = models.make_engine(_tiny_model(), attention_impl="reference", block_size=block_size,
                                     num_blocks=2048 // block_size, max_model_len=128, max_num_seqs=4,
                                     max_num_batched_tokens=64, return_logits=True)
            outs = eng.generate([[t % TINY.vocab_size for t in p] for p in prompts], greedy)
            logits[block_size] = [o.outputs[0].logits for o in outs]
        else:
            llm = models.LLM(request.getfixturevalue("header"), load_format="dummy", dtype="float32",
                             attention_impl="reference", max_model_len=128, num_gpu_blocks=2048 // block_size,
                             max_num_seqs=4, max_num_batched_tokens=64, block_size=block_size)
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        got[block_size] = [o.outputs[0].token_ids for o in outs]
    assert got[64] == got[16] and all(len(t) == 6 for t in got[16])
    assert len(logits.get(64, [])) == len(logits.get(16, [])) == (3 if model == "tiny" else 0)
    for a, b in zip(logits.get(64, []), logits.get(16, [])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dummy_init_compiles_per_distinct_shape_not_per_layer(monkeypatch):
    """The on-device dummy init makes one small program per distinct (shape, dtype, kind): a 2-layer and a
    6-layer model compile the same number (one whole-model program took minutes to compile on a GPU), and
    the values follow the documented initialisers (checked against NumPy statistics)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import models.dummy
    from models import hf_config

    base = dataclasses.replace(hf_config.builtin_config("qwen2.5-7b"), hidden_size=64, intermediate_size=128,
                               num_heads=4, num_kv_heads=2, head_size=16, vocab_size=256)
    counts, real_jit = [], jax.jit

    def counting_jit(fn, **kw):
        counts[-1] += 1
        return real_jit(fn, **kw)

    monkeypatch.setattr(models.dummy.jax, "jit", counting_jit)
    built = {}
    for layers in (2, 6):
        counts.append(0)
        built[layers] = dummy_model(dataclasses.replace(base, num_layers=layers), dtype=jnp.float32)
    assert 4 <= counts[0] == counts[1] <= 10, counts  # one program per distinct parameter shape and kind
    m = built[6]
    attn = m.layers[5].self_attn
    np.testing.assert_array_equal(np.asarray(m.layers[3].input_layernorm.scale[...]), np.ones(64))
    np.testing.assert_array_equal(np.asarray(attn.q_proj.bias[...]), np.zeros(64))
    kernel = np.asarray(m.layers[5].mlp.down_proj.kernel[...], np.float64)  # (128, 64): fan_in 128
    assert abs(kernel.std() - 128 ** -0.5) < 0.1 * 128 ** -0.5 and abs(kernel.mean()) < 0.01
    emb = np.asarray(m.embed_tokens.embedding[...], np.float64)  # (256, 64): fan_in = hidden 64
    assert abs(emb.std() - 64 ** -0.5) < 0.1 * 64 ** -0.5
    # distinct keys per parameter: two layers' same-shaped kernels differ
    assert not np.array_equal(np.asarray(m.layers[0].mlp.up_proj.kernel[...]), np.asarray(m.layers[1].mlp.up_proj.kernel[...]))
