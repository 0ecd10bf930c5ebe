"""Per-KV-cache-group metadata, CommonAttentionMetadata, encoder-decoder metadata and the attention-type
helpers (seeds 000 ``build_attn_metadata`` and 001 ``get_num_prefill_decode_query_kv_tokens``,
``get_seq_len_block_table_args``, ``is_all_*_attn_metadata_set``).

Expected values come from hand-worked examples (arithmetic in the comments) and from a per-token Python
loop over vLLM's slot rule; never from the code under test.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.kv_cache.specs
from jaxkv.attention.metadata import (
    AttentionMetadata,
    CommonAttentionMetadata,
    build_attn_metadata,
    build_attn_metadata_for_groups,
)
from jaxkv.kv_cache.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from jaxkv.kv_cache.specs import FullAttentionSpec
from jaxkv.vllm_parity.enc_dec_metadata import (
    AttentionType,
    EncoderDecoderMetadata,
    build_encoder_decoder_metadata,
    get_num_prefill_decode_query_kv_tokens,
    get_seq_len_block_table_args,
    is_all_cross_attn_metadata_set,
    is_all_encoder_attn_metadata_set,
)

PAD = -1


def L(x):
    return np.asarray(x).tolist()


def ref_slots(table_rows, context_lens, query_lens, block_size, window=None, is_prompt=None):
    """vLLM v0 rule per token: prompts keep only their last ``window`` tokens; others are slotted."""
    out = []
    for s, (c, q) in enumerate(zip(context_lens, query_lens)):
        prompt = (c == 0) if is_prompt is None else is_prompt[s]
        start = max(0, q - window) if (prompt and window is not None) else 0
        for p in range(c, c + q):
            if p < start:
                out.append(PAD)
            else:
                out.append(int(table_rows[s][p // block_size]) * block_size + p % block_size)
    return out


def full_group(names, block_size):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8, dtype=jnp.float32)
    return KVCacheGroupSpec(layer_names=tuple(names), kv_cache_spec=spec)


def swa_group(names, block_size, window):
    spec = types.SimpleNamespace(block_size=block_size, sliding_window=window)
    return types.SimpleNamespace(layer_names=list(names), kv_cache_spec=spec)


FULL_NAMES = ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
SWA_NAMES = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")


# ----------------------------------------------------------------------------------------------
# build_attn_metadata_for_groups
# ----------------------------------------------------------------------------------------------

def hand_batch():
    # seq 0: prompt of 5 tokens; seq 1: decode (6 cached, 1 new)
    groups = [full_group(FULL_NAMES, 4), swa_group(SWA_NAMES, 2, 3)]
    tables = [np.array([[3, 1, 0], [2, 5, 0]]), np.array([[7, 0, 4, 9], [1, 6, 3, 8]])]
    return groups, tables, [0, 6], [5, 1]


def test_groups_hand_values():
    groups, tables, ctx, q = hand_batch()
    out = build_attn_metadata_for_groups(groups, tables, ctx, q, num_seqs_padded=4, num_tokens_padded=8)
    assert set(out) == set(FULL_NAMES + SWA_NAMES)
    full, swa = out[FULL_NAMES[0]], out[SWA_NAMES[0]]
    assert out[FULL_NAMES[1]] is full and out[SWA_NAMES[1]] is swa and full is not swa
    assert isinstance(full, CommonAttentionMetadata)
    # full, bs 4: seq0 p0..3 → block 3 → 12..15, p4 → block 1 → 4; seq1 p6 → block 5 → 22
    assert L(full.slot_mapping) == [12, 13, 14, 15, 4, 22, PAD, PAD]
    # swa, bs 2, window 3: seq0 prompt of 5 → p0, p1 PAD; p2 → blk 0 → 0, p3 → 1, p4 → blk 4 → 8;
    # seq1 (decode, not masked) p6 → logical 3 → block 8 → 16
    assert L(swa.slot_mapping) == [PAD, PAD, 0, 1, 8, 16, PAD, PAD]
    for md in (full, swa):  # request-level arrays; a mixed batch pads with 0-token dummies
        assert L(md.query_start_loc) == [0, 5, 6, 6, 6]
        assert L(md.seq_lens) == [5, 7, 0, 0]
        assert L(md.num_computed_tokens) == [0, 6, 0, 0]
        assert int(md.num_reqs) == 2 and int(md.num_actual_tokens) == 6
        assert md.max_query_len == 5 and md.causal and not md.is_decode_only
        assert L(md.query_lens) == [5, 1, 0, 0]
    assert full.query_start_loc is swa.query_start_loc  # built once, shared (vLLM shares the buffers)
    assert L(full.block_table_tensor) == [[3, 1, 0], [2, 5, 0], [0, 0, 0], [0, 0, 0]]
    assert L(swa.block_table_tensor) == [[7, 0, 4, 9], [1, 6, 3, 8], [0] * 4, [0] * 4]
    assert full.max_seq_len == 12 and swa.max_seq_len == 8  # width * block size


def test_groups_accept_kv_cache_config_and_builders():
    groups, tables, ctx, q = hand_batch()
    tensors = tuple(KVCacheTensor(size=4096, shared_by=(name,)) for name in FULL_NAMES)
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=tensors, kv_cache_groups=(groups[0],))
    out = build_attn_metadata_for_groups(config, tables[:1], ctx, q,
                                         builders=[CommonAttentionMetadata.to_attention_metadata])
    md = out[FULL_NAMES[0]]
    assert isinstance(md, AttentionMetadata) and out[FULL_NAMES[1]] is md
    assert L(md.slot_mapping) == [12, 13, 14, 15, 4, 22]
    assert L(md.block_tables) == [[3, 1, 0], [2, 5, 0]]
    assert L(md.query_start_loc) == [0, 5, 6] and md.max_query_len == 5 and md.max_seq_len == 12
    calls = []
    out = build_attn_metadata_for_groups(groups, tables, ctx, q,
                                         builders=[None, lambda c: calls.append(c) or ("built", len(calls))])
    assert isinstance(out[FULL_NAMES[0]], CommonAttentionMetadata)
    assert out[SWA_NAMES[0]] == ("built", 1) and out[SWA_NAMES[1]] == ("built", 1) and len(calls) == 1


def test_groups_with_real_sliding_window_spec():
    """The same hand example through jaxkv's own specs (skipped where SlidingWindowSpec is absent)."""
    spec_cls = getattr(jaxkv.kv_cache.specs, "SlidingWindowSpec", None)
    if spec_cls is None:
        pytest.skip("jaxkv.kv_cache.specs.SlidingWindowSpec not available")
    groups, tables, ctx, q = hand_batch()
    swa = spec_cls(block_size=2, num_kv_heads=2, head_size=8, dtype=jnp.float32, sliding_window=3)
    groups[1] = KVCacheGroupSpec(layer_names=SWA_NAMES, kv_cache_spec=swa)
    out = build_attn_metadata_for_groups(groups, tables, ctx, q)
    assert L(out[SWA_NAMES[1]].slot_mapping) == [PAD, PAD, 0, 1, 8, 16]
    assert L(out[FULL_NAMES[1]].slot_mapping) == [12, 13, 14, 15, 4, 22]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_random_match_reference(seed):
    rng = np.random.default_rng(seed)
    num_seqs = int(rng.integers(1, 9))
    seq_lens = rng.integers(1, 70, num_seqs)
    ctx = np.array([int(rng.choice([0, n - 1, rng.integers(0, n)])) for n in seq_lens])
    q = seq_lens - ctx
    is_prompt = (ctx == 0) | (rng.random(num_seqs) < 0.5)
    specs = [(16, None), (8, 12), (4, 5)]
    groups = [full_group([f"g{i}.a", f"g{i}.b"], bs) if w is None else swa_group([f"g{i}.a"], bs, w)
              for i, (bs, w) in enumerate(specs)]
    tables = [rng.permutation(500)[: num_seqs * (-(-70 // bs) + 1)].reshape(num_seqs, -1) for bs, _ in specs]
    n_pad = num_seqs + 3
    tok_pad = int(q.sum()) + 5
    out = build_attn_metadata_for_groups(groups, tables, ctx, q, num_seqs_padded=n_pad,
                                         num_tokens_padded=tok_pad, is_prompt=is_prompt)
    decode_only = bool(q.max() == 1)
    dummy = 1 if decode_only else 0
    for i, (bs, w) in enumerate(specs):
        md = out[f"g{i}.a"]
        want = ref_slots(tables[i], ctx.tolist(), q.tolist(), bs, w, is_prompt.tolist())
        assert L(md.slot_mapping) == want + [PAD] * (tok_pad - len(want))
        assert L(md.seq_lens) == seq_lens.tolist() + [dummy] * 3
        assert L(md.query_start_loc) == np.concatenate([[0], np.cumsum(list(q) + [dummy] * 3)]).tolist()
        assert int(md.num_reqs) == num_seqs and int(md.num_actual_tokens) == int(q.sum())


def test_common_metadata_pytree_counts_are_traced():
    """num_reqs / num_actual_tokens vary inside a bucket without recompiling; maxima are static."""
    groups = [full_group(["a"], 4)]
    traces = []

    @jax.jit
    def f(md):
        traces.append(md.max_query_len)
        return md.num_reqs * 1000 + md.num_actual_tokens * 10 + jnp.sum(md.slot_mapping >= 0)

    tables = np.arange(8 * 3).reshape(8, 3)
    a = build_attn_metadata_for_groups(groups, [tables[:2]], [3, 5], [1, 1], num_seqs_padded=8)["a"]
    b = build_attn_metadata_for_groups(groups, [tables[:7]], [0, 1, 2, 3, 4, 5, 6], [1] * 7,
                                       num_seqs_padded=8)["a"]
    assert int(f(a)) == 2 * 1000 + 2 * 10 + 2
    assert int(f(b)) == 7 * 1000 + 7 * 10 + 7
    assert traces == [1]
    leaves, treedef = jax.tree_util.tree_flatten(a)
    assert len(leaves) == 7
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(back, CommonAttentionMetadata) and back.max_seq_len == 12 and back.causal


@pytest.mark.parametrize("make,match", [
    (lambda g, t: ([], t), "kv_cache_groups"),
    (lambda g, t: (g, t[:1]), "block_tables has 1"),
    (lambda g, t: ([g[0], full_group([FULL_NAMES[1]], 4)], t), "layer_name"),
    (lambda g, t: ([swa_group([], 4, None), g[1]], t), "layer_names"),
    (lambda g, t: ([g[0], swa_group(["x"], 0, 3)], t), "block_size"),
    (lambda g, t: ([g[0], swa_group(["x"], 2, 0)], t), "sliding_window"),
    (lambda g, t: ([g[0], object()], t), "kv_cache_groups\\[1\\]"),
    (lambda g, t: (g, [t[0], t[1][:1]]), "block_tables\\[1\\].shape"),
    (lambda g, t: (g, [t[0][:, :1], t[1]]), "block_tables width"),  # seq 1 (len 7, bs 4) needs 2 blocks
])
def test_groups_errors(make, match):
    groups, tables, ctx, q = hand_batch()
    groups, tables = make(groups, tables)
    with pytest.raises(ValueError, match=match):
        build_attn_metadata_for_groups(groups, tables, ctx, q)


def test_groups_builders_count_and_shared_errors():
    groups, tables, ctx, q = hand_batch()
    with pytest.raises(ValueError, match="builders"):
        build_attn_metadata_for_groups(groups, tables, ctx, q, builders=[None])
    with pytest.raises(ValueError, match="query_lens"):
        build_attn_metadata_for_groups(groups, tables, ctx, [5, 0])
    with pytest.raises(ValueError, match="num_tokens_padded"):
        build_attn_metadata_for_groups(groups, tables, ctx, q, num_tokens_padded=5)
    with pytest.raises(ValueError, match="context_lens.shape"):
        build_attn_metadata_for_groups(groups, tables, [0], q)


def test_build_attn_metadata_sliding_window_keyword():
    md = build_attn_metadata(np.array([[0, 1, 0]]), [0], [10], 4, sliding_window=8)
    assert L(md.slot_mapping) == [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]  # the seed's worked example
    # a chunk flagged as prompt: 4 cached, 16 new, window 8 → positions 4..7 PAD
    md = build_attn_metadata(np.array([[9, 3, 7, 0, 5]]), [4], [16], 4, sliding_window=8, is_prompt=[True])
    assert L(md.slot_mapping) == [PAD] * 4 + [28, 29, 30, 31, 0, 1, 2, 3, 20, 21, 22, 23]
    with pytest.raises(ValueError, match="max_query_len"):
        build_attn_metadata(np.zeros((0, 2)), [], [], 4, max_query_len=0)


# ----------------------------------------------------------------------------------------------
# Encoder-decoder metadata
# ----------------------------------------------------------------------------------------------

def enc_dec_prefill():
    decoder = build_attn_metadata(np.array([[3, 1], [2, 5]]), [0, 0], [1, 1], 4, num_seqs_padded=4)
    # encoder 5 and 3 tokens, bs 4: seq0 → block 6: 24..27, block 2: 8; seq1 → block 4: 16, 17, 18
    return build_encoder_decoder_metadata(decoder, [5, 3], np.array([[6, 2], [4, 0]]), 4, is_prompt=True,
                                          num_encoder_tokens_padded=10)


def test_enc_dec_prefill_hand_values():
    md = enc_dec_prefill()
    assert L(md.cross_slot_mapping) == [24, 25, 26, 27, 8, 16, 17, 18, PAD, PAD]
    assert md.num_encoder_tokens == 10
    assert L(md.encoder_seq_lens) == [5, 3, 1, 1]  # decode-only decoder: dummies get 1 (vLLM capture)
    assert L(md.cross_block_tables) == [[6, 2], [4, 0], [0, 0], [0, 0]]
    assert md.max_encoder_seq_len == 8
    # decoder fields are reachable directly
    assert md.seq_lens is md.decoder.seq_lens and md.block_tables is md.decoder.block_tables
    assert md.is_decode_only and md.max_query_len == 1 and L(md.slot_mapping) == [12, 8, PAD, PAD]
    assert md.is_all_encoder_attn_metadata_set and md.is_all_cross_attn_metadata_set


def test_enc_dec_decode_step_and_prefill_padding_rows():
    decoder = build_attn_metadata(np.array([[3, 1]]), [1], [1], 4, num_seqs_padded=2)
    md = build_encoder_decoder_metadata(decoder, [6], np.array([[6, 2]]), 4, is_prompt=False,
                                        max_encoder_seq_len=7)
    assert md.cross_slot_mapping.shape == (0,) and md.num_encoder_tokens == 0
    assert L(md.encoder_seq_lens) == [6, 1] and md.max_encoder_seq_len == 7
    # a mixed (prefill) decoder batch pads rows with encoder length 0
    mixed = build_attn_metadata(np.array([[3, 1]]), [0], [3], 4, num_seqs_padded=3)
    md = build_encoder_decoder_metadata(mixed, [2], np.array([[5]]), 4, is_prompt=True)
    assert L(md.encoder_seq_lens) == [2, 0, 0] and L(md.cross_slot_mapping) == [20, 21]


@pytest.mark.parametrize("kwargs,match", [
    (dict(encoder_seq_lens=[9, 3]), "cross_block_tables width"),  # 9 tokens need 3 blocks of 4
    (dict(encoder_seq_lens=[1, 1, 1, 1, 1]), "decoder has 4 rows"),
    (dict(encoder_seq_lens=[-1, 3]), "encoder_seq_lens"),
    (dict(cross_block_tables=np.array([[6, 2]])), "cross_block_tables.shape"),
    (dict(num_encoder_tokens_padded=7), "num_encoder_tokens_padded"),
    (dict(is_prompt=False, num_encoder_tokens_padded=4), "num_encoder_tokens_padded"),
    (dict(max_encoder_seq_len=4), "max_encoder_seq_len"),
    (dict(block_size=0), "block_size"),
])
def test_enc_dec_errors(kwargs, match):
    decoder = build_attn_metadata(np.array([[3, 1], [2, 5]]), [0, 0], [1, 1], 4, num_seqs_padded=4)
    args = dict(encoder_seq_lens=[5, 3], cross_block_tables=np.array([[6, 2], [4, 0]]), block_size=4,
                is_prompt=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_encoder_decoder_metadata(decoder, **args)


def test_enc_dec_is_a_pytree():
    md = enc_dec_prefill()
    leaves = jax.tree_util.tree_leaves(md)
    assert len(leaves) == 4 + 3  # decoder's 4 arrays + encoder lens, cross slots, cross tables
    f = jax.jit(lambda m: jnp.sum(m.encoder_seq_lens) + jnp.sum(m.cross_slot_mapping >= 0) * 100)
    assert int(f(md)) == (5 + 3 + 1 + 1) + 8 * 100


def test_is_all_metadata_set():
    decoder = build_attn_metadata(np.array([[3, 1]]), [0], [1], 4)
    assert not is_all_encoder_attn_metadata_set(decoder) and not is_all_cross_attn_metadata_set(decoder)
    only_dec = EncoderDecoderMetadata(decoder=decoder)
    assert not only_dec.is_all_encoder_attn_metadata_set
    enc = EncoderDecoderMetadata(decoder=decoder, encoder_seq_lens=jnp.array([3]), max_encoder_seq_len=8)
    assert is_all_encoder_attn_metadata_set(enc) and not is_all_cross_attn_metadata_set(enc)
    no_max = EncoderDecoderMetadata(decoder=decoder, encoder_seq_lens=jnp.array([3]))
    assert not is_all_encoder_attn_metadata_set(no_max)
    # vLLM-style object: every field set
    v0 = types.SimpleNamespace(encoder_seq_lens=[3], max_encoder_seq_len=3, cross_slot_mapping=[0, 1, 2],
                               cross_block_tables=[[0]])
    assert is_all_encoder_attn_metadata_set(v0) and is_all_cross_attn_metadata_set(v0)


# ----------------------------------------------------------------------------------------------
# AttentionType, token counts, seq-len / block-table choice
# ----------------------------------------------------------------------------------------------

def test_attention_type_values_match_vllm():
    assert [t.value for t in AttentionType] == ["decoder", "encoder", "encoder_only", "encoder_decoder"]
    assert AttentionType.DECODER == "decoder"
    assert AttentionType("encoder_decoder") is AttentionType.ENCODER_DECODER


@pytest.mark.parametrize("attn_type,want", [
    (AttentionType.DECODER, (10, 10, 3)),
    ("encoder_only", (10, 10, 3)),
    (AttentionType.ENCODER, (7, 7, 0)),
    ("encoder_decoder", (10, 7, 3)),
])
def test_counts_v0_style_object(attn_type, want):
    md = types.SimpleNamespace(num_prefill_tokens=10, num_decode_tokens=3, num_encoder_tokens=7)
    assert get_num_prefill_decode_query_kv_tokens(md, attn_type) == want


def test_counts_need_num_encoder_tokens():
    md = types.SimpleNamespace(num_prefill_tokens=10, num_decode_tokens=3, num_encoder_tokens=None)
    assert get_num_prefill_decode_query_kv_tokens(md, "decoder") == (10, 10, 3)
    for t in ("encoder", "encoder_decoder"):
        with pytest.raises(ValueError, match="num_encoder_tokens"):
            get_num_prefill_decode_query_kv_tokens(md, t)
    with pytest.raises(ValueError, match="attn_type"):
        get_num_prefill_decode_query_kv_tokens(md, "cross")


def test_counts_from_jaxkv_metadata():
    # a prompt (5), a chunk (9) and a decode (1), padded to 6 seqs / 24 tokens: prefill 14, decode 1
    mixed = build_attn_metadata(np.zeros((3, 5), np.int32), [0, 16, 3], [5, 9, 1], 8, num_seqs_padded=6,
                                num_tokens_padded=24)
    assert get_num_prefill_decode_query_kv_tokens(mixed, AttentionType.DECODER) == (14, 14, 1)
    # decode bucket: 3 real + 5 dummies, every row one decode token (vLLM: num_decode_tokens = batch_size)
    dec = build_attn_metadata(np.zeros((3, 2), np.int32), [1, 2, 3], [1, 1, 1], 4, num_seqs_padded=8)
    assert get_num_prefill_decode_query_kv_tokens(dec, "decoder") == (0, 0, 8)
    groups, tables, ctx, q = hand_batch()
    common = build_attn_metadata_for_groups(groups, tables, ctx, q, num_seqs_padded=4)[FULL_NAMES[0]]
    assert get_num_prefill_decode_query_kv_tokens(common, "decoder") == (5, 5, 1)
    ed = enc_dec_prefill()
    assert get_num_prefill_decode_query_kv_tokens(ed, "encoder_decoder") == (0, 10, 4)
    assert get_num_prefill_decode_query_kv_tokens(ed, "encoder") == (10, 10, 0)


def test_counts_under_jit():
    dec = build_attn_metadata(np.zeros((3, 2), np.int32), [1, 2, 3], [1, 1, 1], 4, num_seqs_padded=4)
    f = jax.jit(lambda m: jnp.array(get_num_prefill_decode_query_kv_tokens(m, "decoder")))
    assert L(f(dec)) == [0, 0, 4]
    mixed = build_attn_metadata(np.zeros((2, 2), np.int32), [0, 3], [4, 1], 4)
    with pytest.raises(ValueError, match="query_start_loc"):
        f(mixed)


def test_seq_len_block_table_args():
    ed = enc_dec_prefill()
    dec = ed.decoder
    for is_prompt in (True, False):
        got = get_seq_len_block_table_args(dec, is_prompt, AttentionType.DECODER)
        assert got[0] is dec.seq_lens and got[1] == dec.max_seq_len == 8 and got[2] is dec.block_tables
        got = get_seq_len_block_table_args(ed, is_prompt, "decoder")
        assert got[0] is dec.seq_lens and got[2] is dec.block_tables
        got = get_seq_len_block_table_args(ed, is_prompt, "encoder_decoder")
        assert got[0] is ed.encoder_seq_lens and got[1] == 8 and got[2] is ed.cross_block_tables
        got = get_seq_len_block_table_args(ed, is_prompt, AttentionType.ENCODER)
        assert got[0] is ed.encoder_seq_lens and got[1] == 8 and got[2] is None
    groups, tables, ctx, q = hand_batch()
    common = build_attn_metadata_for_groups(groups, tables, ctx, q)[SWA_NAMES[0]]
    got = get_seq_len_block_table_args(common, True, "decoder")
    assert got[0] is common.seq_lens and got[1] == 8 and got[2] is common.block_table_tensor


def test_seq_len_block_table_args_errors():
    ed = enc_dec_prefill()
    with pytest.raises(ValueError, match="encoder_only"):
        get_seq_len_block_table_args(ed, True, AttentionType.ENCODER_ONLY)
    with pytest.raises(ValueError, match="attn_type"):
        get_seq_len_block_table_args(ed, True, "bogus")
    with pytest.raises(ValueError, match="encoder_decoder"):
        get_seq_len_block_table_args(ed.decoder, True, "encoder_decoder")
    with pytest.raises(ValueError, match="encoder"):
        get_seq_len_block_table_args(EncoderDecoderMetadata(decoder=ed.decoder), False, "encoder")
