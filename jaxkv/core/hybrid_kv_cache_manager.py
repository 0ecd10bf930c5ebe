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

Prefix caching is not supported for hybrid groups yet (vLLM matches a hit per group, right to left for
sliding windows); the engine logs that it is disabled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jaxkv.block_allocator import BlockAllocator
from jaxkv.core.request import Request
from jaxkv.spec import FullAttentionSpec, SlidingWindowSpec

log = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HybridKVCacheManager:
    """The blocks of every live request, one block list per KV-cache group (``request.group_block_ids``).

    Same interface as :class:`jaxkv.core.KVCacheManager`; ``request.block_ids`` is the first group's list
    (what the scheduler checks for "holds blocks").

    Args:
        kv_cache_groups: the groups (``KVCacheConfig.kv_cache_groups``); each spec a
            :class:`jaxkv.FullAttentionSpec` (a ``sliding_window`` recorded on it only limits compute) or a
            :class:`jaxkv.SlidingWindowSpec`, all with one block size.
        num_blocks: blocks in the pool (``KVCacheConfig.num_blocks``), the null block included.
        enable_prefix_caching: must be ``False`` (or is turned off with a log line).

    Raises:
        ValueError: no group, a spec of another type, different block sizes, ``num_blocks < 2``.
    """

    def __init__(self, kv_cache_groups: Sequence, num_blocks: int, *, enable_prefix_caching: bool = False):
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
        if enable_prefix_caching:
            log.info("prefix caching is disabled: not supported for hybrid KV-cache groups "
                     "(sliding window + full attention) yet")
        (self.block_size,) = sizes
        self.sliding_windows: tuple[int | None, ...] = tuple(windows)
        self.num_groups = len(groups)
        self.allocator = BlockAllocator(num_blocks)
        (self.null_block,) = self.allocator.allocate(1)
        self.prefix_cache = None
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of the usable blocks (all but the null block) held by live requests, 0..1."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return 0.0

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

    # -- prefix cache (off) -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        return [], 0

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens

    def cache_blocks(self, request: Request) -> None:
        return None

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
                self.allocator.free(removed)

    def _num_needed(self, request: Request, num_new_tokens: int) -> int:
        groups = self._groups_of(request)
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return sum(max(0, total - len(blocks)) for blocks in groups)

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        if new_computed_blocks:
            raise ValueError("new_computed_blocks: prefix caching is off for hybrid KV-cache groups")
        groups = request.group_block_ids
        if groups is None:
            return cdiv(num_new_tokens, self.block_size) * self.num_groups <= self.num_free_blocks
        # blocks remove_skipped_blocks would free count as free
        freeable = 0
        for blocks, w in zip(groups, self.sliding_windows):
            if w is not None:
                skipped = max(0, request.num_computed_tokens - w + 1) // self.block_size
                freeable += sum(b != self.null_block for b in blocks[:skipped])
        return self._num_needed(request, num_new_tokens) <= self.num_free_blocks + freeable

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks=()) -> bool:
        """Blocks for ``num_new_tokens`` more tokens in every group, after freeing the sliding groups'
        blocks that fell out of the window. Returns ``False`` (no block taken) when too few are free.
        vLLM: ``KVCacheManager.allocate_slots`` with the hybrid coordinator."""
        if new_computed_blocks:
            raise ValueError("new_computed_blocks: prefix caching is off for hybrid KV-cache groups")
        self.remove_skipped_blocks(request, request.num_computed_tokens)
        if self._num_needed(request, num_new_tokens) > self.num_free_blocks:
            return False
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        for blocks in request.group_block_ids:
            if total > len(blocks):
                blocks.extend(self.allocator.allocate(total - len(blocks)))
        return True

    def free(self, request: Request) -> None:
        """Give back every real block of every group (last blocks first)."""
        for blocks in request.group_block_ids or ():
            real = [b for b in reversed(blocks) if b != self.null_block]
            if real:
                self.allocator.free(real)
        request.group_block_ids = None
        request.block_ids = []
        request.cached_block_ids = set()
        request.num_cached_blocks = 0
