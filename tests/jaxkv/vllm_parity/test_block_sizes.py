"""select_common_block_size, prepare_kernel_block_sizes and virtual block splitting (32 → 16 tokens)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv_cache.backends.base import MultipleOf as BackendsMultipleOf
from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.kv_cache.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, get_kv_cache_config
from jaxkv.kv_cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from jaxkv.vllm_parity.backends.flash_attn import FlashAttentionBackend
from jaxkv.vllm_parity.backends.flashinfer import FlashInferBackend
from jaxkv.vllm_parity.block_sizes import (
    MultipleOf,
    block_size_is_supported,
    blocks_per_kv_block,
    prepare_kernel_block_sizes,
    select_common_block_size,
    split_block_table,
    split_slot_mapping,
    supported_kernel_block_sizes,
)


class Backend:
    """A fake backend: only what block-size selection reads."""

    def __init__(self, name, sizes):
        self.name = name
        self.supported_block_sizes = tuple(sizes)


class VllmStyleBackend:
    """vLLM's spelling: a classmethod instead of an attribute."""

    name = "VLLM_STYLE"

    @classmethod
    def get_supported_kernel_block_sizes(cls):
        return [16, 32]


FLASH = Backend("FLASH", [MultipleOf(16)])
ONLY_16_32 = Backend("ONLY_16_32", [16, 32])
ONLY_8 = Backend("ONLY_8", [8])


def reference_select(manager, backends):
    """Brute force over the divisors of the manager block size."""

    def ok(size, backend):
        for s in backend.supported_block_sizes:
            if isinstance(s, MultipleOf) and size % s.base == 0:
                return True
            if not isinstance(s, MultipleOf) and size == s:
                return True
        return False

    if all(ok(manager, b) for b in backends):
        return manager
    declared_ints = {s for b in backends for s in b.supported_block_sizes if not isinstance(s, MultipleOf)}
    divisors = [d for d in range(1, manager + 1) if manager % d == 0]
    good = [d for d in divisors if d in declared_ints and all(ok(d, b) for b in backends)]
    return max(good) if good else None


# ----------------------------------------------------------------------------------------------------
# select_common_block_size
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("manager,backends,want", [
    (32, [PallasAttentionBackend], 32),           # supported as is
    (256, [PallasAttentionBackend], 128),         # largest supported divisor of 256
    (64, [PallasAttentionBackend], 64),
    (16, [PallasAttentionBackend], 16),
    (32, [FLASH], 32),                             # multiple of 16
    (256, [FLASH, ONLY_16_32], 32),                # 256 not in ONLY_16_32; 32 | 256 and 32 % 16 == 0
    (48, [FLASH, ONLY_16_32], 16),                 # 32 does not divide 48
    (64, [PallasAttentionBackend, FLASH], 64),     # 64: Pallas int entry and a multiple of 16
    (256, [PallasAttentionBackend, FLASH], 128),
    (64, [VllmStyleBackend], 32),
    (24, [ONLY_8, PallasAttentionBackend], 8),
])
def test_select_hand_cases(manager, backends, want):
    assert select_common_block_size(manager, backends) == want


@pytest.mark.parametrize("manager,backends,want", [
    (128, [FlashInferBackend, PallasAttentionBackend], 64),  # (16, 32, 64) and (8, 16, 32, 64, 128)
    (128, [FlashAttentionBackend, FlashInferBackend], 64),   # MultipleOf(16) and (16, 32, 64)
    (32, [FlashAttentionBackend, FlashInferBackend, PallasAttentionBackend], 32),
    (64, [FlashAttentionBackend], 64),
])
def test_select_with_jaxkv_backends(manager, backends, want):
    assert select_common_block_size(manager, backends) == want


def test_one_multiple_of_class():
    assert MultipleOf is BackendsMultipleOf


@pytest.mark.parametrize("manager,backends", [(24, [FLASH]), (16, [ONLY_8, FLASH]), (12, [ONLY_16_32])])
def test_select_no_common_size(manager, backends):
    with pytest.raises(ValueError, match=f"kv_manager_block_size={manager} has no common"):
        select_common_block_size(manager, backends)


