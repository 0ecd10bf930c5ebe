"""Tensor parallelism for every architecture (tiny HF checkpoints of tests/models/hf_checkpoints.py, f32) on 2
CPU devices: the loader puts each parameter straight into its tp shard, one prefill step through the paged
caches gives the single-device logits and cache contents, Gemma 3 (hybrid sliding-window + full KV-cache
groups) through the whole engine gives the single-device greedy tokens, and dummy weights made on the mesh equal
those made on one device.

Like tests/jaxkv/parallel/test_mesh.py, :func:`test_families_on_2_cpu_devices` runs this file again in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``; there the tests below run and the launcher skips.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from jaxkv import AttentionMetadata, SamplingParams
from jaxkv.parallel.mesh import make_mesh
from models import engine_setup, registry
from models.dummy import dummy_model
from models.hf_config import builtin_config
from tests.models import hf_checkpoints as hfc

NUM_DEVICES = 2
needs_mesh = pytest.mark.skipif(jax.device_count() < NUM_DEVICES,
                                reason="runs in the 2-device subprocess of test_families_on_2_cpu_devices")
BLOCK = 8


def test_families_on_2_cpu_devices():
    if jax.device_count() >= NUM_DEVICES:
        pytest.skip("this process has 2 devices: the tests run here directly")
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        str(pathlib.Path(__file__).resolve())], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    out = r.stdout + r.stderr
    print(out[-3000:])
    assert r.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 6, out[-3000:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tok = hfc.build_tokenizer()
    root = tmp_path_factory.mktemp("ckpts")
    for i, arch in enumerate(hfc.ARCHS):
        hfc.write_checkpoint(root / arch, arch, seed=i, tokenizer=tok, num_shards=2)
    return root


def _prefill_metadata(config, kv_config, lens):
    """Metadata of a prefill of sequences of ``lens`` tokens; each KV-cache group its own blocks (groups
    share the cache tensors, so their blocks must differ)."""
    need = [-(-n // BLOCK) for n in lens]
    width = max(need)
    mds, next_block = [], 1
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    for _ in kv_config.kv_cache_groups:
        tables = np.zeros((len(lens), width), np.int32)
        for s, k in enumerate(need):
            tables[s, :k] = np.arange(next_block, next_block + k)
            next_block += k
        seq_of = np.repeat(np.arange(len(lens)), lens)
        slots = tables[seq_of, pos // BLOCK] * BLOCK + pos % BLOCK
        mds.append(AttentionMetadata(slot_mapping=jnp.asarray(slots, jnp.int32), seq_lens=jnp.asarray(lens, jnp.int32),
                                     block_tables=jnp.asarray(tables), query_start_loc=jnp.asarray(qsl),
                                     max_query_len=max(lens), max_seq_len=width * BLOCK))
    return (tuple(mds) if len(mds) > 1 else mds[0]), pos, np.cumsum(lens) - 1


def _step(directory, mesh):
    config, weights, _ = registry.load_checkpoint(directory)
    model = registry.build_model(config, weights, dtype="float32", mesh=mesh)
    kv_config, caches = engine_setup.init_kv_caches(config, block_size=BLOCK, dtype=jnp.float32, num_blocks=16, mesh=mesh)
    params, fn = engine_setup.make_model_fn(model, kv_config, attention_impl="reference", mesh=mesh)
    lens = [13, 6]
    md, pos, last = _prefill_metadata(config, kv_config, lens)
    ids = np.random.default_rng(0).integers(3, config.vocab_size, sum(lens)).astype(np.int32)
    logits, caches = jax.jit(fn)(params, jnp.asarray(ids), jnp.asarray(pos), caches, md, jnp.asarray(last, jnp.int32))
    return model, np.asarray(logits), [np.asarray(c) for c in caches], kv_config


@needs_mesh
@pytest.mark.parametrize("arch", [a for a in hfc.ARCHS if a != "LlamaForCausalLM"])  # Llama: test_mesh.py
def test_tp2_prefill_step_equals_one_device(checkpoints, arch):
    """Each parameter lands in its tp shard (fused q/k/v columns / o_proj rows split, Qwen 2's biases with their
    columns, q/k norms replicated); the step's logits and every written K/V (Mistral: one sliding-window group;
    Gemma 3: a sliding and a full group sharing one tensor) equal the single-device run."""
    d = checkpoints / arch
    mesh = make_mesh(2, 1)
    model, logits, caches, kv_config = _step(d, mesh)
    _, want_logits, want_caches, _ = _step(d, None)
    attn = model.layers[0].self_attn
    assert attn.fused_qkv[0] == 2  # q/k/v fused rank-major for tp=2 (models.fused)
    assert attn.qkv_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert attn.o_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec("tp", None)
    assert {s.data.shape for s in attn.qkv_proj.kernel[...].addressable_shards} == {
        (hfc.HIDDEN, attn.qkv_proj.kernel[...].shape[1] // 2)}
    if arch == "Qwen2ForCausalLM":
        assert attn.qkv_proj.bias[...].sharding.spec == jax.sharding.PartitionSpec("tp")
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert len(caches) == len(kv_config.kv_cache_tensors)
    for got, want in zip(caches, want_caches):  # tp=2 heads = the 2 KV heads: the same global array
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_mesh
def test_tp2_automaton_structured_outputs_equal_one_device(checkpoints):
    """Structured outputs as token automata (their tables replicated over the mesh, each row's state in its slot):
    tp=2 gives the single-device tokens, greedy and sampled, and the JSON validates."""
    from jaxkv.sampling_params import StructuredOutputsParams
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 20},
                                               "b": {"type": "string", "enum": ["x", "yz"]}}, "required": ["a", "b"]}
    so = StructuredOutputsParams(json=schema)
    sps = [SamplingParams(max_tokens=30, temperature=0, structured_outputs=so),
           SamplingParams(max_tokens=30, temperature=1.0, seed=4, structured_outputs=so)]
    kw = dict(dtype="float32", attention_impl="reference", max_model_len=64, num_gpu_blocks=32, block_size=BLOCK,
              max_num_seqs=2, max_num_batched_tokens=32, num_scheduler_steps=4, enable_multiprocessing=False,
              structured_outputs_disable_any_whitespace=True, structured_outputs_table_mib=4)
    prompts = ["Animal:", "Pet:"]
    solo = models.LLM(checkpoints / "LlamaForCausalLM", **kw).generate(prompts, sps, use_tqdm=False)
    tp = models.LLM(checkpoints / "LlamaForCausalLM", tensor_parallel_size=2, **kw)
    outs = tp.generate(prompts, sps, use_tqdm=False)
    assert tp.engine.runner.dfa_tables.num_held == 0 and tp.engine.runner.dfa_tables.num_writes > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in solo]
    for o in outs:
        value = json.loads(o.outputs[0].text)
        assert set(value) == {"a", "b"} and 0 <= value["a"] <= 20 and value["b"] in ("x", "yz")


@needs_mesh
def test_gemma3_tp2_greedy_tokens_equal_one_device(checkpoints):
    """Gemma 3 (a sliding-window and a full-attention layer: two KV-cache groups over one pool, window 8 <
    the sequences) through the engine: tp=2 greedy tokens = single-device tokens."""
    prompts = [list(range(3, 25)), [7, 8, 9]]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", attention_impl="reference", max_model_len=48, num_gpu_blocks=24, block_size=BLOCK,
              max_num_seqs=2, max_num_batched_tokens=32, num_scheduler_steps=4)
    solo = models.LLM(checkpoints / "Gemma3ForCausalLM", **kw).generate(prompts, sp, use_tqdm=False)
    tp = models.LLM(checkpoints / "Gemma3ForCausalLM", tensor_parallel_size=2, **kw)
    assert len(tp.engine.kv_cache_groups) == 2
    outs = tp.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in solo]


@needs_mesh
def test_dummy_weights_on_the_mesh_equal_one_device():
    """``load_format="dummy"`` made on the mesh (each shard by its device) = made on one device, same seed."""
    config = builtin_config("qwen3-8b").replace(num_layers=1, hidden_size=64, intermediate_size=96, num_heads=4,
                                                num_kv_heads=2, head_size=16, vocab_size=300)
    solo = dummy_model(config, dtype=jnp.float32, seed=3)
    tp = dummy_model(config, dtype=jnp.float32, seed=3, mesh=make_mesh(2, 1))
    for a, b in ((solo.layers[0].self_attn.k_proj.kernel, tp.layers[0].self_attn.k_proj.kernel),
                 (solo.layers[0].mlp.down_proj.kernel, tp.layers[0].mlp.down_proj.kernel),
                 (solo.embed_tokens.embedding, tp.embed_tokens.embedding)):
        assert len(b[...].addressable_shards) == 2
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    assert tp.layers[0].mlp.down_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec("tp", None)
