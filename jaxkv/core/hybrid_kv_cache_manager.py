"""Blocks of a hybrid model: one block table per KV-cache group over one block pool.

vLLM: ``vllm/v1/core/kv_cache_coordinator.py`` (``HybridKVCacheCoordinator``) over the per-type managers
of ``vllm/v1/core/single_type_kv_cache_manager.py`` (``FullAttentionManager``, ``SlidingWindowManager``).
Every group hands out its own blocks of the shared pool (:class:`jaxkv.KVCacheConfig`: block id ``b`` of
group ``g`` is page ``b`` of the tensors its layers use, a different layer of each tensor than the other
groups'). A full-attention group keeps a block for every token; a sliding-window group replaces the blocks
that fell out of its window by the *null block* and frees them
(``SlidingWindowManager.remove_skipped_blocks``), so a sequence holds at most
``cdiv(sliding_window - 1 + num_new_tokens, block_size) + 1`` blocks of such a group (decoding:
``cdiv(sliding_window, block_size) + 1``). The null block (block 0, vLLM's ``BlockPool.null_block``) is
never handed out nor written; block tables point skipped logical blocks to it and the attention kernels
never read it (its keys are outside every window).

Prefix caching follows vLLM's hybrid rules (``HybridKVCacheCoordinator.find_longest_cache_hit``): blocks are
cached per group under ``(group, chained block hash)`` in one :class:`jaxkv.core.prefix_cache.PrefixCache` (one
LRU over the shared pool); a full-attention group hits on the longest cached prefix (left to right); a
sliding-window group needs only the last ``cdiv(sliding_window - 1, block_size)`` blocks before the hit
point to be cached (searched right to left, earlier ones become the null block), or a cached run from the
first block; the hit is the longest length every group accepts (iterated to a fixed point, since a
sliding group's answer depends on the length it may use).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jaxkv.core.host_kv_pool import HostBlock, HostBlockPool
from jaxkv.core.kv_cache_manager import BlockPool, cdiv
from jaxkv.core.request import Request
from jaxkv.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec

log = logging.getLogger(__name__)


class HybridKVCacheManager(BlockPool):
    supports_host_prefix_cache = True

    """The blocks of every live request, one block list per KV-cache group (``request.group_block_ids``).

    Same interface as :class:`jaxkv.core.kv_cache_manager.KVCacheManager`; ``request.block_ids`` is the first group's list
    (what the scheduler checks for "holds blocks").

    Args:
        kv_cache_groups: the groups (``KVCacheConfig.kv_cache_groups``); each spec a
            :class:`jaxkv.FullAttentionSpec` (a ``sliding_window`` recorded on it only limits compute) or a
            :class:`jaxkv.SlidingWindowSpec`, all with one block size.
        num_blocks: blocks in the pool (``KVCacheConfig.num_blocks``), the null block included.
        enable_prefix_caching: cache computed full blocks per group and reuse them (vLLM's rules above).
        host_pool: the host tier. Swap preemption: a preempted request's real blocks of every group go to
            host blocks and come back to new device blocks of the same groups (the null blocks stay null).
            With prefix caching, the second-tier prefix cache: blocks evicted from the device are kept under
            ``(group, block hash)``, and the hit rules above treat a block found there as cached
            (``get_computed_blocks(use_host=True)``); it is copied back to a new device block.

    Raises:
        ValueError: no group, a spec of another type, different block sizes, ``num_blocks < 2``.
    """

    supports_host_prefix_cache = True

    def __init__(self, kv_cache_groups: Sequence, num_blocks: int, *, enable_prefix_caching: bool = False,
                 host_pool: HostBlockPool | None = None):
        groups = tuple(kv_cache_groups)
        if not groups:
            raise ValueError("kv_cache_groups=() holds no group")
        windows = []
        for i, g in enumerate(groups):
            spec = g.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                windows.append(spec.sliding_window)
            elif isinstance(spec, FullAttentionSpec):
                windows.append(None)
            else:
                raise ValueError(f"kv_cache_groups[{i}].kv_cache_spec={spec!r} is neither a FullAttentionSpec "
                                 "nor a SlidingWindowSpec")
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"kv_cache_groups have block sizes {sorted(sizes)}; one is supported")
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        (self.block_size,) = sizes
        self.sliding_windows: tuple[int | None, ...] = tuple(windows)
        self.num_groups = len(groups)
        super().__init__(num_blocks, enable_prefix_caching=enable_prefix_caching, host_pool=host_pool)
        (self.null_block,) = self.allocator.allocate(1)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Share of the usable blocks (all but the null block) held by live requests, 0..1."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def max_num_blocks(self, num_tokens: int, max_num_batched_tokens: int | None = None) -> int:
        """Most blocks one request of ``num_tokens`` tokens needs from the pool, all groups together (a
        sliding group: its window plus one step's tokens, as ``SlidingWindowSpec.max_memory_usage_bytes``),
        plus the null block (so that it compares with ``num_blocks``)."""
        step = num_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        total = 1
        for w in self.sliding_windows:
            full = cdiv(num_tokens, self.block_size)
            total += full if w is None else min(full, cdiv(min(w - 1 + step, num_tokens), self.block_size) + 1)
        return total

    def num_blocks_in_use(self, request: Request) -> list[int]:
        """Per group, the real (non-null) blocks ``request`` holds."""
        groups = request.group_block_ids or [[] for _ in range(self.num_groups)]
        return [sum(b != self.null_block for b in blocks) for blocks in groups]

    # -- prefix cache ----------------------------------------------------------------------------------
    def _lookup(self, g: int, h, use_host: bool = False) -> int | HostBlock | None:
        b = self.prefix_cache.get((g, h))
        if b is None and use_host:
            found = self.host_pool.match([(g, h)])
            if found:
                return HostBlock(found[0])
        return b

    def _full_hit(self, g: int, hashes: list, max_blocks: int, use_host: bool = False) -> list:
        blocks = []
        for h in hashes[:max_blocks]:
            b = self._lookup(g, h, use_host)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def _sliding_hit(self, g: int, hashes: list, max_blocks: int, use_host: bool = False) -> list:
        """vLLM ``SlidingWindowManager.find_longest_cache_hit``: rightmost run of
        ``cdiv(window - 1, block_size)`` cached blocks ending at most at ``max_blocks``; earlier blocks null."""
        need = cdiv(self.sliding_windows[g] - 1, self.block_size)
        blocks = [self.null_block] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            b = self._lookup(g, hashes[i], use_host)
            if b is None:
                run = 0
                continue
            blocks[i] = b
            run += 1
            if run >= need:
                return blocks[:i + run]
        return blocks[:run]  # a cached run from block 0 shorter than the window still counts

    def get_computed_blocks(self, request: Request, *, use_host: bool = False) -> tuple[list[list], int]:
        """Per group, the cached blocks (null where a window skips them) of the longest prefix every group
        can reuse, and its length in tokens. Only full blocks of ``all_token_ids[:-1]`` count (the last token
        is always computed). ``use_host``: blocks in the host prefix cache count as cached
        (:class:`jaxkv.core.host_kv_pool.HostBlock` entries). Takes no reference. vLLM:
        ``HybridKVCacheCoordinator.find_longest_cache_hit``."""
        if self.prefix_cache is None or request.skips_prefix_cache:
            return [], 0
        use_host = use_host and self.has_host_prefix_cache
        hashes = request.hashes_of_full_blocks(request.num_tokens - 1, self.block_size)
        length = len(hashes)
        while True:  # each group's hit is monotone in the length it may use: shrink to a fixed point
            hits = [self._full_hit(g, hashes, length, use_host) if w is None
                    else self._sliding_hit(g, hashes, length, use_host) for g, w in enumerate(self.sliding_windows)]
            new = min(len(h) for h in hits)
            if new == length:
                break
            length = new
        if length == 0:
            return [], 0
        return [h[:length] for h in hits], length * self.block_size

    def cache_blocks(self, request: Request) -> None:
        """Offer the request's newly computed full blocks of every group to the prefix cache, under
        ``(group, block hash)``; blocks a window already skipped (null) are not cached."""
        if self.prefix_cache is None or request.group_block_ids is None:
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = request.num_cached_blocks
        if full <= start:
            return
        hashes = request.hashes_of_full_blocks(full * self.block_size, self.block_size)
        for g, blocks in enumerate(request.group_block_ids):
            pairs = [((g, h), b) for h, b in zip(hashes[start:full], blocks[start:full]) if b != self.null_block]
            if not pairs:
                continue
            keys, real = zip(*pairs)
            self._cache(request, list(keys), list(real))
        request.num_cached_blocks = full

    def _release(self, request: Request, blocks: list[int]) -> None:
        """Give back blocks of ``request``: cached ones become evictable, the others free."""
        cached = [b for b in blocks if b in request.cached_block_ids]
        if cached:
            self.prefix_cache.release(cached)
            request.cached_block_ids.difference_update(cached)
        if cached:
            done = set(cached)
            blocks = [b for b in blocks if b not in done]
        plain = blocks
        if plain:
            self.allocator.free(plain)

    # -- allocation -----------------------------------------------------------------------------------
    def _groups_of(self, request: Request) -> list[list[int]]:
        if request.group_block_ids is None:
            request.group_block_ids = [[] for _ in range(self.num_groups)]
            request.block_ids = request.group_block_ids[0]
        return request.group_block_ids

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the sliding-window groups' blocks no query can see any more: those wholly before token
        ``num_computed_tokens - sliding_window + 1`` (the first key the next token attends to); they become
        the null block. vLLM: ``SlidingWindowManager.remove_skipped_blocks``."""
        groups = self._groups_of(request)
        for blocks, w in zip(groups, self.sliding_windows):
            if w is None:
                continue
            num_skipped = max(0, num_computed_tokens - w + 1) // self.block_size
            removed = []
            for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
                if blocks[i] == self.null_block:
                    break  # the earlier ones were replaced by an earlier call
                removed.append(blocks[i])
                blocks[i] = self.null_block
            if removed:
                self._release(request, removed)

    def _num_needed(self, request: Request, num_new_tokens: int, hits=()) -> int:
        """New device blocks: for the tokens after the hits in every group, and one per host hit."""
        groups = request.group_block_ids or [[] for _ in range(self.num_groups)]
        num_hit = len(hits[0]) if hits else 0
        total = cdiv(request.num_computed_tokens + num_hit * self.block_size + num_new_tokens, self.block_size)
        host = sum(isinstance(b, HostBlock) for blocks in hits for b in blocks)
        return host + sum(max(0, total - len(blocks) - num_hit) for blocks in groups)

    def _device_hits(self, hits) -> list[int]:
        return [b for blocks in hits for b in blocks if not isinstance(b, HostBlock) and b != self.null_block]

    def _available(self, hits=()) -> int:
        if self.prefix_cache is None:
            return self.allocator.num_free_blocks
        return self.allocator.num_free_blocks + self.prefix_cache.num_evictable_blocks_without(self._device_hits(hits))

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        groups = request.group_block_ids
        freeable = 0  # blocks remove_skipped_blocks would give back count as available
        for blocks, w in zip(groups or (), self.sliding_windows):
            if w is not None:
                skipped = max(0, request.num_computed_tokens - w + 1) // self.block_size
                freeable += sum(b != self.null_block for b in blocks[:skipped])
        need = self._num_needed(request, num_new_tokens, new_computed_blocks)
        return need <= self._available(new_computed_blocks) + freeable

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        """Blocks for ``num_new_tokens`` more tokens in every group, after freeing the sliding groups'
        blocks that fell out of the window; ``new_computed_blocks`` (per group, from
        :meth:`get_computed_blocks`) are taken first, with a reference. Returns ``False`` (no block taken)
        when too few are free (evictable cached blocks count as free). vLLM: ``KVCacheManager.allocate_slots``
        with the hybrid coordinator."""
        self._groups_of(request)
        self.remove_skipped_blocks(request, request.num_computed_tokens)
        need = self._num_needed(request, num_new_tokens, new_computed_blocks)
        if need > self._available(new_computed_blocks):
            return False
        if new_computed_blocks:
            if any(request.group_block_ids):
                raise ValueError(f"request {request.request_id!r} already holds blocks; new_computed_blocks "
                                 "are for a request being admitted")
            real = self._device_hits(new_computed_blocks)
            self.prefix_cache.acquire(real)
            hits = self._load_host_hits(request, new_computed_blocks)
            for mine, hit in zip(request.group_block_ids, hits):
                mine.extend(hit)
            request.cached_block_ids.update(real)
            request.num_cached_blocks = len(new_computed_blocks[0])
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if new_computed_blocks:
            total = cdiv(len(new_computed_blocks[0]) * self.block_size + num_new_tokens, self.block_size)
        pool = self.prefix_cache if self.prefix_cache is not None else self.allocator
        for blocks in request.group_block_ids:
            if total > len(blocks):
                blocks.extend(pool.allocate(total - len(blocks)))
        return True

    def free(self, request: Request) -> None:
        """Give back every real block of every group (last blocks first): cached ones become evictable, so
        a prefix outlives its tail (vLLM frees in reverse order); a swapped-out request's host blocks go
        back to the host pool."""
        self._free_host_blocks(request)
        request.pending_prefix = []  # a load that never landed: its blocks are plain, freed below
        for blocks in request.group_block_ids or ():
            real = [b for b in reversed(blocks) if b != self.null_block]
            if real:
                self._release(request, real)
        request.group_block_ids = None
        request.block_ids = []
        request.cached_block_ids = set()
        request.num_cached_blocks = 0

    # -- the host tier ---------------------------------------------------------------------------------
    def _load_host_hits(self, request: Request, hits: list[list]) -> list[list[int]]:
        """``hits`` with every host hit replaced by a new device block, filled from the host before the step
        (copies of this pass) and cached on the device under ``(group, block hash)``."""
        where = [(g, i, b.block_id) for g, blocks in enumerate(hits) for i, b in enumerate(blocks)
                 if isinstance(b, HostBlock)]
        if not where:
            return hits
        host = [h for *_, h in where]
        self.host_pool.lock(host)  # before allocating: an eviction it causes must not reuse them
        device = self.prefix_cache.allocate(len(where))
        self.host_pool.load(host, device)
        hashes = request.hashes_of_full_blocks(len(hits[0]) * self.block_size, self.block_size)
        out = [list(blocks) for blocks in hits]
        for (g, i, _), d in zip(where, device):
            out[g][i] = d
            self._register_loaded(request, [(g, hashes[i])], [d])
        first = min(i for _, i, _ in where)
        self.host_pool.num_host_prefix_hit_tokens += (len(hits[0]) - first) * self.block_size
        return out

    def _device_layout(self, request: Request) -> list[list[int | None]]:
        n = cdiv(request.num_computed_tokens, self.block_size)
        return [[None if b == self.null_block else b for b in blocks[:n]]
                for blocks in self._groups_of(request)]

    def _restore_layout(self, request: Request, layout: list[list[int | None]]) -> None:
        request.group_block_ids = [[self.null_block if b is None else b for b in blocks] for blocks in layout]
        request.block_ids = request.group_block_ids[0]
