"""The online-softmax step shared by the paged attention kernels (runs inside Pallas kernels).

The Triton kernels use natural ``exp``, not ``exp2``: a base-2 variant (log2(e) folded into the logit
scale, ``jnp.exp2`` → libdevice ``__nv_exp2f``) measured 13 % slower in the prefill kernel on the H200
(267 vs 306 TF/s at 8192 tokens; docs/perf-notes.md). The Mosaic GPU kernels
use :func:`softmax_rescale_exp2` (``ex2.approx`` with ``approx_math``) and do ``P V`` with ``wgmma``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


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


def softmax_rescale_exp2(acc, m_prev, l_prev, logits):
    """The Mosaic GPU kernels' online-softmax step before ``P V``, in base 2 (``log2 e`` already folded
    into the logits).

    Args:
        acc: f32[rows, head] running output (WGMMA layout), scaled to the running max.
        m_prev, l_prev: f32[rows] running max and sum of ``exp2(logits - max)``.
        logits: f32[rows, keys] with ``-inf`` where a key is invisible.

    Returns:
        ``(acc, m, l, p)``: ``acc`` rescaled to the new max ``m``, the new sum ``l``, and ``p``
        (f32[rows, keys]) for ``acc += p @ v``. A row that has seen only ``-inf`` keeps ``acc = 0,
        l = 0`` (its max stays ``-inf``; ``p`` is 0).
    """
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)   # a row with no visible key stays 0
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(logits - lax.broadcast_in_dim(m_safe, logits.shape, [0]))
    l_next = l_prev * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return acc, m_next, l_next, p


def accumulate_pv(acc, p16, v_tile, p_tile=None, during=None):
    """The Mosaic GPU kernels' ``acc + P V`` after :func:`softmax_rescale_exp2`, with ``wgmma``.

    Args:
        acc: f32[rows, head] rescaled running output (WGMMA layout).
        p16: [rows, keys] P in the 16-bit compute dtype (WGMMA layout).
        v_tile: [keys, head] V tile in shared memory (invisible rows already zeroed).
        p_tile: ``None``: P from registers into the running accumulator (compiled kernels). Else a
            [rows, keys] shared-memory tile: P is written there and multiplied into a fresh accumulator
            added to ``acc`` (what the interpreter runs: ``wgmma`` only from shared memory, and no
            accumulator initialised from registers).
        during: called (traced) after the ``wgmma`` is issued and before it is waited for: work that
            overlaps it (it must not write ``v_tile`` or ``p_tile``); ``None``: nothing.

    Returns:
        f32[rows, head] ``acc + P V``.
    """
    during = during or (lambda: None)
    if p_tile is None:
        def pv_in_place(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_tile)
            during()
        return pl.run_state(pv_in_place)(plgpu.ACC.init(acc))
    p_tile[...] = p16
    plgpu.commit_smem()

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_tile, v_tile)
        during()
        return acc_ref[...]
    return acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
