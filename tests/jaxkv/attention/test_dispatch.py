"""``jaxkv.paged_attention`` routes each batch kind to the right kernel for each implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import xla as xla_mod
from pallas_kernels import paged_attention as decode_mod
from pallas_kernels import paged_prefill_attention as prefill_mod
from tests.conftest import TOLERANCE, PagedBatch, rel_err

BLOCK = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 64
SCALE = HEAD_SIZE ** -0.5


def _batch(rng, context_lens, query_lens, *, num_seqs_padded=None, num_tokens_padded=None):
    """Paged cache (NaN outside owned slots), padded metadata from ``build_attn_metadata``, queries."""
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    paged = PagedBatch(rng, seq_lens=seq_lens, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                       block_size=BLOCK)
    md = jaxkv.build_attn_metadata(paged.block_tables, context_lens, query_lens, BLOCK,
                                   num_seqs_padded=num_seqs_padded, num_tokens_padded=num_tokens_padded)
    q = jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], NUM_HEADS, HEAD_SIZE)), jnp.float32)
    return q, jnp.asarray(paged.kv_cache, jnp.float32), md


class _Spy:
    """Wraps a kernel entry point and records the keyword arguments of each call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.fn(*args, **kwargs)


@pytest.fixture
def spies(monkeypatch):
    spy = {"prefill": _Spy(prefill_mod.paged_prefill_attention),
           "prefill_xla": _Spy(xla_mod.paged_prefill_attention_xla),
           "decode": _Spy(decode_mod.paged_attention),
           "decode_xla": _Spy(xla_mod.paged_attention_xla)}
    monkeypatch.setattr(prefill_mod, "paged_prefill_attention", spy["prefill"])
    monkeypatch.setattr(xla_mod, "paged_prefill_attention_xla", spy["prefill_xla"])
    monkeypatch.setattr(decode_mod, "paged_attention", spy["decode"])
    monkeypatch.setattr(xla_mod, "paged_attention_xla", spy["decode_xla"])
    return spy


def _called(spies):
    return {name for name, s in spies.items() if s.calls}


def test_mixed_batch_pallas_interpret_uses_prefill_kernel_and_matches_reference(rng, spies):
    """Prefill, chunk after a cached prefix, decode tokens, two dummies and padding tokens in one call."""
    q, kv, md = _batch(rng, context_lens=[0, 11, 8, 30], query_lens=[13, 6, 1, 1], num_seqs_padded=6,
                       num_tokens_padded=24)
    assert not md.is_decode_only
    out = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="pallas_interpret")
    assert _called(spies) == {"prefill"} and spies["prefill"].calls[0]["interpret"] is True
    ref = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="reference")
    assert _called(spies) == {"prefill", "prefill_xla"}
    num_real = 13 + 6 + 1 + 1
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out[:num_real], np.asarray(ref[:num_real], np.float64)) < TOLERANCE["float32"]
    np.testing.assert_array_equal(np.asarray(out[num_real:]), 0.0)  # padding tokens
    # the op adds nothing around the kernel: identical to calling it directly
    direct = prefill_mod.paged_prefill_attention(
        q, kv, md.block_tables, md.seq_lens, md.query_start_loc, scale=SCALE,
        max_query_len=md.max_query_len, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(direct))


def test_extras_reach_the_prefill_kernel(rng, spies):
    q, kv, md = _batch(rng, context_lens=[5, 0], query_lens=[9, 3])
    slopes = jnp.asarray(2.0 ** -np.arange(1, NUM_HEADS + 1), jnp.float32)
    extras = dict(sliding_window=4, logits_soft_cap=3.0, alibi_slopes=slopes)
    out = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="pallas_interpret", **extras)
    ref = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="reference", **extras)
    assert spies["prefill"].calls[0]["sliding_window"] == 4
    assert rel_err(out, np.asarray(ref, np.float64)) < TOLERANCE["float32"]


def test_compiled_impl_routes_prefill_to_the_kernel_uncompiled_on_cpu(rng, spies, monkeypatch):
    """impl="pallas" calls the prefill kernel with interpret=False (not run here: no GPU)."""
    q, kv, md = _batch(rng, context_lens=[0], query_lens=[5])
    monkeypatch.setattr(prefill_mod, "paged_prefill_attention",
                        _Spy(lambda q, *a, **k: jnp.zeros_like(q)))
    jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="pallas")
    assert prefill_mod.paged_prefill_attention.calls[0]["interpret"] is False
    assert not _called(spies)


