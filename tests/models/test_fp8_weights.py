"""fp8 weights (issue 45 item 2; :mod:`models.quantization`): the quantizers and the scaled fp8 Linear against
NumPy float64, compressed-tensors checkpoints written here (``F8_E4M3`` through the safetensors header), online
quantization of float checkpoints and of dummy weights, tensor-parallel placement, config errors, and SmolLM2's
fp8 model against its bf16 model.

References are independent of the code under test: NumPy float64 quantization and products
(``tests/models/hf_checkpoints.py`` quantizes the checkpoints), the stored arrays, the unquantized model.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import models
from jaxkv import SamplingParams
from models import engine_setup, registry
from models.decoder import from_weights
from models.entrypoints.engine_args import EngineArgs
from models.fused import member
from models.parallel import partition_spec
from models.quantization import (
    FP8_MIN_SCALE,
    Fp8Activation,
    Fp8Config,
    fp8_config_from_hf,
    fp8_linear,
    quantize_per_token,
    quantize_static,
    quantize_weight,
    resolve_quantization,
    rms_norm_quantize_per_token,
)
from tests.models import hf_checkpoints as hfc

F8 = ml_dtypes.float8_e4m3fn


def np_quantize_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 NumPy: per-row ``s = max(amax / 448, 1/(448*512))``, ``q = e4m3(clip(a / s, ±448))``."""
    a64 = np.asarray(a, np.float64)
    s = np.maximum(np.abs(a64).max(axis=-1) / 448.0, 1.0 / (448.0 * 512.0))
    return np.clip(a64 / s[..., None], -448.0, 448.0).astype(F8), s


def assert_fp8_match(got: np.ndarray, want: np.ndarray) -> None:
    """fp8 arrays equal but for rounding ties: where ``w * 448 / amax`` is exactly half-way between two e4m3
    values (bf16 inputs, whose short mantissas make exact ties common), the code's f32 scale and the reference's
    float64 scale, both inexact (``/ 448``), round it to either neighbour. Measured on the bf16 projections of 5
    random Qwen3 checkpoints: 384 of 491,520 values differ, every one an exact tie (checked with ``fractions``).
    So: at most 1 % of the elements differ, each by one step of the format (adjacent bit patterns, same sign)."""
    g, w = np.asarray(got).view(np.uint8).astype(int), np.asarray(want).view(np.uint8).astype(int)
    diff = g != w
    assert diff.mean() <= 1e-2, f"{diff.sum()} of {diff.size} fp8 values differ"
    assert (np.abs(g - w)[diff] == 1).all() and ((g ^ w)[diff] & 0x80 == 0).all()


def _weights(rng, out=48, inp=64):
    """Rows of very different magnitudes, a zero row, and an outlier."""
    w = rng.standard_normal((out, inp)) * np.exp(rng.uniform(-6, 3, (out, 1)))
    w[3] = 0.0
    w[5, 7] = 1e4
    return w.astype(np.float32)


# -- quantizers ------------------------------------------------------------------------------------------------
def test_weight_quantizer_per_channel_matches_numpy(rng):
    w = _weights(rng)
    q, s = jax.device_get(quantize_weight(jnp.asarray(w)))
    want_q, want_s = np_quantize_rows(w)
    assert q.dtype == F8 and q.shape == w.shape and s.dtype == np.float32 and s.shape == (w.shape[0],)
    np.testing.assert_allclose(s, want_s, rtol=3e-7)  # 2 f32 ulps: XLA multiplies by 1/448
    assert s[3] == np.float32(FP8_MIN_SCALE) and not q[3].astype(np.float32).any()  # zero row: zeros, no NaN
    np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))  # round to nearest even, bit for bit
    qf = q.astype(np.float64)
    assert np.isfinite(qf).all() and np.abs(qf).max(axis=1)[np.abs(w).max(1) > 0].min() == 448.0
    # round trip: e4m3 keeps 3 mantissa bits, half a step is <= 2^-4 of the value (normals; 2^-10 x s subnormal)
    deq = qf * s[:, None].astype(np.float64)
    err = np.abs(deq - w)
    assert (err <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s[:, None] * (1 + 1e-6)).all()
    # per tensor: one amax for the whole weight
    q_t, s_t = jax.device_get(quantize_weight(jnp.asarray(w), "tensor"))
    np.testing.assert_allclose(s_t, np.full(w.shape[0], np.abs(w.astype(np.float64)).max() / 448.0), rtol=3e-7)
    np.testing.assert_array_equal(q_t.view(np.uint8),
                                  np.clip(w / np.float64(s_t[0]), -448, 448).astype(F8).view(np.uint8))
    with pytest.raises(ValueError, match="strategy='block' is not one of"):
        quantize_weight(jnp.asarray(w), "block")


