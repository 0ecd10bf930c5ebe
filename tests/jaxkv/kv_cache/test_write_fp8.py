"""write_to_paged_cache into an fp8 cache (vLLM ``reshape_and_cache`` with ``kv_cache_dtype != "auto"``)
vs. a per-token NumPy loop that quantises with ``ml_dtypes``.

Token ``t`` with slot ``s >= 0`` is stored as ``kv_cache[0, s // block_size, :, s % block_size, :] =
fp8(clip(key[t] / k_scale))`` (values with ``v_scale``); negative slots (``PAD_SLOT_ID``) are dropped.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.kv_cache.write import write_to_paged_cache

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(jnp.bfloat16)


def quant(x, scale: float, dtype) -> np.ndarray:
    top = float(ml_dtypes.finfo(dtype).max)
    inv = np.float32(1) / np.float32(scale)  # the documented convention: x * (1 / scale) in float32
    return np.clip(np.asarray(x, np.float32) * inv, -top, top).astype(dtype)


def ref_write_fp8(cache, key, value, slots, k_scale, v_scale) -> np.ndarray:
    out = cache.copy()
    bs = cache.shape[3]
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s >= 0:
            out[0, s // bs, :, s % bs, :] = quant(key[t], k_scale, cache.dtype)
            out[1, s // bs, :, s % bs, :] = quant(value[t], v_scale, cache.dtype)
    return out


def u8(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


def make_case(rng, *, dtype, num_blocks=6, num_kv_heads=2, block_size=8, head_size=16, num_tokens=13,
              num_pad=4, kv_dtype=np.float32, magnitude=3.0):
    shape = (2, num_blocks, num_kv_heads, block_size, head_size)
    cache = (rng.standard_normal(shape) * 10).astype(dtype)  # random fp8 contents, never zeros
    capacity = num_blocks * block_size
    # distinct slots; never the last slot, where a wrapped PAD (-1) would land
    real = rng.choice(capacity - 1, num_tokens - num_pad, replace=False)
    slots = np.concatenate([real, np.full(num_pad, -1)])[rng.permutation(num_tokens)].astype(np.int32)
    key = (rng.standard_normal((num_tokens, num_kv_heads, head_size)) * magnitude).astype(kv_dtype)
    value = (rng.standard_normal((num_tokens, num_kv_heads, head_size)) * magnitude).astype(kv_dtype)
    return cache, key, value, slots


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("kv_dtype", [np.float32, BF16])
def test_fp8_write_matches_loop_and_drops_pad(rng, dtype, kv_dtype):
    cache, key, value, slots = make_case(rng, dtype=dtype, kv_dtype=kv_dtype)
    k_scale, v_scale = 0.25, 1.75
    got = write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                               jnp.asarray(slots), k_scale=jnp.float32(k_scale),
                               v_scale=jnp.float32(v_scale))
    assert got.dtype == dtype and got.shape == cache.shape
    want = ref_write_fp8(cache, key, value, slots, k_scale, v_scale)
    np.testing.assert_array_equal(u8(got), u8(want))
    # every slot not in the mapping (PAD tokens included) keeps its old bits
    bs = cache.shape[3]
    written = {int(s) for s in slots if s >= 0}
    for s in range(cache.shape[1] * bs):
        if s not in written:
            np.testing.assert_array_equal(u8(got)[:, s // bs, :, s % bs], u8(cache)[:, s // bs, :, s % bs])


def test_all_pad_is_a_no_op_in_fp8(rng):
    cache, key, value, _ = make_case(rng, dtype=E4M3, num_pad=0)
    got = write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                               jnp.full(len(key), -1, jnp.int32), k_scale=1.0, v_scale=1.0)
    np.testing.assert_array_equal(u8(got), u8(cache))


@pytest.mark.parametrize("dtype,bound", [(E4M3, 2.0**-4), (E5M2, 2.0**-3)])
def test_scales_are_applied(rng, dtype, bound):
    """Written with k_scale=2 (v_scale=0.5): stored ≈ key / 2, and stored * 2 reads back ≈ key."""
    cache, key, value, slots = make_case(rng, dtype=dtype, num_pad=0, magnitude=20.0)
    got = np.asarray(write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                                          jnp.asarray(slots), k_scale=2.0, v_scale=0.5))
    bs = cache.shape[3]
    stored_k = np.stack([got[0, s // bs, :, s % bs] for s in slots]).astype(np.float64)
    stored_v = np.stack([got[1, s // bs, :, s % bs] for s in slots]).astype(np.float64)
    key64, value64 = key.astype(np.float64), value.astype(np.float64)
    normal = np.abs(key64) / 2 >= float(ml_dtypes.finfo(dtype).smallest_normal)
    assert normal.mean() > 0.9
    rel_k = np.abs(stored_k * 2 - key64) / np.abs(key64)
    assert rel_k[normal].max() <= bound * (1 + 1e-6)
    np.testing.assert_allclose(stored_k, key64 / 2, rtol=bound * 1.01, atol=2.0**-9)
    normal_v = np.abs(value64) / 0.5 >= float(ml_dtypes.finfo(dtype).smallest_normal)
    rel_v = np.abs(stored_v * 0.5 - value64) / np.abs(value64)
    assert rel_v[normal_v].max() <= bound * (1 + 1e-6)


def test_out_of_range_values_saturate(rng):
    cache, key, value, slots = make_case(rng, dtype=E4M3, num_pad=0)
    key = key.copy()
    key[0, 0, :4] = [1e4, -1e4, 3e38, -np.inf]
    got = np.asarray(write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                                          jnp.asarray(slots), k_scale=1.0, v_scale=1.0))
    s, bs = int(slots[0]), cache.shape[3]
    np.testing.assert_array_equal(got[0, s // bs, 0, s % bs, :4].astype(np.float32),
                                  [448.0, -448.0, 448.0, -448.0])
    assert not np.isnan(got.astype(np.float32)).any()


def test_jit_donated_fp8_cache_with_traced_scales(rng):
    cache, key, value, slots = make_case(rng, dtype=E5M2, num_blocks=8)
    step = jax.jit(write_to_paged_cache, donate_argnums=0)
    cache_j = jnp.array(cache, copy=True)
    ptr = cache_j.unsafe_buffer_pointer()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*donated buffers were not usable.*")
        got = step(cache_j, jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots),
                   k_scale=jnp.float32(3.0), v_scale=jnp.float32(0.125))
    assert got.unsafe_buffer_pointer() == ptr and cache_j.is_deleted()
    np.testing.assert_array_equal(u8(got), u8(ref_write_fp8(cache, key, value, slots, 3.0, 0.125)))


def test_scales_ignored_for_non_fp8_cache(rng):
    """vLLM ignores k_scale / v_scale for kv_cache_dtype="auto": a bf16 cache is a plain cast."""
    cache, key, value, slots = make_case(rng, dtype=BF16)
    args = (jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots))
    plain = write_to_paged_cache(*args)
    scaled = write_to_paged_cache(*args, k_scale=4.0, v_scale=0.1)
    np.testing.assert_array_equal(np.asarray(plain).view(np.uint16), np.asarray(scaled).view(np.uint16))
    bs = cache.shape[3]
    s = int(slots[slots >= 0][0])
    t = int(np.flatnonzero(slots == s)[0])
    np.testing.assert_array_equal(np.asarray(scaled)[0, s // bs, :, s % bs], key[t].astype(BF16))


@pytest.mark.parametrize("kwargs,match", [
    ({}, r"k_scale=None: a scale is required"),
    ({"k_scale": 1.0}, r"v_scale=None"),
    ({"k_scale": 0.0, "v_scale": 1.0}, r"k_scale=0.0 must be finite and > 0"),
    ({"k_scale": 1.0, "v_scale": np.nan}, r"v_scale=nan"),
    ({"k_scale": jnp.ones(3), "v_scale": 1.0}, r"k_scale.shape=\(3,\)"),
])
def test_fp8_scale_errors_write_nothing(rng, kwargs, match):
    cache, key, value, slots = make_case(rng, dtype=E4M3)
    cache_j = jnp.asarray(cache)
    with pytest.raises(ValueError, match=match):
        write_to_paged_cache(cache_j, jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots), **kwargs)
    np.testing.assert_array_equal(u8(cache_j), u8(cache))


def test_fp8_slot_past_capacity_still_rejected(rng):
    cache, key, value, slots = make_case(rng, dtype=E4M3)
    slots = slots.copy()
    slots[3] = cache.shape[1] * cache.shape[3]
    with pytest.raises(ValueError, match=rf"slot_mapping\[3\]={slots[3]}"):
        write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value), slots,
                             k_scale=1.0, v_scale=1.0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_written_fp8_cache_reads_back_through_decode_attention(rng, dtype):
    """Write side (this module's convention) + read side (decode reference with the same scales):
    attention equals a float64 loop over the dequantised K/V, and approximates the unquantised one."""
    from pallas_kernels.paged_attention import paged_attention_reference
    block_size, num_kv_heads, head_size, num_heads = 8, 2, 16, 4
    seq_lens = np.array([13, 8], np.int32)
    block_tables = np.array([[4, 1], [2, 0]], np.int32)
    num_tokens = int(seq_lens.sum())
    cache = (rng.standard_normal((2, 5, num_kv_heads, block_size, head_size)) * 10).astype(dtype)
    slots = np.array([block_tables[s, t // block_size] * block_size + t % block_size
                      for s in range(2) for t in range(seq_lens[s])], np.int32)
    key = (rng.standard_normal((num_tokens, num_kv_heads, head_size)) * 40).astype(np.float32)
    value = (rng.standard_normal((num_tokens, num_kv_heads, head_size)) * 0.1).astype(np.float32)
    k_scale, v_scale = 8.0, 0.0625
    cache = write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                                 jnp.asarray(slots), k_scale=k_scale, v_scale=v_scale)
    q = (rng.standard_normal((2, num_heads, head_size)) * 0.05).astype(np.float32)
    out = np.asarray(paged_attention_reference(jnp.asarray(q), cache, jnp.asarray(block_tables),
                                               jnp.asarray(seq_lens), scale=head_size ** -0.5,
                                               k_scale=k_scale, v_scale=v_scale), np.float64)

    def attention(k_all, v_all):
        res = np.zeros((2, num_heads, head_size))
        start = 0
        for s, n in enumerate(seq_lens.tolist()):
            for h in range(num_heads):
                k, v = k_all[start:start + n, h // 2], v_all[start:start + n, h // 2]
                logits = k @ q[s, h].astype(np.float64) * head_size ** -0.5
                p = np.exp(logits - logits.max())
                res[s, h] = (p / p.sum()) @ v
            start += n
        return res

    k_deq = quant(key, k_scale, dtype).astype(np.float64) * k_scale
    v_deq = quant(value, v_scale, dtype).astype(np.float64) * v_scale
    exact = attention(k_deq, v_deq)
    assert np.abs(out - exact).max() <= 1e-5 * np.abs(exact).max()
    approx = attention(key.astype(np.float64), value.astype(np.float64))
    bound = 2.0**-4 if dtype == E4M3 else 2.0**-3
    assert np.abs(out - approx).max() <= 2 * bound * np.abs(approx).max()
