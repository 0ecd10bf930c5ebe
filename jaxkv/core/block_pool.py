"""A free-list block allocator (host side). vLLM: ``BlockPool`` / the v0 ``BlockAllocator``."""

from __future__ import annotations

import collections


class OutOfBlocksError(ValueError):
    """The cache has fewer free blocks than were asked for."""


class BlockAllocator:
    """Hands out physical block ids ``0..num_blocks-1`` and takes them back.

    Blocks are reused first-freed-first (FIFO), like vLLM's free block queue.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = collections.deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids. Raises :class:`OutOfBlocksError` (nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks) -> None:
        """Return ``blocks`` to the pool. Raises ``ValueError`` (nothing freed) for a block not in use."""
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks={blocks} are not all allocated (offending: {bad or 'duplicates'})")
        self._used.difference_update(blocks)
        self._free.extend(blocks)