def test_activation_quantizers_per_token_static_saturation_zero_rows(rng):
    x = rng.standard_normal((6, 40)).astype(np.float32) * np.array([1e-4, 1, 30, 1, 1, 1], np.float32)[:, None]
    x[4] = 0.0
    x_bf16 = jnp.asarray(x, jnp.bfloat16)
    for arr in (jnp.asarray(x), x_bf16):
        q, s = jax.device_get(quantize_per_token(arr))
        want_q, want_s = np_quantize_rows(np.asarray(arr.astype(jnp.float32)))
        np.testing.assert_allclose(s, want_s, rtol=3e-7)
        assert_fp8_match(q, want_q)
        assert s[4] == np.float32(FP8_MIN_SCALE) and not q[4].astype(np.float32).any()
    # leading dimensions: one scale per token
    q3, s3 = jax.device_get(quantize_per_token(jnp.asarray(x.reshape(2, 3, 40))))
    assert s3.shape == (2, 3) and q3.shape == (2, 3, 40)
    # static per-tensor scale: values past 448 x scale saturate to +-448 (XLA's convert alone would give NaN)
    scale = np.float32(0.01)
    qs = np.asarray(quantize_static(jnp.asarray(x), jnp.asarray(scale)).astype(jnp.float32))
    want = np.clip(x.astype(np.float64) / np.float64(scale), -448, 448).astype(F8).astype(np.float32)
    np.testing.assert_array_equal(qs, want)
    assert np.isfinite(qs).all() and qs.max() == 448.0 and qs.min() == -448.0


def test_rms_norm_quantize_per_token_matches_float64(rng):
    """The norm's fused quantization against float64 NumPy: ``rms_norm`` then per-token quantization, rows of
    very different magnitudes (bf16 and f32), a zero row; an fp8 Linear takes the result as it is."""
    x = rng.standard_normal((2, 6, 64)).astype(np.float32) * np.exp(rng.uniform(-8, 8, (2, 6, 1))).astype(np.float32)
    x[1, 3] = 0.0
    w = rng.uniform(0.2, 3.0, 64).astype(np.float32)
    w[5] = -2.0  # the absmax is of |x * w|: a negative weight counts by its magnitude
    eps = 1e-5
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = jnp.asarray(x, dtype)
        x64 = np.asarray(xd.astype(jnp.float32), np.float64)
        normed = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * w
        want_q, want_s = np_quantize_rows(normed)
        got = jax.jit(rms_norm_quantize_per_token, static_argnums=2)(xd, jnp.asarray(w), eps)
        assert isinstance(got, Fp8Activation) and got.dtype == dtype and got.shape == x.shape
        np.testing.assert_allclose(np.asarray(got.scale), want_s, rtol=2e-6)
        assert_fp8_match(np.asarray(got.q), want_q)
        assert got.scale[1, 3] == np.float32(FP8_MIN_SCALE) and not np.asarray(got.q[1, 3], np.float32).any()
        # the Linear takes it where it took the activations: the same product as quantizing the f32 norm itself
        w_q, s_w = np_quantize_rows(_weights(rng, 16, 64))
        y = fp8_linear(got, jnp.asarray(w_q), jnp.asarray(s_w, jnp.float32))
        y_ref = fp8_linear(jnp.asarray(normed, jnp.float32), jnp.asarray(w_q), jnp.asarray(s_w, jnp.float32))
        assert y.dtype == dtype and y.shape == (2, 6, 16)
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=2 ** -7,
                                   atol=2 ** -7 * float(np.abs(y_ref).max()))
    with pytest.raises(ValueError, match="static input_scale"):
        fp8_linear(got, jnp.asarray(w_q), jnp.asarray(s_w, jnp.float32), input_scale=jnp.float32(0.1))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_fp8_linear_matches_float64_formula(rng, static):
    """``y = (x_q @ w_q^T) * s_x[:, None] * s_w[None, :] + b`` against float64 NumPy, [batch, seq, in] bf16 and
    f32 activations, with a zero token."""
    w = _weights(rng, 24, 64)
    w_q, s_w = np_quantize_rows(w)
    bias = rng.standard_normal(24).astype(np.float32)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    x[1, 2] = 0.0
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = jnp.asarray(x, dtype)
        x64 = np.asarray(xd.astype(jnp.float32), np.float64)
        if static:
            s_x = np.float64(np.float32(0.02))
            x_q = np.clip(x64 / s_x, -448, 448).astype(F8)
            want = (x_q.astype(np.float64) @ w_q.astype(np.float64).T) * s_x * s_w + bias
            got = fp8_linear(xd, jnp.asarray(w_q), jnp.asarray(s_w, jnp.float32), bias=jnp.asarray(bias),
                             input_scale=jnp.float32(0.02))
        else:
            x_q, s_x = np_quantize_rows(x64)
            want = (x_q.astype(np.float64) @ w_q.astype(np.float64).T) * s_x[..., None] * s_w + bias
            got = fp8_linear(xd, jnp.asarray(w_q), jnp.asarray(s_w, jnp.float32), bias=jnp.asarray(bias))
        assert got.dtype == dtype and got.shape == (2, 5, 24)
        tol = 1e-5 if dtype == jnp.float32 else 2 ** -8  # bf16 output: one rounding of the result
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol * np.abs(want).max())
        if not static:
            np.testing.assert_allclose(np.asarray(got.astype(jnp.float32))[1, 2], bias, rtol=tol)  # zero token


