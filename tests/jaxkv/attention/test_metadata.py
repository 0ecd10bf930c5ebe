"""build_attn_metadata: padding to a compiled bucket (vLLM CUDA-graph rules) and the pytree contract.

Expected values are built here by hand from the vLLM rules (seed 001, ``CommonAttentionState``):
decode buckets pad with dummy sequences of one token whose slot is ``PAD_SLOT_ID``, ``seq_len = 1`` and an
all-zero block-table row; prefill buckets pad with dummy sequences of zero tokens; padded tokens are PAD.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.metadata import AttentionMetadata, build_attn_metadata

PAD = -1


def ref_slots(block_tables, context_lens, query_lens, block_size) -> list[int]:
    """Per-token loop: position p of sequence s → block_tables[s][p // bs] * bs + p % bs."""
    out = []
    for s, (c, q) in enumerate(zip(context_lens, query_lens)):
        for p in range(c, c + q):
            out.append(int(block_tables[s][p // block_size]) * block_size + p % block_size)
    return out


def random_tables(rng, num_seqs, width, num_blocks):
    perm = rng.permutation(num_blocks)[: num_seqs * width]
    return perm.reshape(num_seqs, width).astype(np.int32)


def as_list(x):
    return np.asarray(x).tolist()


# ----------------------------------------------------------------------------------------------
# Decode batches padded to a bucket
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens_padded", [None, 8, 11])
def test_decode_batch_padded(num_tokens_padded):
    rng = np.random.default_rng(0)
    bs, width = 16, 4
    tables = random_tables(rng, 3, width, 40)
    ctx = [5, 16, 47]  # seq_lens 6, 17, 48: inside block 0, first of block 1, last of block 2
    md = build_attn_metadata(tables, ctx, [1, 1, 1], bs, num_seqs_padded=8,
                             num_tokens_padded=num_tokens_padded)
    n_tok = 8 if num_tokens_padded is None else num_tokens_padded
    assert as_list(md.slot_mapping) == ref_slots(tables, ctx, [1, 1, 1], bs) + [PAD] * (n_tok - 3)
    assert as_list(md.seq_lens) == [6, 17, 48] + [1] * 5
    np.testing.assert_array_equal(np.asarray(md.block_tables[:3]), tables)
    np.testing.assert_array_equal(np.asarray(md.block_tables[3:]), np.zeros((5, width)))
    assert as_list(md.query_start_loc) == list(range(9))
    assert md.max_query_len == 1
    assert md.is_decode_only
    assert md.max_seq_len >= 48
    for leaf in (md.slot_mapping, md.seq_lens, md.block_tables, md.query_start_loc):
        assert leaf.dtype == jnp.int32


def test_decode_batch_hand_values():
    # bs 4; seq 0: table [7, 2], 5 cached → position 5 → block 2 → slot 9
    #        seq 1: table [3, 6], 0 cached → position 0 → block 3 → slot 12
    md = build_attn_metadata(np.array([[7, 2], [3, 6]]), [5, 0], [1, 1], 4, num_seqs_padded=4)
    assert as_list(md.slot_mapping) == [9, 12, PAD, PAD]
    assert as_list(md.seq_lens) == [6, 1, 1, 1]
    assert as_list(md.block_tables) == [[7, 2], [3, 6], [0, 0], [0, 0]]
    assert as_list(md.query_start_loc) == [0, 1, 2, 3, 4]


def test_unpadded_decode_batch():
    rng = np.random.default_rng(1)
    tables = random_tables(rng, 5, 3, 30)
    ctx = [0, 7, 8, 9, 23]
    md = build_attn_metadata(tables, ctx, [1] * 5, 8)
    assert as_list(md.slot_mapping) == ref_slots(tables, ctx, [1] * 5, 8)
    assert as_list(md.seq_lens) == [c + 1 for c in ctx]
    assert as_list(md.query_start_loc) == [0, 1, 2, 3, 4, 5]
    assert md.is_decode_only


# ----------------------------------------------------------------------------------------------
# Prefill / mixed batches
# ----------------------------------------------------------------------------------------------

def test_prefill_batch_padded():
    rng = np.random.default_rng(2)
    bs, width = 8, 5
    tables = random_tables(rng, 3, width, 50)
    ctx, q = [0, 16, 3], [5, 9, 1]  # a prompt, a chunked-prefill chunk, a decode token
    md = build_attn_metadata(tables, ctx, q, bs, num_seqs_padded=6, num_tokens_padded=24)
    assert as_list(md.slot_mapping) == ref_slots(tables, ctx, q, bs) + [PAD] * (24 - 15)
    assert as_list(md.seq_lens) == [5, 25, 4, 0, 0, 0]
    assert as_list(md.query_start_loc) == [0, 5, 14, 15, 15, 15, 15]
    np.testing.assert_array_equal(np.asarray(md.block_tables[:3]), tables)
    np.testing.assert_array_equal(np.asarray(md.block_tables[3:]), np.zeros((3, width)))
    assert md.max_query_len == 9
    assert not md.is_decode_only
    assert md.max_seq_len >= 25


def test_prefill_hand_values():
    # bs 4, table [5, 1]: prompt of 6 tokens → slots 20..23, 4, 5; padded to 8 tokens
    md = build_attn_metadata(np.array([[5, 1]]), [0], [6], 4, num_seqs_padded=2, num_tokens_padded=8)
    assert as_list(md.slot_mapping) == [20, 21, 22, 23, 4, 5, PAD, PAD]
    assert as_list(md.seq_lens) == [6, 0]
    assert as_list(md.query_start_loc) == [0, 6, 6]
    assert md.max_query_len == 6


def test_explicit_max_query_len_is_recorded():
    md = build_attn_metadata(np.array([[0, 1]]), [0], [3], 4, max_query_len=8)
    assert md.max_query_len == 8
    assert not md.is_decode_only


# ----------------------------------------------------------------------------------------------
# Pytree contract: 4 array leaves, static maxima → one compilation per bucket
# ----------------------------------------------------------------------------------------------

def test_pytree_leaves_are_the_four_arrays():
    md = build_attn_metadata(np.array([[3, 1], [2, 0]]), [1, 4], [1, 1], 4, num_seqs_padded=4)
    leaves, treedef = jax.tree_util.tree_flatten(md)
    assert len(leaves) == 4
    ids = {id(x) for x in leaves}
    assert ids == {id(md.slot_mapping), id(md.seq_lens), id(md.block_tables), id(md.query_start_loc)}
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(back, AttentionMetadata)
    assert back.max_query_len == md.max_query_len and back.max_seq_len == md.max_seq_len
    # the maxima live in the treedef (static), not in the leaves
    md2 = build_attn_metadata(np.array([[3, 1], [2, 0]]), [0, 0], [2, 1], 4, num_seqs_padded=4)
    assert jax.tree_util.tree_structure(md2) != treedef


def test_jit_compiles_once_per_bucket():
    traces = []

    @jax.jit
    def step(md):
        traces.append(md.max_query_len)
        assert isinstance(md.max_query_len, int)  # static: a Python int inside the trace
        if md.max_query_len == 1:  # Python branch on a static field
            return md.seq_lens.sum()
        return -jnp.sum(md.slot_mapping >= 0)

    rng = np.random.default_rng(3)
    bs, width = 16, 4
    a = build_attn_metadata(random_tables(rng, 3, width, 40), [4, 20, 33], [1, 1, 1], bs,
                            num_seqs_padded=8)
    b = build_attn_metadata(random_tables(rng, 5, width, 40), [0, 1, 15, 16, 60], [1] * 5, bs,
                            num_seqs_padded=8)
    assert int(step(a)) == (5 + 21 + 34) + 5 * 1
    assert int(step(b)) == (1 + 2 + 16 + 17 + 61) + 3 * 1
    assert traces == [1]  # same padded shapes and statics → traced once
    c = build_attn_metadata(random_tables(rng, 2, width, 40), [0, 3], [4, 2], bs, num_seqs_padded=8,
                            num_tokens_padded=8)
    assert int(step(c)) == -6
    assert traces == [1, 4]


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

def test_query_len_zero_raises():
    with pytest.raises(ValueError, match="query_lens"):
        build_attn_metadata(np.zeros((2, 2), np.int32), [0, 0], [1, 0], 4)


def test_num_seqs_padded_too_small_raises():
    with pytest.raises(ValueError, match="num_seqs_padded"):
        build_attn_metadata(np.zeros((3, 2), np.int32), [0, 0, 0], [1, 1, 1], 4, num_seqs_padded=2)


def test_num_tokens_padded_too_small_raises():
    with pytest.raises(ValueError, match="num_tokens_padded"):
        build_attn_metadata(np.zeros((2, 2), np.int32), [0, 0], [3, 2], 4, num_tokens_padded=4)
    # decode dummies count as tokens: 4 padded sequences need 4 tokens
    with pytest.raises(ValueError, match="num_tokens_padded"):
        build_attn_metadata(np.zeros((2, 2), np.int32), [0, 0], [1, 1], 4, num_seqs_padded=4,
                            num_tokens_padded=3)


def test_block_table_too_narrow_raises():
    with pytest.raises(ValueError, match="block_tables"):
        build_attn_metadata(np.zeros((2, 2), np.int32), [0, 8], [1, 1], 4)  # seq_len 9 needs 3 blocks


def test_shape_disagreement_raises():
    with pytest.raises(ValueError, match="block_tables.shape"):
        build_attn_metadata(np.zeros((3, 2), np.int32), [0, 0], [1, 1], 4)
    with pytest.raises(ValueError, match="context_lens.shape"):
        build_attn_metadata(np.zeros((2, 2), np.int32), [0, 0, 0], [1, 1], 4)


def test_max_query_len_too_small_raises():
    with pytest.raises(ValueError, match="max_query_len"):
        build_attn_metadata(np.zeros((1, 2), np.int32), [0], [3], 4, max_query_len=2)
