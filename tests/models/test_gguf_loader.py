"""Tests of models.gguf_loader: q/k un-permutation (synthetic) and the real SmolLM2 GGUF."""

import os

import gguf
import numpy as np
import pytest

from models.gguf_loader import (
    load_llama_gguf,
    permute_qk_for_interleaved_rope,
    read_gguf_metadata,
    unpermute_qk_from_interleaved_rope,
)

# ----------------------------------------------------------------------------------------
# Synthetic: permutation and RoPE equivalence (float64, no file needed).

def _angles(positions: np.ndarray, head_size: int, theta: float) -> np.ndarray:
    """[T] positions -> [T, head_size // 2] rotation angles, frequency index i."""
    inv_freq = theta ** (-np.arange(0, head_size, 2, dtype=np.float64) / head_size)
    return positions[:, None].astype(np.float64) * inv_freq[None, :]


def _rope_interleaved(x: np.ndarray, ang: np.ndarray) -> np.ndarray:
    """llama.cpp 'normal' RoPE: rotates pairs (2i, 2i+1). x: [T, N, S], ang: [T, S/2]."""
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _rope_rotate_half(x: np.ndarray, ang: np.ndarray) -> np.ndarray:
    """HF / NeoX RoPE: rotates pairs (i, i + S/2). x: [T, N, S], ang: [T, S/2]."""
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("n_head,head_size,in_features", [(9, 64, 24), (3, 8, 5), (1, 2, 3)])
def test_permute_unpermute_are_inverse(n_head, head_size, in_features):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_size, in_features))
    p = permute_qk_for_interleaved_rope(w, n_head)
    assert not np.array_equal(p, w) or head_size == 2
    np.testing.assert_array_equal(unpermute_qk_from_interleaved_rope(p, n_head), w)
    np.testing.assert_array_equal(permute_qk_for_interleaved_rope(
        unpermute_qk_from_interleaved_rope(w, n_head), n_head), w)


def test_permute_moves_half_pairs_to_adjacent_rows():
    # One head of size 8: HF rows (i, i+4) must become GGUF rows (2i, 2i+1).
    w = np.arange(8.0)[:, None]
    np.testing.assert_array_equal(permute_qk_for_interleaved_rope(w, 1)[:, 0],
                                  [0, 4, 1, 5, 2, 6, 3, 7])


def test_permute_rejects_bad_shape():
    with pytest.raises(ValueError, match="n_head=4"):
        permute_qk_for_interleaved_rope(np.zeros((6, 3)), 4)


