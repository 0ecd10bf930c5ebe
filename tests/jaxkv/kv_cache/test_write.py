"""write_to_paged_cache (vLLM ``reshape_and_cache``) vs. a per-token NumPy loop.

Layout: ``kv_cache[2, num_blocks, num_kv_heads, block_size, head_size]``; token ``t`` with slot ``s >= 0``
goes to ``kv_cache[0, s // block_size, :, s % block_size, :] = key[t]`` (and ``[1, ...] = value[t]``);
tokens with a negative slot (``PAD_SLOT_ID``) are dropped.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv_cache.write import write_to_paged_cache

BF16 = np.dtype(jnp.bfloat16)


def ref_write(cache: np.ndarray, key: np.ndarray, value: np.ndarray, slots) -> np.ndarray:
    """Per-token loop; the cast to the cache dtype is done by NumPy (round to nearest even)."""
    out = cache.copy()
    bs = cache.shape[3]
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s >= 0:
            out[0, s // bs, :, s % bs, :] = key[t].astype(cache.dtype)
            out[1, s // bs, :, s % bs, :] = value[t].astype(cache.dtype)
    return out


def bits(x) -> np.ndarray:
    """Raw bit pattern (so NaN == NaN and -0.0 != 0.0)."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def make_case(rng, *, num_blocks, num_kv_heads, block_size, head_size, num_tokens, num_pad,
              cache_dtype=np.float32, kv_dtype=np.float32, nan_cache=False, include_edges=True):
    shape = (2, num_blocks, num_kv_heads, block_size, head_size)
    if nan_cache:
        cache = np.full(shape, np.nan, cache_dtype)
    else:
        cache = rng.standard_normal(shape).astype(cache_dtype)
    capacity = num_blocks * block_size
    num_real = num_tokens - num_pad
    if include_edges:
        # always write slot 0 and the second-to-last slot; never the last slot (where a wrapped -1
        # would land), so PAD wrap-around bugs show up
        real = np.concatenate([[0, capacity - 2],
                               1 + rng.choice(capacity - 3, num_real - 2, replace=False)])
    else:
        real = rng.choice(capacity, num_real, replace=False)
    assert len(set(real.tolist())) == num_real  # distinct slots: the write order cannot matter
    slots = np.concatenate([real, np.full(num_pad, -1)])
    slots = slots[rng.permutation(num_tokens)].astype(np.int32)
    key = rng.standard_normal((num_tokens, num_kv_heads, head_size)).astype(kv_dtype)
    value = rng.standard_normal((num_tokens, num_kv_heads, head_size)).astype(kv_dtype)
    return cache, key, value, slots


@pytest.mark.parametrize("block_size,num_kv_heads,head_size", [(8, 1, 16), (16, 3, 64), (32, 2, 32)])
def test_matches_loop_reference(block_size, num_kv_heads, head_size):
    rng = np.random.default_rng(block_size * 100 + num_kv_heads)
    cache, key, value, slots = make_case(rng, num_blocks=7, num_kv_heads=num_kv_heads,
                                         block_size=block_size, head_size=head_size, num_tokens=23,
                                         num_pad=5)
    got = write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                               jnp.asarray(slots))
    assert got.shape == cache.shape and got.dtype == cache.dtype
    np.testing.assert_array_equal(bits(got), bits(ref_write(cache, key, value, slots)))


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_numpy_slot_mapping_of_either_int_width(slot_dtype):
    rng = np.random.default_rng(11)
    cache, key, value, slots = make_case(rng, num_blocks=5, num_kv_heads=2, block_size=8,
                                         head_size=16, num_tokens=12, num_pad=3)
    got = write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                               slots.astype(slot_dtype))
    np.testing.assert_array_equal(bits(got), bits(ref_write(cache, key, value, slots)))


