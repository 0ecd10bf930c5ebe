"""Slot mapping vs. an independent pure-Python transcription of vLLM's loop.

Reference semantics (vLLM ``vllm/attention/backends/utils.py``, seed 001):

* ``compute_slot_mapping_start_idx``: a *prompt* with a sliding window keeps only its last
  ``sliding_window`` tokens, so ``start_idx = max(0, query_len - sliding_window)``; otherwise 0.
* ``compute_slot_mapping``: in a profile run every one of the ``seq_len`` tokens gets ``PAD_SLOT_ID``.
  Otherwise the tokens ``[context_len, start_idx)`` (if any) get ``PAD_SLOT_ID`` and every position ``i`` in
  ``[max(start_idx, context_len), seq_len)`` gets ``block_table[i // block_size] * block_size +
  i % block_size`` (``_compute_slot_mapping_python``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv_cache.slot_mapping import (
    PAD_SLOT_ID,
    compute_slot_mapping,
    compute_slot_mapping_batch,
    compute_slot_mapping_start_idx,
    slot_mapping_from_positions,
)

PAD = -1  # vLLM's PAD_SLOT_ID, written out independently of the module under test


# ----------------------------------------------------------------------------------------------
# Independent reference (plain Python lists and ints, no NumPy arithmetic).
# ----------------------------------------------------------------------------------------------

def ref_start_idx(is_prompt: bool, query_len: int, sliding_window: int | None) -> int:
    if not is_prompt or sliding_window is None:
        return 0
    return query_len - sliding_window if query_len > sliding_window else 0


def ref_slot_mapping(is_profile_run: bool, seq_len: int, context_len: int, start_idx: int,
                     block_size: int, block_table) -> list[int]:
    out: list[int] = []
    if is_profile_run:
        for _ in range(seq_len):
            out.append(PAD)
        return out
    # masked prompt tokens that are not yet cached
    for _ in range(context_len, start_idx):
        out.append(PAD)
    first = start_idx if start_idx > context_len else context_len
    for pos in range(first, seq_len):
        logical_block, offset = divmod(pos, block_size)
        out.append(int(block_table[logical_block]) * block_size + offset)
    return out


def ref_batch(block_tables, context_lens, seq_lens, block_size, sliding_window=None, is_prompt=None):
    out: list[int] = []
    for s in range(len(seq_lens)):
        ctx, n = int(context_lens[s]), int(seq_lens[s])
        prompt = (ctx == 0) if is_prompt is None else bool(is_prompt[s])
        start = ref_start_idx(prompt, n - ctx, sliding_window)
        out += ref_slot_mapping(False, n, ctx, start, block_size, list(block_tables[s]))
    return out


def random_batch(rng: np.random.Generator, block_size: int, num_seqs: int, *, extra_cols: int = 2):
    """Random seq/context lengths (incl. 1, bs-1, bs, bs+1) and permuted, disjoint block tables."""
    special = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 1]
    seq_lens = []
    for s in range(num_seqs):
        if s < len(special):
            seq_lens.append(special[s])
        else:
            seq_lens.append(int(rng.integers(1, 5 * block_size)))
    seq_lens = [int(x) for x in rng.permutation(seq_lens)]
    context_lens = []
    for n in seq_lens:
        kind = rng.integers(0, 3)
        if kind == 0:
            context_lens.append(0)  # prompt
        elif kind == 1:
            context_lens.append(n - 1)  # decode
        else:
            context_lens.append(int(rng.integers(0, n)))  # chunked prefill chunk
    need = [-(-n // block_size) for n in seq_lens]
    width = max(need) + extra_cols
    num_blocks = sum(need) + 7
    perm = rng.permutation(num_blocks)
    tables = np.zeros((num_seqs, width), np.int32)
    c = 0
    for s, k in enumerate(need):
        tables[s, :k] = perm[c:c + k]
        tables[s, k:] = rng.integers(0, num_blocks, width - k)  # junk past the sequence's blocks
        c += k
    return tables, np.array(context_lens), np.array(seq_lens)


# ----------------------------------------------------------------------------------------------
# Reference self-check on the seed's worked example (keeps the reference honest).
# ----------------------------------------------------------------------------------------------

SEED_EXAMPLE = [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_reference_reproduces_seed_example():
    start = ref_start_idx(True, 10, 8)
    assert start == 2
    assert ref_slot_mapping(False, 10, 0, start, 4, [0, 1, 0]) == SEED_EXAMPLE


def test_pad_slot_id_is_minus_one():
    assert PAD_SLOT_ID == -1


# ----------------------------------------------------------------------------------------------
# compute_slot_mapping_start_idx
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("is_prompt", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 1, 4, 8, 100])
@pytest.mark.parametrize("query_len", [1, 7, 8, 9, 40])
@pytest.mark.parametrize("context_len", [0, 5])
def test_start_idx_matches_reference(is_prompt, sliding_window, query_len, context_len):
    got = compute_slot_mapping_start_idx(is_prompt, query_len, context_len, sliding_window)
    assert got == ref_start_idx(is_prompt, query_len, sliding_window)


# ----------------------------------------------------------------------------------------------
# compute_slot_mapping (one sequence)
# ----------------------------------------------------------------------------------------------

def test_seed_sliding_window_example():
    start = compute_slot_mapping_start_idx(True, 10, 0, 8)
    got = compute_slot_mapping(False, 10, 0, start, 4, [0, 1, 0])
    assert got.tolist() == SEED_EXAMPLE
    assert np.issubdtype(got.dtype, np.integer)


def test_seed_example_batched():
    got = compute_slot_mapping_batch(np.array([[0, 1, 0]]), [0], [10], 4, sliding_window=8)
    assert got.tolist() == SEED_EXAMPLE


@pytest.mark.parametrize("seq_len,context_len", [(7, 0), (1, 0), (33, 0)])
def test_profile_run_is_all_pad(seq_len, context_len):
    # vLLM: block tables are not built yet (None in embeddings); every token is padding.
    got = compute_slot_mapping(True, seq_len, context_len, 0, 16, None)
    assert got.tolist() == ref_slot_mapping(True, seq_len, context_len, 0, 16, None)
    assert got.tolist() == [PAD] * seq_len


@pytest.mark.parametrize("sliding_window", [None, 4, 8, 64])
@pytest.mark.parametrize("seq_len,context_len", [(20, 4), (20, 12), (17, 16), (33, 8), (9, 8)])
def test_chunked_prefill(seq_len, context_len, sliding_window):
    """A prompt chunk that starts after ``context_len`` cached tokens (is_prompt=True, as in vLLM)."""
    block_size = 4
    table = [9, 3, 7, 0, 5, 2, 8, 1, 6, 4]
    query_len = seq_len - context_len
    start = compute_slot_mapping_start_idx(True, query_len, context_len, sliding_window)
    assert start == ref_start_idx(True, query_len, sliding_window)
    got = compute_slot_mapping(False, seq_len, context_len, start, block_size, table)
    want = ref_slot_mapping(False, seq_len, context_len, start, block_size, table)
    assert got.tolist() == want
    assert len(want) == query_len
    # the batched version with explicit is_prompt gives the same slots
    tables = np.array([table])
    got_b = compute_slot_mapping_batch(tables, [context_len], [seq_len], block_size,
                                       sliding_window=sliding_window, is_prompt=[True])
    assert got_b.tolist() == want


def test_chunked_prefill_hand_example():
    """seq 20, 4 cached, window 8, bs 4: query 16 → start 8 → positions 4..7 PAD, 8..19 slotted."""
    table = [9, 3, 7, 0, 5]
    got = compute_slot_mapping(False, 20, 4, compute_slot_mapping_start_idx(True, 16, 4, 8), 4, table)
    assert got.tolist() == [PAD] * 4 + [28, 29, 30, 31, 0, 1, 2, 3, 20, 21, 22, 23]


@pytest.mark.parametrize("sliding_window", [None, 4])
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 40])
def test_decode_single_token(seq_len, sliding_window):
    block_size = 16
    table = [4, 1, 3]
    start = compute_slot_mapping_start_idx(False, 1, seq_len - 1, sliding_window)
    assert start == 0
    got = compute_slot_mapping(False, seq_len, seq_len - 1, start, block_size, table)
    pos = seq_len - 1
    assert got.tolist() == [table[pos // block_size] * block_size + pos % block_size]


def test_full_prompt_without_window_maps_every_position():
    table = [5, 2, 7]
    got = compute_slot_mapping(False, 9, 0, 0, 4, table)
    assert got.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28]


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_random_sequences_match_reference(block_size):
    rng = np.random.default_rng(1000 + block_size)
    for sliding_window in (None, block_size // 2, 3 * block_size):
        tables, ctx, seq = random_batch(rng, block_size, 12)
        for s in range(len(seq)):
            is_prompt = bool(rng.integers(0, 2)) if ctx[s] > 0 else True
            q = int(seq[s] - ctx[s])
            start = compute_slot_mapping_start_idx(is_prompt, q, int(ctx[s]), sliding_window)
            # only the needed prefix of the table (exactly cdiv(seq_len, bs) entries) must suffice
            need = -(-int(seq[s]) // block_size)
            table = list(tables[s, :need])
            got = compute_slot_mapping(False, int(seq[s]), int(ctx[s]), start, block_size, table)
            want = ref_slot_mapping(False, int(seq[s]), int(ctx[s]),
                                    ref_start_idx(is_prompt, q, sliding_window), block_size, table)
            assert got.tolist() == want, (s, int(seq[s]), int(ctx[s]), sliding_window)


# ----------------------------------------------------------------------------------------------
# compute_slot_mapping_batch
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("sliding_window", [None, 5, 40])
def test_batch_matches_reference(block_size, sliding_window):
    rng = np.random.default_rng(7 * block_size + (sliding_window or 0))
    for _ in range(3):
        tables, ctx, seq = random_batch(rng, block_size, int(rng.integers(5, 14)))
        got = compute_slot_mapping_batch(tables, ctx, seq, block_size, sliding_window=sliding_window)
        assert got.tolist() == ref_batch(tables, ctx, seq, block_size, sliding_window)
        # explicit is_prompt (chunked prefill chunks flagged as prompts)
        is_prompt = rng.integers(0, 2, len(seq)).astype(bool) | (ctx == 0)
        got = compute_slot_mapping_batch(tables, ctx, seq, block_size, sliding_window=sliding_window,
                                         is_prompt=is_prompt)
        assert got.tolist() == ref_batch(tables, ctx, seq, block_size, sliding_window, is_prompt)


def test_batch_with_empty_query_and_single_tokens():
    """A sequence with no new token contributes nothing; seq_len 1 prompts still get a slot."""
    tables = np.array([[3, 1], [0, 2], [5, 4]])
    got = compute_slot_mapping_batch(tables, [4, 0, 1], [4, 1, 2], 4)
    assert got.tolist() == ref_batch(tables, [4, 0, 1], [4, 1, 2], 4)
    assert got.tolist() == [0, 21]


def test_batch_concatenation_equals_per_sequence_calls():
    rng = np.random.default_rng(42)
    tables, ctx, seq = random_batch(rng, 16, 9)
    parts = [compute_slot_mapping(False, int(n), int(c),
                                  compute_slot_mapping_start_idx(c == 0, int(n - c), int(c), 20), 16,
                                  tables[s])
             for s, (c, n) in enumerate(zip(ctx, seq))]
    got = compute_slot_mapping_batch(tables, ctx, seq, 16, sliding_window=20)
    assert got.tolist() == np.concatenate(parts).tolist()


# ----------------------------------------------------------------------------------------------
# slot_mapping_from_positions (device side, jnp)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_from_positions_matches_reference(block_size):
    rng = np.random.default_rng(300 + block_size)
    tables, ctx, seq = random_batch(rng, block_size, 10)
    seq_ids, positions = [], []
    for s in range(len(seq)):
        for p in range(int(ctx[s]), int(seq[s])):
            seq_ids.append(s)
            positions.append(p)
    want = ref_batch(tables, ctx, seq, block_size)  # no window: every new token is slotted
    # padding tokens: negative positions, arbitrary seq ids
    num_pad = 13
    seq_ids += [int(x) for x in rng.integers(0, len(seq), num_pad)]
    positions += [-1] * (num_pad - 3) + [-5, -block_size, -1000]
    want += [PAD] * num_pad
    order = rng.permutation(len(want))
    seq_ids = np.array(seq_ids, np.int32)[order]
    positions = np.array(positions, np.int32)[order]
    want = np.array(want)[order]
    got = slot_mapping_from_positions(jnp.asarray(tables, jnp.int32), jnp.asarray(seq_ids),
                                      jnp.asarray(positions), block_size)
    assert got.dtype == jnp.int32
    assert np.asarray(got).tolist() == want.tolist()


def test_from_positions_under_jit():
    rng = np.random.default_rng(5)
    tables, ctx, seq = random_batch(rng, 8, 6)
    seq_ids = np.repeat(np.arange(len(seq)), seq - ctx).astype(np.int32)
    positions = np.concatenate([np.arange(c, n) for c, n in zip(ctx, seq)]).astype(np.int32)
    f = jax.jit(slot_mapping_from_positions, static_argnums=3)
    got = f(jnp.asarray(tables), jnp.asarray(seq_ids), jnp.asarray(positions), 8)
    assert np.asarray(got).tolist() == ref_batch(tables, ctx, seq, 8)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

def test_context_longer_than_sequence_raises():
    with pytest.raises(ValueError, match="context_len"):
        compute_slot_mapping(False, 5, 6, 0, 4, [0, 1])


def test_negative_context_raises():
    with pytest.raises(ValueError, match="context_len"):
        compute_slot_mapping(False, 5, -1, 0, 4, [0, 1])


def test_block_table_too_short_raises():
    # seq_len 9 at block size 4 needs 3 blocks
    with pytest.raises(ValueError, match="block_table"):
        compute_slot_mapping(False, 9, 0, 0, 4, [0, 1])
    with pytest.raises(ValueError, match="block_table"):
        compute_slot_mapping(False, 9, 8, 0, 4, [0, 1])  # decode into the missing block


def test_bad_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        compute_slot_mapping(False, 4, 0, 0, 0, [0])


def test_batch_context_longer_than_sequence_raises():
    with pytest.raises(ValueError, match="context_lens"):
        compute_slot_mapping_batch(np.zeros((3, 4), np.int32), [0, 9, 1], [4, 8, 2], 4)


def test_batch_block_tables_too_narrow_raises():
    with pytest.raises(ValueError, match="block_tables"):
        compute_slot_mapping_batch(np.zeros((2, 2), np.int32), [0, 0], [4, 9], 4)
