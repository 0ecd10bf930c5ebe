"""Prefix caching: reuse the KV blocks of a prompt prefix that is already in the cache.

vLLM: automatic prefix caching (``KVCacheManager.get_computed_blocks`` / ``BlockPool`` with block
hashes). A *full* block of prompt tokens is identified by a hash chained over every token from the start
of the sequence, so two prompts share a block only when they agree on everything before and inside it.
Cached blocks are reference-counted: blocks in use by a running sequence are never evicted; blocks no
sequence uses stay cached (evictable, least recently released first) until the allocator needs them.
"""

from __future__ import annotations

import collections

from jaxkv.core.block_pool import BlockAllocator, OutOfBlocksError


def block_hashes(tokens, block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a trailing partial block has none).

    ``h[i] = hash((h[i-1], tokens of block i))``: equal hashes mean equal prefixes (up to hash
    collisions of Python's 64-bit tuple hash).
    """
    hashes, prev = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(int(t) for t in tokens[start:start + block_size])))
        hashes.append(prev)
    return hashes


class PrefixCache:
    """Block-hash → block map with reference counts, on top of a :class:`BlockAllocator`.

    The cache owns its blocks in the allocator's eyes (they are allocated, not free) and hands them back
    with :meth:`evict` when the allocator runs short.
    """

    def __init__(self, allocator: BlockAllocator, *, on_evict=None):
        self.allocator = allocator
        # ``on_evict(block_hash, block)``: called for each evicted block before it is freed (the host tier
        # copies it out: jaxkv.core.host_kv_pool)
        self.on_evict = on_evict
        self._block_of: dict[int, int] = {}          # block hash → physical block
        self._hash_of: dict[int, int] = {}           # physical block → block hash
        self._refcount: collections.Counter = collections.Counter()
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def num_evictable_blocks_without(self, blocks) -> int:
        """Evictable blocks left once ``blocks`` (about to be reused) are acquired."""
        return len(self._evictable) - sum(1 for b in set(blocks) if b in self._evictable)

    def get(self, block_hash) -> int | None:
        """The cached block of one hash (any hashable key, e.g. ``(group, hash)``), or ``None``."""
        return self._block_of.get(block_hash)

    def match(self, hashes: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (no reference taken)."""
        blocks = []
        for h in hashes:
            if h not in self._block_of:
                break
            blocks.append(self._block_of[h])
        return blocks

    def acquire(self, blocks) -> None:
        """Take a reference on cached ``blocks`` (they can no longer be evicted)."""
        for b in blocks:
            self._refcount[b] += 1
            self._evictable.pop(b, None)

    def release(self, blocks) -> None:
        """Drop a reference; a cached block nobody uses becomes evictable (most recent last)."""
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} released more often than acquired")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                del self._refcount[b]
                self._evictable[b] = None

    def register(self, hashes: list[int], blocks: list[int]) -> list[int]:
        """Cache ``blocks`` (held by the caller) under ``hashes``; returns the blocks it did NOT keep
        (a hash already cached by another block), which the caller frees as usual."""
        rejected = []
        for h, b in zip(hashes, blocks):
            if h in self._block_of or b in self._hash_of:
                if self._block_of.get(h) != b:
                    rejected.append(b)
                continue
            self._block_of[h], self._hash_of[b] = b, h
            self._refcount[b] += 1  # the caller's reference, dropped by its release()
        return rejected

    def evict(self, n: int) -> int:
        """Return up to ``n`` evictable blocks to the allocator (least recently released first)."""
        evicted = 0
        while evicted < n and self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._block_of[h]
            if self.on_evict is not None:
                self.on_evict(h, b)
            self.allocator.free([b])
            evicted += 1
        return evicted

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the allocator, evicting cached blocks when it is short.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks free even after evicting every evictable block
                (nothing allocated, nothing evicted).
        """
        short = n - self.allocator.num_free_blocks
        if short > self.num_evictable_blocks:
            raise OutOfBlocksError(f"asked for {n} blocks: {self.allocator.num_free_blocks} free and "
                                   f"{self.num_evictable_blocks} evictable")
        if short > 0:
            self.evict(short)
        return self.allocator.allocate(n)