def test_pad_slots_are_dropped_and_nothing_else_changes():
    """NaN-filled cache: every slot not in the mapping stays bit-identical (NaN); PAD never wraps to
    the last block (a -1 index would)."""
    rng = np.random.default_rng(3)
    block_size, num_blocks = 16, 6
    cache, key, value, slots = make_case(rng, num_blocks=num_blocks, num_kv_heads=2,
                                         block_size=block_size, head_size=32, num_tokens=20,
                                         num_pad=8, nan_cache=True)
    got = np.asarray(write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                                          jnp.asarray(slots)))
    written = set(int(s) for s in slots if s >= 0)
    capacity = num_blocks * block_size
    assert capacity - 1 not in written  # the slot a wrapped -1 would hit
    for s in range(capacity):
        b, o = divmod(s, block_size)
        page = got[:, b, :, o, :]
        if s in written:
            assert not np.isnan(page).any(), s
        else:
            np.testing.assert_array_equal(bits(page), bits(cache[:, b, :, o, :]), err_msg=f"slot {s}")
    np.testing.assert_array_equal(bits(got), bits(ref_write(cache, key, value, slots)))


def test_all_pad_is_a_no_op():
    rng = np.random.default_rng(4)
    cache = rng.standard_normal((2, 3, 2, 8, 16)).astype(np.float32)
    key = rng.standard_normal((5, 2, 16)).astype(np.float32)
    got = write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(-key),
                               jnp.full(5, -1, jnp.int32))
    np.testing.assert_array_equal(bits(got), bits(cache))


def test_input_cache_not_mutated():
    rng = np.random.default_rng(5)
    cache, key, value, slots = make_case(rng, num_blocks=4, num_kv_heads=1, block_size=8,
                                         head_size=16, num_tokens=9, num_pad=2)
    cache_j = jnp.asarray(cache)
    write_to_paged_cache(cache_j, jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots))
    np.testing.assert_array_equal(bits(cache_j), bits(cache))


@pytest.mark.parametrize("kv_dtype", [np.float32, BF16])
def test_bf16_cache_casts_keys(kv_dtype):
    rng = np.random.default_rng(6)
    cache, key, value, slots = make_case(rng, num_blocks=5, num_kv_heads=2, block_size=16,
                                         head_size=64, num_tokens=17, num_pad=4, cache_dtype=BF16,
                                         kv_dtype=kv_dtype)
    got = write_to_paged_cache(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                               jnp.asarray(slots))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(got), bits(ref_write(cache, key, value, slots)))


def test_jit_with_donated_cache():
    rng = np.random.default_rng(7)
    cache, key, value, slots = make_case(rng, num_blocks=6, num_kv_heads=2, block_size=16,
                                         head_size=32, num_tokens=21, num_pad=6, cache_dtype=BF16)
    want = ref_write(cache, key, value, slots)
    step = jax.jit(write_to_paged_cache, donate_argnums=0)
    cache_j = jnp.asarray(cache)
    with warnings.catch_warnings():
        # "Some donated buffers were not usable" would mean the step copies the cache
        warnings.filterwarnings("error", message=".*donated buffers were not usable.*")
        got = step(cache_j, jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots))
    np.testing.assert_array_equal(bits(got), bits(want))
    assert cache_j.is_deleted()  # the buffer was handed to XLA
    # a second step on the returned (donated again) cache: same as two reference writes
    key2 = rng.standard_normal(key.shape).astype(np.float32)
    slots2 = np.roll(slots, 3)
    got2 = step(got, jnp.asarray(key2), jnp.asarray(-key2), jnp.asarray(slots2))
    np.testing.assert_array_equal(bits(got2), bits(ref_write(want, key2, -key2, slots2)))


def test_out_of_range_slot_under_jit_corrupts_nothing():
    """Under jit the slot mapping is traced (no check possible); an out-of-range slot must be dropped,
    not clamped or wrapped onto a real slot."""
    rng = np.random.default_rng(8)
    cache, key, value, slots = make_case(rng, num_blocks=3, num_kv_heads=1, block_size=8,
                                         head_size=16, num_tokens=6, num_pad=1)
    slots = slots.copy()
    slots[2] = 3 * 8 + 5  # past capacity
    got = jax.jit(write_to_paged_cache)(jnp.asarray(cache), jnp.asarray(key), jnp.asarray(value),
                                        jnp.asarray(slots))
    slots_ref = np.where(np.arange(6) == 2, -1, slots)
    np.testing.assert_array_equal(bits(got), bits(ref_write(cache, key, value, slots_ref)))


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def small():
    rng = np.random.default_rng(9)
    cache = jnp.asarray(rng.standard_normal((2, 4, 2, 8, 16)).astype(np.float32))
    key = jnp.asarray(rng.standard_normal((3, 2, 16)).astype(np.float32))
    return cache, key, jnp.array([0, 9, -1], jnp.int32)