def test_select_matches_brute_force():
    rng = np.random.default_rng(0)
    pool = [1, 2, 4, 8, 16, 32, 48, 64, 128]
    for _ in range(300):
        backends = []
        for k in range(int(rng.integers(1, 4))):
            entries = [int(x) for x in rng.choice(pool, int(rng.integers(1, 4)), replace=False)]
            if rng.random() < 0.3:
                entries.append(MultipleOf(int(rng.choice([8, 16, 32]))))
            backends.append(Backend(f"b{k}", entries))
        manager = int(rng.choice([8, 16, 24, 32, 48, 64, 96, 128, 256]))
        want = reference_select(manager, backends)
        if want is None:
            with pytest.raises(ValueError):
                select_common_block_size(manager, backends)
        else:
            got = select_common_block_size(manager, backends)
            assert got == want
            assert manager % got == 0
            assert block_size_is_supported(backends, got)


@pytest.mark.parametrize("backends,needle", [
    ([], "backends=[] is empty"),
    ([Backend("BAD", [0])], "supported block size 0"),
    ([Backend("BAD", [16.0])], "supported block size 16.0"),
    ([Backend("BAD", ["16"])], "supported block size '16'"),
    ([object()], "declares no supported_block_sizes"),
])
def test_select_bad_backends(backends, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        select_common_block_size(32, backends)


def test_select_bad_manager_size():
    with pytest.raises(ValueError, match="kv_manager_block_size=0"):
        select_common_block_size(0, [FLASH])


def test_supported_sizes_and_multiple_of():
    assert supported_kernel_block_sizes(PallasAttentionBackend) == (8, 16, 32, 64, 128)
    assert supported_kernel_block_sizes(VllmStyleBackend) == (16, 32)
    assert MultipleOf(16) == MultipleOf(16) and hash(MultipleOf(16)) == hash(MultipleOf(16))
    with pytest.raises(ValueError, match="base=0"):
        MultipleOf(0)


# ----------------------------------------------------------------------------------------------------
# prepare_kernel_block_sizes
# ----------------------------------------------------------------------------------------------------

def test_prepare_per_group():
    full = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
    sw = SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16,
                           sliding_window=256)
    cfg = get_kv_cache_config({"f0": full, "s0": sw, "s1": sw}, full.page_size_bytes * 10)
    assert len(cfg.kv_cache_groups) == 3
    got = prepare_kernel_block_sizes(cfg, [[PallasAttentionBackend], FLASH, [FLASH, ONLY_16_32]])
    assert got == [64, 64, 32]


def test_prepare_non_attention_cache_keeps_its_block_size():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class StateSpec(KVCacheSpec):  # a Mamba-like cache: no splitting
        @property
        def page_size_bytes(self):
            return 1024

    group = KVCacheGroupSpec(layer_names=("m",), kv_cache_spec=StateSpec(block_size=48))
    cfg = KVCacheConfig(num_blocks=2, kv_cache_tensors=(KVCacheTensor(size=2048, shared_by=("m",)),),
                        kv_cache_groups=(group,))
    assert prepare_kernel_block_sizes(cfg, [[ONLY_8]]) == [48]


