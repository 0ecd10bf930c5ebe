"""The online-softmax step shared by the paged attention kernels (runs inside Pallas kernels).

Natural ``exp``, not ``exp2``: a base-2 variant (log2(e) folded into the logit scale, ``jnp.exp2`` →
libdevice ``__nv_exp2f``) measured 13 % slower in the prefill kernel on the H200 (267 vs 306 TF/s at
8192 tokens; docs/perf-notes.md), so it was reverted.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def scaled_logits(qk, *, scale: float, k_scale, logits_soft_cap: float | None, alibi_bias=None):
    """f32 ``q·k`` → ``softcap(scale * k_scale * q·k) + alibi_bias`` (each term only when given)."""
    logits = qk * (scale * k_scale)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if alibi_bias is not None:
        logits += alibi_bias
    return logits


def dot_f32(a, b, *, contract_b_dim: int):
    """a[m, k] · b → f32[m, n]; b is [n, k] (contract_b_dim=1) or [k, n] (contract_b_dim=0).

    f32 operands use full precision (Triton would otherwise use TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (contract_b_dim,)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def online_softmax_step(acc, m_prev, l_prev, logits, v):
    """Fold one tile of masked logits into the running (acc, max, sum).

    Args:
        acc: f32[rows, head] running ``sum(p @ v)`` scaled to the running max.
        m_prev, l_prev: f32[rows] running max and sum of ``exp(logits - max)``.
        logits: f32[rows, tile] with ``-inf`` where a key is invisible.
        v: [tile, head] values (invisible rows already zeroed).

    Returns:
        The updated ``(acc, m, l)``; a row that has seen only ``-inf`` keeps ``acc = 0, l = 0``.
    """
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))
    m_safe = jnp.where(jnp.isneginf(m_next), 0.0, m_next)  # a fully masked row stays 0, not NaN
    correction = jnp.exp(m_prev - m_safe)
    p = jnp.exp(logits - m_safe[:, None])
    l_next = l_prev * correction + p.sum(axis=-1)
    acc = acc * correction[:, None] + dot_f32(p.astype(v.dtype), v, contract_b_dim=0)
    return acc, m_next, l_next
