"""Paged prefill / chunked-prefill attention: many new query tokens per sequence.

vLLM: ``PagedAttention.forward_prefix`` (``context_attention_fwd``). Each new token attends causally to
the sequence's cached prefix and to the new tokens up to itself, all read from the paged cache after the
new tokens' K/V were written (one code path for prefill, chunked prefill and prefix reuse).

Only the reference exists so far; it is what the model's prefill uses on every platform. The Pallas
kernel is a separate piece of work (issue 5) and will live beside it with the same signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import _kv_scales, dense_kv_from_pages


@functools.partial(jax.jit, static_argnames=("scale", "max_query_len", "sliding_window", "logits_soft_cap"))
def paged_prefill_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float,
    max_query_len: int,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Causal varlen attention over the paged cache (plain jnp, float32 softmax).

    Args:
        q: ``[num_tokens, num_heads, head_size]``, the new tokens of all sequences, concatenated.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` holding every token of every
            sequence up to its ``seq_len`` (the new ones included).
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]`` cached + new tokens.
        query_start_loc: ``int32[num_seqs + 1]``; sequence ``s`` owns tokens
            ``[query_start_loc[s], query_start_loc[s+1])`` of ``q``. Tokens past ``query_start_loc[-1]``
            are padding: their output is 0.
        scale: softmax scale.
        max_query_len: static bound on ``query_start_loc[s+1] - query_start_loc[s]``.
        k_scale, v_scale, alibi_slopes, sliding_window, logits_soft_cap: as in
            :func:`pallas_kernels.paged_attention.paged_attention`, with the query token's own position
            ``p`` in place of ``seq_len - 1`` (ALiBi bias ``slope * (t - p)``, window ``t > p - window``).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.
    """
    num_tokens, num_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_heads // num_kv_heads
    max_len = max_blocks * block_size

    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    context_lens = seq_lens - query_lens
    i = jnp.arange(max_query_len)
    q_valid = i[None, :] < query_lens[:, None]                         # [num_seqs, max_q]
    q_idx = jnp.where(q_valid, query_start_loc[:-1, None] + i[None, :], num_tokens)
    qs = q.at[q_idx].get(mode="fill", fill_value=0).astype(jnp.float32)  # [s, max_q, H, D]
    qs = qs.reshape(num_seqs, max_query_len, num_kv_heads, group, head_size)

    k, v = dense_kv_from_pages(kv_cache, block_tables, seq_lens)         # [s, kvh, max_len, D]
    q_pos = context_lens[:, None] + i[None, :]                           # [s, max_q]
    t = jnp.arange(max_len)
    allowed = (t[None, None, :] <= q_pos[:, :, None]) & (t[None, None, :] < seq_lens[:, None, None])
    if sliding_window is not None:
        allowed &= t[None, None, :] > q_pos[:, :, None] - sliding_window
    scales = _kv_scales(k_scale, v_scale)

    logits = jnp.einsum("sqkgd,sktd->skgqt", qs, k, precision=lax.Precision.HIGHEST) * (scale * scales[0])
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1)
        logits += slopes * (t[None, None, :] - q_pos[:, :, None]).astype(jnp.float32)[:, None, None]
    logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isneginf(m), 0.0, m))
    denom = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("skgqt,sktd->sqkgd", p / jnp.where(denom == 0.0, 1.0, denom), v,
                   precision=lax.Precision.HIGHEST)
    o = o.reshape(num_seqs, max_query_len, num_heads, head_size) * scales[1]
    out = jnp.zeros((num_tokens, num_heads, head_size), jnp.float32)
    out = out.at[q_idx].set(o, mode="drop")
    return out.astype(q.dtype)
