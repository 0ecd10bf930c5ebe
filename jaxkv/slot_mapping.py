"""Slot mapping: where each new token's K/V goes in the paged cache.

``slot = block_table[position // block_size] * block_size + position % block_size``; tokens whose K/V
must not be written get ``PAD_SLOT_ID``. vLLM: ``vllm/attention/backends/utils.py``
(``compute_slot_mapping``, ``compute_slot_mapping_start_idx``, ``PAD_SLOT_ID``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PAD_SLOT_ID = -1
"""Slot of a token whose K/V is not written (padding, sliding-window-masked prompt tokens)."""


def compute_slot_mapping_start_idx(is_prompt: bool, query_len: int, context_len: int,
                                   sliding_window: int | None) -> int:
    """First prompt token whose K/V is kept. vLLM: ``compute_slot_mapping_start_idx``.

    With a sliding window, a prompt's first ``query_len - sliding_window`` tokens are never attended to
    again, so they are masked with ``PAD_SLOT_ID``. ``context_len`` is accepted for vLLM parity (unused,
    as in vLLM).
    """
    del context_len
    if is_prompt and sliding_window is not None:
        return max(0, query_len - sliding_window)
    return 0


def compute_slot_mapping(is_profile_run: bool, seq_len: int, context_len: int, start_idx: int,
                         block_size: int, block_table) -> np.ndarray:
    """Slots of tokens ``[context_len, seq_len)`` of one sequence. vLLM: ``compute_slot_mapping``.

    Args:
        is_profile_run: block tables are not built yet: every slot is ``PAD_SLOT_ID``.
        seq_len: tokens of the sequence after this step.
        context_len: tokens already in the cache.
        start_idx: tokens before this index are masked (``compute_slot_mapping_start_idx``).
        block_size: tokens per block.
        block_table: ``int[>= cdiv(seq_len, block_size)]`` physical block of each logical block.

    Returns:
        ``int64[seq_len - context_len]`` (vLLM appends to a list; we return the piece).

    Raises:
        ValueError: ``context_len > seq_len``, ``block_size < 1`` or a block table too short.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if not 0 <= context_len <= seq_len:
        raise ValueError(f"context_len={context_len} must be in [0, seq_len={seq_len}]")
    if is_profile_run:
        return np.full(seq_len, PAD_SLOT_ID, np.int64)
    padding = max(0, start_idx - context_len)
    start = max(start_idx, context_len)
    table = np.asarray(block_table, np.int64)
    needed = -(-seq_len // block_size)
    if seq_len > start and table.shape[0] < needed:
        raise ValueError(f"block_table has {table.shape[0]} blocks; seq_len={seq_len} needs {needed}")
    idx = np.arange(start, seq_len)
    slots = table[idx // block_size] * block_size + idx % block_size
    return np.concatenate([np.full(padding, PAD_SLOT_ID, np.int64), slots])


def compute_slot_mapping_batch(block_tables: np.ndarray, context_lens, seq_lens, block_size: int, *,
                               sliding_window: int | None = None, is_prompt=None) -> np.ndarray:
    """Slot mapping of a whole batch in one vectorised pass (tokens of all sequences concatenated).

    Equivalent to calling :func:`compute_slot_mapping` with
    :func:`compute_slot_mapping_start_idx` for each sequence and concatenating (vLLM's builder loop).

    Args:
        block_tables: ``int[num_seqs, max_num_blocks_per_seq]``.
        context_lens: ``int[num_seqs]`` tokens already cached.
        seq_lens: ``int[num_seqs]`` tokens after this step.
        block_size: tokens per block.
        sliding_window: window in tokens, or ``None``.
        is_prompt: ``bool[num_seqs]``; defaults to ``context_lens == 0``.

    Returns:
        ``int64[sum(seq_lens - context_lens)]``.

    Raises:
        ValueError: a context longer than its sequence or a block table too narrow.
    """
    tables = np.asarray(block_tables, np.int64)
    context_lens = np.asarray(context_lens, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    if np.any(context_lens > seq_lens) or np.any(context_lens < 0):
        bad = int(np.flatnonzero((context_lens > seq_lens) | (context_lens < 0))[0])
        raise ValueError(f"context_lens[{bad}]={context_lens[bad]} must be in [0, seq_lens[{bad}]="
                         f"{seq_lens[bad]}]")
    needed = -(-seq_lens // block_size)
    if needed.size and needed.max() > tables.shape[1]:
        raise ValueError(f"block_tables width {tables.shape[1]} < {needed.max()} blocks needed by "
                         f"seq_lens max {seq_lens.max()}")
    query_lens = seq_lens - context_lens
    if is_prompt is None:
        is_prompt = context_lens == 0
    start_idx = np.zeros_like(seq_lens)
    if sliding_window is not None:
        start_idx = np.where(np.asarray(is_prompt), np.maximum(0, query_lens - sliding_window), 0)
    seq_of_token = np.repeat(np.arange(len(seq_lens)), query_lens)
    first = np.cumsum(query_lens) - query_lens
    position = context_lens[seq_of_token] + np.arange(query_lens.sum()) - first[seq_of_token]
    slots = tables[seq_of_token, position // block_size] * block_size + position % block_size
    return np.where(position < start_idx[seq_of_token], PAD_SLOT_ID, slots)


def slot_mapping_from_positions(block_tables: jax.Array, seq_ids: jax.Array, positions: jax.Array,
                                block_size: int) -> jax.Array:
    """Device-side slot mapping (jnp): the slot of token ``i`` of sequence ``seq_ids[i]``.

    Args:
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_ids: ``int32[num_tokens]`` row of ``block_tables`` of each token.
        positions: ``int32[num_tokens]`` position of each token in its sequence; negative → PAD.
        block_size: tokens per block (static).

    Returns:
        ``int32[num_tokens]`` slots, ``PAD_SLOT_ID`` where ``positions < 0``.
    """
    safe = jnp.maximum(positions, 0)
    blocks = block_tables[seq_ids, safe // block_size]
    slots = blocks * block_size + safe % block_size
    return jnp.where(positions < 0, PAD_SLOT_ID, slots).astype(jnp.int32)
