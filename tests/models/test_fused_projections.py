"""Fused q/k/v and gate/up projections (:mod:`models.fused`): the fused model against the same weights unfused
(the reference: separate Linears, the forward of every earlier session), each member's weights read back exactly,
the rank-major layout of a ``tp``-way mesh, what stays separate, and weights from a trainer's unfused model.

The 2-device mesh runs (fused rank-major for ``tp=2``, placed in shards, the step equal to one device's) are in
``tests/jaxkv/parallel/test_mesh_families.py`` and ``test_fp8_weights.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import engine_setup
from models.dummy import dummy_model
from models.fused import FUSED, fuse_projections, fused_params, member
from models.hf_config import builtin_config
from models.llama import LlamaForCausalLM
from models.quantization import Fp8Config, Fp8Linear

TINY = dict(num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_size=16,
            vocab_size=128)


def _config(name: str):
    base = builtin_config(name)
    extra = {"layer_types": base.layer_types[:TINY["num_layers"]]} if base.layer_types is not None else {}
    return dataclasses.replace(base, **TINY, **extra)


def _copy(model):
    return nnx.merge(*nnx.split(model))


def _linears(model):
    """Every (layer, parent, name) -> its weights as NumPy (fp8 as uint8 bits), from the unfused model."""
    out = {}
    for i, layer in enumerate(model.layers):
        for parent_name, names, _ in FUSED.values():
            for n in names:
                lin = member(getattr(layer, parent_name), n)
                leaves = ({"weight": lin.weight[...], "weight_scale": lin.weight_scale[...]}
                          if isinstance(lin, Fp8Linear) else {"kernel": lin.kernel[...]})
                if lin.bias is not None:
                    leaves["bias"] = lin.bias[...]
                out[i, parent_name, n] = {k: np.asarray(v).view(np.uint8) if v.dtype == jnp.float8_e4m3fn
                                          else np.asarray(v) for k, v in leaves.items()}
    return out


@pytest.mark.parametrize("name,fp8,tp", [("llama-3.1-8b", False, 1), ("qwen2.5-7b", False, 2),
                                         ("gemma-3-4b", False, 1), ("llama-3.1-8b", True, 2),
                                         ("qwen2.5-7b", True, 1)])
def test_fused_model_equals_the_separate_projections(name, fp8, tp):
    """Llama, Qwen 2 (q/k/v biases), Gemma 3 (q/k norms, GeGLU); float and fp8 weights; laid out for one device
    and for ``tp=2`` (rank-major: a permutation of the columns, so the same product on one device)."""
    config = _config(name)
    quant = {"quantization": Fp8Config()} if fp8 else {}
    separate = dummy_model(config, dtype=jnp.float32, seed=7, **quant)
    fused = fuse_projections(_copy(separate), tensor_parallel_size=tp)
    for layer in fused.layers:
        assert layer.self_attn.fused_qkv == (tp, (64 // tp, 32 // tp, 32 // tp))
        assert layer.mlp.fused_gate_up == (tp, (96 // tp, 96 // tp))
        assert not any(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        assert not any(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj"))
    want, got = _linears(separate), _linears(fused)
    assert want.keys() == got.keys()
    for key in want:  # each member's weights come back bit for bit
        assert want[key].keys() == got[key].keys()
        for leaf in want[key]:
            np.testing.assert_array_equal(got[key][leaf], want[key][leaf], err_msg=f"{key} {leaf}")
    ids = np.arange(24).reshape(2, 12) * 5 % config.vocab_size
    np.testing.assert_allclose(np.asarray(engine_setup.dense_logits(fused, ids)),
                               np.asarray(engine_setup.dense_logits(separate, ids)), rtol=2e-5, atol=2e-5)


def test_what_stays_separate():
    """k/v replicated over tp (``num_kv_heads < tp``) keep q/k/v separate (gate/up still fuse); static fp8 input
    scales keep their own Linears; a tp that does not divide the columns is an error naming it."""
    config = _config("llama-3.1-8b").replace(num_kv_heads=1)
    m = fuse_projections(dummy_model(config, dtype=jnp.float32, seed=1), tensor_parallel_size=2)
    assert getattr(m.layers[0].self_attn, "fused_qkv", None) is None and hasattr(m.layers[0].self_attn, "k_proj")
    assert m.layers[0].mlp.fused_gate_up == (2, (48, 48))
    static = LlamaForCausalLM(_config("llama-3.1-8b"), rngs=nnx.Rngs(0),
                              quantization=Fp8Config(activation_scheme="static", checkpoint_fp8=True))
    fuse_projections(static)
    assert hasattr(static.layers[0].self_attn, "q_proj") and hasattr(static.layers[0].mlp, "up_proj")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide qkv_proj"):
        fuse_projections(dummy_model(_config("llama-3.1-8b").replace(num_kv_heads=4), dtype=jnp.float32, seed=1),
                         tensor_parallel_size=3)


def test_fused_params_of_a_trainers_unfused_model():
    """A trainer's decoder (separate Linears), as a module or its state, comes back in the engine model's fused
    layout with the trainer's values; the trainer's model is left as it was; the fused state passes as is."""
    config = _config("qwen2.5-7b")
    engine_model = fuse_projections(dummy_model(config, dtype=jnp.float32, seed=2), tensor_parallel_size=2)
    trainer = dummy_model(config, dtype=jnp.float32, seed=9)
    engine_tree = jax.tree.structure(nnx.state(engine_model))
    for params in (trainer, nnx.state(trainer)):
        state = fused_params(params, engine_model)
        assert jax.tree.structure(state) == engine_tree
        model = nnx.merge(nnx.graphdef(engine_model), state)
        want, got = _linears(trainer), _linears(model)
        for key in want:
            for leaf in want[key]:
                np.testing.assert_array_equal(got[key][leaf], want[key][leaf])
    assert hasattr(trainer.layers[0].self_attn, "q_proj")
    same = nnx.state(engine_model)
    assert fused_params(same, engine_model) is same
    # k/v replicated over tp: only gate/up fused; the model's own state passes, a trainer's is fused alike
    config1 = config.replace(num_kv_heads=1)
    partly = fuse_projections(dummy_model(config1, dtype=jnp.float32, seed=2), tensor_parallel_size=2)
    own = nnx.state(partly)
    assert fused_params(own, partly) is own
    state = fused_params(nnx.state(dummy_model(config1, dtype=jnp.float32, seed=4)), partly)
    assert jax.tree.structure(state) == jax.tree.structure(nnx.state(partly))
    assert fused_params({"w": 1}, engine_model) == {"w": 1}
