"""The online-softmax step shared by the paged attention kernels (runs inside Pallas kernels)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


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