def test_unpermuted_weights_with_rotate_half_match_gguf_with_interleaved():
    """What llama.cpp computes (GGUF q/k + interleaved RoPE) equals what we compute
    (un-permuted q/k + rotate_half RoPE): same vectors up to the per-head row
    permutation, identical q.k scores across positions."""
    rng = np.random.default_rng(42)
    n_heads, n_kv_heads, head_size, hidden, seq = 6, 2, 16, 32, 11
    theta = 10000.0
    # "HF" weights in nn.Linear orientation [out, in]; the converter permutes them.
    wq_hf = rng.standard_normal((n_heads * head_size, hidden))
    wk_hf = rng.standard_normal((n_kv_heads * head_size, hidden))
    wq_gguf = permute_qk_for_interleaved_rope(wq_hf, n_heads)
    wk_gguf = permute_qk_for_interleaved_rope(wk_hf, n_kv_heads)
    # Our loader only ever sees the GGUF weights.
    wq_ours = unpermute_qk_from_interleaved_rope(wq_gguf, n_heads)
    wk_ours = unpermute_qk_from_interleaved_rope(wk_gguf, n_kv_heads)

    x = rng.standard_normal((seq, hidden))
    ang = _angles(rng.permutation(1000)[:seq], head_size, theta)

    def heads(w, n):
        return (x @ w.T).reshape(seq, n, head_size)

    q_ref = _rope_interleaved(heads(wq_gguf, n_heads), ang)
    k_ref = _rope_interleaved(heads(wk_gguf, n_kv_heads), ang)
    q_ours = _rope_rotate_half(heads(wq_ours, n_heads), ang)
    k_ours = _rope_rotate_half(heads(wk_ours, n_kv_heads), ang)

    # Same vectors up to the converter's per-head permutation of channels.
    perm = permute_qk_for_interleaved_rope(np.arange(head_size)[:, None], 1)[:, 0]
    np.testing.assert_allclose(q_ours[..., perm], q_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(k_ours[..., perm], k_ref, rtol=1e-12, atol=1e-12)

    # Attention scores (GQA: query head h reads KV head h // group) are identical.
    group = n_heads // n_kv_heads
    s_ref = np.einsum("qhd,khd->hqk", q_ref, np.repeat(k_ref, group, axis=1))
    s_ours = np.einsum("qhd,khd->hqk", q_ours, np.repeat(k_ours, group, axis=1))
    np.testing.assert_allclose(s_ours, s_ref, rtol=1e-10, atol=1e-10)

    # Sanity: without un-permuting, rotate_half gives different scores.
    q_wrong = _rope_rotate_half(heads(wq_gguf, n_heads), ang)
    k_wrong = _rope_rotate_half(heads(wk_gguf, n_kv_heads), ang)
    s_wrong = np.einsum("qhd,khd->hqk", q_wrong, np.repeat(k_wrong, group, axis=1))
    assert not np.allclose(s_wrong, s_ref, rtol=1e-3, atol=1e-3)


def test_load_rejects_bad_dtype_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        load_llama_gguf(tmp_path / "x.gguf", dtype=np.int32)
    with pytest.raises(FileNotFoundError):
        load_llama_gguf(tmp_path / "missing.gguf")


# ----------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct Q4_1 GGUF.

@pytest.fixture(scope="module")
def loaded(gguf_reader):
    return load_llama_gguf(gguf_reader, progress=False)   # test_metadata reads the file from its path


def test_find_smollm2_gguf(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.is_file() and gguf_path.is_absolute()


def test_metadata(gguf_path):
    meta = read_gguf_metadata(gguf_path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert isinstance(meta["tokenizer.ggml.tokens"], list)


def test_smollm2_config(loaded):
    config, _ = loaded
    assert config.num_layers == 30
    assert config.hidden_size == 576
    assert config.num_heads == 9
    assert config.num_kv_heads == 3
    assert config.head_size == 64
    assert config.vocab_size == 49152
    assert config.intermediate_size == 1536
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_smollm2_weight_shapes_and_values(loaded):
    config, w = loaded
    assert "lm_head" not in w  # tied
    assert len(w) == 2 + 9 * config.num_layers
    assert w["embed_tokens"].shape == (49152, 576)
    assert w["norm"].shape == (576,)
    for i in (0, 17, 29):
        assert w[f"layers.{i}.input_layernorm"].shape == (576,)
        assert w[f"layers.{i}.post_attention_layernorm"].shape == (576,)
        assert w[f"layers.{i}.q_proj"].shape == (576, 576)
        assert w[f"layers.{i}.k_proj"].shape == (576, 192)
        assert w[f"layers.{i}.v_proj"].shape == (576, 192)
        assert w[f"layers.{i}.o_proj"].shape == (576, 576)
        assert w[f"layers.{i}.gate_proj"].shape == (576, 1536)
        assert w[f"layers.{i}.up_proj"].shape == (576, 1536)
        assert w[f"layers.{i}.down_proj"].shape == (1536, 576)
    for name, a in w.items():
        assert a.dtype == np.float32, name
        assert a.flags.c_contiguous, name
        assert np.isfinite(a).all(), name
        assert np.abs(a).max() > 0, name


def test_smollm2_rope_pairs_look_like_hf_layout(loaded):
    """Statistical check on real weights: in HF layout channels i and i + S/2 of a head
    are one RoPE pair (same frequency), so their column norms correlate strongly across
    heads/frequencies; in raw GGUF order that pairing is meaningless."""
    config, w = loaded
    s = config.head_size

    def half_pair_corr(wt, n):  # wt: [hidden, n * S] "x @ W"
        norms = np.linalg.norm(wt, axis=0).reshape(n, 2, s // 2)
        return np.corrcoef(norms[:, 0].ravel(), norms[:, 1].ravel())[0, 1]

    ours, raw = [], []
    for i in range(config.num_layers):
        q = w[f"layers.{i}.q_proj"]
        ours.append(half_pair_corr(q, config.num_heads))
        raw.append(half_pair_corr(
            permute_qk_for_interleaved_rope(q.T, config.num_heads).T, config.num_heads))
    assert np.mean(ours) > 0.5
    assert np.mean(ours) > np.mean(raw) + 0.3


def test_dtype_float16(gguf_reader):
    _, w = load_llama_gguf(gguf_reader, dtype=np.float16, progress=False)
    assert w["layers.3.k_proj"].dtype == np.float16
    assert np.isfinite(w["embed_tokens"]).all()


def _tiny_gguf(path, arch: str):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_load_rejects_other_architectures(tmp_path):
    with pytest.raises(ValueError, match="general.architecture='gemma'"):
        load_llama_gguf(_tiny_gguf(tmp_path / "gemma.gguf", "gemma"), progress=False)


def test_load_reports_missing_metadata(tmp_path):
    with pytest.raises(ValueError, match="llama.embedding_length"):
        load_llama_gguf(_tiny_gguf(tmp_path / "llama.gguf", "llama"), progress=False)


def test_header_cache_equals_a_fresh_parse_and_follows_the_file(tmp_path, monkeypatch):
    """models/gguf_header.py: the metadata and tensor names come back from the disk cache (the file is not
    parsed again), equal to a parse; a rewritten file (new size or time) is parsed again."""
    from models import gguf_header
    from tests.tiny_gguf import write_tiny_llama_gguf

    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(tmp_path / "t.gguf")
    first = gguf_header.read_header(path)
    assert first == gguf_header._parse(path) and first.metadata["llama.block_count"] == 2
    assert list((tmp_path / "cache" / "gguf-headers").glob("*.msgpack"))
    parsed = []
    real = gguf_header._parse
    monkeypatch.setattr(gguf_header, "_parse", lambda p: parsed.append(p) or real(p))
    assert gguf_header.read_header(path) == first and parsed == []  # from the cache
    write_tiny_llama_gguf(path, block_count=3)
    os.utime(path, ns=(1, 1))  # a different version of the file, even within one mtime tick
    assert gguf_header.read_header(path).metadata["llama.block_count"] == 3 and len(parsed) == 1