def test_fp8_gemm_writing_the_output_dtype(rng, monkeypatch):
    """By default (``$JAXKV_FP8_GEMM_OUT=out``) the GEMM writes bf16 for bf16 activations (one more rounding before
    the scales) and the Linear stays within two bf16 roundings of the float64 formula; ``f32`` writes f32."""
    w = _weights(rng, 24, 64)
    w_q, s_w = np_quantize_rows(w)
    x = rng.standard_normal((7, 64)).astype(np.float32)
    x_q, s_x = np_quantize_rows(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64))
    want = (x_q.astype(np.float64) @ w_q.astype(np.float64).T) * s_x[:, None] * s_w
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(w_q), jnp.asarray(s_w))
    lower_text = lambda: jax.jit(lambda *a: fp8_linear(*a)).lower(*args).as_text()  # noqa: E731 (a new trace)
    monkeypatch.setenv("JAXKV_FP8_GEMM_OUT", "out")
    hlo = lower_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1 and dots[0].endswith("-> tensor<7x24xbf16>")  # the dot itself writes bf16
    got = np.asarray(fp8_linear(*args), np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())
    monkeypatch.setenv("JAXKV_FP8_GEMM_OUT", "f32")
    hlo = lower_text()
    assert [line for line in hlo.splitlines() if "stablehlo.dot_general" in line][0].endswith("-> tensor<7x24xf32>")


