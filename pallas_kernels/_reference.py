"""The plain-jnp attention over a paged cache that both references (decode and prefill) are made of."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def kv_scales(k_scale, v_scale) -> tuple[jax.Array, jax.Array]:
    """``(k_scale, v_scale)``, each ``f32[1]``: the fp8 dequantisation scales, 1 where not given.

    Two one-element arrays rather than one ``f32[2]``: XLA rewrites a uniform constant array (``[1, 1]``,
    the scales of every bf16 call) into a broadcast of a scalar, and a kernel operand built that way
    costs one ``loop_broadcast_fusion`` launch per call (0.9 us on the H100, per attention layer); a
    one-element constant stays a constant. NumPy constants when not given or Python numbers.
    """
    def one(x):
        if x is None or isinstance(x, (int, float)):
            return np.array([1.0 if x is None else x], np.float32)
        return jnp.asarray(x, jnp.float32).reshape(1)
    return one(k_scale), one(v_scale)


def dense_kv_from_pages(kv_cache: jax.Array, block_tables: jax.Array,
                        seq_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gather each sequence's pages into dense float32 K and V (reference helper).

    Args:
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``; ids are clipped into range.
        seq_lens: ``int32[num_seqs]``; positions ``>= seq_lens`` are zeroed (pages may hold NaN).

    Returns:
        ``(k, v)``, each ``f32[num_seqs, num_kv_heads, max_num_blocks_per_seq * block_size, head_size]``.
    """
    _, num_blocks, num_kv_heads, block_size, head_size = kv_cache.shape
    num_seqs, max_blocks = block_tables.shape
    max_len = max_blocks * block_size
    ids = jnp.clip(block_tables, 0, num_blocks - 1)
    # [2, num_seqs, max_blocks, kvh, block_size, hs] → [2, num_seqs, kvh, max_len, hs]
    kv = kv_cache[:, ids].transpose(0, 1, 3, 2, 4, 5).reshape(2, num_seqs, num_kv_heads, max_len, head_size)
    valid = jnp.arange(max_len)[None, :] < seq_lens[:, None]
    kv = jnp.where(valid[None, :, None, :, None], kv.astype(jnp.float32), 0)
    return kv[0], kv[1]


def paged_attention_dense(qs: jax.Array, q_pos: jax.Array, kv_cache: jax.Array, block_tables: jax.Array,
                          seq_lens: jax.Array, *, scale: float, k_scale, v_scale, alibi_slopes,
                          sliding_window: int | None, logits_soft_cap: float | None) -> jax.Array:
    """Each query attends causally to its sequence's cached tokens, float32 softmax.

    Query ``(s, i)`` at position ``p = q_pos[s, i]`` sees key ``t`` iff ``t <= p``, ``t < seq_lens[s]`` and,
    with a window, ``t > p - sliding_window``. Logits: ``scale * k_scale * q·k`` → soft cap →
    ``+ slope * (t - p)``; output ``v_scale * softmax @ v`` (0 for a query that sees nothing).

    Args:
        qs: ``[num_seqs, max_q, num_heads, head_size]``.
        q_pos: ``int32[num_seqs, max_q]``.
        kv_cache, block_tables, seq_lens, and the options: as in the public ops.

    Returns:
        ``f32[num_seqs, max_q, num_heads, head_size]``.
    """
    num_seqs, max_q, num_heads, head_size = qs.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    qs = qs.astype(jnp.float32).reshape(num_seqs, max_q, num_kv_heads, group, head_size)
    k, v = dense_kv_from_pages(kv_cache, block_tables, seq_lens)         # [s, kvh, max_len, D]
    t = jnp.arange(k.shape[2])
    allowed = (t[None, None, :] <= q_pos[:, :, None]) & (t[None, None, :] < seq_lens[:, None, None])
    if sliding_window is not None:
        allowed &= t[None, None, :] > q_pos[:, :, None] - sliding_window
    k_scale, v_scale = kv_scales(k_scale, v_scale)

    logits = jnp.einsum("sqkgd,sktd->skgqt", qs, k, precision=lax.Precision.HIGHEST) * (scale * k_scale[0])
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
    return o.reshape(num_seqs, max_q, num_heads, head_size) * v_scale[0]
