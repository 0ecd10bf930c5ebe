"""vLLM-signature slot mapping (append to a list, block tables keyed by seq id), profile runs, validation.

The reference below is a plain-Python transcription of vLLM's ``compute_slot_mapping`` /
``_compute_slot_mapping_python`` / ``compute_slot_mapping_start_idx`` / ``is_block_tables_empty`` (seed 001),
written independently of the code under test. Hand-worked examples pin the reference itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.kv_cache.slot_mapping import (
    compute_slot_mapping,
    compute_slot_mapping_batch,
    compute_slot_mapping_into,
    compute_slot_mapping_start_idx,
    is_block_tables_empty,
)

PAD = -1


# ----------------------------------------------------------------------------------------------
# Independent reference (vLLM's loop, list in / list out)
# ----------------------------------------------------------------------------------------------

def ref_is_empty(block_tables) -> bool:
    if block_tables is None:
        return True
    if not isinstance(block_tables, dict):
        return False
    for value in block_tables.values():
        if value is not None:
            return False
    return True


def ref_start_idx(is_prompt, query_len, sliding_window):
    if is_prompt and sliding_window is not None:
        return max(0, query_len - sliding_window)
    return 0


def ref_append(is_profile_run, out, seq_id, seq_len, context_len, start_idx, block_size, block_tables):
    if is_profile_run:
        out += [PAD] * seq_len
        return
    out += [PAD] * max(0, start_idx - context_len)
    table = block_tables[seq_id]
    for i in range(max(start_idx, context_len), seq_len):
        out.append(table[i // block_size] * block_size + i % block_size)


def ref_builder(seqs, block_tables, block_size, sliding_window):
    """vLLM ``CommonMetadataBuilder._add_seq_group`` slot part: one list over a batch of sequences."""
    out: list[int] = []
    profile = ref_is_empty(block_tables)
    for seq_id, seq_len, context_len, is_prompt in seqs:
        start = ref_start_idx(is_prompt, seq_len - context_len, sliding_window)
        ref_append(profile, out, seq_id, seq_len, context_len, start, block_size, block_tables)
    return out


def test_reference_hand_examples():
    # seed: prompt 10, window 8, block size 4, table [0, 1, 0] → [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]
    out = []
    ref_append(False, out, 7, 10, 0, ref_start_idx(True, 10, 8), 4, {7: [0, 1, 0]})
    assert out == [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]
    # decode: seq_len 6, 5 cached, bs 4, table [9, 2] → position 5 → block 2 offset 1 → 9
    out = [100]
    ref_append(False, out, 1, 6, 5, 0, 4, {1: [9, 2]})
    assert out == [100, 9]
    assert ref_is_empty(None) and ref_is_empty({3: None}) and not ref_is_empty({3: [1]})


# ----------------------------------------------------------------------------------------------
# compute_slot_mapping_into
# ----------------------------------------------------------------------------------------------

def test_into_seed_example_appends_python_ints():
    out = [5, 6]
    start = compute_slot_mapping_start_idx(True, 10, 0, 8)
    compute_slot_mapping_into(False, out, 42, 10, 0, start, 4, {42: [0, 1, 0], 3: [7]})
    assert out == [5, 6, -1, -1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert all(type(x) is int for x in out)


@pytest.mark.parametrize("block_tables", [None, {0: None, 1: None}, {}])
def test_into_profile_run_is_all_pad(block_tables):
    assert is_block_tables_empty(block_tables)
    out = [3]
    compute_slot_mapping_into(True, out, 0, 7, 0, 0, 16, block_tables)
    assert out == [3] + [PAD] * 7


def test_into_chunked_prefill_hand_example():
    # seq 20, 4 cached, chunk of 16, window 8, bs 4: start 8 → positions 4..7 PAD; 8..19 slotted
    table = {11: [9, 3, 7, 0, 5]}
    out: list[int] = []
    compute_slot_mapping_into(False, out, 11, 20, 4, compute_slot_mapping_start_idx(True, 16, 4, 8), 4, table)
    assert out == [PAD] * 4 + [28, 29, 30, 31, 0, 1, 2, 3, 20, 21, 22, 23]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [None, 3, 16])
def test_into_builder_loop_matches_reference(block_size, sliding_window):
    """A vLLM builder loop over many sequences (prompts, chunks, decodes) appending to one list."""
    rng = np.random.default_rng(block_size * 31 + (sliding_window or 0))
    seqs, tables = [], {}
    next_block = 0
    for seq_id in rng.permutation(40)[:14].tolist():
        seq_len = int(rng.choice([1, block_size - 1 or 1, block_size, block_size + 1,
                                  int(rng.integers(1, 6 * block_size + 2))]))
        kind = int(rng.integers(0, 3))
        context_len = 0 if kind == 0 else (seq_len - 1 if kind == 1 else int(rng.integers(0, seq_len)))
        is_prompt = kind != 1
        need = -(-seq_len // block_size)
        tables[seq_id] = [int(b) for b in rng.permutation(1000)[:need] + next_block]
        next_block += 1000
        seqs.append((seq_id, seq_len, context_len, is_prompt))
    got: list[int] = []
    for seq_id, seq_len, context_len, is_prompt in seqs:
        start = compute_slot_mapping_start_idx(is_prompt, seq_len - context_len, context_len, sliding_window)
        compute_slot_mapping_into(is_block_tables_empty(tables), got, seq_id, seq_len, context_len, start,
                                  block_size, tables)
    assert got == ref_builder(seqs, tables, block_size, sliding_window)


def test_into_long_sequence_numpy_path():
    """vLLM switches to NumPy at 256 tokens; the result is the same either way."""
    bs = 16
    table = [int(x) for x in np.random.default_rng(0).permutation(64)[:40]]
    for seq_len, ctx in ((600, 0), (600, 300), (257, 256)):
        got: list[int] = []
        compute_slot_mapping_into(False, got, 0, seq_len, ctx, 0, bs, {0: table})
        want: list[int] = []
        ref_append(False, want, 0, seq_len, ctx, 0, bs, {0: table})
        assert got == want and len(got) == seq_len - ctx


def test_into_decode_uses_only_needed_prefix():
    out: list[int] = []
    compute_slot_mapping_into(False, out, 2, 9, 8, 0, 4, {2: [4, 5, 6]})
    assert out == [6 * 4 + 0]


# ----------------------------------------------------------------------------------------------
# Errors: ValueError naming the field; the list is left unchanged
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_id=9), "seq_id"),                                       # not in block_tables
    (dict(block_tables={1: None}), "seq_id"),                         # mapped to None, not profiling
    (dict(block_tables=None), "seq_id"),
    (dict(context_len=11), "context_len"),
    (dict(context_len=-1), "context_len"),
    (dict(start_idx=11), "start_idx"),
    (dict(start_idx=-2), "start_idx"),
    (dict(block_size=0), "block_size"),
    (dict(seq_len=13), "block_table"),                               # needs 4 blocks of 4, table has 3
])
def test_into_errors_leave_list_unchanged(kwargs, match):
    args = dict(is_profile_run=False, seq_id=1, seq_len=10, context_len=0, start_idx=0, block_size=4,
                block_tables={1: [3, 4, 5]})
    args.update(kwargs)
    out = [7, 8]
    with pytest.raises(ValueError, match=match):
        compute_slot_mapping_into(args.pop("is_profile_run"), out, **args)
    assert out == [7, 8]


def test_into_rejects_non_list():
    with pytest.raises(ValueError, match="slot_mapping"):
        compute_slot_mapping_into(False, (1, 2), 1, 4, 0, 0, 4, {1: [0]})


def test_is_block_tables_empty():
    assert is_block_tables_empty(None)
    assert is_block_tables_empty({1: None, 2: None})
    assert not is_block_tables_empty({1: None, 2: [3]})
    assert not is_block_tables_empty({1: []})  # an empty list is a (short) table, not None


# ----------------------------------------------------------------------------------------------
# Batch: profile run and the new validation
# ----------------------------------------------------------------------------------------------

def test_batch_profile_run_all_pad_without_tables():
    got = compute_slot_mapping_batch(None, [0, 0, 0], [5, 1, 17], 16, is_profile_run=True)
    assert got.tolist() == [PAD] * 23
    want: list[int] = []
    for n in (5, 1, 17):
        ref_append(True, want, 0, n, 0, 0, 16, None)
    assert got.tolist() == want


def test_batch_equals_into_loop_with_explicit_is_prompt():
    rng = np.random.default_rng(3)
    bs, window = 8, 5
    lens = [(20, 4, True), (9, 8, False), (7, 0, True), (30, 0, True), (17, 16, True)]
    width = 5
    tables = rng.permutation(60)[: len(lens) * width].reshape(len(lens), width)
    got = compute_slot_mapping_batch(tables, [c for _, c, _ in lens], [n for n, _, _ in lens], bs,
                                     sliding_window=window, is_prompt=[p for _, _, p in lens])
    seqs = [(s, n, c, p) for s, (n, c, p) in enumerate(lens)]
    assert got.tolist() == ref_builder(seqs, {s: tables[s].tolist() for s in range(len(lens))}, bs, window)


@pytest.mark.parametrize("call,match", [
    (lambda: compute_slot_mapping_batch(np.zeros((2, 2)), [0, 0], [1, 1], 0), "block_size"),
    (lambda: compute_slot_mapping_batch(np.zeros((2, 2)), [0, 0], [1, 1], 4, sliding_window=0),
     "sliding_window"),
    (lambda: compute_slot_mapping_batch(np.zeros((2, 2)), [0], [1, 1], 4), "context_lens.shape"),
    (lambda: compute_slot_mapping_batch(np.zeros((2, 2)), [0, 0], [1, 1], 4, is_prompt=[True]),
     "is_prompt"),
    (lambda: compute_slot_mapping_batch(np.zeros((3, 2)), [0, 0], [1, 1], 4), "block_tables.shape"),
    (lambda: compute_slot_mapping_batch(None, [0, 3], [1, 1], 4, is_profile_run=True), "context_lens"),
    (lambda: compute_slot_mapping_start_idx(True, 5, 0, 0), "sliding_window"),
    (lambda: compute_slot_mapping(False, 5, 0, 6, 4, [0, 1]), "start_idx"),
])
def test_batch_and_start_idx_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