# -- configs and errors ------------------------------------------------------------------------------------------
def test_quantization_configs_and_their_errors():
    assert fp8_config_from_hf(hfc.fp8_quantization_config("channel")) == Fp8Config(checkpoint_fp8=True)
    assert fp8_config_from_hf(hfc.fp8_quantization_config("tensor", static=True)) == Fp8Config(
        weight_strategy="tensor", activation_scheme="static", checkpoint_fp8=True)
    assert fp8_config_from_hf({"quant_method": "fp8", "activation_scheme": "static"}) == Fp8Config(
        weight_strategy="tensor", activation_scheme="static", checkpoint_fp8=True)
    qc = hfc.fp8_quantization_config()
    qc["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$", "model.layers.0.self_attn.o_proj"]
    cfg = fp8_config_from_hf(qc)
    assert not cfg.quantizes(1, "down_proj") and not cfg.quantizes(0, "o_proj")
    assert cfg.quantizes(0, "down_proj") and cfg.quantizes(1, "o_proj")

    def bad(change, match):
        qc = hfc.fp8_quantization_config()
        change(qc)
        with pytest.raises(ValueError, match=match):
            fp8_config_from_hf(qc, source="ckpt/config.json")

    g = "config_groups.group_0"
    bad(lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"),
        rf"ckpt/config.json: quantization_config.{g}.weights.strategy='block' is not supported")
    bad(lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), rf"{g}.weights.num_bits=4")
    bad(lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"), rf"{g}.weights.type='int'")
    bad(lambda q: q["config_groups"]["group_0"].update(input_activations=None),
        rf"{g}.input_activations=None is not supported \(weight-only")
    bad(lambda q: q.update(kv_cache_scheme={"num_bits": 8}),
        "quantization_config.kv_cache_scheme.type=None is not supported")
    bad(lambda q: q.update(quant_method="gptq"), "quantization_config.quant_method='gptq' is not supported")
    bad(lambda q: q.update(quant_method="fp8", weight_block_size=[128, 128]),
        r"quantization_config.weight_block_size=\[128, 128\]")
    for q in ("int8", "fp8_e5m2", "none"):
        with pytest.raises(ValueError, match=f"quantization='{q}' is not one of"):
            resolve_quantization(q)
        with pytest.raises(ValueError, match=f"quantization='{q}' is not one of"):
            EngineArgs(quantization=q)
    assert resolve_quantization(None) is None and resolve_quantization("fp8") == Fp8Config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization is None
    with pytest.raises(ValueError, match="activation_scheme='static' needs calibrated input scales"):
        Fp8Config(activation_scheme="static")


def test_fp8_partition_specs():
    """Column-parallel weights [out, in] split their rows and scales; row-parallel split columns, scales whole."""
    c = hfc_config()

    def spec(*names):
        return partition_spec(tuple(jax.tree_util.GetAttrKey(n) if isinstance(n, str) else
                                    jax.tree_util.SequenceKey(n) for n in names), c, 2)
    for lin in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        parent = "mlp" if lin in ("gate_proj", "up_proj") else "self_attn"
        assert spec("layers", 0, parent, lin, "weight") == P("tp", None)
        assert spec("layers", 0, parent, lin, "weight_scale") == P("tp")
    for lin, parent in (("o_proj", "self_attn"), ("down_proj", "mlp")):
        assert spec("layers", 1, parent, lin, "weight") == P(None, "tp")
        assert spec("layers", 1, parent, lin, "weight_scale") == P()
    assert spec("layers", 0, "self_attn", "q_proj", "input_scale") == P()
    c4 = c.replace(num_kv_heads=1, num_heads=4)  # fewer KV heads than tp: k/v replicated
    assert partition_spec((jax.tree_util.GetAttrKey("layers"), jax.tree_util.SequenceKey(0),
                           jax.tree_util.GetAttrKey("self_attn"), jax.tree_util.GetAttrKey("k_proj"),
                           jax.tree_util.GetAttrKey("weight_scale")), c4, 2) == P()


def hfc_config():
    from models.decoder_config import LlamaConfig
    return LlamaConfig(vocab_size=96, hidden_size=hfc.HIDDEN, intermediate_size=hfc.INTER, num_layers=hfc.LAYERS,
                       num_heads=hfc.HEADS, num_kv_heads=hfc.KV_HEADS, head_size=16)


# -- checkpoints --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return hfc.build_tokenizer()


def _reference_model(config, stored, cfg, quantization):
    """The dense reference of an fp8 checkpoint built from the stored arrays by hand: unquantized tensors through
    :func:`hf_checkpoints.reference_weights`, every projection's fp8 weight / scales set as stored."""
    floats = {k: v for k, v in stored.items() if v.dtype != hfc.FP8 and not k.endswith("_scale")}
    for k, v in stored.items():  # placeholders of the right shape, replaced below
        if v.dtype == hfc.FP8:
            floats[k] = v.astype(np.float32)
    model = from_weights(config, hfc.reference_weights(floats, cfg), dtype=jnp.float32, quantization=quantization)
    for i in range(config.num_layers):
        for stem in hfc.PROJECTIONS:
            parent, name = stem.split(".")
            lin = getattr(getattr(model.layers[i], parent), name)
            p = f"model.layers.{i}.{stem}."
            lin.weight.set_value(jnp.asarray(stored[p + "weight"]))
            lin.weight_scale.set_value(jnp.broadcast_to(jnp.asarray(stored[p + "weight_scale"]).reshape(-1),
                                                        (lin.out_features,)))
            if quantization.static_input_scale:
                lin.input_scale.set_value(jnp.asarray(stored[p + "input_scale"]).reshape(()))
    return model


@pytest.mark.parametrize("arch,strategy,input_scale", [("LlamaForCausalLM", "channel", None),
                                                       ("Qwen2ForCausalLM", "tensor", 0.02),
                                                       ("Gemma3ForCausalLM", "channel", None)],
                         ids=["llama-channel-dynamic", "qwen2-tensor-static", "gemma3-channel-dynamic"])
def test_fp8_checkpoint_loads_and_matches_the_reference(tmp_path, tokenizer, arch, strategy, input_scale):
    """A compressed-tensors checkpoint (F8_E4M3 + scales, written here): every fp8 parameter holds the stored bits
    (read through the header), the scales the stored values. Llama through ``LLM(model=DIR)``: prefill + 8 paged
    decode steps match the dense forward of a model built from the stored arrays by hand; Qwen 2 (q/k/v bias,
    per-tensor weights, static input scales) and Gemma 3 (sandwich norms, GeGLU) loaded alone: their dense logits
    equal that reference's."""
    stored, cfg = hfc.write_fp8_checkpoint(tmp_path, arch, strategy=strategy, input_scale=input_scale,
                                           tokenizer=tokenizer, seed=3)
    name = "model.layers.1.self_attn.k_proj"
    header = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    try:  # the files read as fp8 by an independent reader too
        import torch
        from safetensors import safe_open
        with safe_open(str(tmp_path / header[name + ".weight"]), framework="pt") as f:
            t = f.get_tensor(name + ".weight")
        assert t.dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(t.view(torch.uint8).numpy(), stored[name + ".weight"].view(np.uint8))
    except ImportError:
        pass
    engine = arch == "LlamaForCausalLM"
    if engine:
        llm = models.LLM(tmp_path, dtype="float32", attention_impl="reference", max_model_len=64, num_gpu_blocks=16,
                         block_size=8, max_num_seqs=2, max_num_batched_tokens=32, num_scheduler_steps=8,
                         return_logits=True, max_admission_delay_steps=0)
        model, config = llm.model, llm.config
    else:
        config, weights, _ = registry.load_checkpoint(tmp_path)
        model = registry.build_model(config, weights, dtype="float32")
    want_q = Fp8Config(weight_strategy=strategy, activation_scheme="static" if input_scale else "dynamic",
                       checkpoint_fp8=True)
    assert model.quantization == want_q
    for i in range(hfc.LAYERS):
        for stem in hfc.PROJECTIONS:
            parent, proj = stem.split(".")
            lin = member(getattr(model.layers[i], parent), proj)  # q/k/v and gate/up are fused (models.fused)
            p = f"model.layers.{i}.{stem}."
            got = np.asarray(lin.weight[...])
            assert got.dtype == F8
            np.testing.assert_array_equal(got.view(np.uint8), stored[p + "weight"].view(np.uint8))
            np.testing.assert_array_equal(np.asarray(lin.weight_scale[...]),
                                          np.broadcast_to(stored[p + "weight_scale"].reshape(-1), (lin.out_features,)))
            if input_scale:
                assert float(lin.input_scale[...]) == np.float32(input_scale)
    assert model.embed_tokens.embedding[...].dtype == jnp.float32  # not quantized: embedding, LM head, norms
    if not cfg["tie_word_embeddings"]:
        assert model.lm_head.kernel[...].dtype == jnp.float32
    ref = _reference_model(config, stored, cfg, want_q)
    if not engine:
        ids = np.arange(40).reshape(2, 20) * 7 % config.vocab_size
        # equal products; the norms' fused quantization reduces in another XLA fusion in the fused model's program
        # than in the reference's, so the f32 sums may round apart (1.4e-6 seen)
        got, want = np.asarray(engine_setup.dense_logits(model, ids)), np.asarray(engine_setup.dense_logits(ref, ids))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
        return
    steps = 8
    outs = llm.generate(["The capital of France is", "Hello"], SamplingParams(max_tokens=steps + 1, temperature=0,
                                                                              ignore_eos=True), use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    width = max(map(len, seqs))
    ids = np.array([s + [0] * (width - len(s)) for s in seqs])
    dense = np.asarray(engine_setup.dense_logits(ref, ids))
    for out, d in zip(outs, dense):
        start = len(out.prompt_token_ids) - 1
        # the same fp8 products; the paged and the dense attention differ in f32 rounding only
        np.testing.assert_allclose(out.outputs[0].logits, d[start:start + steps + 1], rtol=2e-4, atol=2e-4)
        np.testing.assert_array_equal(out.outputs[0].token_ids, d[start:start + steps + 1].argmax(-1))


def test_online_fp8_of_a_float_checkpoint(tmp_path, tokenizer):
    """``quantization="fp8"`` on a bf16 HF checkpoint: every projection is the float64 NumPy per-channel
    quantization of its stored weight; the same directory without the flag loads unquantized."""
    stored = hfc.write_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer=tokenizer, num_shards=2)
    config, weights, _ = registry.load_checkpoint(tmp_path)
    model = registry.build_model(config, weights, dtype="bfloat16", quantization="fp8")
    assert model.quantization == Fp8Config()
    for stem in hfc.PROJECTIONS:
        parent, proj = stem.split(".")
        lin = member(getattr(model.layers[1], parent), proj)
        want_q, want_s = np_quantize_rows(stored[f"model.layers.1.{stem}.weight"].astype(np.float32))
        assert_fp8_match(np.asarray(lin.weight[...]), want_q)
        np.testing.assert_allclose(np.asarray(lin.weight_scale[...]), want_s, rtol=3e-7)
    assert model.layers[0].self_attn.q_norm.scale[...].dtype == jnp.float32
    plain = registry.build_model(config, weights, dtype="bfloat16")
    assert not hasattr(plain, "quantization")
    assert member(plain.layers[0].mlp, "up_proj").kernel[...].dtype == jnp.bfloat16


def test_fp8_checkpoint_kv_cache_scales(tmp_path, tokenizer, caplog):
    """A ``kv_cache_scheme`` checkpoint: each layer's ``k_scale`` / ``v_scale`` load, and an fp8 cache holds
    e4m3(k / k_scale), e4m3(v / v_scale). Against the same checkpoint without the scheme (scales 1): with k_scale 0.5
    and v_scale 0.25 every cached value in e4m3's normal range is exactly 2x / 4x the unscaled cache's, and the
    logits agree (dequantized with the scales; only values below e4m3's normal range round differently). A bf16
    cache leaves the scales unused, with a warning. A scheme jaxkv does not run names its field."""
    common = dict(dtype="float32", attention_impl="reference", max_model_len=64, num_gpu_blocks=16, block_size=8,
                  max_num_seqs=2, max_num_batched_tokens=32, return_logits=True, enable_multiprocessing=False)
    stored, cfg = hfc.write_fp8_checkpoint(tmp_path / "kv", "LlamaForCausalLM", tokenizer=tokenizer,
                                           kv_scales=(0.5, 0.25))
    hfc.write_fp8_checkpoint(tmp_path / "plain", "LlamaForCausalLM", tokenizer=tokenizer)
    prompts = ["The capital of France is", "Hello"]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    runs = {}
    for name in ("kv", "plain"):
        llm = models.LLM(tmp_path / name, kv_cache_dtype="fp8", **common)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        runs[name] = (llm, outs, [np.asarray(c).astype(np.float32) for c in llm.engine.kv_caches])
    attn = runs["kv"][0].model.layers[1].self_attn
    assert float(attn.k_scale[...]) == 0.5 and float(attn.v_scale[...]) == 0.25
    assert runs["kv"][0].model.quantization.kv_cache_scales
    normal = 2.0 ** -6  # e4m3's smallest normal magnitude
    # layer 0's K and V are the same in both runs (the embeddings' projections; later layers see attention outputs
    # that subnormal rounding moved a little)
    scaled, plain = runs["kv"][2][0], runs["plain"][2][0]
    for kv, factor in ((0, 2.0), (1, 4.0)):   # the cache's leading axis: K, V
        a, b = scaled[kv], plain[kv]
        ok = (np.abs(b) >= normal) & (np.abs(b) * factor <= 448.0)
        assert ok.sum() > 300
        np.testing.assert_array_equal(a[ok], factor * b[ok])
    # against the dense forward (no cache, K/V unquantized) along each run's own tokens: both runs carry the same
    # e4m3 rounding error (power-of-two scales move exponents only), while a scale missing on either side of the
    # cache would put a factor of 2 or 4 into K or V
    errs = {}
    for name, (llm, outs, _) in runs.items():
        seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        width = max(map(len, seqs))
        dense = np.asarray(engine_setup.dense_logits(llm.model, np.array([q + [0] * (width - len(q)) for q in seqs])))
        errs[name] = max(np.abs(o.outputs[0].logits - d[len(o.prompt_token_ids) - 1:][:4]).max()
                         for o, d in zip(outs, dense))
    between = max(np.abs(a.outputs[0].logits - b.outputs[0].logits).max()
                  for a, b in zip(runs["kv"][1], runs["plain"][1]))
    assert errs["kv"] < 1.25 * errs["plain"] and between < 0.5 * errs["plain"], (errs, between)
    with caplog.at_level("WARNING"):
        models.LLM(tmp_path / "kv", **common)
    assert "kv_cache_scheme" in caplog.text and "kv_cache_dtype='fp8'" in caplog.text
    bad = cfg["quantization_config"] | {"kv_cache_scheme": dict(hfc.KV_CACHE_SCHEME, dynamic=True)}
    with pytest.raises(ValueError, match=r"quantization_config.kv_cache_scheme.dynamic=True is not supported"):
        fp8_config_from_hf(bad)


def test_bad_fp8_checkpoints_name_the_tensor(tmp_path, tokenizer):
    stored, cfg = hfc.write_fp8_checkpoint(tmp_path, "LlamaForCausalLM", tokenizer=tokenizer, num_shards=1)
    shard = tmp_path / "model-00001-of-00001.safetensors"
    name = "model.layers.0.mlp.up_proj"
    # a projection stored in bf16 where quantization_config makes it fp8
    hfc.write_safetensors(shard, stored | {name + ".weight": stored[name + ".weight"].astype(ml_dtypes.bfloat16)})
    with pytest.raises(ValueError, match=rf"tensor '{name}.weight' in {shard.name} has dtype BF16, expected F8_E4M3"):
        registry.build_model(*registry.load_checkpoint(tmp_path)[:2], dtype="float32")
    # a scale of the wrong shape
    hfc.write_safetensors(shard, stored | {name + ".weight_scale": np.ones((hfc.INTER, 2), np.float32)})
    with pytest.raises(ValueError, match=rf"tensor '{name}.weight_scale' .* has shape \[128, 2\], expected \[out, 1\]"):
        registry.build_model(*registry.load_checkpoint(tmp_path)[:2], dtype="float32")
    # an unsupported quantization_config: names the file and the field
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"quantization_config": cfg["quantization_config"] | {
        "quant_method": "awq"}}))
    with pytest.raises(ValueError, match=r"config.json: quantization_config.quant_method='awq' is not supported"):
        models.LLM(tmp_path, dtype="float32", num_gpu_blocks=8)