def test_decode_only_batch_still_uses_the_decode_kernel(rng, spies):
    q, kv, md = _batch(rng, context_lens=[4, 17, 0], query_lens=[1, 1, 1], num_seqs_padded=4)
    assert md.is_decode_only
    out = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="pallas_interpret")
    assert _called(spies) == {"decode"}
    ref = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="reference")
    assert _called(spies) == {"decode", "decode_xla"}
    assert rel_err(out[:3], np.asarray(ref[:3], np.float64)) < TOLERANCE["float32"]


def test_prefill_kernel_inside_jit(rng):
    """As in the model step: the metadata is a traced pytree, the kernel still runs and matches."""
    q, kv, md = _batch(rng, context_lens=[3, 0], query_lens=[7, 1], num_seqs_padded=3)
    step = jax.jit(lambda q, kv, md: jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="pallas_interpret"))
    ref = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl="reference")
    assert rel_err(step(q, kv, md), np.asarray(ref, np.float64)) < TOLERANCE["float32"]


def _hopper() -> bool:
    d = jax.devices()[0]
    return d.platform == "gpu" and getattr(d, "compute_capability", "") == "9.0"


@pytest.mark.parametrize("impl", [pytest.param("pallas_interpret", marks=pytest.mark.skipif(
                                      jax.default_backend() == "gpu", reason="the Mosaic GPU interpreter is for CPU")),
                                  pytest.param("pallas", marks=pytest.mark.skipif(
                                      not _hopper(), reason="compiled Mosaic GPU kernels need an sm_90 GPU"))])
@pytest.mark.parametrize("apart,extras", [(True, {}), (False, {}),
                                          (True, dict(sliding_window=8, logits_soft_cap=5.0))])  # Gemma 3's extras
@pytest.mark.parametrize("order", ["decodes_first", "mixed_order"])
def test_mixed_batch_leading_decodes_on_the_mosaic_decode_kernel(rng, monkeypatch, apart, extras, order, impl):
    """Where decode runs on the Mosaic kernel and prefill on Triton (the 8B shape on an H100; forced here), a mixed
    batch's leading one-token rows go to the decode kernel and the rest to the prefill kernel; every real token
    matches the reference (interpreters on CPU, compiled on an H100), whatever the row order."""
    from jaxkv.attention import dispatch as attention_mod
    from pallas_kernels import paged_attention_mgpu as mgpu_mod
    from pallas_kernels import tuning
    monkeypatch.setattr(tuning, "MIXED_DECODES_FIRST_APART", apart)
    monkeypatch.setattr(attention_mod, "_use_mosaic", lambda kind, *a, **k: kind == "decode")
    decode_spy = _Spy(mgpu_mod.paged_attention_mgpu)
    monkeypatch.setattr(mgpu_mod, "paged_attention_mgpu", decode_spy)
    if order == "decodes_first":  # as the scheduler orders a mixed step: decodes over 30, 4 and 9 tokens, a one-token
        # last chunk of a prompt (a decode too), then a prefill and a chunk after a cached prefix; dummies; padding
        context_lens, query_lens = [30, 4, 9, 17, 0, 11], [1, 1, 1, 1, 13, 6]
    else:  # one-token rows after longer ones go to the prefill kernel
        context_lens, query_lens = [30, 0, 4, 11, 9], [1, 13, 1, 6, 1]
    q, kv, md = _batch(rng, context_lens, query_lens, num_seqs_padded=8, num_tokens_padded=32)
    q, kv = q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)
    out = jaxkv.paged_attention(q, kv, md, scale=SCALE, impl=impl, **extras)
    assert len(decode_spy.calls) == (1 if apart else 0)
    ref = np.asarray(jaxkv.paged_attention(q.astype(jnp.float32), kv.astype(jnp.float32), md, scale=SCALE,
                                           impl="reference", **extras), np.float64)
    num_real = sum(query_lens)
    got = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(got).all()
    for token in range(num_real):  # each token on its own: a wrong row would hide in a whole-batch norm
        assert rel_err(got[token], ref[token]) < TOLERANCE["bfloat16"], token
    np.testing.assert_array_equal(got[num_real:], 0.0)  # padding tokens
