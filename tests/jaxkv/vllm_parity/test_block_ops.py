"""copy_blocks / zero_blocks / swap_blocks (vLLM ``copy_blocks``, ``KVBlockZeroer``, ``swap_blocks``)
against per-pair NumPy loops.

Layout: one array per layer ``[2, num_blocks, num_kv_heads, block_size, head_size]``; a block is
``cache[:, b]`` (K and V halves). Caches are filled with fresh random data (never zeros), so a block that
should not change is checked bit for bit.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.vllm_parity.block_ops import copy_blocks, copy_blocks_donated, zero_blocks, zero_blocks_donated
from jaxkv.vllm_parity.swap import allocate_host_kv_cache, host_memory_kind, swap_blocks, swap_blocks_donated, to_host

BF16 = np.dtype(jnp.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def bits(x) -> np.ndarray:
    """Raw bit pattern (so NaN == NaN and -0.0 != 0.0)."""
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def assert_same(got, want):
    assert np.asarray(got).dtype == want.dtype and np.asarray(got).shape == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))


def random_cache(rng, num_blocks=7, num_kv_heads=2, block_size=8, head_size=16, dtype=np.float32):
    x = rng.standard_normal((2, num_blocks, num_kv_heads, block_size, head_size)) * 4
    return x.astype(dtype)


def on_device(x: np.ndarray) -> jax.Array:
    """A device array with its own XLA buffer (never an alias of the NumPy memory)."""
    return jnp.array(x, copy=True)


# ----------------------------------------------------------------------------------------------
# References: plain loops over pairs / ids, one layer at a time
# ----------------------------------------------------------------------------------------------

def ref_copy(cache: np.ndarray, pairs) -> np.ndarray:
    out = cache.copy()
    for src, dst in np.asarray(pairs).tolist():
        out[:, dst] = cache[:, src]  # read from the original cache
    return out


def ref_zero(cache: np.ndarray, ids) -> np.ndarray:
    out = cache.copy()
    for b in np.asarray(ids).tolist():
        out[:, b] = 0
    return out


def ref_swap(src: np.ndarray, dst: np.ndarray, pairs) -> np.ndarray:
    out = dst.copy()
    for s, d in np.asarray(pairs).tolist():
        for kv in range(2):
            out[kv, d] = src[kv, s]
    return out


# ----------------------------------------------------------------------------------------------
# copy_blocks
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, BF16, FP8])
def test_copy_blocks_all_layers_match_loop(rng, dtype):
    caches = [random_cache(rng, dtype=dtype) for _ in range(3)]
    # 6 -> 0 and 0 -> 3: block 0 is both a destination and a source; 2 -> 2 is a self-copy
    pairs = np.array([[6, 0], [0, 3], [2, 2], [1, 5]], np.int32)
    got = copy_blocks([on_device(c) for c in caches], pairs)
    assert isinstance(got, list) and len(got) == 3
    for g, c in zip(got, caches):
        assert_same(g, ref_copy(c, pairs))


def test_copy_blocks_reads_sources_before_any_write(rng):
    """A chain and a cycle: every destination gets its source's ORIGINAL contents."""
    cache = random_cache(rng, num_blocks=5)
    chain = copy_blocks(on_device(cache), [[0, 1], [1, 2], [2, 3]])
    want = cache.copy()
    want[:, 1], want[:, 2], want[:, 3] = cache[:, 0], cache[:, 1], cache[:, 2]
    assert_same(chain, want)
    cycle = copy_blocks(on_device(cache), [[3, 4], [4, 3]])
    want = cache.copy()
    want[:, 3], want[:, 4] = cache[:, 4], cache[:, 3]
    assert_same(cycle, want)
    reversed_order = copy_blocks(on_device(cache), [[2, 3], [1, 2], [0, 1]])
    assert_same(reversed_order, ref_copy(cache, [[0, 1], [1, 2], [2, 3]]))


def test_copy_blocks_dict_of_layers_int64_pairs_and_input_not_mutated(rng):
    caches = {f"model.layers.{i}.self_attn.attn": random_cache(rng, num_blocks=9) for i in range(2)}
    pairs = np.stack([rng.permutation(9)[:4], rng.permutation(9)[:4]], axis=1).astype(np.int64)
    inputs = {k: on_device(v) for k, v in caches.items()}
    got = copy_blocks(inputs, jnp.asarray(pairs))
    assert set(got) == set(caches)
    for k in caches:
        assert_same(got[k], ref_copy(caches[k], pairs))
        assert_same(inputs[k], caches[k])  # functional: the input is unchanged