def test_dummy_fp8_is_the_dummy_model_quantized():
    """``load_format="dummy"`` + fp8: each projection is the float64 NumPy quantization of the kernel the
    unquantized dummy model draws (same seed)."""
    from models.dummy import dummy_model
    c = hfc_config()
    plain = dummy_model(c, dtype=jnp.float32, seed=5)
    fp8 = dummy_model(c, dtype=jnp.float32, seed=5, quantization=Fp8Config())
    for i in range(c.num_layers):
        for stem in hfc.PROJECTIONS:
            parent, proj = stem.split(".")
            kernel = np.asarray(getattr(getattr(plain.layers[i], parent), proj).kernel[...])
            lin = getattr(getattr(fp8.layers[i], parent), proj)
            want_q, want_s = np_quantize_rows(kernel.T)
            assert_fp8_match(np.asarray(lin.weight[...]), want_q)
            np.testing.assert_allclose(np.asarray(lin.weight_scale[...]), want_s, rtol=3e-7)
    with pytest.raises(ValueError, match="activation_scheme='static' needs a checkpoint's input scales"):
        dummy_model(c, quantization=Fp8Config(activation_scheme="static", checkpoint_fp8=True))


# -- tensor parallelism (2 CPU devices, in a subprocess) -----------------------------------------------------------
_TP_SCRIPT = r"""
import sys, numpy as np, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxkv.parallel.mesh import make_mesh
from models import engine_setup
from models.dummy import dummy_model
from models.hf_loader import load_hf_weights
from models.hf_config import load_hf_config
from models.quantization import Fp8Config
from tests.models import hf_checkpoints as hfc
assert jax.device_count() == 2
mesh = make_mesh(2, 1)
ckpt = sys.argv[1]
config = load_hf_config(ckpt)
fp8 = Fp8Config(checkpoint_fp8=True)
one = load_hf_weights(ckpt, config, dtype=jnp.float32, quantization=fp8)
tp = load_hf_weights(ckpt, config, dtype=jnp.float32, quantization=fp8, mesh=mesh)
a0 = tp.layers[0].self_attn
assert a0.q_proj.weight[...].sharding.spec == P("tp", None) and a0.q_proj.weight_scale[...].sharding.spec == P("tp")
assert a0.o_proj.weight[...].sharding.spec == P(None, "tp") and a0.o_proj.weight_scale[...].sharding.spec == P()
assert a0.q_proj.weight[...].addressable_shards[0].data.shape == (32, 64)
for m in (one, tp):
    np.testing.assert_array_equal(np.asarray(m.layers[1].mlp.down_proj.weight[...]).view(np.uint8),
                                  np.asarray(one.layers[1].mlp.down_proj.weight[...]).view(np.uint8))
ids = np.arange(30).reshape(2, 15) % config.vocab_size
l1, l2 = (np.asarray(engine_setup.dense_logits(m, ids)) for m in (one, tp))
np.testing.assert_allclose(l2, l1, rtol=1e-4, atol=1e-4 * np.abs(l1).max())
# online quantization of a float checkpoint onto the mesh: the same fp8 values as on one device
flt = sys.argv[2]
c2 = load_hf_config(flt)
on1 = load_hf_weights(flt, c2, dtype=jnp.float32, quantization=Fp8Config())
on2 = load_hf_weights(flt, c2, dtype=jnp.float32, quantization=Fp8Config(), mesh=mesh)
for name in ("q_proj", "o_proj"):
    w1, w2 = (getattr(m.layers[0].self_attn, name) for m in (on1, on2))
    np.testing.assert_array_equal(np.asarray(w2.weight[...]).view(np.uint8), np.asarray(w1.weight[...]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(w2.weight_scale[...]), np.asarray(w1.weight_scale[...]))
d2 = dummy_model(c2, dtype=jnp.float32, quantization=Fp8Config(), mesh=mesh)  # made in its shards
down, up = d2.layers[0].mlp.down_proj, d2.layers[0].mlp.up_proj
assert down.weight[...].sharding.spec == P(None, "tp") and down.weight_scale[...].sharding.spec == P()
assert up.weight[...].sharding.spec == P("tp", None) and up.weight_scale[...].sharding.spec == P("tp")
assert up.weight[...].dtype == jnp.float8_e4m3fn and float(jnp.abs(up.weight[...].astype(jnp.float32)).max()) == 448
print("TP-OK")
"""


