"""Tensor parallelism on 4 CPU devices (f32, a tiny random Llama): greedy tokens on every mesh equal the
single-device tokens, the caches hold the shards they should, and the compiled step holds one all-reduce
per o_proj and down_proj. (Data parallelism is engine-core processes: tests/models/test_engine_core_processes.py.)

JAX fixes its device count when it starts, and the pytest process has usually started it with one CPU
device. So :func:`test_mesh_suite_on_4_cpu_devices` runs this file again in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``; there the tests below run and the launcher skips.
Set ``JAXKV_SLOW=1`` to add the SmolLM2 test (``LLM(tensor_parallel_size=3)``).
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
import models
from jaxkv import AttentionMetadata, SamplingParams
from jaxkv.parallel.mesh import make_mesh
from models.decoder_config import LlamaConfig
from models.engine_setup import init_kv_caches, make_model_fn
from models.llama import LlamaForCausalLM
from tests.conftest import step_compiles

NUM_DEVICES = 4
needs_mesh = pytest.mark.skipif(jax.device_count() < NUM_DEVICES,
                                reason="runs in the 4-device subprocess of test_mesh_suite_on_4_cpu_devices")
slow = pytest.mark.skipif(not os.environ.get("JAXKV_SLOW"), reason="set JAXKV_SLOW=1 (SmolLM2, minutes)")

BLOCK, MAX_LEN = 8, 64


def test_mesh_suite_on_4_cpu_devices():
    if jax.device_count() >= NUM_DEVICES:
        pytest.skip("this process has 4 devices: the mesh tests run here directly")
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
    assert passed and int(passed.group(1)) >= 5, out[-3000:]


# -- a tiny random Llama, its single-device tokens --------------------------------------------------------
def _config(num_kv_heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=num_kv_heads, head_size=16, max_position_embeddings=MAX_LEN)


def _model(num_kv_heads: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(_config(num_kv_heads), rngs=nnx.Rngs(num_kv_heads))


PROMPTS = [list(np.random.default_rng(7).integers(0, 128, n)) for n in (5, 17, 3, 30, 9, 12)]
SAMPLING = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(num_kv_heads, mesh, *, num_blocks=32, **options):
    return models.make_engine(_model(num_kv_heads), attention_impl="reference", block_size=BLOCK,
                              num_blocks=num_blocks, max_model_len=MAX_LEN, max_num_seqs=4,
                              max_num_batched_tokens=16, num_scheduler_steps=4, mesh=mesh, **options)


def _tokens(engine):
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, SAMPLING)]


_solo: dict[int, list] = {}


def _single_device_tokens(num_kv_heads):
    if num_kv_heads not in _solo:
        _solo[num_kv_heads] = _tokens(_engine(num_kv_heads, None))
    return _solo[num_kv_heads]


def _check_shards(engine, num_kv_heads, tp, dp, num_blocks):
    """Every device holds ``[2, num_blocks, max(1, kv // tp), block, head]``: its rank's pool and heads."""
    kv_per_rank = max(1, num_kv_heads // tp)
    for cache in engine.kv_caches:
        assert cache.shape == (2, dp * num_blocks, tp * kv_per_rank, BLOCK, 16)
        shards = cache.addressable_shards
        assert len(shards) == tp * dp
        assert {s.data.shape for s in shards} == {(2, num_blocks, kv_per_rank, BLOCK, 16)}
        assert len({(s.index[1].start, s.index[2].start) for s in shards}) == tp * dp  # no two alike
    if num_kv_heads < tp:  # replicated KV heads: the tp ranks of one dp rank hold equal copies
        by_dp = collections.defaultdict(list)
        for s in engine.kv_caches[0].addressable_shards:
            by_dp[s.index[1].start].append(np.asarray(s.data))
        for copies in by_dp.values():
            assert np.abs(copies[0]).sum() > 0
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0])


@needs_mesh
@pytest.mark.parametrize("num_kv_heads,tp,options", [
    (2, 2, dict(async_scheduling=True, num_blocks=7)),  # a small pool: the engine preempts
    (1, 2, {}),  # 1 KV head, tp=2: one replica per rank
], ids=["tp2-async-preempt", "tp2-kv1-replicated"])
def test_greedy_tokens_equal_single_device(num_kv_heads, tp, options):
    """A batch of 6 requests (prompts of 3..30 tokens, chunked prefill, 4 running at most) on the mesh."""
    engine = _engine(num_kv_heads, make_mesh(tp, 1), **options)
    assert _tokens(engine) == _single_device_tokens(num_kv_heads)
    _check_shards(engine, num_kv_heads, tp, 1, options.get("num_blocks", 32))
    if options.get("num_blocks") == 7:
        # 7 blocks for requests of up to 6 blocks, 4 running at once: the engine preempts
        assert engine.stats.num_preemptions > 0


@needs_mesh
def test_warmup_on_a_mesh_compiles_each_bucket_once():
    """tp=2, async scheduling: the warm-up's concurrent compiles serve the dummy runs and the real steps (no
    compile while serving; before, every bucket compiled again at its first real step, its previous tokens
    being sharded where the warm-up's were not); the tokens stay the single-device ones."""
    engine = _engine(2, make_mesh(2, 1), async_scheduling=True)  # steps read the last step's tokens
    names = step_compiles(engine.warmup)
    assert len(names) == engine.num_buckets == engine.num_compiles, names
    tokens = []
    assert step_compiles(lambda: tokens.extend(_tokens(engine))) == []
    assert tokens == _single_device_tokens(2)


@needs_mesh
def test_executable_cache_loads_onto_the_programs_devices(tmp_path):
    """Executables loaded from the executable cache run on their program's devices: one device on a
    4-device host (loaded onto every device, as JAX's loader does by default, the first call failed:
    "Expected args to execute_sharded_on_local_devices to have 2 shards"), and a tp=2 mesh. Nothing
    compiles on the warm start; the tokens are the single-device ones."""
    from jaxkv.worker.executable_cache import ExecutableCache

    for mesh, name in ((None, "one device"), (make_mesh(2, 1), "tp=2")):
        _engine(2, mesh).warmup(executable_cache=ExecutableCache(tmp_path, name))
        warm, cache = _engine(2, mesh), ExecutableCache(tmp_path, name)
        assert step_compiles(lambda: warm.warmup(executable_cache=cache)) == [], name
        assert cache.hits == warm.num_buckets == warm.num_compiles, name
        assert _tokens(warm) == _single_device_tokens(2), name


def test_an_engine_mesh_with_dp_is_refused():
    """Data-parallel ranks are engines of their own; a mesh with dp > 1 names the alternative."""
    mesh = type("M", (), {"shape": {"dp": 2, "tp": 1}})()
    with pytest.raises(ValueError, match="dp=2: data-parallel ranks are engines of their own"):
        jaxkv.LLMEngine(lambda *a: None, {}, [jnp.zeros((2, 4, 1, BLOCK, 16))], block_size=BLOCK,
                        max_model_len=MAX_LEN, mesh=mesh)


def _collectives(tp, dp, num_kv_heads=2):
    """Collective ops in the compiled decode step of the tiny model on a ``(dp, tp)`` mesh."""
    config = _config(num_kv_heads)
    mesh = make_mesh(tp, dp)
    params, fn = make_model_fn(_model(num_kv_heads), attention_impl="reference", mesh=mesh)
    _, caches = init_kv_caches(config, block_size=BLOCK, num_blocks=8, dtype=jnp.float32, mesh=mesh)
    rows = 4 * dp
    md = AttentionMetadata(slot_mapping=jnp.zeros(rows, jnp.int32), seq_lens=jnp.ones(rows, jnp.int32),
                           block_tables=jnp.zeros((rows, 4), jnp.int32),
                           query_start_loc=jnp.arange(rows + 1, dtype=jnp.int32), max_query_len=1,
                           max_seq_len=4 * BLOCK)
    ids = jnp.zeros(rows, jnp.int32)
    text = jax.jit(fn).lower(params, ids, ids, caches, md, jnp.arange(rows, dtype=jnp.int32)).compile().as_text()
    ops = re.findall(r"= (\S+) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(",
                     text)
    return collections.Counter(op for _, op in ops), [shape for shape, _ in ops]


@needs_mesh
def test_compiled_step_has_one_all_reduce_per_row_parallel_matmul():
    """Megatron-style: per layer one all-reduce after o_proj and one after down_proj, each of the
    hidden state ``[tokens, hidden]``; nothing else (embedding and LM head are replicated)."""
    layers = _config(2).num_layers
    counts, shapes = _collectives(2, 1)
    assert counts == {"all-reduce": 2 * layers}, counts
    assert set(shapes) == {"f32[4,64]{1,0}"}, shapes  # 4 tokens, hidden 64
    counts, shapes = _collectives(2, 1, num_kv_heads=1)  # replicated KV heads: still only the two
    assert counts == {"all-reduce": 2 * layers} and set(shapes) == {"f32[4,64]{1,0}"}


@pytest.fixture
def fresh_traces():
    """JAX's trace caches emptied before and after: the environment a layer reads when it is traced is not in the
    key of ``models.decoder._layer_step``'s cache, so a step traced by another test would be reused."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@needs_mesh
def test_two_shot_all_reduce_is_a_reduce_scatter_and_an_all_gather(monkeypatch, fresh_traces):
    """``$JAXKV_TP_ALL_REDUCE=two-shot``: each row-parallel layer's sum is one reduce-scatter over the rows and one
    all-gather (4 decode rows over tp=2); a float and an fp8 layer give what one all-reduce gives, on 4 rows and on
    3 (which do not split over 2 ranks and take the all-reduce)."""
    from models.parallel import row_parallel
    from models.quantization import Fp8Linear, quantize_weight

    config, mesh = _config(2), make_mesh(2, 1)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    fp8 = Fp8Linear(128, 64, dtype=jnp.float32)
    w_q, s_w = quantize_weight(jnp.asarray(rng.standard_normal((64, 128)), jnp.float32))
    fp8.weight.set_value(w_q)
    fp8.weight_scale.set_value(s_w)
    projs = (fp8, nnx.Linear(128, 64, rngs=nnx.Rngs(4)))
    one = [[np.asarray(row_parallel(p, rows, mesh)) for rows in (x, x[:3])] for p in projs]
    monkeypatch.setenv("JAXKV_TP_ALL_REDUCE", "two-shot")
    for p, want in zip(projs, one):
        for rows, w in zip((x, x[:3]), want):
            np.testing.assert_allclose(np.asarray(row_parallel(p, rows, mesh)), w, rtol=1e-6, atol=1e-6)
    counts, shapes = _collectives(2, 1)
    assert counts == {"reduce-scatter": 2 * config.num_layers, "all-gather": 2 * config.num_layers}, counts
    assert set(shapes) == {"f32[2,64]{1,0}", "f32[4,64]{1,0}"}, shapes  # each rank's 2 rows, then all 4
    monkeypatch.setenv("JAXKV_TP_ALL_REDUCE", "ring")
    with pytest.raises(ValueError, match="JAXKV_TP_ALL_REDUCE='ring' is not one of"):
        row_parallel(projs[1], x, mesh)
    monkeypatch.delenv("JAXKV_TP_ALL_REDUCE")


@needs_mesh
def test_fp8_row_parallel_layers_scale_each_rank_and_all_reduce_in_the_model_dtype():
    """fp8 weights on tp=2 (vLLM's ``RowParallelLinear`` with ``Fp8LinearMethod``): o_proj / down_proj quantize
    each rank's slice of the row with its own per-token scales (float64 NumPy per shard; a whole-row scale would
    flush the small half to e4m3 subnormals), and the decode step all-reduces only their bf16 partial sums
    (before: one more all-reduce of the f32 ``[tokens]`` absmax per projection, and f32 sums)."""
    import ml_dtypes

    from models.dummy import dummy_model
    from models.parallel import row_parallel
    from models.quantization import Fp8Config, Fp8Linear

    f8 = ml_dtypes.float8_e4m3fn
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64))
    x[:, 32:] *= 1e-5                                    # rank 1's half: 5 orders of magnitude smaller
    w = rng.standard_normal((24, 64))
    w[:, 32:] *= 1e5                                     # ... and its weights as much larger
    s_w = np.abs(w).max(axis=1) / 448
    w_q = np.clip(w / s_w[:, None], -448, 448).astype(f8)
    proj = Fp8Linear(64, 24, dtype=jnp.float32)
    proj.weight.set_value(jnp.asarray(w_q))
    proj.weight_scale.set_value(jnp.asarray(s_w, jnp.float32))
    got = np.asarray(row_parallel(proj, jnp.asarray(x, jnp.float32), make_mesh(2, 1)), np.float64)

    def partial(xs, ws):  # one rank's fp8 product in float64, its own per-token scales
        s = np.maximum(np.abs(xs).max(axis=1) / 448, 1 / (448 * 512))
        xq = np.clip(xs / s[:, None], -448, 448).astype(f8).astype(np.float64)
        return xq @ ws.astype(np.float64).T * s[:, None] * s_w
    want = partial(x[:, :32], w_q[:, :32]) + partial(x[:, 32:], w_q[:, 32:])
    whole_row = partial(x, w_q)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(whole_row - want).max() > 0.05 * np.abs(want).max()  # the two schemes differ on this input
    np.testing.assert_allclose(np.asarray(row_parallel(proj, jnp.asarray(x, jnp.float32), None)), whole_row,
                               rtol=1e-5, atol=1e-5 * np.abs(whole_row).max())  # one device: the whole row

    config = _config(2)
    mesh = make_mesh(2, 1)
    params, fn = make_model_fn(dummy_model(config, dtype=jnp.bfloat16, quantization=Fp8Config(), mesh=mesh),
                               attention_impl="reference", mesh=mesh)
    _, caches = init_kv_caches(config, block_size=BLOCK, num_blocks=8, dtype=jnp.bfloat16, mesh=mesh)
    md = AttentionMetadata(slot_mapping=jnp.zeros(4, jnp.int32), seq_lens=jnp.ones(4, jnp.int32),
                           block_tables=jnp.zeros((4, 4), jnp.int32), query_start_loc=jnp.arange(5, dtype=jnp.int32),
                           max_query_len=1, max_seq_len=4 * BLOCK)
    ids = jnp.zeros(4, jnp.int32)
    lowered = jax.jit(fn).lower(params, ids, ids, caches, md, jnp.arange(4, dtype=jnp.int32))
    reduced = re.findall(r"\"stablehlo.all_reduce\".*?\) -> tensor<([^>]*)>", lowered.as_text(), re.S)
    assert reduced and set(reduced) == {"4x64xbf16"}, reduced           # the partial sums, in bf16
    ops = re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(",
                     lowered.compile().as_text())
    assert ops == ["all-reduce"] * (2 * config.num_layers), ops         # (the CPU backend sums them in f32)


@needs_mesh
def test_bad_head_counts_name_the_valid_sizes():
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by tensor_parallel_size=3.*\[1, 2, 4\]"):
        make_model_fn(_model(2), attention_impl="reference", mesh=make_mesh(3, 1))


# -- SmolLM2 (9 query heads, 3 KV heads: tp=3) ------------------------------------------------------------
@needs_mesh
@slow
def test_smollm2_text_equals_single_device(gguf_path):
    prompts = ["The capital of France is", "Water is", "Once upon a time"]
    sp = SamplingParams(max_tokens=16, temperature=0)
    kw = dict(dtype="float32", max_model_len=128, max_num_seqs=4, num_gpu_blocks=64)
    solo = models.LLM(gguf_path, **kw).generate(prompts, sp, use_tqdm=False)
    mesh = models.LLM(gguf_path, tensor_parallel_size=3, **kw).generate(
        prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mesh] == [o.outputs[0].token_ids for o in solo]
    assert "Paris" in mesh[0].outputs[0].text
