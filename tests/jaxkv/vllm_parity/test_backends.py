"""Backend layouts: shapes, stride orders, registry, legacy split views and the legacy write path.

References are written here by hand: expected shapes as literals, and the legacy layout as address
arithmetic on a flat NumPy buffer (seed 003: key ``[num_blocks, num_kv_heads, head_size // x, block_size,
x]`` with ``x = 16 // itemsize``, value ``[num_blocks, num_kv_heads, head_size, block_size]``).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv_cache.backends.base import (
    MultipleOf,
    inverse_stride_order,
    physical_kv_cache_shape,
    supports_block_size,
    to_logical,
    to_physical,
    validate_backend_args,
)
from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.vllm_parity.backends import BACKEND_NAMES, get_backend
from jaxkv.vllm_parity.backends.flash_attn import FlashAttentionBackend, FlashAttentionHNDBackend
from jaxkv.vllm_parity.backends.flashinfer import FlashInferBackend, FlashInferHNDBackend
from jaxkv.vllm_parity.backends.mla import MLAAttentionBackend
from jaxkv.vllm_parity.backends.paged_attention_legacy import (
    PagedAttentionLegacyBackend,
    reshape_and_cache_legacy,
    write_to_paged_cache_legacy,
)

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
E4M3 = np.dtype(jnp.float8_e4m3fn)

# ----------------------------------------------------------------------------------------------
# shapes, stride orders, registry
# ----------------------------------------------------------------------------------------------

# (backend, logical shape for num_blocks=7, block_size=16, num_kv_heads=3, head_size=64, stride order)
LAYOUTS = [
    (PallasAttentionBackend, (2, 7, 3, 16, 64), (0, 1, 2, 3, 4)),
    (PagedAttentionLegacyBackend, (2, 7, 16 * 3 * 64), (0, 1, 2)),
    (FlashAttentionBackend, (2, 7, 16, 3, 64), (0, 1, 2, 3, 4)),
    (FlashAttentionHNDBackend, (2, 7, 16, 3, 64), (0, 1, 3, 2, 4)),
    (FlashInferBackend, (7, 2, 16, 3, 64), (0, 1, 2, 3, 4)),
    (FlashInferHNDBackend, (7, 2, 16, 3, 64), (0, 1, 3, 2, 4)),
]
# memory shapes of the same, written out by hand
PHYSICAL = {
    "PALLAS": (2, 7, 3, 16, 64), "PAGED_ATTN": (2, 7, 3072), "FLASH_ATTN": (2, 7, 16, 3, 64),
    "FLASH_ATTN_HND": (2, 7, 3, 16, 64), "FLASHINFER": (7, 2, 16, 3, 64),
    "FLASHINFER_HND": (7, 2, 3, 16, 64),
}


@pytest.mark.parametrize("backend,shape,order", LAYOUTS, ids=lambda v: getattr(v, "name", None))
def test_layout_shape_order_and_physical(backend, shape, order):
    assert backend.get_kv_cache_shape(7, 16, 3, 64) == shape
    assert backend.get_kv_cache_stride_order() == order
    assert physical_kv_cache_shape(backend, 7, 16, 3, 64) == PHYSICAL[backend.name]


def test_mla_layout():
    assert MLAAttentionBackend.get_kv_cache_shape(5, 32, 1, 576) == (5, 32, 576)
    assert MLAAttentionBackend.get_kv_cache_stride_order() == (0, 1, 2)
    assert MLAAttentionBackend.get_supported_head_sizes() == [576]
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        MLAAttentionBackend.get_kv_cache_shape(5, 32, 2, 576)


def test_legacy_supported_head_sizes_are_vllms():
    assert PagedAttentionLegacyBackend.get_supported_head_sizes() == [32, 64, 80, 96, 112, 120, 128,
                                                                      192, 256]


def test_flash_attn_block_size_multiple_of_16():
    assert FlashAttentionBackend.get_kv_cache_shape(2, 48, 1, 8) == (2, 2, 48, 1, 8)
    with pytest.raises(ValueError, match="block_size=24"):
        FlashAttentionHNDBackend.get_kv_cache_shape(2, 24, 1, 8)


@pytest.mark.parametrize("backend", [b for b, _, _ in LAYOUTS] + [MLAAttentionBackend],
                         ids=lambda b: b.name)
@pytest.mark.parametrize("field", ["num_blocks", "block_size", "num_kv_heads", "head_size"])
@pytest.mark.parametrize("bad", [0, -16, 2.0])
def test_get_kv_cache_shape_rejects_bad_sizes(backend, field, bad):
    dims = dict(num_blocks=4, block_size=16, num_kv_heads=1, head_size=64)
    dims[field] = bad
    with pytest.raises(ValueError, match=field):
        backend.get_kv_cache_shape(**dims)


def test_registry():
    classes = [PallasAttentionBackend, PagedAttentionLegacyBackend, FlashAttentionBackend,
               FlashAttentionHNDBackend, FlashInferBackend, FlashInferHNDBackend, MLAAttentionBackend]
    assert sorted(BACKEND_NAMES) == sorted(["PALLAS", "PAGED_ATTN", "FLASH_ATTN", "FLASH_ATTN_HND",
                                            "FLASHINFER", "FLASHINFER_HND", "MLA"])
    for cls in classes:
        assert get_backend(cls.name) is cls
        assert get_backend(cls.name.lower()) is cls
    for bad in ["XFORMERS", "", "flash attn", None, 3]:
        with pytest.raises(ValueError, match="name="):
            get_backend(bad)


def test_hnd_nhd_layout_attribute():
    assert (FlashAttentionBackend.kv_cache_layout, FlashAttentionHNDBackend.kv_cache_layout) == ("NHD", "HND")
    assert (FlashInferBackend.kv_cache_layout, FlashInferHNDBackend.kv_cache_layout) == ("NHD", "HND")


# ----------------------------------------------------------------------------------------------
# supported sizes / dtypes
# ----------------------------------------------------------------------------------------------

def test_multiple_of():
    m = MultipleOf(16)
    assert [s for s in range(0, 70) if s in m] == [16, 32, 48, 64]
    assert 16.0 not in m
    with pytest.raises(ValueError, match="base=0"):
        MultipleOf(0)


@pytest.mark.parametrize("backend,block_size,ok", [
    (PallasAttentionBackend, 16, True), (PallasAttentionBackend, 64, True), (PallasAttentionBackend, 256, False),
    (PagedAttentionLegacyBackend, 8, True), (PagedAttentionLegacyBackend, 64, False),
    (FlashAttentionBackend, 16, True), (FlashAttentionBackend, 272, True), (FlashAttentionBackend, 8, False),
    (FlashInferBackend, 64, True), (FlashInferBackend, 128, False), (MLAAttentionBackend, 64, True),
    (MLAAttentionBackend, 40, False)])
def test_supports_block_size(backend, block_size, ok):
    assert supports_block_size(backend, block_size) is ok


@pytest.mark.parametrize("backend,kwargs,needle", [
    (FlashAttentionBackend, dict(block_size=8, head_size=64, dtype=F16), "block_size=8"),
    (FlashAttentionBackend, dict(block_size=16, head_size=260, dtype=F16), "head_size=260"),
    (FlashInferHNDBackend, dict(block_size=16, head_size=80, dtype=BF16), "head_size=80"),
    (PagedAttentionLegacyBackend, dict(block_size=16, head_size=64, dtype=np.int8), "dtype=int8"),
    (MLAAttentionBackend, dict(block_size=16, head_size=512, dtype=BF16), "head_size=512"),
])
def test_validate_backend_args_rejects(backend, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        validate_backend_args(backend, **kwargs)
    validate_backend_args(backend, block_size=16, head_size=backend.supported_head_sizes[-1], dtype=F32)


# ----------------------------------------------------------------------------------------------
# stride-order helpers
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_inverse_order_and_views(order):
    logical_shape = (2, 3, 4, 5)
    phys_shape = tuple(logical_shape[i] for i in order)
    physical = np.arange(np.prod(phys_shape)).reshape(phys_shape)
    inv = inverse_stride_order(order)
    assert all(order[inv[i]] == i for i in range(4))
    logical = to_logical(jnp.asarray(physical), order)
    assert logical.shape == logical_shape
    # element at logical index L lives at physical index (L[order[0]], L[order[1]], ...)
    for idx in itertools.product(*map(range, logical_shape)):
        assert logical[idx] == physical[tuple(idx[i] for i in order)]
    np.testing.assert_array_equal(to_physical(logical, order), physical)


def test_stride_order_helpers_reject():
    with pytest.raises(ValueError, match="stride_order"):
        inverse_stride_order((0, 2, 2))
    with pytest.raises(ValueError, match="stride_order"):
        to_logical(jnp.zeros((2, 3)), (0, 1, 2))
    with pytest.raises(ValueError, match="stride_order"):
        to_physical(jnp.zeros((2, 3)), (1, 1))
    x = jnp.zeros((2, 3))
    assert to_logical(x, (0, 1)) is x and to_physical(x, (0, 1)) is x


# ----------------------------------------------------------------------------------------------
# legacy PagedAttention: split views and writes against address arithmetic
# ----------------------------------------------------------------------------------------------

def legacy_offsets(kv: int, offset: int, num_kv_heads: int, head_size: int, block_size: int, x: int):
    """``int[num_kv_heads, head_size]`` offsets inside one block's flat half for token ``offset``."""
    h, d = np.meshgrid(np.arange(num_kv_heads), np.arange(head_size), indexing="ij")
    if kv == 0:
        return ((h * (head_size // x) + d // x) * block_size + offset) * x + d % x
    return (h * head_size + d) * block_size + offset


def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def random_in(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


LEGACY_CASES = [(64, F32, 16), (80, F16, 8), (128, BF16, 32), (96, E4M3, 16), (32, BF16, 16)]


@pytest.mark.parametrize("head_size,dtype,block_size", LEGACY_CASES, ids=str)
def test_legacy_split_views_match_address_arithmetic(rng, head_size, dtype, block_size):
    num_blocks, num_kv_heads = 3, 2
    x = 16 // dtype.itemsize
    flat = random_in(rng, (2, num_blocks, block_size * num_kv_heads * head_size), dtype)
    key, value = PagedAttentionLegacyBackend.split_kv_cache(jnp.asarray(flat), num_kv_heads, head_size)
    assert key.shape == (num_blocks, num_kv_heads, head_size // x, block_size, x)
    assert value.shape == (num_blocks, num_kv_heads, head_size, block_size)
    key, value = np.asarray(key), np.asarray(value)
    for b, o in itertools.product(range(num_blocks), range(block_size)):
        for h, d in itertools.product(range(num_kv_heads), range(head_size)):
            k_at = ((h * (head_size // x) + d // x) * block_size + o) * x + d % x
            v_at = (h * head_size + d) * block_size + o
            assert bits(key[b, h, d // x, o, d % x]) == bits(flat[0, b, k_at])
            assert bits(value[b, h, d, o]) == bits(flat[1, b, v_at])


def legacy_reference_write(flat, key, value, slots, block_size):
    """Loop reference of ``reshape_and_cache`` into a flat legacy cache (NumPy, in place on a copy)."""
    out = flat.copy()
    _, num_kv_heads, head_size = key.shape
    x = 16 // flat.dtype.itemsize
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        out[0, b, legacy_offsets(0, o, num_kv_heads, head_size, block_size, x)] = key[t]
        out[1, b, legacy_offsets(1, o, num_kv_heads, head_size, block_size, x)] = value[t]
    return out


def legacy_batch(rng, head_size, dtype, block_size, num_blocks=4, num_kv_heads=2, num_tokens=11):
    flat = random_in(rng, (2, num_blocks, block_size * num_kv_heads * head_size), dtype)
    key = random_in(rng, (num_tokens, num_kv_heads, head_size), dtype)
    value = random_in(rng, (num_tokens, num_kv_heads, head_size), dtype)
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False).astype(np.int32)
    slots[[2, 7]] = -1  # PAD_SLOT_ID
    return flat, key, value, slots


@pytest.mark.parametrize("head_size,dtype,block_size", LEGACY_CASES, ids=str)
def test_legacy_write_round_trip(rng, head_size, dtype, block_size):
    num_kv_heads = 2
    flat, key, value, slots = legacy_batch(rng, head_size, dtype, block_size, num_kv_heads=num_kv_heads)
    expected = legacy_reference_write(flat, key, value, slots, block_size)
    out = write_to_paged_cache_legacy(jnp.asarray(flat), jnp.asarray(key), jnp.asarray(value),
                                      jnp.asarray(slots))
    assert out.shape == flat.shape and out.dtype == dtype
    np.testing.assert_array_equal(bits(out), bits(expected))
    # read back through the split views: every written token, every head and channel
    k_view, v_view = map(np.asarray, PagedAttentionLegacyBackend.split_kv_cache(out, num_kv_heads,
                                                                                head_size))
    x = 16 // dtype.itemsize
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        for h, d in itertools.product(range(num_kv_heads), range(0, head_size, 7)):
            assert bits(k_view[b, h, d // x, o, d % x]) == bits(key[t, h, d])
            assert bits(v_view[b, h, d, o]) == bits(value[t, h, d])


@pytest.mark.parametrize("head_size,dtype,block_size", LEGACY_CASES[:3], ids=str)
def test_legacy_reshape_and_cache_on_split_views(rng, head_size, dtype, block_size):
    num_kv_heads, x = 2, 16 // dtype.itemsize
    flat, key, value, slots = legacy_batch(rng, head_size, dtype, block_size, num_kv_heads=num_kv_heads)
    num_blocks = flat.shape[1]
    expected = legacy_reference_write(flat, key, value, slots, block_size)
    k_cache = jnp.asarray(flat[0].reshape(num_blocks, num_kv_heads, head_size // x, block_size, x))
    v_cache = jnp.asarray(flat[1].reshape(num_blocks, num_kv_heads, head_size, block_size))
    k_out, v_out = reshape_and_cache_legacy(jnp.asarray(key), jnp.asarray(value), k_cache, v_cache,
                                            jnp.asarray(slots))
    np.testing.assert_array_equal(bits(k_out).reshape(num_blocks, -1), bits(expected[0]))
    np.testing.assert_array_equal(bits(v_out).reshape(num_blocks, -1), bits(expected[1]))


def test_legacy_write_jitted_with_donation_and_traced_slots(rng):
    flat, key, value, slots = legacy_batch(rng, 64, BF16, 16)
    expected = legacy_reference_write(flat, key, value, slots, 16)
    step = jax.jit(write_to_paged_cache_legacy, donate_argnums=0)
    out = step(jnp.asarray(flat), jnp.asarray(key), jnp.asarray(value), jnp.asarray(slots))
    np.testing.assert_array_equal(bits(out), bits(expected))


def test_legacy_write_casts_to_cache_dtype(rng):
    flat, key, value, slots = legacy_batch(rng, 64, BF16, 16)
    k32, v32 = key.astype(np.float32) * 1.001, value.astype(np.float32)
    expected = legacy_reference_write(flat, k32.astype(BF16), v32.astype(BF16), slots, 16)
    out = write_to_paged_cache_legacy(jnp.asarray(flat), jnp.asarray(k32), jnp.asarray(v32),
                                      jnp.asarray(slots))
    assert out.dtype == BF16
    np.testing.assert_array_equal(bits(out), bits(expected))


def test_legacy_write_rejects_bad_input(rng):
    flat, key, value, slots = legacy_batch(rng, 64, F16, 16)
    cache = jnp.asarray(flat)
    before = bits(cache).copy()
    k, v = jnp.asarray(key), jnp.asarray(value)
    bad_slots = slots.copy()
    bad_slots[4] = 4 * 16  # == capacity
    with pytest.raises(ValueError, match=r"slot_mapping\[4\]=64"):
        write_to_paged_cache_legacy(cache, k, v, jnp.asarray(bad_slots))
    with pytest.raises(ValueError, match="slot_mapping.dtype"):
        write_to_paged_cache_legacy(cache, k, v, jnp.asarray(slots, jnp.float32))
    with pytest.raises(ValueError, match="slot_mapping.shape"):
        write_to_paged_cache_legacy(cache, k, v, jnp.asarray(slots[:-1]))
    with pytest.raises(ValueError, match="value.shape"):
        write_to_paged_cache_legacy(cache, k, v[:, :1], jnp.asarray(slots))
    with pytest.raises(ValueError, match="kv_cache.shape"):
        write_to_paged_cache_legacy(cache[0], k, v, jnp.asarray(slots))
    with pytest.raises(ValueError, match=r"kv_cache.shape\[2\]"):  # 3 heads do not divide the block
        write_to_paged_cache_legacy(cache, jnp.zeros((11, 3, 64), F16), jnp.zeros((11, 3, 64), F16),
                                    jnp.asarray(slots))
    with pytest.raises(ValueError, match="key.shape"):
        write_to_paged_cache_legacy(cache, k[0], v[0], jnp.asarray(slots))
    np.testing.assert_array_equal(bits(cache), before)  # nothing written


def test_legacy_split_rejects_bad_input():
    fp8 = jnp.zeros((2, 3, 16 * 1 * 120), E4M3)
    with pytest.raises(ValueError, match="head_size=120"):  # x = 16 for 1-byte dtypes
        PagedAttentionLegacyBackend.split_kv_cache(fp8, 1, 120)
    with pytest.raises(ValueError, match=r"kv_cache.shape\[2\]"):
        PagedAttentionLegacyBackend.split_kv_cache(jnp.zeros((2, 3, 100), F16), 2, 64)
    with pytest.raises(ValueError, match="kv_cache.shape"):
        PagedAttentionLegacyBackend.split_kv_cache(jnp.zeros((3, 3, 128), F16), 2, 64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        PagedAttentionLegacyBackend.split_kv_cache(jnp.zeros((2, 3, 128), F16), 0, 64)


def test_reshape_and_cache_legacy_rejects_bad_views():
    k_cache = jnp.zeros((3, 2, 8, 16, 8), F16)
    v_cache = jnp.zeros((3, 2, 64, 16), F16)
    key = jnp.zeros((2, 2, 64), F16)
    slots = jnp.array([0, 47], jnp.int32)
    with pytest.raises(ValueError, match="value_cache"):
        reshape_and_cache_legacy(key, key, k_cache, v_cache.astype(F32), slots)
    with pytest.raises(ValueError, match="value_cache"):
        reshape_and_cache_legacy(key, key, k_cache, v_cache[:, :, :32], slots)
    with pytest.raises(ValueError, match=r"key_cache.shape\[-1\]=4"):
        reshape_and_cache_legacy(key, key, k_cache.reshape(3, 2, 16, 16, 4), v_cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]=48"):
        reshape_and_cache_legacy(key, key, k_cache, v_cache, jnp.array([0, 48], jnp.int32))


# ----------------------------------------------------------------------------------------------
# K/V split of the other layouts
# ----------------------------------------------------------------------------------------------

def test_split_kv_cache_of_5d_layouts(rng):
    a = rng.standard_normal((2, 3, 16, 2, 8)).astype(np.float32)
    for backend in (FlashAttentionBackend, FlashAttentionHNDBackend, PallasAttentionBackend):
        k, v = backend.split_kv_cache(jnp.asarray(a))
        np.testing.assert_array_equal(k, a[0])
        np.testing.assert_array_equal(v, a[1])
        with pytest.raises(ValueError, match="kv_cache.shape"):
            backend.split_kv_cache(jnp.asarray(a[:1]))
    b = rng.standard_normal((3, 2, 16, 2, 8)).astype(np.float32)
    for backend in (FlashInferBackend, FlashInferHNDBackend):
        k, v = backend.split_kv_cache(jnp.asarray(b))
        for blk in range(3):
            np.testing.assert_array_equal(k[blk], b[blk, 0])
            np.testing.assert_array_equal(v[blk], b[blk, 1])
        with pytest.raises(ValueError, match="kv_cache.shape"):
            backend.split_kv_cache(jnp.zeros((3, 3, 16, 2, 8)))