def test_fp8_tensor_parallel_on_2_cpu_devices(tmp_path, tokenizer):
    """On a tp=2 mesh: fp8 weights and scales in their shards (column: both split; row: weight split, scales
    whole; checkpoint, online, dummy), the same values as on one device (checkpoint, online), and the same
    logits."""
    hfc.write_fp8_checkpoint(tmp_path / "fp8", "LlamaForCausalLM", tokenizer=tokenizer)
    hfc.write_checkpoint(tmp_path / "flt", "MistralForCausalLM", tokenizer=tokenizer, num_shards=1)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(tmp_path / "fp8"), str(tmp_path / "flt")], cwd=root,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "TP-OK" in r.stdout, (r.stdout + r.stderr)[-4000:]


# -- SmolLM2: fp8 against bf16 -------------------------------------------------------------------------------------
# the bf16 model's 16 greedy tokens after fp8_accuracy.PROMPTS[:8] on the CPU machine, kept as text (each prompt +
# continuation re-tokenizes to exactly prompt ids + the 16 tokens): the 16 greedy steps cost more than the rest of
# the test together
CONTINUATIONS = [" Paris.\n\nThe answer is: 2018-01",
                 " Jupiter, but it's not the only one. There are many other planets in",
                 " around 1,000°C, which is significantly higher than the",
                 "\n    if n == 0:\n        return 1\n    return n * fib",
                 "\n    return np.mean(xs)\n\ndef sum_of_squ",
                 " there was a king named King Elara. She was a powerful sorceress",
                 " the primary colors: red, blue, and yellow. These are the only three",
                 ", you need to prepare a pot of tea.\n\nThe first step is"]


