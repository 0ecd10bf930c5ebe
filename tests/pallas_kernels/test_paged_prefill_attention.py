"""The paged prefill/chunked-prefill reference vs a float64 loop over query tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_prefill_attention import paged_prefill_attention_reference
from tests.conftest import TOLERANCE, PagedBatch, rel_err
from tests.conftest import prefill_attention_loop as prefill_loop


@pytest.mark.parametrize("extra", [{}, dict(sliding_window=7), dict(logits_soft_cap=3.0),
                                   dict(alibi=True)], ids=["plain", "window", "softcap", "alibi"])
def test_prefill_reference_matches_loop(rng, extra):
    bs = 8
    seq_lens = [9, 16, 30, 5]
    query_lens = [9, 1, 12, 5]  # full prompt, a decode token, a chunk after a cached prefix, prompt
    batch = PagedBatch(rng, seq_lens=seq_lens, num_kv_heads=2, head_size=32, block_size=bs)
    q = rng.standard_normal((sum(query_lens) + 3, 6, 32))  # 3 padding tokens at the end
    kwargs = {k: v for k, v in extra.items() if k != "alibi"}
    slopes = 2.0 ** -np.arange(1, 7) if extra.get("alibi") else None
    expected = prefill_loop(q[:sum(query_lens)], batch, query_lens, 32 ** -0.5, alibi_slopes=slopes,
                            **kwargs)
    out = paged_prefill_attention_reference(
        jnp.asarray(q, jnp.float32), jnp.asarray(batch.kv_cache, jnp.float32),
        jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens),
        jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32), scale=32 ** -0.5,
        max_query_len=16, alibi_slopes=None if slopes is None else jnp.asarray(slopes, jnp.float32),
        **kwargs)
    out = np.asarray(out, np.float64)
    assert rel_err(out[:sum(query_lens)], expected) < TOLERANCE["float32"]
    np.testing.assert_array_equal(out[sum(query_lens):], 0.0)  # padding tokens belong to no sequence