def test_copy_blocks_empty_and_block_axis_0(rng):
    cache = random_cache(rng)
    assert_same(copy_blocks([on_device(cache)], np.zeros((0, 2), np.int32))[0], cache)
    # num_blocks-first layout (FlashInfer / MLA style): [num_blocks, block_size, latent_dim]
    mla = rng.standard_normal((6, 8, 12)).astype(np.float32)
    got = copy_blocks([on_device(mla)], [[5, 0], [0, 1]], block_axis=0)[0]
    want = mla.copy()
    want[0], want[1] = mla[5], mla[0]
    assert_same(got, want)


def test_copy_blocks_donated_reuses_buffers(rng):
    caches = [random_cache(rng, num_blocks=16, dtype=BF16) for _ in range(2)]
    pairs = np.array([[3, 9], [9, 4], [15, 0]], np.int32)
    inputs = [on_device(c) for c in caches]
    ptrs = [x.unsafe_buffer_pointer() for x in inputs]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*donated buffers were not usable.*")
        got = copy_blocks_donated(inputs, pairs)
    assert [g.unsafe_buffer_pointer() for g in got] == ptrs
    assert all(x.is_deleted() for x in inputs)
    for g, c in zip(got, caches):
        assert_same(g, ref_copy(c, pairs))


def test_copy_blocks_under_jit_drops_out_of_range_pairs(rng):
    """Traced ids cannot be checked: a pair with an id out of range is dropped, never wrapped."""
    cache = random_cache(rng, num_blocks=6)
    pairs = np.array([[1, 2], [-1, 3], [4, 6], [6, 0], [0, -1]], np.int32)
    got = jax.jit(copy_blocks)([on_device(cache)], pairs)[0]
    assert_same(got, ref_copy(cache, [[1, 2]]))


@pytest.mark.parametrize("pairs,match", [
    ([[7, 1]], r"src_to_dst\[0, 0\]=7 \(source block\) is out of range"),
    ([[0, 1], [-1, 2]], r"src_to_dst\[1, 0\]=-1 \(source block\)"),
    ([[0, 1], [2, 7]], r"src_to_dst\[1, 1\]=7 \(destination block\)"),
    ([[0, -1]], r"src_to_dst\[0, 1\]=-1"),
    ([[0, 4], [1, 5], [2, 4]], r"src_to_dst\[2, 1\]=4 is a duplicate destination"),
    ([[0, 1, 2]], r"src_to_dst.shape=\(1, 3\)"),
    ([0, 1], r"src_to_dst.shape=\(2,\)"),
    (np.array([[0.0, 1.0]]), r"src_to_dst.dtype=float64"),
])
@pytest.mark.parametrize("donated", [False, True])
def test_copy_blocks_rejects_bad_pairs_and_writes_nothing(rng, pairs, match, donated):
    cache = random_cache(rng)  # num_blocks = 7
    inputs = [on_device(cache), on_device(cache)]
    with pytest.raises(ValueError, match=match):
        (copy_blocks_donated if donated else copy_blocks)(inputs, pairs)
    for x in inputs:
        assert not x.is_deleted()
        assert_same(x, cache)


@pytest.mark.parametrize("other,match", [
    ((2, 8, 2, 8, 16), r"kv_caches\[1\] is float32\[2, 8, 2, 8, 16\] but kv_caches\[0\] is float32\[2, 7"),
    ((2, 7, 1, 8, 16), r"kv_caches\[1\] is float32\[2, 7, 1, 8, 16\]"),
])
def test_copy_blocks_rejects_mismatched_layers(rng, other, match):
    cache = on_device(random_cache(rng))
    bad = on_device(rng.standard_normal(other).astype(np.float32))
    with pytest.raises(ValueError, match=match):
        copy_blocks_donated([cache, bad], [[0, 1]])
    with pytest.raises(ValueError, match=r"kv_caches\['b'\] is bfloat16"):
        copy_blocks({"a": cache, "b": cache.astype(jnp.bfloat16)}, [[0, 1]])
    with pytest.raises(ValueError, match=r"kv_caches\[0\].shape=\(7,\) has no block_axis=1"):
        copy_blocks([jnp.zeros(7)], [[0, 1]])
    assert not cache.is_deleted() and not bad.is_deleted()


# ----------------------------------------------------------------------------------------------
# zero_blocks
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, BF16, FP8])
def test_zero_blocks_all_layers_match_loop(rng, dtype):
    caches = [random_cache(rng, num_blocks=10, dtype=dtype) for _ in range(3)]
    ids = np.array([9, 0, 4, 4], np.int32)  # repeated ids are allowed
    got = zero_blocks(tuple(on_device(c) for c in caches), ids)
    assert isinstance(got, tuple)
    for g, c in zip(got, caches):
        assert_same(g, ref_zero(c, ids))
        assert np.all(np.asarray(g, np.float32)[:, [0, 4, 9]] == 0)