def test_smollm2_fp8_against_bf16(gguf_path):
    """SmolLM2-135M with online fp8 weights (bf16 elsewhere) against its bf16 model along the bf16 model's greedy
    continuations of 8 prompts (16 tokens each): mean KL(bf16 || fp8) of the next-token distributions < 0.05
    nats and >= 85 % of the fp8 argmaxes on the path equal to bf16's (measured: 0.031 nats, 93.0 %; 93.8 % before
    session 32's norm quantization and bf16 GEMM output). Whole-sequence greedy agreement (2 of 8 here) is printed,
    not asserted: on 50 prompts SmolLM2 in fp8 keeps all 16 tokens for 16 % of them (KL 0.034; session 31's path
    22 %, KL 0.038), with fp8 weights alone and bf16 activations 16 %, and even its float32 model only 68 % against
    bf16 (docs/logs/session32/smollm2-accuracy-cpu*.txt, docs/logs/fp8-weights/smollm2-accuracy-cpu.txt,
    scripts/dev/fp8_accuracy.py): the brief's 80 % is out of reach for a 135M model whatever the kernel."""
    from tests.conftest import load_script
    acc = load_script("fp8_accuracy")
    config, weights, tok = registry.load_checkpoint(gguf_path)
    prompts = [tok.encode(t, add_special_tokens=True) for t in acc.PROMPTS[:8]]
    paths = []
    for p, text, cont in zip(prompts, acc.PROMPTS, CONTINUATIONS):
        full = tok.encode(text + cont, add_special_tokens=True)
        assert full[:len(p)] == p and len(full) == len(p) + 16, text
        paths.append(full[len(p):])
    bf16 = registry.build_model(config, weights, dtype="bfloat16")
    fp8 = registry.build_model(config, weights, dtype="bfloat16", quantization="fp8")
    r = acc.measure(bf16, fp8, prompts, steps=16, batch=8, paths=np.array(paths))
    print(r)
    assert r["reference_reproduces"] >= 0.95, r  # the texts are (near enough) bf16's greedy path here
    assert r["mean_kl"] < acc.KL_MAX, r
    assert r["token_agreement"] >= 0.85, r


