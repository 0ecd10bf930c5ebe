"""The CPU attention (jaxkv.attention.xla) vs float64 loops, and its memory at the engine's bucket shapes.

Both forms: the loops (``dense_max_bytes=0`` forces them on these small batches) and the one-step dense form
that calls whose dense logits fit ``DENSE_MAX_BYTES`` take (``form="dense"``: the default knobs here).

Small loop knobs (one-block key chunks, 4-token query tiles, decode batches 2 rows a step) make every loop
of the implementation run several steps on small batches: chunks before a window, partial chunks, several
tiles per sequence, partial groups, decodes beside prefills.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.xla import paged_attention_xla, paged_prefill_attention_xla
from pallas_kernels.paged_prefill_attention import paged_prefill_attention_reference
from tests.conftest import TOLERANCE, PagedBatch, decode_attention_loop, prefill_attention_loop, rel_err

SMALL_LOOPS = dict(chunk_tokens=8, dense_max_bytes=0)  # loops even where the dense form is small
NUM_PAD_TOKENS = 3


def _prefill_case(rng, context_lens, query_lens, *, num_heads, num_kv_heads, head_size=32, block_size=8,
                  dtype="float32", kv_dtype=None):
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    batch = PagedBatch(rng, seq_lens=seq_lens, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size)
    q = jnp.asarray(rng.standard_normal((sum(query_lens) + NUM_PAD_TOKENS, num_heads, head_size)), dtype)
    kv = jnp.asarray(batch.kv_cache, kv_dtype or dtype)
    batch.kv_cache = np.asarray(kv, np.float64)  # the loop sees the rounded values
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32)
    return batch, q, (q, kv, jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens), qsl)


def _check(out, expected, num_real, dtype, factor=1.0):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "NaN pages leaked into the output"
    assert rel_err(out[:num_real], expected[:num_real]) < TOLERANCE[dtype] * factor
    np.testing.assert_array_equal(out[num_real:], 0.0)  # tokens past query_start_loc[-1]


# (num_heads, num_kv_heads, dtype, extras): GQA 3, 1:1, MQA; every mask option, alone and together
CASES = [
    (9, 3, "float32", {}),
    (6, 2, "bfloat16", dict(sliding_window=7)),
    (4, 4, "float32", dict(logits_soft_cap=3.0)),
    (8, 1, "float32", dict(alibi=True)),
    (6, 2, "float32", dict(sliding_window=10, logits_soft_cap=5.0, alibi=True)),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,dtype,extras,form",
                         [c + ("loops",) for c in CASES] + [CASES[0] + ("dense",), CASES[-1] + ("dense",)],
                         ids=["gqa3", "window-bf16", "softcap-1to1", "alibi-mqa", "all", "gqa3-dense", "all-dense"])
def test_prefill_matches_float64_loop(rng, num_heads, num_kv_heads, dtype, extras, form):
    """A whole prompt, a chunk after a prefix, decodes (first token / block-1 / block / block+1 / long),
    an empty row, a row past the window; 4-token tiles, one-block key chunks."""
    bs = 8
    context_lens = [0, 11, 0, bs - 1, bs, 0, 3 * bs + 5, 30]
    query_lens = [13, 6, 1, 1, 1, 0, 1, 9]
    batch, q, args = _prefill_case(rng, context_lens, query_lens, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, dtype=dtype)
    kwargs = {k: v for k, v in extras.items() if k != "alibi"}
    slopes = 2.0 ** -np.arange(1, num_heads + 1) if extras.get("alibi") else None
    if slopes is not None:
        kwargs["alibi_slopes"] = jnp.asarray(slopes, jnp.float32)
    expected = prefill_attention_loop(np.asarray(q, np.float64), batch, query_lens, 32 ** -0.5,
                                      **{**kwargs, "alibi_slopes": slopes})
    knobs = dict(query_tile=4, **SMALL_LOOPS) if form == "loops" else {}
    out = paged_prefill_attention_xla(*args, scale=32 ** -0.5, max_query_len=16, **knobs, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, expected, sum(query_lens), dtype)


@pytest.mark.parametrize("fp8,q_dtype,form", [("float8_e4m3fn", "bfloat16", "loops"),
                                             ("float8_e5m2", "float32", "dense")])
def test_fp8_cache_with_scales(rng, fp8, q_dtype, form):
    """An fp8 cache with k/v scales equals attention over exactly the dequantised values."""
    context_lens, query_lens = [0, 17, 5], [12, 1, 9]
    k_scale, v_scale = 0.5, 2.0
    batch, q, args = _prefill_case(rng, context_lens, query_lens, num_heads=9, num_kv_heads=3,
                                   dtype=q_dtype)
    quantized = jnp.asarray(batch.kv_cache / np.array([k_scale, v_scale]).reshape(2, 1, 1, 1, 1), fp8)
    batch.kv_cache = np.asarray(quantized, np.float64)
    expected = prefill_attention_loop(np.asarray(q, np.float64), batch, query_lens, 0.125, k_scale=k_scale,
                                      v_scale=v_scale)
    out = paged_prefill_attention_xla(args[0], quantized, *args[2:], scale=0.125, max_query_len=12,
                                      k_scale=jnp.float32(k_scale), v_scale=jnp.float32(v_scale),
                                      **(dict(query_tile=4, **SMALL_LOOPS) if form == "loops" else {}))
    _check(out, expected, sum(query_lens), q_dtype)


@pytest.mark.parametrize("form", ["loops", "dense"])
def test_pages_before_the_window_are_never_read(rng, form):
    """Blocks wholly before every query's window hold NaN (freed): the output does not change."""
    bs, window = 8, 10
    context_lens, query_lens = [40, 3], [16, 1]
    batch, q, args = _prefill_case(rng, context_lens, query_lens, num_heads=6, num_kv_heads=2)
    expected = prefill_attention_loop(np.asarray(q, np.float64), batch, query_lens, 0.125,
                                      sliding_window=window)
    kv = np.asarray(args[1]).copy()
    first_needed = (40 - window + 1) // bs  # the first tile's first query sees keys from position 31 on
    kv[:, batch.block_tables[0, :first_needed]] = np.nan
    out = paged_prefill_attention_xla(args[0], jnp.asarray(kv), *args[2:], scale=0.125, max_query_len=16,
                                      sliding_window=window,
                                      **(dict(query_tile=8, **SMALL_LOOPS) if form == "loops" else {}))
    _check(out, expected, sum(query_lens), "float32")