def test_key_value_shape_mismatch(small):
    cache, key, slots = small
    with pytest.raises(ValueError, match="value.shape"):
        write_to_paged_cache(cache, key, key[:2], slots)


def test_key_heads_or_head_size_mismatch(small):
    cache, key, slots = small
    with pytest.raises(ValueError, match="key.shape"):
        write_to_paged_cache(cache, key[:, :1], key[:, :1], slots)
    with pytest.raises(ValueError, match="key.shape"):
        write_to_paged_cache(cache, key[..., :8], key[..., :8], slots)


def test_slot_mapping_length_mismatch(small):
    cache, key, slots = small
    with pytest.raises(ValueError, match="slot_mapping.shape"):
        write_to_paged_cache(cache, key, key, slots[:2])


def test_bad_cache_rank(small):
    cache, key, slots = small
    with pytest.raises(ValueError, match="kv_cache.shape"):
        write_to_paged_cache(cache[0], key, key, slots)


def test_float_slot_mapping(small):
    cache, key, slots = small
    with pytest.raises(ValueError, match="slot_mapping.dtype"):
        write_to_paged_cache(cache, key, key, slots.astype(jnp.float32))


@pytest.mark.parametrize("bad_slot", [32, 33, 1000])
def test_slot_past_capacity_raises_and_writes_nothing(small, bad_slot):
    cache, key, _ = small  # capacity 4 * 8 = 32
    before = np.asarray(cache).copy()
    slots = np.array([1, bad_slot, 2], np.int32)
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\]={bad_slot}\b"):
        write_to_paged_cache(cache, key, key, jnp.asarray(slots))
    with pytest.raises(ValueError, match=rf"{bad_slot}"):
        write_to_paged_cache(cache, key, key, slots)  # NumPy slot mapping too
    np.testing.assert_array_equal(bits(cache), bits(before))


@pytest.mark.parametrize("bad_slot", [-5, -2])
def test_negative_slot_other_than_pad_raises_and_writes_nothing(small, bad_slot):
    """Issue 9: only PAD_SLOT_ID = -1 means "skip"; any other negative slot is a bug upstream."""
    cache, key, _ = small
    before = np.asarray(cache).copy()
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\]={bad_slot} is neither PAD_SLOT_ID=-1 nor "
                                         r"a slot in \[0, num_blocks\*block_size=32\)"):
        write_to_paged_cache(cache, key, key, jnp.asarray([1, bad_slot, -1], jnp.int32))
    np.testing.assert_array_equal(bits(cache), bits(before))


def test_last_valid_slot_is_accepted(small):
    cache, key, _ = small
    slots = np.array([31, -1, 0], np.int32)
    got = write_to_paged_cache(cache, key, 2 * key, jnp.asarray(slots))
    want = ref_write(np.asarray(cache), np.asarray(key), 2 * np.asarray(key), slots)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("slots,first", [([3, 9, 3], 2), ([9, 9, -1], 1)])
def test_a_slot_twice_raises_on_the_host_and_under_checkify(small, slots, first):
    """The scatter is declared to have unique indices, so a step may not give two tokens one slot: the later
    token is named, on the host and staged with checkify under jit; PAD_SLOT_ID may repeat."""
    from jaxkv.checks import checked
    cache, key, _ = small
    before = np.asarray(cache).copy()
    msg = rf"slot_mapping\[{first}\]={slots[first]} is an earlier token's slot too"
    with pytest.raises(ValueError, match=msg):
        write_to_paged_cache(cache, key, key, jnp.asarray(slots, jnp.int32))
    np.testing.assert_array_equal(bits(cache), bits(before))
    run = jax.jit(checked(lambda s: write_to_paged_cache(cache, key, key, s)))
    err, _ = run(jnp.asarray(slots, jnp.int32))
    assert err.get() is not None and err.get().startswith(f"slot_mapping[{first}]={slots[first]} is an earlier")
    err, _ = run(jnp.asarray([-1, 5, -1], jnp.int32))
    assert err.get() is None