def test_zero_blocks_donated_reuses_buffers_and_jit_drops_out_of_range(rng):
    caches = {"k0": random_cache(rng, num_blocks=12), "k1": random_cache(rng, num_blocks=12)}
    inputs = {k: on_device(v) for k, v in caches.items()}
    ptrs = {k: v.unsafe_buffer_pointer() for k, v in inputs.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*donated buffers were not usable.*")
        got = zero_blocks_donated(inputs, [3, 7])
    assert {k: v.unsafe_buffer_pointer() for k, v in got.items()} == ptrs
    assert all(v.is_deleted() for v in inputs.values())
    for k in caches:
        assert_same(got[k], ref_zero(caches[k], [3, 7]))
    # traced ids: -1 must not wrap onto block 11, 12 must not be clamped onto block 11
    traced = jax.jit(zero_blocks)(got, jnp.array([-1, 12, 5], jnp.int32))
    for k in caches:
        assert_same(traced[k], ref_zero(caches[k], [3, 7, 5]))


@pytest.mark.parametrize("ids,match", [
    ([0, 7], r"block_ids\[1\]=7 is out of range \[0, num_blocks=7\)"),
    ([-1], r"block_ids\[0\]=-1 is out of range"),
    ([[0, 1]], r"block_ids.shape=\(1, 2\)"),
    (np.array([1.0]), r"block_ids.dtype=float64"),
])
def test_zero_blocks_rejects_bad_ids_and_writes_nothing(rng, ids, match):
    cache = random_cache(rng)
    x = on_device(cache)
    with pytest.raises(ValueError, match=match):
        zero_blocks_donated([x], ids)
    assert not x.is_deleted()
    assert_same(x, cache)
    with pytest.raises(ValueError, match=r"kv_caches\[1\] is float32\[2, 6"):
        zero_blocks([x, on_device(random_cache(rng, num_blocks=6))], [0])


# ----------------------------------------------------------------------------------------------
# swap_blocks
# ----------------------------------------------------------------------------------------------

def test_host_memory_kind_on_cpu_is_pinned_host():
    """Which path runs: on CPU with JAX >= 0.12 the memory-kinds path (pinned_host) works."""
    if jax.default_backend() != "cpu":
        pytest.skip("documented for the CPU backend")
    assert host_memory_kind() == "pinned_host"
    host = allocate_host_kv_cache((2, 3, 1, 8, 16), jnp.bfloat16)
    assert host.sharding.memory_kind == "pinned_host" and host.dtype == jnp.bfloat16
    assert_same(host, np.zeros((2, 3, 1, 8, 16), BF16))


def _host(x: np.ndarray):
    h = to_host(x)
    if host_memory_kind() is not None:
        assert h.sharding.memory_kind == host_memory_kind()
    return h


def test_swap_out_and_in_round_trip(rng):
    """Device (10 blocks) → host (4 blocks) → other device blocks: the blocks come back bit-exact."""
    layers = [random_cache(rng, num_blocks=10, dtype=BF16) for _ in range(2)]
    host_init = [random_cache(rng, num_blocks=4, dtype=BF16) for _ in range(2)]
    device, host = [on_device(x) for x in layers], [_host(x) for x in host_init]
    out_pairs = np.array([[7, 2], [0, 0], [3, 3]], np.int32)
    host2 = swap_blocks(device, host, out_pairs)
    for h, x, h0 in zip(host2, layers, host_init):
        if host_memory_kind() is not None:
            assert h.sharding.memory_kind == host_memory_kind()
        assert_same(h, ref_swap(x, h0, out_pairs))
    for h, h0 in zip(host, host_init):  # functional: the old host cache is unchanged
        assert_same(h, h0)
    in_pairs = np.array([[2, 9], [0, 5], [3, 7]], np.int32)  # 9 ← old 7, 5 ← old 0, 7 ← old 3
    device2 = swap_blocks(host2, device, in_pairs)
    for d, x, h0 in zip(device2, layers, host_init):
        assert d.sharding.memory_kind in (None, "device")
        assert_same(d, ref_swap(ref_swap(x, h0, out_pairs), x, in_pairs))
        np.testing.assert_array_equal(bits(np.asarray(d)[:, 9]), bits(x[:, 7]))


def test_swap_donated_both_directions_in_place(rng):
    src = random_cache(rng, num_blocks=8)
    host_init = random_cache(rng, num_blocks=5)
    host, device = _host(host_init), on_device(src)
    ptr = host.unsafe_buffer_pointer()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*donated buffers were not usable.*")
        host2 = swap_blocks_donated(device, host, [[6, 4], [1, 0]])
        assert host2.unsafe_buffer_pointer() == ptr and host.is_deleted()
        want_host = ref_swap(src, host_init, [[6, 4], [1, 0]])
        assert_same(host2, want_host)
        ptr = device.unsafe_buffer_pointer()
        device2 = swap_blocks_donated(host2, device, [[4, 2]])
    assert device2.unsafe_buffer_pointer() == ptr and device.is_deleted()
    assert not host2.is_deleted()  # the source is never consumed
    assert_same(device2, ref_swap(want_host, src, [[4, 2]]))


def test_swap_under_jit_with_out_shardings(rng):
    """Traced ids, memory-kinds path inside the caller's jit (which places and donates the output)."""
    if host_memory_kind() is None:
        pytest.skip("no memory kinds")
    src, host_init = random_cache(rng, num_blocks=6), random_cache(rng, num_blocks=3)
    host = _host(host_init)
    pairs = jnp.array([[5, 1], [2, 2], [6, 0]], jnp.int32)  # [6, 0]: out of range, dropped
    step = jax.jit(swap_blocks, out_shardings=host.sharding, donate_argnums=1)
    got = step(on_device(src), host, pairs)
    assert got.sharding.memory_kind == "pinned_host"
    assert_same(got, ref_swap(src, host_init, [[5, 1], [2, 2]]))


@pytest.mark.parametrize("donated", [False, True])
def test_swap_numpy_host_path(rng, donated):
    """Fallback path: host caches as NumPy arrays (written in place only by the donated variant)."""
    src = random_cache(rng, num_blocks=6, dtype=BF16)
    host_init = random_cache(rng, num_blocks=4, dtype=BF16)
    host = host_init.copy()
    swap = swap_blocks_donated if donated else swap_blocks
    out = swap({"l0": on_device(src)}, {"l0": host}, [[5, 3], [0, 1]])["l0"]
    assert isinstance(out, np.ndarray)
    want_host = ref_swap(src, host_init, [[5, 3], [0, 1]])
    assert_same(out, want_host)
    assert (out is host) == donated
    assert_same(host, want_host if donated else host_init)
    device = on_device(src)
    back = swap({"l0": out}, {"l0": device}, np.array([[3, 0], [1, 2]], np.int64))["l0"]
    assert_same(back, ref_swap(want_host, src, [[3, 0], [1, 2]]))
    assert device.is_deleted() == donated


@pytest.mark.parametrize("pairs,match", [
    ([[6, 0]], r"src_to_dst\[0, 0\]=6 \(source block\) is out of range \[0, num_blocks=6\)"),
    ([[0, 4]], r"src_to_dst\[0, 1\]=4 \(destination block\) is out of range \[0, num_blocks=4\)"),
    ([[0, 3], [1, 3]], r"src_to_dst\[1, 1\]=3 is a duplicate destination"),
])
def test_swap_rejects_bad_ids_and_writes_nothing(rng, pairs, match):
    src, host_init = random_cache(rng, num_blocks=6), random_cache(rng, num_blocks=4)
    for host in (_host(host_init), host_init.copy()):  # memory-kinds and NumPy destinations
        with pytest.raises(ValueError, match=match):
            swap_blocks_donated(on_device(src), host, pairs)
        if isinstance(host, jax.Array):
            assert not host.is_deleted()
        assert_same(host, host_init)


def test_swap_rejects_mismatched_caches(rng):
    src = on_device(random_cache(rng, num_blocks=6))
    host = _host(random_cache(rng, num_blocks=4))
    with pytest.raises(ValueError, match=r"src.dtype=float32 != dst.dtype=bfloat16"):
        swap_blocks(src, _host(random_cache(rng, num_blocks=4, dtype=BF16)), [[0, 0]])
    with pytest.raises(ValueError, match=r"must agree except on block_axis=1"):
        swap_blocks(src, _host(random_cache(rng, num_blocks=4, head_size=8)), [[0, 0]])
    with pytest.raises(ValueError, match=r"different structures"):
        swap_blocks([src, src], [host], [[0, 0]])
    with pytest.raises(ValueError, match=r"dst\[1\] is float32\[2, 5"):
        swap_blocks([src, src], [host, _host(random_cache(rng, num_blocks=5))], [[0, 0]])
    assert not host.is_deleted()