def test_decode_matches_float64_loop(rng):
    """Decode contract: lengths 1, block-1, block, block+1, long, a padding row of length 0 (output 0), with
    a window and a soft cap; an odd row count in groups of 2, and the dense form."""
    bs = 8
    seq_lens = [1, bs - 1, bs, bs + 1, 45, 0, 20]
    batch = PagedBatch(rng, seq_lens=seq_lens, num_kv_heads=3, head_size=32, block_size=bs)
    q = rng.standard_normal((len(seq_lens), 9, 32))
    for extras, knobs in (({}, dict(decode_group=2, **SMALL_LOOPS)),
                          (dict(sliding_window=12, logits_soft_cap=4.0), dict(decode_group=2, **SMALL_LOOPS)),
                          (dict(sliding_window=12, logits_soft_cap=4.0), {})):
        expected = decode_attention_loop(q, batch, 0.2, **extras)
        out = paged_attention_xla(jnp.asarray(q, jnp.float32), jnp.asarray(batch.kv_cache, jnp.float32),
                                  jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens), scale=0.2,
                                  **knobs, **extras)
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all()
        assert rel_err(out, expected) < TOLERANCE["float32"]
        np.testing.assert_array_equal(out[5], 0.0)


def test_engine_padding_layout_matches_the_dense_reference(rng):
    """The engine's mixed step: many padding rows (length 0, no token), a token bucket larger than the
    work, decodes beside a long prompt; the default loop sizes; equal to the kernels' dense jnp reference."""
    context_lens = [0, 9, 30, 2] + [0] * 12
    query_lens = [37, 1, 1, 5] + [0] * 12
    batch, q, args = _prefill_case(rng, context_lens, query_lens, num_heads=9, num_kv_heads=3)
    q = jnp.pad(q, ((0, 64 - q.shape[0]), (0, 0), (0, 0)))
    args = (q,) + args[1:]
    ref = paged_prefill_attention_reference(*args, scale=0.3, max_query_len=64)
    out = paged_prefill_attention_xla(*args, scale=0.3, max_query_len=64, dense_max_bytes=0)
    assert rel_err(out, np.asarray(ref, np.float64)) < TOLERANCE["float32"]


