"""Blocks for requests, on demand: allocate as tokens are scheduled, free at once, reuse cached prefixes.

vLLM: ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager.get_computed_blocks``, ``allocate_slots``,
``free``, ``usage``) over the block pool. Here the pool is :class:`jaxkv.BlockAllocator` and the hash
table :class:`jaxkv.prefix_cache.PrefixCache` (chained block hashes, reference counts, LRU eviction).
"""

from __future__ import annotations

from jaxkv.block_allocator import BlockAllocator
from jaxkv.core.request import Request
from jaxkv.prefix_cache import PrefixCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """What every KV-cache manager has: one block allocator, the optional prefix cache over it and the
    prefix-cache statistics (vLLM: ``BlockPool`` + ``PrefixCacheStats``)."""

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool):
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_cache = PrefixCache(self.allocator) if enable_prefix_caching else None
        self.prefix_cache_queries = 0  # tokens looked up (vLLM PrefixCacheStats.queries)
        self.prefix_cache_hits = 0     # of which found cached

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus cached blocks no request holds."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return self.allocator.num_free_blocks + evictable

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens


class KVCacheManager(BlockPool):
    """The blocks of every live request (one KV-cache group: every layer shares a block table).

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: keep computed full blocks under their chained hash so that a later
            request (or the re-prefill of a preempted one) with the same prefix reuses them.

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        super().__init__(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self.block_size = block_size

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests, 0..1 (vLLM ``KVCacheManager.usage``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds (every layer keeps every token)."""
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks of the request's longest cached prefix and the tokens they hold.

        Only full blocks of ``all_token_ids[:-1]`` are looked up: the last token is always computed so
        the step has logits to sample from (as vLLM does). Takes no reference.
        """
        if self.prefix_cache is None:
            return [], 0
        hashes = request.hashes_of_full_blocks(request.num_tokens - 1, self.block_size)
        blocks = self.prefix_cache.match(hashes)
        return blocks, len(blocks) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        need = self._num_needed(request, num_new_tokens, new_computed_blocks)
        return need == 0 or need <= self._available(new_computed_blocks)

    def _num_needed(self, request, num_new_tokens, new_computed_blocks) -> int:
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(request.block_ids) - len(new_computed_blocks))

    def _available(self, new_computed_blocks) -> int:
        if self.prefix_cache is None:
            return self.allocator.num_free_blocks
        return (self.allocator.num_free_blocks
                + self.prefix_cache.num_evictable_blocks_without(new_computed_blocks))

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        """Give ``request`` the blocks for ``num_new_tokens`` more tokens (after its computed ones and
        the prefix-cache hits ``new_computed_blocks``, which it takes a reference on).

        Returns ``False`` and changes nothing when too few blocks are free (evictable cached blocks
        count as free). vLLM: ``KVCacheManager.allocate_slots`` (returning ``None`` there).
        """
        need = self._num_needed(request, num_new_tokens, new_computed_blocks)
        # most decode steps fit in the last block: no free count (the prefix cache's evictable blocks)
        if need and need > self._available(new_computed_blocks):
            return False
        if new_computed_blocks:
            self.prefix_cache.acquire(new_computed_blocks)
            request.block_ids.extend(new_computed_blocks)
            request.cached_block_ids.update(new_computed_blocks)
            request.num_cached_blocks = len(request.block_ids)
        if need:
            pool = self.prefix_cache if self.prefix_cache is not None else self.allocator
            request.block_ids.extend(pool.allocate(need))
        return True

    def cache_blocks(self, request: Request) -> None:
        """Offer the request's newly computed full blocks to the prefix cache (after its step ran)."""
        if self.prefix_cache is None:
            return
        # only positions whose token ids are known (a dispatched step's placeholder token is not)
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= request.num_cached_blocks:
            return
        hashes = request.hashes_of_full_blocks(full * self.block_size, self.block_size)
        start = request.num_cached_blocks
        blocks = request.block_ids[start:full]
        rejected = set(self.prefix_cache.register(hashes[start:full], blocks))
        request.cached_block_ids.update(b for b in blocks if b not in rejected)
        request.num_cached_blocks = full

    def free(self, request: Request) -> None:
        """Give back every block of ``request``: cached ones become evictable (the last block first, so
        a prefix outlives its tail, as vLLM frees in reverse order), the others free."""
        for b in reversed(request.block_ids):
            if b in request.cached_block_ids:
                self.prefix_cache.release([b])
            else:
                self.allocator.free([b])
        request.block_ids = []
        request.cached_block_ids = set()
        request.num_cached_blocks = 0
