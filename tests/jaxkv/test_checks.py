"""Checked ops: every bad index input raises a clear ValueError with concrete inputs (nothing written),
and the checkify mode (jaxkv.checks) reports the same error from inside jax.jit; off, it adds no op."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkv
from jaxkv.attention.metadata import AttentionMetadata, build_attn_metadata, build_attn_metadata_for_groups
from jaxkv.checks import checked, checks_are_enabled, checks_enabled, raise_if_error
from jaxkv.kv_cache import write as ops
from jaxkv.kv_cache.slot_mapping import compute_slot_mapping, compute_slot_mapping_batch, slot_mapping_from_positions
from jaxkv.vllm_parity import block_ops
from jaxkv.vllm_parity.graph_buckets import pad_decode_metadata
from jaxkv.vllm_parity.swap import swap_blocks_donated
from pallas_kernels import paged_attention as decode_mod
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_prefill_attention import paged_prefill_attention

BS, NB, KVH, H, D = 8, 6, 2, 4, 16          # block size, num_blocks, KV heads, query heads, head size
CAPACITY = NB * BS                           # 48 slots
TABLES = np.array([[0, 1, 5], [2, 3, 4]], np.int32)   # width 3: seq_lens up to 24
LENS = np.array([9, 20], np.int32)           # seq 0 reads blocks 0, 1 (entry [0, 2] is never read)


def _cache():
    return np.random.default_rng(0).standard_normal((2, NB, KVH, BS, D)).astype(np.float32)


def _q(num_tokens=2):
    return np.random.default_rng(1).standard_normal((num_tokens, H, D)).astype(np.float32)


def _host_then_jit(fn, args, match, jitted=None):
    """``fn(*args)`` raises ValueError matching ``match``; the checkify mode under jit reports the same
    message (and raise_if_error turns it into the same ValueError)."""
    with pytest.raises(ValueError, match=match) as host:
        fn(*args)
    err, _ = (jitted or jax.jit(checked(fn)))(*args)
    assert err.get() is not None and err.get().startswith(str(host.value)), (err.get(), str(host.value))
    with pytest.raises(ValueError, match=match):
        raise_if_error(err)
    return str(host.value)


# ------------------------------------------------------------------------------------------------
# Decode / prefill / dispatch: one shared metadata checker
# ------------------------------------------------------------------------------------------------

def _decode(q, cache, tables, lens):
    return paged_attention(q, cache, tables, lens, scale=0.25, interpret=True)


def _prefill(q, cache, tables, lens):  # a decode-shaped batch through the prefill op
    qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return paged_prefill_attention(q, cache, tables, lens, qsl, scale=0.25, max_query_len=1,
                                   interpret=True)


def _dispatch(q, cache, tables, lens):  # jaxkv.paged_attention, reference impl (the CPU default)
    md = AttentionMetadata(slot_mapping=jnp.full(q.shape[0], -1, jnp.int32), seq_lens=lens,
                           block_tables=tables, query_start_loc=jnp.arange(q.shape[0] + 1, dtype=jnp.int32),
                           max_query_len=1, max_seq_len=TABLES.shape[1] * BS)
    return jaxkv.paged_attention(q, cache, md, scale=0.25, impl="reference")


_OPS = {"decode": _decode, "prefill": _prefill, "dispatch_reference": _dispatch}
_JITTED = {name: jax.jit(checked(fn)) for name, fn in _OPS.items()}  # one compile per op for all cases

BAD_METADATA = [
    # (tables change, lens, message)
    ({(1, 2): 6}, LENS, r"^block_tables\[1, 2\]=6 is not a block id in \[0, num_blocks=6\)$"),
    ({(1, 0): 17}, LENS, r"^block_tables\[1, 0\]=17 is not a block id in \[0, num_blocks=6\)$"),
    ({(0, 0): -1}, LENS, r"^block_tables\[0, 0\]=-1 is not a block id in \[0, num_blocks=6\)$"),
    ({}, [9, 25], r"^seq_lens\[1\]=25 needs 4 blocks but block_tables has max_num_blocks_per_seq=3: "
                  r"seq_lens must be in \[0, max_num_blocks_per_seq \* block_size=24\]$"),
    ({}, [-3, 20], r"^seq_lens\[0\]=-3 must be >= 0$"),
]


@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("change,lens,match", BAD_METADATA)
def test_bad_attention_metadata_raises_and_is_caught_under_jit(op, change, lens, match):
    tables = TABLES.copy()
    for idx, value in change.items():
        tables[idx] = value
    args = (jnp.asarray(_q()), jnp.asarray(_cache()), jnp.asarray(tables), jnp.asarray(lens, jnp.int32))
    _host_then_jit(_OPS[op], args, match, _JITTED[op])


@pytest.mark.parametrize("op", list(_OPS))
def test_good_metadata_passes_with_garbage_past_the_used_blocks(op):
    """Entries past cdiv(seq_len, block_size) are never read, so they are never checked; results are the
    same with and without the check mode."""
    tables = TABLES.copy()
    tables[0, 2] = 99  # seq 0 (9 tokens) reads blocks 0 and 1 only
    args = (jnp.asarray(_q()), jnp.asarray(_cache()), jnp.asarray(tables), jnp.asarray(LENS))
    plain = _OPS[op](*args)
    err, out = _JITTED[op](*args)
    assert err.get() is None
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=1e-6, atol=1e-6)
    ref = paged_attention_reference(*args[:2], jnp.asarray(TABLES), args[3], scale=0.25)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_prefill_query_start_loc_checked_under_jit():
    q, cache = jnp.asarray(_q(8)), jnp.asarray(_cache())

    def prefill(qsl):
        return paged_prefill_attention(q, cache, jnp.asarray(TABLES), jnp.asarray(LENS), qsl, scale=0.25,
                                       max_query_len=4, interpret=True)

    jitted = jax.jit(checked(prefill))
    for qsl, match in (([-1, 3, 8], r"query_start_loc\[0\]=-1 must be >= 0"),
                       ([0, 5, 3], r"query_start_loc\[2\]=3 < query_start_loc\[1\]=5"),
                       ([0, 3, 9], r"query_start_loc\[-1\]=9 exceeds num_tokens=8"),
                       ([0, 3, 8], r"query_len=5 of sequence 1 exceeds max_query_len=4")):
        _host_then_jit(prefill, (jnp.asarray(qsl, jnp.int32),), match, jitted)


# ------------------------------------------------------------------------------------------------
# Cache writes and block ops: raise before any work, nothing consumed
# ------------------------------------------------------------------------------------------------

KV = np.random.default_rng(2).standard_normal((3, KVH, D)).astype(np.float32)


@pytest.mark.parametrize("bad", [-5, -2, CAPACITY, CAPACITY + 100])
def test_write_rejects_slots_that_are_not_pad_or_in_range(bad):
    cache = jnp.asarray(_cache())
    slots = jnp.asarray([0, bad, -1], jnp.int32)
    match = (rf"^slot_mapping\[1\]={bad} is neither PAD_SLOT_ID=-1 nor a slot in "
             rf"\[0, num_blocks\*block_size={CAPACITY}\)$")
    _host_then_jit(lambda c, s: jaxkv.write_to_paged_cache(c, jnp.asarray(KV), jnp.asarray(KV), s),
                   (cache, slots), match)
    np.testing.assert_array_equal(np.asarray(cache), _cache())  # the input cache is unchanged


def test_write_good_slots_unchanged_by_the_check_mode():
    cache, slots = jnp.asarray(_cache()), jnp.asarray([0, CAPACITY - 1, -1], jnp.int32)
    fn = lambda c, s: jaxkv.write_to_paged_cache(c, jnp.asarray(KV), jnp.asarray(KV), s)  # noqa: E731
    err, out = jax.jit(checked(fn))(cache, slots)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(cache, slots)))


@pytest.mark.parametrize("op,ids,match", [
    ("copy", [[0, 6]], r"^src_to_dst\[0, 1\]=6 \(destination block\) is out of range \[0, num_blocks=6\)$"),
    ("copy", [[0, 1], [-2, 3]], r"^src_to_dst\[1, 0\]=-2 \(source block\) is out of range"),
    ("copy", [[0, 4], [1, 5], [2, 4]], r"^src_to_dst\[2, 1\]=4 is a duplicate destination block "
                                       r"\(also src_to_dst\[0, 1\]\)$"),
    ("zero", [1, 6], r"^block_ids\[1\]=6 is out of range \[0, num_blocks=6\)$"),
    ("zero", [-1], r"^block_ids\[0\]=-1 is out of range"),
    ("swap", [[0, 1], [6, 2]], r"^src_to_dst\[1, 0\]=6 \(source block\) is out of range \[0, num_blocks=6\)$"),
    ("swap", [[0, 3], [1, 3]], r"^src_to_dst\[1, 1\]=3 is a duplicate destination block"),
])
def test_block_ops_reject_bad_ids_before_donation(op, ids, match):
    """The donated variants validate first: the rejected cache is neither consumed nor changed; the check
    mode reports the same error for traced ids."""
    cache = jnp.asarray(_cache())
    ids = np.asarray(ids, np.int32)
    donated = {"copy": lambda c, i: block_ops.copy_blocks_donated(c, i),
               "zero": lambda c, i: block_ops.zero_blocks_donated(c, i),
               "swap": lambda c, i: swap_blocks_donated(jnp.asarray(_cache()), c, i)}[op]
    plain = {"copy": block_ops.copy_blocks, "zero": block_ops.zero_blocks,
             "swap": lambda c, i: jaxkv.swap_blocks(jnp.asarray(_cache()), c, i)}[op]
    with pytest.raises(ValueError, match=match):
        donated(cache, ids)
    assert not cache.is_deleted()
    np.testing.assert_array_equal(np.asarray(cache), _cache())
    _host_then_jit(plain, (cache, jnp.asarray(ids)), match)


def test_block_ops_good_ids_pass_the_check_mode():
    cache, pairs = jnp.asarray(_cache()), jnp.asarray([[0, 4], [4, 2]], jnp.int32)
    err, out = jax.jit(checked(block_ops.copy_blocks))(cache, pairs)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(out), np.asarray(block_ops.copy_blocks(cache, pairs)))


# ------------------------------------------------------------------------------------------------
# Slot mapping and metadata builders
# ------------------------------------------------------------------------------------------------

def test_compute_slot_mapping_rejects_negative_block_ids():
    with pytest.raises(ValueError, match=r"^block_table\[1\]=-2 is not a block id \(block ids are >= 0\) "
                                         r"\(block of token 8\)$"):
        compute_slot_mapping(False, 12, 0, 0, 8, [3, -2])
    with pytest.raises(ValueError, match=r"block_table\[1\]=6 is not a block id in \[0, num_blocks=6\)"):
        compute_slot_mapping(False, 12, 0, 0, 8, [3, 6], num_blocks=6)
    assert compute_slot_mapping(False, 8, 0, 0, 8, [3, -2]).tolist() == list(range(24, 32))  # [1] unused


def test_compute_slot_mapping_batch_checks_written_blocks_only():
    tables = np.array([[0, -1], [6, 2]])
    with pytest.raises(ValueError, match=r"^block_tables\[1, 0\]=6 is not a block id in "
                                         r"\[0, num_blocks=6\) \(block of token 3\)$"):
        compute_slot_mapping_batch(tables, [0, 0], [3, 9], 8, num_blocks=6)
    # seq 1 writes only its tokens 8.. (block 1): block [1, 0] = 6 is not written, [0, 1] = -1 never used
    got = compute_slot_mapping_batch(tables, [0, 8], [3, 9], 8, num_blocks=6)
    assert got.tolist() == [0, 1, 2, 16]


@pytest.mark.parametrize("seq_ids,positions,match", [
    ([0, 2], [3, 1], r"^seq_ids\[1\]=2 is not a row of block_tables in \[0, num_seqs=2\)$"),
    ([0, 1], [3, 24], r"^positions\[1\]=24 is past the block table: max_num_blocks_per_seq \* block_size=24$"),
    ([0, 1], [23, 1], r"^block_tables\[0, 2\]=5 is not a block id in \[0, num_blocks=5\) \(block of token 0\)$"),
])
def test_slot_mapping_from_positions_checks(seq_ids, positions, match):
    fn = lambda t, s, p: slot_mapping_from_positions(t, s, p, BS, num_blocks=5)  # noqa: E731
    _host_then_jit(fn, (jnp.asarray(TABLES), jnp.asarray(seq_ids, jnp.int32),
                        jnp.asarray(positions, jnp.int32)), match)


def test_slot_mapping_from_positions_pad_tokens_are_not_checked():
    got = slot_mapping_from_positions(jnp.asarray(TABLES), jnp.asarray([7, 1], jnp.int32),
                                      jnp.asarray([-1, 9], jnp.int32), BS, num_blocks=NB)
    assert np.asarray(got).tolist() == [-1, 3 * BS + 1]


def test_build_attn_metadata_checks_the_blocks_each_sequence_reads():
    with pytest.raises(ValueError, match=r"^block_tables\[1, 1\]=6 is not a block id in \[0, num_blocks=6\)$"):
        build_attn_metadata([[0, 1], [2, 6]], [8, 9], [1, 1], BS, num_blocks=6)
    with pytest.raises(ValueError, match=r"^block_tables\[0, 0\]=-4 is not a block id \(block ids are >= 0\)$"):
        build_attn_metadata([[-4, 1], [2, 3]], [0, 0], [3, 3], BS)
    md = build_attn_metadata([[0, -1], [2, 3]], [0, 8], [3, 1], BS, num_blocks=6)  # [0, 1] never read
    assert np.asarray(md.slot_mapping).tolist() == [0, 1, 2, 3 * BS]


def test_build_attn_metadata_for_groups_checks_each_group():
    groups = [types.SimpleNamespace(layer_names=(f"l{g}",), kv_cache_spec=types.SimpleNamespace(block_size=BS))
              for g in range(2)]
    tables = [np.array([[0, 1]]), np.array([[5, 9]])]
    with pytest.raises(ValueError, match=r"^block_tables\[1\]\[0, 1\]=9 is not a block id in "
                                         r"\[0, num_blocks=8\)$"):
        build_attn_metadata_for_groups(groups, tables, [8], [1], num_blocks=[16, 8])
    with pytest.raises(ValueError, match="num_blocks has 1 entries for 2 kv_cache_groups"):
        build_attn_metadata_for_groups(groups, tables, [8], [1], num_blocks=[16])
    assert len(build_attn_metadata_for_groups(groups, tables, [8], [1], num_blocks=10)) == 2


def test_pad_decode_metadata_max_seq_len_checked_under_jit():
    md = build_attn_metadata(TABLES, [8, 19], [1, 1], BS)
    fn = lambda m: pad_decode_metadata(m, 4, max_seq_len=16)  # noqa: E731
    _host_then_jit(fn, (md,), r"^max_seq_len=16 < seq_lens\[1\]=20$")


# ------------------------------------------------------------------------------------------------
# The check mode: trace-time, jit-cache keyed, zero cost when off
# ------------------------------------------------------------------------------------------------

def _step(cache, q, k, v, slots, tables, lens, pairs, seq_ids, positions):
    """A decode step using the checked ops: write, decode attention, copy, slot mapping."""
    cache = jaxkv.write_to_paged_cache(cache, k, v, slots)
    out = paged_attention(q, cache, tables, lens, scale=0.25, interpret=True)
    cache = block_ops.copy_blocks(cache, pairs)
    return out, cache, slot_mapping_from_positions(tables, seq_ids, positions, BS)


def _bare_step(cache, q, k, v, slots, tables, lens, pairs, seq_ids, positions):
    """The same step from the unchecked internals (what main ran: no value check exists in a trace)."""
    from jaxkv.kv_cache.slot_mapping import _slots_from_positions
    cache = ops._scatter(cache, k, v, slots, None, None)
    out = paged_attention.__wrapped__(q, cache, tables, lens, scale=0.25, interpret=True)
    cache = block_ops._copy_jit(cache, pairs, block_axis=1)
    return out, cache, _slots_from_positions(tables, seq_ids, positions, BS)


def _step_args(bad_slot=False):
    slots = [0, -5] if bad_slot else [0, 17]
    return (jnp.asarray(_cache()), jnp.asarray(_q()), jnp.asarray(KV[:2]), jnp.asarray(KV[:2]),
            jnp.asarray(slots, jnp.int32), jnp.asarray(TABLES), jnp.asarray(LENS),
            jnp.asarray([[0, 4]], jnp.int32), jnp.asarray([0, 1], jnp.int32), jnp.asarray([8, 19], jnp.int32))


def _num_ops(text: str) -> int:
    return len(re.findall(r"= (?:stablehlo|chlo|func|mhlo)\.[a-z_]+|^\s*(?:stablehlo|func)\.[a-z_]+", text,
                          re.M))


def test_checks_off_add_no_op_and_on_add_some():
    args = _step_args()
    off = jax.jit(_step).lower(*args).as_text()
    bare = jax.jit(_bare_step).lower(*args).as_text().replace("@jit__bare_step", "@jit__step", 1)
    assert off == bare  # byte-identical program: zero cost when off
    on = jax.jit(checked(_step)).lower(*args).as_text()
    assert _num_ops(on) > _num_ops(off) > 0


def test_check_mode_is_part_of_the_jit_cache_key():
    """A jitted step traced with the mode off is re-traced under checkify with it on (the checks are not
    skipped by a cache hit), and the checked trace does not leak into later unchecked calls."""
    step = jax.jit(_step)
    good, bad = _step_args(), _step_args(bad_slot=True)
    out_plain = step(*bad)  # unchecked under jit: -5 is dropped silently
    with checks_enabled():
        assert checks_are_enabled()
        err, out = checkify.checkify(step)(*bad)
    assert not checks_are_enabled()
    assert err.get().startswith("slot_mapping[1]=-5 is neither PAD_SLOT_ID=-1")
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(out_plain[0]))
    step(*good)  # the unchecked trace is still served (no "not functionalized" error)
    with checks_enabled(), pytest.raises(Exception, match="functionaliz"):
        step(*good)  # the mode on without checkify.checkify is an error, never a silent no-op
    err, _ = checked(step)(*good)
    assert err.get() is None


def test_host_checks_run_under_the_check_mode_too():
    """Concrete inputs are checked on the host whatever the mode (nothing to functionalise)."""
    with checks_enabled(), pytest.raises(ValueError, match=r"block_tables\[1, 0\]=6"):
        _decode(jnp.asarray(_q()), jnp.asarray(_cache()), jnp.asarray([[0, 1, 5], [6, 3, 4]], jnp.int32),
                jnp.asarray(LENS))


def test_jitted_op_attributes_kept():
    assert paged_attention.lower == decode_mod.paged_attention.__wrapped__.lower
    assert paged_attention.__name__ == "paged_attention" and "Raises" in paged_attention.__doc__