def test_prepare_errors():
    spec = FullAttentionSpec(block_size=24, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
    cfg = get_kv_cache_config({"a": spec}, spec.page_size_bytes * 4)
    with pytest.raises(ValueError, match=r"len\(backends_per_group\)=2 must equal the 1"):
        prepare_kernel_block_sizes(cfg, [[FLASH], [FLASH]])
    with pytest.raises(ValueError, match=r"kv_cache_groups\[0\].*kv_manager_block_size=24"):
        prepare_kernel_block_sizes(cfg, [[FLASH]])


# ----------------------------------------------------------------------------------------------------
# virtual block splitting
# ----------------------------------------------------------------------------------------------------

MANAGER, KERNEL = 32, 16


def random_tables(rng, num_seqs, num_manager_blocks):
    """Each sequence owns distinct manager blocks in random order; unused columns are 0 (vLLM padding)."""
    seq_lens = rng.integers(1, 5 * MANAGER, num_seqs)
    need = -(-seq_lens // MANAGER)
    width = int(need.max()) + 1
    perm = rng.permutation(num_manager_blocks)
    tables = np.zeros((num_seqs, width), np.int32)
    c = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[c:c + n]
        c += n
    return tables, seq_lens


def test_hand_example():
    # vLLM's map_to_kernel_blocks docstring: [0, 1, 2] -> [0, 1, 2, 3, 4, 5]
    assert split_block_table(np.array([0, 1, 2], np.int32), 32, 16).tolist() == [0, 1, 2, 3, 4, 5]
    got = split_block_table(np.array([[7, 3]], np.int32), 64, 16)
    assert got.tolist() == [[28, 29, 30, 31, 12, 13, 14, 15]]
    # negative padding stays padding
    assert split_block_table(np.array([[5, -1]], np.int32), 32, 16).tolist() == [[10, 11, -1, -1]]


@pytest.mark.parametrize("as_jax", [False, True])
def test_every_token_lands_in_the_same_slot(as_jax):
    rng = np.random.default_rng(1)
    num_manager_blocks = 40
    tables, seq_lens = random_tables(rng, 6, num_manager_blocks)
    before = tables.copy()
    inp = jnp.asarray(tables) if as_jax else tables
    kernel_tables = split_block_table(inp, MANAGER, KERNEL)
    if as_jax:
        assert isinstance(kernel_tables, jax.Array)
        kernel_tables = np.asarray(kernel_tables)
    else:
        assert isinstance(kernel_tables, np.ndarray)
        assert not np.shares_memory(kernel_tables, tables)
    np.testing.assert_array_equal(tables, before)  # input untouched
    assert kernel_tables.dtype == np.int32
    assert kernel_tables.shape == (tables.shape[0], tables.shape[1] * 2)
    for s in range(len(seq_lens)):
        for p in range(int(seq_lens[s])):
            manager_slot = int(tables[s, p // MANAGER]) * MANAGER + p % MANAGER
            kernel_block = int(kernel_tables[s, p // KERNEL])
            offset = p % KERNEL
            assert (kernel_block, offset) == (manager_slot // KERNEL, manager_slot % KERNEL)
            assert kernel_block * KERNEL + offset == manager_slot
    # kernel blocks in use are distinct across sequences, as the manager blocks were
    used = [int(kernel_tables[s, j]) for s in range(len(seq_lens))
            for j in range(-(-int(seq_lens[s]) // KERNEL))]
    assert len(set(used)) == len(used)
    assert max(used) < num_manager_blocks * 2


def test_split_under_jit_and_ratio_4():
    rng = np.random.default_rng(2)
    tables = rng.integers(0, 100, (3, 5)).astype(np.int32)
    got = jax.jit(lambda t: split_block_table(t, 64, 16))(jnp.asarray(tables))
    want = np.array([[tables[s, j // 4] * 4 + j % 4 for j in range(20)] for s in range(3)], np.int32)
    np.testing.assert_array_equal(np.asarray(got), want)
    # ratio 1: same ids, a copy
    same = split_block_table(tables, 16, 16)
    np.testing.assert_array_equal(same, tables)
    assert not np.shares_memory(same, tables)


def test_kv_data_through_both_views():
    """Write K/V by manager slot, read through the kernel block table: same token data."""
    rng = np.random.default_rng(3)
    num_manager_blocks, heads, head_size = 12, 2, 8
    tables, seq_lens = random_tables(rng, 3, num_manager_blocks)
    cache = np.full((num_manager_blocks * MANAGER, heads, head_size), np.nan, np.float32)  # token-major
    tokens = {}
    for s in range(3):
        for p in range(int(seq_lens[s])):
            slot = int(tables[s, p // MANAGER]) * MANAGER + p % MANAGER
            tokens[s, p] = rng.standard_normal((heads, head_size)).astype(np.float32)
            cache[slot] = tokens[s, p]
    # what a 16-token kernel sees
    kernel_view = cache.reshape(num_manager_blocks * 2, KERNEL, heads, head_size)
    kernel_tables = split_block_table(tables, MANAGER, KERNEL)
    for (s, p), kv in tokens.items():
        np.testing.assert_array_equal(kernel_view[kernel_tables[s, p // KERNEL], p % KERNEL], kv)


def test_page_size_el_zeroing_lands_on_the_kernel_blocks():
    """vLLM KVBlockZeroer: manager block b starts at element b * PAGE_SIZE_EL (ratio kernel blocks)."""
    rng = np.random.default_rng(4)
    num_manager_blocks, heads, head_size = 6, 2, 4
    ratio = MANAGER // KERNEL
    kernel_block_el = KERNEL * heads * head_size
    page_size_el = kernel_block_el * ratio
    flat = rng.standard_normal(num_manager_blocks * page_size_el).astype(np.float32) + 10.0  # never 0
    kernel_view = flat.reshape(num_manager_blocks * ratio, KERNEL, heads, head_size)
    zero_ids = [4, 1]
    for b in zero_ids:
        flat[b * page_size_el:(b + 1) * page_size_el] = 0.0
    zeroed_kernel_blocks = set(split_block_table(np.array(zero_ids, np.int32), MANAGER, KERNEL).tolist())
    assert zeroed_kernel_blocks == {8, 9, 2, 3}
    for k in range(num_manager_blocks * ratio):
        assert (not kernel_view[k].any()) == (k in zeroed_kernel_blocks)


def test_slot_mapping_is_unchanged():
    slots = np.array([0, 31, 32, 65, -1, 1023], np.int64)
    out = split_slot_mapping(slots, MANAGER, KERNEL)
    np.testing.assert_array_equal(out, [0, 31, 32, 65, -1, 1023])
    assert out.dtype == np.int64 and not np.shares_memory(out, slots)
    # the slot seen as (kernel block, offset) vs (manager block, offset): the same token index
    for s in [0, 31, 32, 65, 1023]:
        assert (s // KERNEL) * KERNEL + s % KERNEL == (s // MANAGER) * MANAGER + s % MANAGER == s
        assert s // KERNEL // (MANAGER // KERNEL) == s // MANAGER
    j = split_slot_mapping(jnp.asarray(slots[:4], jnp.int32), MANAGER, KERNEL)
    np.testing.assert_array_equal(np.asarray(j), [0, 31, 32, 65])


@pytest.mark.parametrize("fn", [split_block_table, split_slot_mapping])
@pytest.mark.parametrize("args,needle", [
    ((np.zeros((2, 3), np.int32), 32, 12), "kernel_block_size=12 does not divide manager_block_size=32"),
    ((np.zeros((2, 3), np.int32), 16, 32), "kernel_block_size=32 does not divide manager_block_size=16"),
    ((np.zeros((2, 3), np.int32), 0, 16), "manager_block_size=0"),
    ((np.zeros((2, 3), np.float32), 32, 16), "dtype=float32"),
    ((jnp.zeros((2, 3), jnp.float32), 32, 16), "dtype=float32"),
    ((np.int32(3), 32, 16), "ndim=0"),
])
def test_split_errors(fn, args, needle):
    with pytest.raises(ValueError, match=needle):
        fn(*args)


def test_split_overflow_rejected():
    big = np.array([[np.iinfo(np.int32).max // 2 + 1]], np.int32)
    with pytest.raises(ValueError, match="overflow int32"):
        split_block_table(big, 32, 16)
    assert split_block_table(big.astype(np.int64), 32, 16).tolist() == [[2 ** 31, 2 ** 31 + 1]]


def test_blocks_per_kv_block():
    assert blocks_per_kv_block(32, 16) == 2 and blocks_per_kv_block(64, 8) == 8
    assert blocks_per_kv_block(16, 16) == 1
    with pytest.raises(ValueError, match="kernel_block_size=-16"):
        blocks_per_kv_block(32, -16)