def test_fp8_engines_turn_xla_triton_gemm_off_before_the_backend_starts():
    """``use_xla_flags``: in a fresh process the flag reaches XLA_FLAGS (and XLA accepts it on CPU); the user's own
    setting of the same flag wins; once the backend runs, nothing changes and a warning says why."""
    code = ("import os, logging; logging.basicConfig(level=logging.INFO)\n"
            "from models.entrypoints.engine_args import FP8_XLA_FLAGS, use_xla_flags\n"
            "ok = use_xla_flags(FP8_XLA_FLAGS, why='fp8 weights')\n"
            "import jax.numpy as jnp; assert float(jnp.ones(3).sum()) == 3.0\n"
            "print(ok, repr(os.environ.get('XLA_FLAGS')))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True '--xla_gpu_enable_triton_gemm=false'"
    env["XLA_FLAGS"] = "--xla_gpu_enable_triton_gemm=true"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "True '--xla_gpu_enable_triton_gemm=true'", out.stderr[-2000:]

    from models.entrypoints import engine_args
    jnp.ones(1).block_until_ready()  # this process's backend runs
    before = os.environ.get("XLA_FLAGS")
    assert not engine_args.use_xla_flags(("--xla_gpu_enable_triton_gemm=false",), why="fp8 weights")
    assert os.environ.get("XLA_FLAGS") == before


def _spied_logits(monkeypatch, name: str, config, *, stride: int):
    """``(calls, logits)``: ``models.decoder.<name>`` appends its first argument's shape to ``calls`` at each call;
    ``logits(model)`` empties ``calls`` and returns ``model.forward_dense`` of a fixed 2 x 12 batch of token ids."""
    from models import decoder
    calls = []
    real = getattr(decoder, name)
    monkeypatch.setattr(decoder, name, lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    ids = jnp.asarray(np.arange(24).reshape(2, 12) * stride % config.vocab_size)
    valid = jnp.ones(ids.shape, bool)

    def logits(model):
        calls.clear()
        return np.asarray(model.forward_dense(ids, valid))

    return calls, logits


def test_swiglu_and_its_quantization_as_one_op_when_asked(monkeypatch):
    """With ``$JAXKV_FP8_SWIGLU_KERNEL=1`` a fused fp8 MLP hands ``down_proj`` the quantized SwiGLU of its gate/up
    GEMM's raw output (:func:`jaxkv.ops.activation.silu_and_mul_quant`, once a layer; its ``jnp`` form on CPU); the
    logits match the default path's (the same math, the scales applied in the other order). Not without the switch,
    and not with the projections separate."""
    from models.dummy import dummy_model
    from models.fused import fuse_projections
    c = hfc_config()
    calls, logits = _spied_logits(monkeypatch, "silu_and_mul_quant", c, stride=7)
    fp8 = dummy_model(c, dtype=jnp.float32, seed=6, quantization=Fp8Config())
    fuse_projections(fp8)
    default = logits(fp8)
    assert not calls
    monkeypatch.setenv("JAXKV_FP8_SWIGLU_KERNEL", "1")
    one_op = logits(fp8)
    assert calls == [(24, 2 * c.intermediate_size)] * c.num_layers
    np.testing.assert_allclose(one_op, default, rtol=1e-3, atol=1e-3 * np.abs(default).max())
    assert (one_op.argmax(-1) == default.argmax(-1)).mean() >= 0.9
    separate = dummy_model(c, dtype=jnp.float32, seed=6, quantization=Fp8Config())
    logits(separate)
    assert not calls


def test_norms_quantize_for_dynamic_fp8_linears_only(monkeypatch):
    """The decoder's norms hand their fp8 Linears quantized activations (two norms a layer) only when every Linear
    they feed is fp8 with dynamic scales and ``$JAXKV_FP8_NORM_QUANT`` is not ``0``; the logits match the path that
    quantizes the norm's output on its own."""
    from models.dummy import dummy_model
    c = hfc_config()
    calls, logits = _spied_logits(monkeypatch, "rms_norm_quantize_per_token", c, stride=5)
    fp8 = dummy_model(c, dtype=jnp.float32, seed=5, quantization=Fp8Config())
    fused = logits(fp8)
    assert len(calls) == 2 * c.num_layers  # input_layernorm and post_attention_layernorm
    monkeypatch.setenv("JAXKV_FP8_NORM_QUANT", "0")
    separate = logits(fp8)
    assert not calls
    np.testing.assert_allclose(fused, separate, rtol=1e-3, atol=1e-3 * np.abs(separate).max())
    assert (fused.argmax(-1) == separate.argmax(-1)).mean() >= 0.9
    monkeypatch.delenv("JAXKV_FP8_NORM_QUANT")
    # up_proj left in float: the MLP's norm feeds a float Linear, so it keeps its output; the attention's quantizes
    partial = dummy_model(c, dtype=jnp.float32, seed=5, quantization=Fp8Config(ignore=("re:.*mlp.up_proj",)))
    logits(partial)
    assert len(calls) == c.num_layers
