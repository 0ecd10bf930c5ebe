"""Query tiles of a varlen batch, flattened: the grid of the Triton paged prefill kernel.

Every sequence's new tokens (``query_start_loc``) are split into tiles of ``tokens_per_tile`` tokens,
sequences back to back, so a kernel launches one program per tile that holds a query row instead of
``num_seqs x cdiv(max_query_len, tokens_per_tile)`` (vLLM's unified attention walks its "q blocks" the
same way). Host-side XLA ops on ``int32`` vectors, run once per call before the kernel. (The Mosaic GPU
prefill kernel tiles the flat token range instead and finds a tile's sequences inside the kernel.)
"""

from __future__ import annotations

import jax.numpy as jnp


def query_tiles(query_start_loc, num_tiles: int, tokens_per_tile: int, *, last_first: bool = False):
    """Which sequence and rows each of ``num_tiles`` tiles covers.

    Args:
        query_start_loc: ``int32[num_seqs + 1]``.
        num_tiles: static tile count, at least ``sum_s cdiv(query_len_s, tokens_per_tile)``; tiles past the
            work own no row.
        tokens_per_tile: new tokens per tile (static).
        last_first: inside a sequence, order its tiles from the last (most keys under a causal mask) to
            the first.

    Returns:
        ``(tile_seq, tile_row0, tile_q_len, first_tile)``: ``int32[num_tiles]`` sequence (clipped into
        range for tiles past the work), first new-token index inside it (0 past the work) and its
        ``query_len`` (0 past the work), and ``int32[num_seqs]`` each sequence's first tile.
    """
    num_seqs = query_start_loc.shape[0] - 1
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    first_tile = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles).astype(jnp.int32)])
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fused compare-and-sum; the default method is a loop (an XLA while on the device)
    after = jnp.searchsorted(first_tile, j, side="right", method="compare_all")
    tile_seq = jnp.clip(after - 1, 0, num_seqs - 1).astype(jnp.int32)
    owned = j < first_tile[-1]
    local = first_tile[tile_seq + 1] - 1 - j if last_first else j - first_tile[tile_seq]
    tile_row0 = jnp.where(owned, local * tokens_per_tile, 0)
    tile_q_len = jnp.where(owned, q_lens[tile_seq], 0)
    return tile_seq, tile_row0.astype(jnp.int32), tile_q_len.astype(jnp.int32), first_tile[:-1]
