"""The memory warpgroup of the Mosaic GPU paged kernels: K/V pages by TMA through the block table.

Shared by :mod:`pallas_kernels.paged_attention_mgpu` (decode) and
:mod:`pallas_kernels.paged_prefill_attention_mgpu` (prefill). Both walk a program's keys ``block_kv``
tokens per step; step ``i`` of the program covers tokens ``[step_token(i), step_token(i) + block_kv)``
and lands in slot ``i % num_stages`` of a shared-memory ring of K tiles and one of V tiles
(``[num_stages, block_kv, head_size]``), one TMA copy per page (or page slice of ``tokens_per_copy``
tokens) arriving on the slot's barrier. A slot is refilled once the consumers have arrived on its
"consumed" barrier.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def produce_kv_ring(kv_ref, tables_ref, s, h, *, step_token: Callable, num_steps, num_pages, block_kv: int,
                    tokens_per_copy: int, num_stages: int, k_smem, v_smem, k_bars, v_bars, k_consumed,
                    v_consumed) -> None:
    """Issue the TMA copies of ``num_steps`` K/V steps of sequence ``s``, KV head ``h``.

    Args:
        kv_ref: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` cache in global memory.
        tables_ref: ``int32[num_seqs, >= num_pages]`` block tables in global memory.
        s, h: sequence row and KV head (traced scalars).
        step_token: ``i -> `` the first token position of the program's step ``i`` (traced).
        num_steps: steps to copy (traced, may be 0).
        num_pages: pages the sequence owns; pages past it are read from block 0 (the kernels mask or zero
            their slots, so any finite or NaN content is harmless).
        block_kv, tokens_per_copy, num_stages: static; ``tokens_per_copy`` divides ``block_kv`` and is at
            most the block size.
        k_smem, v_smem: the rings; k_bars, v_bars: one barrier per slot (``block_kv // tokens_per_copy``
            arrivals); k_consumed, v_consumed: the consumers' barriers per slot.
    """
    def issue(i, slot, cache, tiles, bars):
        issue_kv_step(kv_ref, tables_ref, s, h, step_token(i), slot, cache, tiles, bars, num_pages=num_pages,
                      block_kv=block_kv, tokens_per_copy=tokens_per_copy)

    for i in range(num_stages):                              # fill the ring
        @pl.when(i < num_steps)
        def _prologue():
            issue(i, i, 0, k_smem, k_bars)
            issue(i, i, 1, v_smem, v_bars)

    @pl.loop(0, jnp.maximum(num_steps - num_stages, 0))
    def _steady(i):
        slot = lax.rem(i, num_stages)
        plgpu.barrier_wait(k_consumed.at[slot])
        issue(i + num_stages, slot, 0, k_smem, k_bars)
        plgpu.barrier_wait(v_consumed.at[slot])
        issue(i + num_stages, slot, 1, v_smem, v_bars)


def step_pages(kv_ref, tables_ref, s, t0, *, num_pages, block_kv: int, tokens_per_copy: int) -> list:
    """``(page_id, row offset)`` of each TMA copy of the step at token ``t0`` of sequence ``s``: the block table's
    scalar loads, all issued before any copy uses one (a warp issues in order: a load between two copies waits
    for the first copy's page id). Pages at or past ``num_pages`` are block 0 (and the table is never read past
    its last column)."""
    num_blocks, block_size = kv_ref.shape[1], kv_ref.shape[3]
    tokens = [t0 + c * tokens_per_copy for c in range(block_kv // tokens_per_copy)]
    page_ids = [tables_ref[s, jnp.minimum(t // block_size, tables_ref.shape[1] - 1)]   # steps may pass the
                for t in tokens]                                                       # table's end
    return [(jnp.clip(jnp.where(t // block_size < num_pages, page_id, 0), 0, num_blocks - 1),
             t % block_size if tokens_per_copy < block_size else 0) for t, page_id in zip(tokens, page_ids)]


def issue_kv_step(kv_ref, tables_ref, s, h, t0, slot, cache: int, tiles, bars, *, num_pages, block_kv: int,
                  tokens_per_copy: int, pages: list | None = None) -> None:
    """The TMA copies of one step: K (``cache`` 0) or V (1) of tokens ``[t0, t0 + block_kv)`` of sequence
    ``s``, KV head ``h``, into ``tiles[slot]``, arriving on ``bars[slot]`` (``block_kv // tokens_per_copy``
    copies, one per page or page slice). Pages at or past ``num_pages`` are read from block 0 (and the
    table is never read past its last column). ``pages``: the step's :func:`step_pages` when already loaded
    (``None``: each copy's page id is loaded just before it)."""
    if pages is not None:
        for c, (page_id, offset) in enumerate(pages):
            plgpu.copy_gmem_to_smem(
                kv_ref.at[cache, page_id, h, pl.ds(offset, tokens_per_copy)],
                tiles.at[slot, pl.ds(c * tokens_per_copy, tokens_per_copy)],
                bars.at[slot])
        return
    num_blocks, block_size = kv_ref.shape[1], kv_ref.shape[3]
    for c in range(block_kv // tokens_per_copy):
        token = t0 + c * tokens_per_copy
        page = token // block_size
        page_id = tables_ref[s, jnp.minimum(page, tables_ref.shape[1] - 1)]   # steps may pass the table
        page_id = jnp.clip(jnp.where(page < num_pages, page_id, 0), 0, num_blocks - 1)
        offset = token % block_size if tokens_per_copy < block_size else 0
        plgpu.copy_gmem_to_smem(
            kv_ref.at[cache, page_id, h, pl.ds(offset, tokens_per_copy)],
            tiles.at[slot, pl.ds(c * tokens_per_copy, tokens_per_copy)],
            bars.at[slot])


def issue_ring_step(g, step_token: Callable, issue: Callable, *, num_stages: int, k_smem, v_smem, k_bars,
                    v_bars, k_consumed, v_consumed, pages: Callable | None = None):
    """The persistent kernels' memory warpgroup, one step: the program's ``g``-th K/V step (counted across
    its items) into slot ``g % num_stages``, after the consumers released that slot's previous step
    (the phase of step ``g - num_stages``; no wait while the ring fills). ``step_token()`` is the step's
    first token; ``issue(t0, slot, cache, tiles, bars)`` (:func:`issue_kv_step` with its sequence bound)
    starts the step's copies of K (``cache`` 0) or V (1). ``pages``: ``t0 ->`` the step's :func:`step_pages`,
    then loaded once for K and V before the slot waits (their latency hides behind the waits) and passed to
    ``issue`` as ``pages=``; ``None``: ``issue`` loads each copy's page id before it, for K and again for V.
    Returns ``g + 1``."""
    slot = lax.rem(g, num_stages)
    refill = g >= num_stages
    t0 = step_token()
    if pages is not None:
        issue = functools.partial(issue, pages=pages(t0))
    for cache, (tiles, bars, consumed) in enumerate(((k_smem, k_bars, k_consumed), (v_smem, v_bars, v_consumed))):
        with jax.named_scope("wait_slot"):                   # profiler regions (paged_attention_mgpu.PROFILE)
            pl.when(refill)(functools.partial(plgpu.barrier_wait, consumed.at[slot]))
        with jax.named_scope("issue"):
            issue(t0, slot, cache, tiles, bars)
    return g + 1
