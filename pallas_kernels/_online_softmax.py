"""The online-softmax step shared by the paged attention kernels (runs inside Pallas kernels).

The kernels keep logits in base-2 units (``log2(e) * logits``) and use ``exp2``: on NVIDIA GPUs ``exp2``
lowers to one ``ex2.approx`` instruction, while ``exp`` lowers to libdevice's ``__nv_expf`` (about eight
instructions per element), which matters in the compute-bound prefill kernel.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)


def base2_logits(qk, *, scale: float, k_scale, logits_soft_cap: float | None, alibi_bias=None):
    """f32 ``q·k`` → ``(logits, logit_scale)`` whose product is the base-2 logits
    ``log2(e) * (softcap(scale * k_scale * q·k) + alibi_bias)``.

    Without a soft cap or ALiBi the scale is left to :func:`online_softmax_step` (``logit_scale > 0``), where
    the multiply fuses with the max subtraction into one FMA per element."""
    if logits_soft_cap is None and alibi_bias is None:
        return qk, scale * LOG2E * k_scale
    logits = qk * (scale * k_scale)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if alibi_bias is not None:
        logits += alibi_bias
    return logits * LOG2E, None


def dot_f32(a, b, *, contract_b_dim: int):
    """a[m, k] · b → f32[m, n]; b is [n, k] (contract_b_dim=1) or [k, n] (contract_b_dim=0).

    f32 operands use full precision (Triton would otherwise use TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (contract_b_dim,)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def online_softmax_step(acc, m_prev, l_prev, logits, v, logit_scale=None):
    """Fold one tile of masked logits into the running (acc, max, sum).

    Args:
        acc: f32[rows, head] running ``sum(p @ v)`` scaled to the running max.
        m_prev, l_prev: f32[rows] running max (base 2) and sum of ``exp2(logits - max)``.
        logits: f32[rows, tile], times ``logit_scale`` the base-2 logits (:func:`base2_logits`); ``-inf``
            where a key is invisible.
        v: [tile, head] values (invisible rows already zeroed).
        logit_scale: positive f32 scalar multiplying ``logits``, or ``None`` for 1.

    Returns:
        The updated ``(acc, m, l)``; a row that has seen only ``-inf`` keeps ``acc = 0, l = 0``.
    """
    tile_max = logits.max(axis=-1)
    if logit_scale is not None:  # max commutes with a positive scale
        tile_max = tile_max * logit_scale
    m_next = jnp.maximum(m_prev, tile_max)
    m_safe = jnp.where(jnp.isneginf(m_next), 0.0, m_next)  # a fully masked row stays 0, not NaN
    correction = jnp.exp2(m_prev - m_safe)
    if logit_scale is None:
        p = jnp.exp2(logits - m_safe[:, None])
    else:
        p = jnp.exp2(logits * logit_scale - m_safe[:, None])  # one FMA + ex2 per element
    l_next = l_prev * correction + p.sum(axis=-1)
    acc = acc * correction[:, None] + dot_f32(p.astype(v.dtype), v, contract_b_dim=0)
    return acc, m_next, l_next
