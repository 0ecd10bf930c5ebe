"""Slot mapping: where each new token's K/V goes in the paged cache.

``slot = block_table[position // block_size] * block_size + position % block_size``; tokens whose K/V
must not be written get ``PAD_SLOT_ID``. vLLM: ``vllm/attention/backends/utils.py``
(``compute_slot_mapping``, ``compute_slot_mapping_start_idx``, ``is_block_tables_empty``, ``PAD_SLOT_ID``).

Three host-side (NumPy) forms and one device-side form:

* :func:`compute_slot_mapping` — one sequence, returns its piece;
* :func:`compute_slot_mapping_into` — vLLM's exact signature (appends to a list, block tables keyed by
  ``seq_id``), vectorised;
* :func:`compute_slot_mapping_batch` — a whole batch in one pass;
* :func:`slot_mapping_from_positions` — ``jnp``, inside ``jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.checks import as_checked, below, check_block_ids, check_mode, require, xp

PAD_SLOT_ID = -1
"""Slot of a token whose K/V is not written (padding, sliding-window-masked prompt tokens)."""


def compute_slot_mapping_start_idx(is_prompt: bool, query_len: int, context_len: int,
                                   sliding_window: int | None) -> int:
    """First prompt token whose K/V is kept. vLLM: ``compute_slot_mapping_start_idx``.

    With a sliding window, a prompt's first ``query_len - sliding_window`` tokens are never attended to
    again, so they are masked with ``PAD_SLOT_ID``. ``context_len`` is accepted for vLLM parity (unused,
    as in vLLM: for a chunked-prefill chunk the window is counted from the chunk's ``query_len``, and
    :func:`compute_slot_mapping` compares the result with absolute positions, exactly as vLLM does).

    Raises:
        ValueError: ``sliding_window < 1``.
    """
    del context_len
    _check_sliding_window(sliding_window)
    if is_prompt and sliding_window is not None:
        return max(0, query_len - sliding_window)
    return 0


def compute_slot_mapping(is_profile_run: bool, seq_len: int, context_len: int, start_idx: int,
                         block_size: int, block_table, *, num_blocks: int | None = None) -> np.ndarray:
    """Slots of tokens ``[context_len, seq_len)`` of one sequence. vLLM: ``compute_slot_mapping``.

    Args:
        is_profile_run: block tables are not built yet: every slot is ``PAD_SLOT_ID``.
        seq_len: tokens of the sequence after this step.
        context_len: tokens already in the cache.
        start_idx: tokens before this index are masked (``compute_slot_mapping_start_idx``).
        block_size: tokens per block.
        block_table: ``int[>= cdiv(seq_len, block_size)]`` physical block of each logical block.
        num_blocks: blocks in the cache, to check the block ids written to (default: only ``>= 0``).

    Returns:
        ``int64[seq_len - context_len]`` (vLLM appends to a list; we return the piece).

    Raises:
        ValueError: ``context_len`` outside ``[0, seq_len]``, ``start_idx`` outside ``[0, seq_len]``,
            ``block_size < 1``, a block table too short, or a block id written to that is negative or
            (with ``num_blocks``) ``>= num_blocks`` (names the entry and the bound).
    """
    _check_one_sequence(seq_len, context_len, start_idx, block_size)
    if is_profile_run:
        return np.full(seq_len, PAD_SLOT_ID, np.int64)
    padding = max(0, start_idx - context_len)
    start = max(start_idx, context_len)
    table = np.asarray(block_table, np.int64)
    needed = -(-seq_len // block_size)
    if seq_len > start and table.shape[0] < needed:
        raise ValueError(f"block_table has {table.shape[0]} blocks; seq_len={seq_len} needs {needed}")
    idx = np.arange(start, seq_len)
    blocks = table[idx // block_size]
    check_block_ids("host", blocks, np.ones(blocks.shape, bool), "block_table[{b}]", num_blocks,
                    index_names=("t",), b=idx // block_size, suffix=" (block of token {p})", p=idx)
    slots = blocks * block_size + idx % block_size
    return np.concatenate([np.full(padding, PAD_SLOT_ID, np.int64), slots])


def _check_sliding_window(sliding_window) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")


def _check_one_sequence(seq_len: int, context_len: int, start_idx: int, block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if not 0 <= context_len <= seq_len:
        raise ValueError(f"context_len={context_len} must be in [0, seq_len={seq_len}]")
    if not 0 <= start_idx <= seq_len:
        raise ValueError(f"start_idx={start_idx} must be in [0, seq_len={seq_len}]")


def _check_context_lens(context_lens: np.ndarray, seq_lens: np.ndarray) -> None:
    bad = np.flatnonzero((context_lens > seq_lens) | (context_lens < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"context_lens[{i}]={context_lens[i]} must be in [0, seq_lens[{i}]={seq_lens[i]}]")


def is_block_tables_empty(block_tables) -> bool:
    """Whether block tables are not built yet (a profile run). vLLM: ``is_block_tables_empty``.

    Args:
        block_tables: ``None`` or ``dict[seq_id, list[int] | None]``.

    Returns:
        ``True`` for ``None`` or a dict whose values are all ``None`` (vLLM's embedding-model case; an
        empty dict counts as empty too, as in vLLM).
    """
    if block_tables is None:
        return True
    return isinstance(block_tables, dict) and all(v is None for v in block_tables.values())


def compute_slot_mapping_into(is_profile_run: bool, slot_mapping: list, seq_id: int, seq_len: int,
                              context_len: int, start_idx: int, block_size: int,
                              block_tables: dict[int, list[int]] | None, *,
                              num_blocks: int | None = None) -> None:
    """Append one sequence's slots to ``slot_mapping``: vLLM's exact signature and semantics, vectorised.

    vLLM: ``compute_slot_mapping`` (``vllm/attention/backends/utils.py``). In a profile run ``seq_len``
    ``PAD_SLOT_ID`` entries are appended (block tables may be ``None`` or ``{seq_id: None}``). Otherwise
    ``max(0, start_idx - context_len)`` ``PAD_SLOT_ID`` entries (sliding-window-masked prompt tokens), then
    ``block_table[i // block_size] * block_size + i % block_size`` for every position ``i`` in
    ``[max(start_idx, context_len), seq_len)`` with ``block_table = block_tables[seq_id]``. vLLM switches
    between a Python loop and NumPy at 256 tokens; this always uses one NumPy pass. Entries are Python
    ``int``.

    Args:
        is_profile_run: block tables are not built yet (see :func:`is_block_tables_empty`).
        slot_mapping: ``list[int]`` the batch's slot mapping so far; extended in place.
        seq_id: key of this sequence in ``block_tables``.
        seq_len: tokens of the sequence after this step.
        context_len: tokens already in the cache (``> 0`` for decode and chunked-prefill chunks).
        start_idx: from :func:`compute_slot_mapping_start_idx`.
        block_size: tokens per block.
        block_tables: ``dict[seq_id, list[int]]`` physical block of each logical block; ignored in a
            profile run.
        num_blocks: blocks in the cache, to check the block ids written to (default: only ``>= 0``).

    Raises:
        ValueError: ``slot_mapping`` has no ``extend``; ``context_len`` or ``start_idx`` outside
            ``[0, seq_len]``; ``block_size < 1``; (not profiling) ``seq_id`` missing from
            ``block_tables`` or mapped to ``None``, its table shorter than ``cdiv(seq_len,
            block_size)`` blocks (vLLM raises ``KeyError`` / ``IndexError``), or a block id written to
            outside ``[0, num_blocks)`` (negative without ``num_blocks``). Nothing is appended then.
    """
    if not hasattr(slot_mapping, "extend"):
        raise ValueError(f"slot_mapping={slot_mapping!r} must be a list (it is extended in place)")
    _check_one_sequence(seq_len, context_len, start_idx, block_size)
    table = None
    if not is_profile_run:
        if not isinstance(block_tables, dict) or block_tables.get(seq_id) is None:
            keys = None if not isinstance(block_tables, dict) else sorted(block_tables)
            raise ValueError(f"seq_id={seq_id} has no block table in block_tables (keys {keys}); "
                             "pass is_profile_run=True if block tables are not built yet")
        table = block_tables[seq_id]
    piece = compute_slot_mapping(is_profile_run, seq_len, context_len, start_idx, block_size, table,
                                 num_blocks=num_blocks)
    slot_mapping.extend(piece.tolist())


def compute_slot_mapping_batch(block_tables: np.ndarray, context_lens, seq_lens, block_size: int, *,
                               sliding_window: int | None = None, is_prompt=None,
                               is_profile_run: bool = False, num_blocks: int | None = None) -> np.ndarray:
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
        is_profile_run: block tables are not built yet: every token gets ``PAD_SLOT_ID`` and
            ``block_tables`` may be ``None``. (vLLM appends ``seq_len`` PADs per sequence; profile runs
            only hold prompts, ``context_len == 0``, so that is the same count.)
        num_blocks: blocks in the cache, to check the block ids written to (default: only ``>= 0``).

    Returns:
        ``int64[sum(seq_lens - context_lens)]``.

    Raises:
        ValueError: ``block_size < 1``, ``sliding_window < 1``, lengths of different sizes, a context
            outside ``[0, seq_len]``, a block table too narrow, or a block id written to outside
            ``[0, num_blocks)`` (negative without ``num_blocks``; names the entry, the token and the
            bound). Entries of the tables no token is written to are not checked.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    _check_sliding_window(sliding_window)
    context_lens = np.asarray(context_lens, np.int64).reshape(-1)
    seq_lens = np.asarray(seq_lens, np.int64).reshape(-1)
    if context_lens.shape != seq_lens.shape:
        raise ValueError(f"context_lens.shape={context_lens.shape} != seq_lens.shape={seq_lens.shape}")
    if is_prompt is not None and np.shape(is_prompt) != seq_lens.shape:
        raise ValueError(f"is_prompt.shape={np.shape(is_prompt)} != seq_lens.shape={seq_lens.shape}")
    if is_profile_run:
        _check_context_lens(context_lens, seq_lens)
        return np.full(int((seq_lens - context_lens).sum()), PAD_SLOT_ID, np.int64)
    tables = np.asarray(block_tables, np.int64)
    if tables.ndim != 2 or tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables.shape={tables.shape} must be [num_seqs={seq_lens.shape[0]}, "
                         "max_num_blocks_per_seq]")
    _check_context_lens(context_lens, seq_lens)
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
    blocks = tables[seq_of_token, position // block_size]
    written = position >= start_idx[seq_of_token]
    check_block_ids("host", blocks, written, "block_tables[{s}, {b}]", num_blocks, index_names=("t",),
                    s=seq_of_token, b=position // block_size, suffix=" (block of token {t})")
    slots = blocks * block_size + position % block_size
    return np.where(written, slots, PAD_SLOT_ID)


def slot_mapping_from_positions(block_tables: jax.Array, seq_ids: jax.Array, positions: jax.Array,
                                block_size: int, *, num_blocks: int | None = None) -> jax.Array:
    """Device-side slot mapping (jnp): the slot of token ``i`` of sequence ``seq_ids[i]``.

    vLLM: v1 ``BlockTable.compute_slot_mapping`` (no counterpart in the v0 utils of seed 001).

    Args:
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_ids: ``int32[num_tokens]`` row of ``block_tables`` of each token.
        positions: ``int32[num_tokens]`` position of each token in its sequence; negative → PAD.
        block_size: tokens per block (static).
        num_blocks: blocks in the cache, to check the block ids written to (default: only ``>= 0``).

    Returns:
        ``int32[num_tokens]`` slots, ``PAD_SLOT_ID`` where ``positions < 0``.

    Raises:
        ValueError: with concrete inputs, for a token with ``positions >= 0``: a ``seq_ids`` entry
            outside ``[0, num_seqs)``, a position past the block table (``>= max_num_blocks_per_seq *
            block_size``; JAX would clamp the gather onto the last entry) or a block id outside ``[0,
            num_blocks)`` (negative without ``num_blocks``). Under ``jax.jit`` these are not checked
            unless the check mode stages them (:mod:`jaxkv.checks`).
    """
    _check_positions(block_tables, seq_ids, positions, block_size, num_blocks)
    return _slots_from_positions(block_tables, seq_ids, positions, block_size)


def _slots_from_positions(block_tables, seq_ids, positions, block_size: int) -> jax.Array:
    safe = jnp.maximum(positions, 0)
    blocks = block_tables[seq_ids, safe // block_size]
    slots = blocks * block_size + safe % block_size
    return jnp.where(positions < 0, PAD_SLOT_ID, slots).astype(jnp.int32)


def _check_positions(block_tables, seq_ids, positions, block_size: int, num_blocks: int | None) -> None:
    """Value checks of :func:`slot_mapping_from_positions` (host or checkify, see :mod:`jaxkv.checks`)."""
    if (getattr(block_tables, "ndim", None) != 2 or np.shape(seq_ids) != np.shape(positions)
            or len(np.shape(positions)) != 1):
        return  # shapes the gather rejects itself
    mode = check_mode(block_tables, seq_ids, positions)
    if mode is None:
        return
    np_ = xp(mode)
    tables, seqs, pos = (as_checked(mode, a) for a in (block_tables, seq_ids, positions))
    num_seqs, width = tables.shape
    real = pos >= 0
    require(mode, ~real | ((seqs >= 0) & below(seqs, num_seqs)),
            f"seq_ids[{{i}}]={{value}} is not a row of block_tables in [0, num_seqs={num_seqs})",
            index_names=("i",), value=seqs)
    require(mode, ~real | below(pos, width * block_size),
            f"positions[{{i}}]={{value}} is past the block table: max_num_blocks_per_seq * block_size="
            f"{width * block_size}", index_names=("i",), value=pos)
    if num_seqs == 0 or width == 0:
        return
    row = np_.clip(seqs, 0, num_seqs - 1)
    col = np_.clip(np_.maximum(pos, 0) // block_size, 0, width - 1)
    check_block_ids(mode, tables[row, col], real, "block_tables[{s}, {b}]", num_blocks,
                    index_names=("i",), s=row, b=col, suffix=" (block of token {i})")
