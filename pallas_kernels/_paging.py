"""How the paged kernels walk a sequence's K/V: the inner-loop step geometry and the page gather.

Both kernels (decode and prefill) fold the keys of a sequence into an online softmax one *step* at a
time. A step is ``pages`` pages of ``tokens`` slots each: either whole pages (``tokens == block_size``,
``pages >= 1``), or, when one page is too large for a register/shared-memory tile, a slice of one page
(``pages == 1``, ``tokens`` a power of two dividing ``block_size``). Step ``j`` of a walk covers the
``block_k = pages * tokens`` key positions ``[j * block_k, (j + 1) * block_k)`` of the walk's origin, so
the two cases share one formula.

Two hardware rules fix the geometry, and each was a bug before it was written down here:

* ``block_k >= MIN_DOT_K`` (16): the step's keys are the N dimension of ``q @ kᵀ`` and the K dimension of
  ``p @ v``. Pallas' Triton lowering emits ``tt.dot`` for any shape, but Triton's MMA layouts assume
  16; a decode step of one 8-slot page (block size 8 with a one-column block table) compiled and
  returned wrong numbers on an H100 (issue 9). Short pages therefore always go several to a step.
* one K (or V) tile ``block_k * head_p * itemsize`` at most ``max_tile_bytes``: Triton pipelines the
  gathers through shared memory (tile x 2 (K, V) x stages must fit 227 KiB) and holds the tile in
  registers. A 128-slot page of head size 256 in bf16 is 64 KiB: read in slices.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_DOT_K = 16  # keys per step, channels per head: the smallest dot dimension Triton's MMA handles


def padded_head_size(head_size: int) -> int:
    """Channels the kernels compute with: the next power of two, at least 16 (extra lanes masked)."""
    return max(MIN_DOT_K, pl.next_power_of_2(head_size))


@dataclasses.dataclass(frozen=True)
class KVStep:
    """One inner-loop step: ``pages`` pages x ``tokens`` slots (see the module docstring)."""

    pages: int
    tokens: int

    @property
    def block_k(self) -> int:
        return self.pages * self.tokens


def kv_step(*, block_size: int, head_size: int, itemsize: int, pages: int, max_tile_bytes: int,
            max_pages: int | None = None) -> KVStep:
    """The step geometry for a cache of ``block_size``-slot pages.

    Args:
        block_size: slots per page (a power of two).
        head_size: channels per head (padded with :func:`padded_head_size` for the tile size).
        itemsize: bytes per cached element (fp8: 1).
        pages: the wanted pages per step (a power of two), from the tuning tables or the caller.
        max_tile_bytes: the most bytes one K (or V) tile may take.
        max_pages: pages the block table holds; a step takes no more pages than that (rounded up to a
            power of two) unless a dot needs them, ``None``: no limit.

    Returns:
        A :class:`KVStep` with ``block_k >= MIN_DOT_K``: whole pages when one page fits a tile (at least
        ``cdiv(16, block_size)`` of them), else slices of ``tokens`` slots of one page, the largest power
        of two >= 16 whose tile fits.
    """
    head_p = padded_head_size(head_size)
    tokens = block_size
    while tokens > MIN_DOT_K and tokens * head_p * itemsize > max_tile_bytes:
        tokens //= 2
    if tokens < block_size:
        return KVStep(pages=1, tokens=tokens)
    if max_pages is not None:
        pages = min(pages, pl.next_power_of_2(max(1, max_pages)))
    return KVStep(pages=max(pages, pl.cdiv(MIN_DOT_K, block_size)), tokens=block_size)


def load_kv_step(k_ref, v_ref, block_ids, slot0, *, step: KVStep, head_size: int, visible,
                 masked_loads: bool, dtype):
    """Gather one step's K and V: ``[block_k, head_p]`` each, in ``dtype``, invisible lanes 0.

    Args:
        k_ref, v_ref: ``[num_blocks, block_size, head_size]`` pages of one KV head.
        block_ids: ``i32[step.pages]`` physical pages of the step (already clipped to the cache).
        slot0: first slot read in each page (0 unless the step is a slice of a page).
        step: the geometry.
        head_size: channels stored per head; ``head_p`` channels are computed, the rest masked.
        visible: ``bool[step.pages, step.tokens]`` visible slots, or ``None`` when all are.
        masked_loads: invisible slots are not read (masked loads); with ``False`` they are read
            (plain gathers, faster when few slots are invisible) and zeroed after, so stale or NaN
            slots never reach ``p @ v``.
        dtype: the compute dtype (fp8 pages are cast here; their scale is applied by the caller).
    """
    head_p = padded_head_size(head_size)
    shape = (step.pages, step.tokens, head_p)
    d = jnp.arange(head_p)
    d_valid = (d < head_size)[None, None, :] if head_p != head_size else None
    lanes = None if visible is None else visible[:, :, None]   # lanes to keep
    if d_valid is not None:
        lanes = d_valid if lanes is None else lanes & d_valid
    load_mask = lanes if masked_loads else d_valid
    if load_mask is None and step.tokens == k_ref.shape[1]:
        k, v = k_ref[block_ids], v_ref[block_ids]  # whole pages, every lane: plain gathers
    else:
        # Unclipped slot/channel indices: masked lanes are never accessed, and a clip would hide the
        # channel index's contiguity from Triton (2-byte scalar loads instead of 16-byte vectors).
        index = (block_ids[:, None, None], (slot0 + jnp.arange(step.tokens))[None, :, None],
                 d[None, None, :])
        if load_mask is not None:
            load_mask = jnp.broadcast_to(load_mask, shape)
        # No `other=` (fp8 refs cannot take it): masked lanes are undefined, zeroed after the cast.
        k = plgpu.load(k_ref.at[index], mask=load_mask)
        v = plgpu.load(v_ref.at[index], mask=load_mask)
    k, v = k.astype(dtype), v.astype(dtype)
    if lanes is not None:
        lanes = jnp.broadcast_to(lanes, shape)
        k, v = jnp.where(lanes, k, 0), jnp.where(lanes, v, 0)
    return k.reshape(step.block_k, head_p), v.reshape(step.block_k, head_p)
