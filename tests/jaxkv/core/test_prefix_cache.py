"""PrefixCache / block_hashes: chained hashing, reference counts, LRU eviction, allocation."""

from __future__ import annotations

import pytest

from jaxkv.core.block_pool import BlockAllocator, OutOfBlocksError
from jaxkv.core.prefix_cache import PrefixCache, block_hashes


def test_hashes_cover_full_blocks_and_chain_over_the_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    assert len(a) == 2  # the 7th token is a partial block
    assert block_hashes([1, 2, 3, 4, 5, 6], 3) == a
    # same second block after a different first block: a different hash (the whole prefix counts)
    b = block_hashes([9, 9, 9, 4, 5, 6], 3)
    assert b[1] != a[1]
    assert block_hashes([1, 2, 3, 4, 5, 7], 3)[0] == a[0] and block_hashes([1, 2, 3, 4, 5, 7], 3)[1] != a[1]


def test_match_acquire_release_and_lru_eviction():
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc)
    h = block_hashes(list(range(12)), 4)  # 3 full blocks
    blocks = alloc.allocate(3)
    assert cache.register(h, blocks) == []
    assert cache.match(h) == blocks and cache.match(h[:1] + [12345]) == blocks[:1]
    cache.release(blocks)  # the registering sequence finished
    assert cache.num_evictable_blocks == 3 and alloc.num_free_blocks == 1
    cache.acquire(blocks[:1])  # a new sequence reuses the first block: not evictable any more
    assert cache.num_evictable_blocks == 2
    got = cache.allocate(2)  # 1 free + 1 evicted: the least recently released idle block goes first
    assert len(got) == 2 and blocks[1] in got and cache.match(h) == blocks[:1]
    with pytest.raises(OutOfBlocksError):
        cache.allocate(3)  # 0 free, 1 evictable
    assert cache.num_evictable_blocks == 1 and alloc.num_free_blocks == 0  # nothing changed
    with pytest.raises(ValueError, match="released more often"):
        cache.release([blocks[2], blocks[2]])


def test_register_rejects_a_second_block_for_a_cached_hash():
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc)
    h = block_hashes([5, 6, 7, 8], 4)
    first, second = alloc.allocate(1), alloc.allocate(1)
    assert cache.register(h, first) == []
    assert cache.register(h, second) == second  # the caller frees it
    assert cache.match(h) == first
