"""Blocks for requests, on demand: allocate as tokens are scheduled, free at once, reuse cached prefixes.

vLLM: ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager.get_computed_blocks``, ``allocate_slots``,
``free``, ``usage``) over the block pool. Here the pool is :class:`jaxkv.BlockAllocator` and the hash
table :class:`jaxkv.core.prefix_cache.PrefixCache` (chained block hashes, reference counts, LRU eviction).
"""

from __future__ import annotations

from jaxkv.core.block_pool import BlockAllocator
from jaxkv.core.host_kv_pool import HostBlock, HostBlockPool
from jaxkv.core.prefix_cache import PrefixCache
from jaxkv.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """What every KV-cache manager has: one block allocator, the optional prefix cache over it, the
    prefix-cache statistics (vLLM: ``BlockPool`` + ``PrefixCacheStats``) and the optional host tier
    (:class:`jaxkv.core.host_kv_pool.HostBlockPool`): swap preemption and, where the manager supports it
    (``supports_host_prefix_cache``), a second-tier prefix cache that keeps blocks evicted from the
    device prefix cache."""

    supports_host_prefix_cache = False

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool, host_pool: HostBlockPool | None = None):
        self.allocator = BlockAllocator(num_blocks)
        self.host_pool = host_pool
        on_evict = self._offload_evicted if host_pool is not None and self.supports_host_prefix_cache else None
        self.prefix_cache = PrefixCache(self.allocator, on_evict=on_evict) if enable_prefix_caching else None
        # host→device copies run outside the scheduling pass (the engine's loads): a host hit's new device
        # block is registered in the device prefix cache only once its load has landed (finish_load), so
        # that no other request can hit a block that does not hold its data yet
        self.async_loads = False
        self.prefix_cache_queries = 0  # tokens looked up (vLLM PrefixCacheStats.queries)
        self.prefix_cache_hits = 0     # of which found cached (on the device or, with a host tier, the host)

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

    # -- the host tier ---------------------------------------------------------------------------------
    @property
    def has_host_prefix_cache(self) -> bool:
        return self.host_pool is not None and self.prefix_cache is not None and self.supports_host_prefix_cache

    def _offload_evicted(self, key, block: int) -> None:
        self.host_pool.offload(key, block)

    def _register_loaded(self, request: Request, keys: list, blocks: list[int]) -> None:
        """Cache host hits' new device blocks under their keys: now, or with :attr:`async_loads` once their
        load has landed (:meth:`finish_load`)."""
        if self.async_loads:
            request.pending_prefix.append((list(keys), list(blocks)))
        else:
            self._cache(request, list(keys), list(blocks))

    def finish_load(self, request: Request) -> None:
        """``request``'s load has landed (the copy into its device blocks is dispatched before any step
        that reads them): its host hits' device blocks join the device prefix cache."""
        pending, request.pending_prefix = request.pending_prefix, []
        for keys, blocks in pending:
            self._cache(request, keys, blocks)

    def _cache(self, request: Request, keys: list, blocks: list[int]) -> None:
        """Register ``blocks`` under ``keys`` in the device prefix cache; those it takes become the request's
        cached blocks (a key cached already keeps its block, and the request's stays plain)."""
        rejected = set(self.prefix_cache.register(keys, blocks))
        request.cached_block_ids.update(b for b in blocks if b not in rejected)

    def _device_layout(self, request: Request) -> list[list[int | None]]:
        """Per group, the device blocks holding the request's computed tokens (``None``: a null block)."""
        raise NotImplementedError

    def _restore_layout(self, request: Request, layout: list[list[int | None]]) -> None:
        """Give a request being swapped in its new device blocks (``layout`` as :meth:`_device_layout`)."""
        raise NotImplementedError

    def swap_out(self, request: Request) -> bool:
        """Swap preemption: copy the blocks holding ``request``'s computed tokens to host blocks (copies
        of this pass, issued before the next step) and free its device blocks (cached ones stay in the
        device prefix cache, evictable). ``request.num_computed_tokens`` stays. Returns ``False`` and
        changes nothing when there is no host tier or it cannot hold the blocks (the caller recomputes).
        vLLM V0: ``BlockSpaceManager.swap_out``."""
        if self.host_pool is None or request.num_computed_tokens == 0:
            return False
        layout = self._device_layout(request)
        device = [b for blocks in layout for b in blocks if b is not None]
        host = self.host_pool.swap_out(device)
        if host is None:
            return False
        it = iter(host)
        host_layout = [[None if b is None else next(it) for b in blocks] for blocks in layout]
        self.free(request)
        request.host_block_ids = host_layout
        return True

    def num_blocks_to_swap_in(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks a swapped-out request needs to resume with ``num_new_tokens`` more tokens."""
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return sum(sum(h is not None for h in blocks) + max(0, total - len(blocks))
                   for blocks in request.host_block_ids)

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Resume a swapped-out request: new device blocks for its host blocks (host→device copies of this
        pass; the host blocks are freed) and for ``num_new_tokens`` more tokens. Returns ``False`` and
        keeps it swapped out when too few device blocks are free (evictable cached blocks count).
        vLLM V0: ``BlockSpaceManager.swap_in``."""
        host_layout = request.host_block_ids
        host = [h for blocks in host_layout for h in blocks if h is not None]
        if self.num_blocks_to_swap_in(request, num_new_tokens) > self._available():
            return False
        pool = self.prefix_cache if self.prefix_cache is not None else self.allocator
        device = pool.allocate(len(host))
        it = iter(device)
        self._restore_layout(request, [[None if h is None else next(it) for h in blocks] for blocks in host_layout])
        request.host_block_ids = None
        if not self.allocate_slots(request, num_new_tokens):
            self.free(request)  # the new blocks are plain (not cached): back to the free list
            request.host_block_ids = host_layout
            return False
        self.host_pool.swap_in(host, device)
        return True

    def _free_host_blocks(self, request: Request) -> None:
        """A swapped-out request that finishes or is aborted gives its host blocks back."""
        if request.host_block_ids is not None:
            self.host_pool.free([h for blocks in request.host_block_ids for h in blocks if h is not None])
            request.host_block_ids = None


class KVCacheManager(BlockPool):
    """The blocks of every live request (one KV-cache group: every layer shares a block table).

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: keep computed full blocks under their chained hash so that a later
            request (or the re-prefill of a preempted one) with the same prefix reuses them.
        host_pool: the host tier (swap preemption; with prefix caching also the second-tier prefix cache:
            blocks evicted from the device are kept there and found by ``get_computed_blocks(use_host=True)``).

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    supports_host_prefix_cache = True

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 host_pool: HostBlockPool | None = None):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        super().__init__(num_blocks, enable_prefix_caching=enable_prefix_caching, host_pool=host_pool)

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests, 0..1 (vLLM ``KVCacheManager.usage``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds (every layer keeps every token)."""
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request, *, use_host: bool = False) -> tuple[list, int]:
        """Cached blocks of the request's longest cached prefix and the tokens they hold.

        Only full blocks of ``all_token_ids[:-1]`` are looked up: the last token is always computed so
        the step has logits to sample from (as vLLM does). ``use_host``: after the device's hits, the host
        prefix cache's, as :class:`jaxkv.core.host_kv_pool.HostBlock` entries. Takes no reference.
        """
        if self.prefix_cache is None or request.skips_prefix_cache:
            return [], 0
        hashes = request.hashes_of_full_blocks(request.num_tokens - 1, self.block_size)
        blocks = self.prefix_cache.match(hashes)
        if use_host and self.has_host_prefix_cache:
            blocks += [HostBlock(b) for b in self.host_pool.match(hashes[len(blocks):])]
        return blocks, len(blocks) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        device, host = self._split_hits(new_computed_blocks)
        need = self._num_needed(request, num_new_tokens + len(host) * self.block_size, device)
        return need == 0 or need <= self._available(device)

    @staticmethod
    def _split_hits(hits) -> tuple[list[int], list[int]]:
        """Device hits and host hits (their host blocks; they follow the device hits)."""
        host = [b.block_id for b in hits if isinstance(b, HostBlock)]
        return list(hits[:len(hits) - len(host)]), host

    def _num_needed(self, request, num_new_tokens, new_computed_blocks) -> int:
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(request.block_ids) - len(new_computed_blocks))

    def _available(self, new_computed_blocks=()) -> int:
        if self.prefix_cache is None:
            return self.allocator.num_free_blocks
        return (self.allocator.num_free_blocks
                + self.prefix_cache.num_evictable_blocks_without(new_computed_blocks))

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        """Give ``request`` the blocks for ``num_new_tokens`` more tokens (after its computed ones and
        the prefix-cache hits ``new_computed_blocks``, which it takes a reference on).

        Host prefix-cache hits in ``new_computed_blocks`` (``get_computed_blocks(use_host=True)``, admission
        only) each get a new device block, copied from the host before the step (a copy of this pass) and
        cached on the device under its hash.

        Returns ``False`` and changes nothing when too few blocks are free (evictable cached blocks
        count as free). vLLM: ``KVCacheManager.allocate_slots`` (returning ``None`` there).
        """
        new_computed_blocks, host_computed_blocks = self._split_hits(new_computed_blocks)
        num_host = len(host_computed_blocks)
        need = self._num_needed(request, num_new_tokens + num_host * self.block_size, new_computed_blocks)
        # most decode steps fit in the last block: no free count (the prefix cache's evictable blocks)
        if need and need > self._available(new_computed_blocks):
            return False
        if new_computed_blocks:
            self.prefix_cache.acquire(new_computed_blocks)
            request.block_ids.extend(new_computed_blocks)
            request.cached_block_ids.update(new_computed_blocks)
            request.num_cached_blocks = len(request.block_ids)
        if num_host:  # before allocating: an eviction it causes must not reuse these host blocks
            self.host_pool.lock(host_computed_blocks)
        if need:
            pool = self.prefix_cache if self.prefix_cache is not None else self.allocator
            request.block_ids.extend(pool.allocate(need))
        if num_host:
            start = len(new_computed_blocks)
            targets = request.block_ids[start:start + num_host]
            self.host_pool.load(host_computed_blocks, targets)
            hashes = request.hashes_of_full_blocks((start + num_host) * self.block_size, self.block_size)
            self._register_loaded(request, hashes[start:], targets)
            request.num_cached_blocks = start + num_host
            self.host_pool.num_host_prefix_hit_tokens += num_host * self.block_size
        return True

    def cache_blocks(self, request: Request) -> None:
        """Offer the request's newly computed full blocks to the prefix cache (after its step ran)."""
        if self.prefix_cache is None or not request.block_ids:  # none held (e.g. swapped out)
            return
        # only positions whose token ids are known (a dispatched step's placeholder token is not)
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full <= request.num_cached_blocks:
            return
        hashes = request.hashes_of_full_blocks(full * self.block_size, self.block_size)
        start = request.num_cached_blocks
        blocks = request.block_ids[start:full]
        self._cache(request, hashes[start:full], blocks)
        request.num_cached_blocks = full

    def free(self, request: Request) -> None:
        """Give back every block of ``request``: cached ones become evictable (the last block first, so
        a prefix outlives its tail, as vLLM frees in reverse order), the others free; a swapped-out
        request's host blocks go back to the host pool."""
        self._free_host_blocks(request)
        request.pending_prefix = []  # a load that never landed: its blocks are plain, freed below
        for b in reversed(request.block_ids):
            if b in request.cached_block_ids:
                self.prefix_cache.release([b])
            else:
                self.allocator.free([b])
        request.block_ids = []
        request.cached_block_ids = set()
        request.num_cached_blocks = 0

    def _device_layout(self, request: Request) -> list[list[int | None]]:
        return [list(request.block_ids[:cdiv(request.num_computed_tokens, self.block_size)])]

    def _restore_layout(self, request: Request, layout: list[list[int | None]]) -> None:
        (request.block_ids,) = [list(blocks) for blocks in layout]