def test_bad_tuning_knob_is_named():
    q = jnp.zeros((2, 2, 8))
    kv = jnp.zeros((2, 4, 1, 4, 8))
    with pytest.raises(ValueError, match="chunk_tokens=0 must be an int >= 1"):
        paged_attention_xla(q, kv, jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32), scale=1.0,
                            chunk_tokens=0)


def _temp_bytes(fn, *shapes, **static) -> int:
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return fn.lower(*args, **static).compile().memory_analysis().temp_size_in_bytes


def test_memory_follows_the_tokens_not_the_buckets():
    """At the engine's default CPU shapes for SmolLM2 (256 request rows, a 4096-token bucket, 2048-token
    context, 9/3 heads of 64) the compiled step's scratch is tens of MB; the dense reference's was 155 GB
    (issue 31: XLA's RESOURCE_EXHAUSTED when the mixed step ran)."""
    rows, tokens, width, bs, kvh, heads, d = 256, 4096, 128, 16, 3, 9, 64
    cache = ((2, 1024, kvh, bs, d), jnp.float32)
    table, lens = ((rows, width), jnp.int32), ((rows,), jnp.int32)
    out_bytes = tokens * heads * d * 4
    prefill = _temp_bytes(paged_prefill_attention_xla, ((tokens, heads, d), jnp.float32), cache, table, lens,
                          ((rows + 1,), jnp.int32), scale=0.125, max_query_len=tokens)
    assert prefill < 4 * out_bytes + (16 << 20), f"{prefill / 2**20:.0f} MiB of scratch"
    decode = _temp_bytes(paged_attention_xla, ((rows, heads, d), jnp.float32), cache, table, lens, scale=0.125)
    assert decode < (16 << 20), f"{decode / 2**20:.0f} MiB of scratch"


def test_engine_at_the_cpu_default_buckets_serves_a_long_prompt():
    """``LLMEngine`` with ``LLM``'s CPU defaults for SmolLM2 (256 request rows, token buckets up to 4096,
    2048-token sequences) on a tiny random Llama: a 1500-token prompt beside two short ones runs the
    2048-token mixed bucket (the dense reference attention's logits there were ``256 x 2048 x 2048`` per
    head: 25 GB for this model's 6 heads), and every step's logits equal the cache-free dense forward."""
    import dataclasses

    import models
    from jaxkv import SamplingParams
    from tests.models.test_llama_paged import TINY, _tiny_model

    model = _tiny_model(3)
    model.config = dataclasses.replace(TINY, max_position_embeddings=2048)
    eng = models.make_engine(model, attention_impl="reference", block_size=16, num_blocks=110, max_model_len=2048,
                             max_num_seqs=256, max_num_batched_tokens=4096, num_scheduler_steps=2,
                             return_logits=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (1500, 7, 30)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
    for out in outs:
        seq = out.prompt_token_ids + out.outputs[0].token_ids
        dense = np.asarray(models.dense_logits(model, np.array([seq]), np.ones((1, len(seq)), bool)))[0]
        start = len(out.prompt_token_ids) - 1
        np.testing.assert_allclose(out.outputs[0].logits, dense[start:start + 3], rtol=2e-4, atol=2e-4)
