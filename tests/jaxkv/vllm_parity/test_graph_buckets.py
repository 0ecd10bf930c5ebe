"""Graph-capture analogue (seed 001 ``CommonAttentionState``): capture sizes, decode padding, staging buffers,
and one compilation per bucket across many decode steps of changing real batch size.

References: vLLM's model-runner rules transcribed below (``_BATCH_SIZES_TO_CAPTURE``,
``_get_graph_batch_size``, ``_get_max_graph_batch_size``), hand-worked padded metadata, and a float64 NumPy
attention loop over dense K/V kept outside the paged cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.metadata import build_attn_metadata
from jaxkv.kv_cache.write import write_to_paged_cache
from jaxkv.vllm_parity.enc_dec_metadata import EncoderDecoderMetadata, build_encoder_decoder_metadata
from jaxkv.vllm_parity.graph_buckets import DecodeGraphState, capture_batch_sizes, graph_batch_size, pad_decode_metadata

PAD = -1


def L(x):
    return np.asarray(x).tolist()


# ----------------------------------------------------------------------------------------------
# vLLM's capture-size rules, transcribed
# ----------------------------------------------------------------------------------------------

VLLM_SIZES = [1, 2, 4] + [8 * i for i in range(1, 1025)]


def vllm_graph_batch_size(batch_size):
    if batch_size <= 2:
        return batch_size
    if batch_size <= 4:
        return 4
    return (batch_size + 7) // 8 * 8


def vllm_max_graph_batch_size(max_num_seqs):
    padded = vllm_graph_batch_size(max_num_seqs)
    return padded if padded in VLLM_SIZES else VLLM_SIZES[-1]


def test_capture_sizes_hand_values():
    assert capture_batch_sizes(1) == (1,)
    assert capture_batch_sizes(3) == (1, 2, 4)
    assert capture_batch_sizes(5) == (1, 2, 4, 8)
    assert capture_batch_sizes(13) == (1, 2, 4, 8, 16)
    assert capture_batch_sizes(17) == (1, 2, 4, 8, 16, 24)


@pytest.mark.parametrize("max_batch_size", range(1, 101))
def test_capture_sizes_match_vllm(max_batch_size):
    top = vllm_max_graph_batch_size(max_batch_size)
    assert capture_batch_sizes(max_batch_size) == tuple(s for s in VLLM_SIZES if s <= top)


def test_graph_batch_size_matches_vllm():
    sizes = capture_batch_sizes(40)
    for b in range(1, 41):
        assert graph_batch_size(b, sizes) == vllm_graph_batch_size(b)
    for bad in (0, 41):
        with pytest.raises(ValueError, match="batch_size"):
            graph_batch_size(bad, sizes)
    with pytest.raises(ValueError, match="max_batch_size"):
        capture_batch_sizes(0)


# ----------------------------------------------------------------------------------------------
# pad_decode_metadata
# ----------------------------------------------------------------------------------------------

def two_seq_decode():
    # bs 4; seq 0: table [7, 2], 5 cached → slot 2*4+1 = 9; seq 1: table [3, 6], 0 cached → slot 12
    return build_attn_metadata(np.array([[7, 2], [3, 6]]), [5, 0], [1, 1], 4)


def test_pad_decode_metadata_hand_values():
    md = pad_decode_metadata(two_seq_decode(), 4, max_num_blocks_per_seq=3, max_seq_len=12)
    assert L(md.slot_mapping) == [9, 12, PAD, PAD]
    assert L(md.seq_lens) == [6, 1, 1, 1]
    assert L(md.block_tables) == [[7, 2, 0], [3, 6, 0], [0, 0, 0], [0, 0, 0]]
    assert L(md.query_start_loc) == [0, 1, 2, 3, 4]
    assert md.max_query_len == 1 and md.max_seq_len == 12
    assert all(x.dtype == jnp.int32 for x in jax.tree_util.tree_leaves(md))


def test_pad_decode_metadata_under_jit_and_from_padded():
    f = jax.jit(functools.partial(pad_decode_metadata, bucket=8, max_num_blocks_per_seq=2))
    md = f(pad_decode_metadata(two_seq_decode(), 4))  # re-padding a padded batch extends it
    assert L(md.slot_mapping) == [9, 12] + [PAD] * 6
    assert L(md.seq_lens) == [6, 1] + [1] * 6
    assert L(md.query_start_loc) == list(range(9))
    assert md.max_seq_len == 8  # unchanged default bound (width 2 * block 4)


def test_pad_decode_metadata_errors():
    with pytest.raises(ValueError, match="max_query_len"):
        pad_decode_metadata(build_attn_metadata(np.array([[0, 1]]), [0], [3], 4), 4)
    with pytest.raises(ValueError, match="bucket"):
        pad_decode_metadata(two_seq_decode(), 1)
    with pytest.raises(ValueError, match="max_num_blocks_per_seq"):
        pad_decode_metadata(two_seq_decode(), 4, max_num_blocks_per_seq=1)
    with pytest.raises(ValueError, match="max_seq_len"):
        pad_decode_metadata(two_seq_decode(), 4, max_seq_len=5)  # seq 0 has 6 tokens


def test_pad_encoder_decoder_metadata():
    ed = build_encoder_decoder_metadata(two_seq_decode(), [5, 3], np.array([[6, 2], [4, 0]]), 4,
                                        is_prompt=False)
    md = pad_decode_metadata(ed, 4)
    assert isinstance(md, EncoderDecoderMetadata)
    assert L(md.encoder_seq_lens) == [5, 3, 1, 1]
    assert L(md.cross_block_tables) == [[6, 2], [4, 0], [0, 0], [0, 0]]
    assert L(md.seq_lens) == [6, 1, 1, 1] and md.cross_slot_mapping.shape == (0,)


# ----------------------------------------------------------------------------------------------
# DecodeGraphState: buffers, capture metadata, copy-in
# ----------------------------------------------------------------------------------------------

def test_capture_buffers_and_metadata():
    state = DecodeGraphState(block_size=4, max_num_blocks_per_seq=3)
    assert state.max_seq_len_to_capture == 12
    with state.graph_capture(max_batch_size=5) as s:
        assert s is state and state.is_graph_capturing
        assert state.capture_sizes == (1, 2, 4, 8)
        bufs = state.get_graph_input_buffers()
        assert L(bufs["slot_mapping"]) == [PAD] * 8 and L(bufs["seq_lens_tensor"]) == [1] * 8
        assert L(bufs["block_tables"]) == [[0, 0, 0]] * 8
        with pytest.raises(ValueError, match="read-only"):
            bufs["seq_lens_tensor"][0] = 7
        md = state.graph_capture_get_metadata_for_batch(4)
        assert L(md.slot_mapping) == [PAD] * 4 and L(md.seq_lens) == [1] * 4
        assert L(md.block_tables) == [[0, 0, 0]] * 4 and L(md.query_start_loc) == [0, 1, 2, 3, 4]
        assert md.max_query_len == 1 and md.max_seq_len == 12
        clone = state.graph_clone(4)
        assert clone is not state and clone.max_seq_len_to_capture == 12 and clone.capture_sizes == ()
        with pytest.raises(RuntimeError, match="already"):
            with state.graph_capture(3):
                pass
        with pytest.raises(ValueError, match="batch_size"):
            state.graph_capture_get_metadata_for_batch(9)
    assert not state.is_graph_capturing
    with pytest.raises(RuntimeError, match="graph_capture"):
        state.graph_capture_get_metadata_for_batch(1)
    with pytest.raises(RuntimeError, match="graph_capture"):
        state.graph_clone(1)


def test_prepare_copies_in_and_resets_padding_rows():
    state = DecodeGraphState(block_size=4, max_num_blocks_per_seq=3, max_seq_len_to_capture=10)
    with pytest.raises(RuntimeError, match="graph_capture"):
        state.prepare_graph_input_buffers(two_seq_decode())
    with state.graph_capture(8):
        captured = state.graph_capture_get_metadata_for_batch(8)
    # 7 sequences (bucket 8): seq s has table [s+1, s+20], s+1 cached → new token at position s+1
    tables7 = np.array([[s + 1, s + 20] for s in range(7)])
    big = state.prepare_graph_input_buffers(
        build_attn_metadata(tables7, [s + 1 for s in range(7)], [1] * 7, 4))
    want_slots = [(s + 1) * 4 + s + 1 if s + 1 < 4 else (s + 20) * 4 + (s + 1 - 4) for s in range(7)]
    assert want_slots[:4] == [5, 10, 15, 92]  # s=3: position 4 → logical 1 → block 23 → 92
    assert L(big.slot_mapping) == want_slots + [PAD]
    assert L(big.seq_lens) == [s + 2 for s in range(7)] + [1]
    assert L(big.block_tables) == [[s + 1, s + 20, 0] for s in range(7)] + [[0, 0, 0]]
    # then 5 sequences (same bucket): rows 5..7 go back to padding values
    small = state.prepare_graph_input_buffers(two_seq_decode())
    assert L(small.slot_mapping) == [9, 12] and L(small.seq_lens) == [6, 1]  # bucket 2
    five = state.prepare_graph_input_buffers(build_attn_metadata(tables7[:5], [0] * 5, [1] * 5, 4))
    assert L(five.slot_mapping) == [(s + 1) * 4 for s in range(5)] + [PAD] * 3
    assert L(five.seq_lens) == [1] * 8
    assert L(five.block_tables) == [[s + 1, s + 20, 0] for s in range(5)] + [[0, 0, 0]] * 3
    # metadata returned earlier is not changed by later fills (no aliasing of the staging buffers)
    assert L(big.slot_mapping) == want_slots + [PAD] and L(big.seq_lens)[:2] == [2, 3]
    # same treedef and shapes as the captured bucket → the compiled step is reused
    assert jax.tree_util.tree_structure(five) == jax.tree_util.tree_structure(captured)
    shapes = [[x.shape for x in jax.tree_util.tree_leaves(m)] for m in (five, captured)]
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize("make,match", [
    (lambda: build_attn_metadata(np.zeros((2, 2)), [0, 0], [2, 1], 4), "max_query_len"),
    (lambda: build_attn_metadata(np.zeros((9, 2)), [0] * 9, [1] * 9, 4), "batch_size=9"),
    (lambda: build_attn_metadata(np.zeros((2, 4)), [0, 0], [1, 1], 4), "max_num_blocks_per_seq"),
    (lambda: build_attn_metadata(np.zeros((2, 3)), [0, 10], [1, 1], 4), "max_seq_len_to_capture"),
    (lambda: build_attn_metadata(np.zeros((2, 2)), [0, 0], [1, 1], 4, num_tokens_padded=3), "slot_mapping"),
])
def test_prepare_rejects_and_leaves_buffers_unchanged(make, match):
    state = DecodeGraphState(block_size=4, max_num_blocks_per_seq=3, max_seq_len_to_capture=10)
    with state.graph_capture(8):
        pass
    state.prepare_graph_input_buffers(build_attn_metadata(np.array([[5, 6, 7]] * 3), [1, 2, 3], [1] * 3, 4))
    before = {k: v.copy() for k, v in state.get_graph_input_buffers().items()}
    with pytest.raises(ValueError, match=match):
        state.prepare_graph_input_buffers(make())
    after = state.get_graph_input_buffers()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_state_constructor_errors():
    with pytest.raises(ValueError, match="block_size"):
        DecodeGraphState(block_size=0, max_num_blocks_per_seq=2)
    with pytest.raises(ValueError, match="max_num_blocks_per_seq"):
        DecodeGraphState(block_size=4, max_num_blocks_per_seq=0)
    with pytest.raises(ValueError, match="max_seq_len_to_capture"):
        DecodeGraphState(block_size=4, max_num_blocks_per_seq=2, max_seq_len_to_capture=9)
    with pytest.raises(ValueError, match="max_num_cross_blocks"):
        DecodeGraphState(block_size=4, max_num_blocks_per_seq=2, max_num_cross_blocks=0)


def test_encoder_decoder_capture_and_prepare():
    state = DecodeGraphState(block_size=4, max_num_blocks_per_seq=2, max_num_cross_blocks=3)
    with state.graph_capture(4):
        cap = state.graph_capture_get_metadata_for_batch(2, is_encoder_decoder_model=True)
    assert isinstance(cap, EncoderDecoderMetadata)
    assert L(cap.encoder_seq_lens) == [1, 1] and cap.cross_slot_mapping.shape == (0,)
    assert L(cap.cross_block_tables) == [[0, 0, 0]] * 2
    assert cap.max_encoder_seq_len == 8 and cap.num_encoder_tokens == 0
    one = build_attn_metadata(np.array([[7, 2]]), [5], [1], 4)
    ed = build_encoder_decoder_metadata(one, [5], np.array([[6, 2]]), 4, is_prompt=False,
                                        max_encoder_seq_len=5)
    md = state.prepare_graph_input_buffers(ed)  # bucket 1
    assert L(md.encoder_seq_lens) == [5] and L(md.cross_block_tables) == [[6, 2, 0]]
    assert md.max_encoder_seq_len == 8 and md.num_encoder_tokens == 0  # the captured statics
    two = build_attn_metadata(np.array([[7, 2], [3, 6]]), [5, 0], [1, 1], 4)
    md = state.prepare_graph_input_buffers(
        build_encoder_decoder_metadata(two, [5, 8], np.array([[6, 2], [4, 1]]), 4, is_prompt=False))
    assert jax.tree_util.tree_structure(md) == jax.tree_util.tree_structure(cap)
    assert L(md.encoder_seq_lens) == [5, 8] and L(md.slot_mapping) == [9, 12]
    prefill = build_encoder_decoder_metadata(one, [5], np.array([[6, 2]]), 4, is_prompt=True)
    with pytest.raises(ValueError, match="cross_slot_mapping"):
        state.prepare_graph_input_buffers(prefill)
    with pytest.raises(ValueError, match="encoder_seq_lens"):
        state.prepare_graph_input_buffers(EncoderDecoderMetadata(decoder=one))


# ----------------------------------------------------------------------------------------------
# One compilation per bucket across ~30 decode steps (real write + paged attention, reference impl)
# ----------------------------------------------------------------------------------------------

BS, WIDTH, NUM_BLOCKS, KVH, HEADS, HS = 4, 6, 100, 2, 4, 16
SCALE = HS ** -0.5


def make_step(traces):
    @jax.jit
    def step(q, k, v, kv_cache, md):
        traces.append(q.shape[0])  # Python side effect: runs only while tracing
        kv_cache = write_to_paged_cache(kv_cache, k, v, md.slot_mapping)
        return paged_attention(q, kv_cache, md, scale=SCALE, impl="reference"), kv_cache
    return step


def random_decode_batch(rng, n):
    """n sequences with random histories in a NaN-filled cache; dense K/V kept aside for the reference."""
    cache = np.full((2, NUM_BLOCKS, KVH, BS, HS), np.nan, np.float32)
    ctx = rng.integers(0, WIDTH * BS, n)  # seq_len = ctx + 1 <= 24 = WIDTH * BS
    free = rng.permutation(np.arange(1, NUM_BLOCKS))  # block 0 is never owned (dummy rows read it)
    tables = np.zeros((n, WIDTH), np.int32)
    dense_k, dense_v = [], []
    used = 0
    for s in range(n):
        need = -(-(int(ctx[s]) + 1) // BS)
        tables[s, :need] = free[used:used + need]
        used += need
        k = rng.standard_normal((int(ctx[s]), KVH, HS)).astype(np.float32)
        v = rng.standard_normal((int(ctx[s]), KVH, HS)).astype(np.float32)
        for p in range(int(ctx[s])):
            cache[0, tables[s, p // BS], :, p % BS] = k[p]
            cache[1, tables[s, p // BS], :, p % BS] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    q = rng.standard_normal((n, HEADS, HS)).astype(np.float32)
    k_new = rng.standard_normal((n, KVH, HS)).astype(np.float32)
    v_new = rng.standard_normal((n, KVH, HS)).astype(np.float32)
    return cache, tables, ctx, dense_k, dense_v, q, k_new, v_new


def ref_attention(dense_k, dense_v, q, k_new, v_new):
    out = np.zeros(q.shape, np.float64)
    group = HEADS // KVH
    for s in range(q.shape[0]):
        k = np.concatenate([dense_k[s], k_new[s][None]]).astype(np.float64)
        v = np.concatenate([dense_v[s], v_new[s][None]]).astype(np.float64)
        for h in range(HEADS):
            logits = k[:, h // group] @ q[s, h].astype(np.float64) * SCALE
            p = np.exp(logits - logits.max())
            out[s, h] = (p / p.sum()) @ v[:, h // group]
    return out


def pad_rows(x, rows):
    return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


def run_steps(state, step, schedule, rng):
    buckets = []
    for n in schedule:
        cache, tables, ctx, dense_k, dense_v, q, k_new, v_new = random_decode_batch(rng, n)
        md = state.prepare_graph_input_buffers(build_attn_metadata(tables, ctx, np.ones(n), BS))
        bucket = md.seq_lens.shape[0]
        buckets.append(bucket)
        out, new_cache = step(*(jnp.asarray(pad_rows(a, bucket)) for a in (q, k_new, v_new)),
                              jnp.asarray(cache), md)
        np.testing.assert_allclose(np.asarray(out)[:n], ref_attention(dense_k, dense_v, q, k_new, v_new),
                                   rtol=1e-5, atol=1e-5)
        want_cache = cache.copy()  # only the real tokens' slots are written; dummy rows write nothing
        for s in range(n):
            p = int(ctx[s])
            want_cache[0, tables[s, p // BS], :, p % BS] = k_new[s]
            want_cache[1, tables[s, p // BS], :, p % BS] = v_new[s]
        np.testing.assert_array_equal(np.asarray(new_cache), want_cache)  # NaN == NaN here
    return buckets


def test_one_compile_per_bucket_over_30_decode_steps():
    rng = np.random.default_rng(0)
    schedule = [1, 2, 3, 5, 9, 13] + [int(x) for x in rng.integers(1, 14, 24)]
    state = DecodeGraphState(block_size=BS, max_num_blocks_per_seq=WIDTH)
    with state.graph_capture(max_batch_size=13):
        pass
    traces = []
    buckets = run_steps(state, make_step(traces), schedule, rng)
    assert len(schedule) == 30 and len(set(schedule)) > 5
    assert buckets == [vllm_graph_batch_size(n) for n in schedule]
    assert sorted(traces) == sorted(set(buckets)) == [1, 2, 4, 8, 16]  # exactly one compile per bucket


def test_warm_up_in_graph_capture_then_no_compile():
    rng = np.random.default_rng(1)
    state = DecodeGraphState(block_size=BS, max_num_blocks_per_seq=WIDTH)
    traces = []
    step = make_step(traces)
    cache = jnp.full((2, NUM_BLOCKS, KVH, BS, HS), jnp.nan, jnp.float32)
    with state.graph_capture(max_batch_size=13):
        for b in state.capture_sizes:  # "capture": compile each bucket on its dummy batch
            md = state.graph_capture_get_metadata_for_batch(b)
            z = jnp.zeros((b, KVH, HS), jnp.float32)
            step(jnp.zeros((b, HEADS, HS), jnp.float32), z, z, cache, md)
    assert traces == [1, 2, 4, 8, 16]
    schedule = [int(x) for x in rng.integers(1, 14, 30)]
    run_steps(state, step, schedule, rng)
    assert traces == [1, 2, 4, 8, 16]  # 30 replays, no new compilation
