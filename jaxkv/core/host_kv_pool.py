"""The host tier's bookkeeping: host blocks shared by swapped-out requests and a second-tier prefix cache.

vLLM: V0's CPU block allocator for ``swap_space`` (``BlockSpaceManager.swap_out`` / ``swap_in``, with the
scheduler's ``blocks_to_swap_out`` / ``blocks_to_swap_in``) and V1's CPU KV offloading
(``--kv-offloading-size``, ``LRUOffloadingManager``: evicted blocks kept in host memory under their block
hash). Host side only: this module decides which host block holds what and which copies a scheduling pass
needs; :mod:`jaxkv.worker.kv_offload` owns the host arrays and issues the copies.

A host block holds one device block's pages (all cache tensors, every layer; for a hybrid model a block of
any KV-cache group, as on the device, where the groups share one pool). Two kinds of owner:

* a **swapped-out request** owns its host blocks until it is swapped back in, finishes or is aborted;
* the **prefix cache** keeps full blocks under the key the device prefix cache used (the chained block hash),
  least recently used first out when a block is needed.

Ordering within one scheduling pass: the engine issues every device→host copy of the pass before every
host→device copy (so a device block freed by a swap-out and reused by a swap-in is read before it is
overwritten). A host block read by a host→device copy of the pass is *locked* until the pass ends: it is
neither evicted nor reused by a device→host copy of the same pass (which would run first).

Loads in flight (the engine's asynchronous host→device copies, :meth:`HostBlockPool.take_swap_ins`): the
host blocks a load reads are *held* from the pass that asked for it until the engine has read them
(:meth:`HostBlockPool.release`), across passes: not evicted, not reused, a free of them deferred.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Sequence

from jaxkv.core.block_pool import BlockAllocator


@dataclasses.dataclass(frozen=True, slots=True)
class HostBlock:
    """A prefix-cache hit held by the host tier, in a hit list beside device block ids: it needs a new device
    block, filled by a host → device copy before the step."""

    block_id: int


def has_host_blocks(hits) -> bool:
    """Whether a hit list (one group's, or one list per group) holds a :class:`HostBlock`."""
    return any(isinstance(b, HostBlock) or (isinstance(b, list) and has_host_blocks(b)) for b in hits)


class HostBlockPool:
    """``num_blocks`` host blocks: a free list, the host prefix cache (key → host block, LRU) and the
    copies the current scheduling pass asked for.

    Args:
        num_blocks: host blocks in the pool (``kv_offloading_size`` over the bytes of one block).

    Raises:
        ValueError: ``num_blocks < 1``.

    Attributes:
        blocks_to_swap_out: ``(device_block, host_block)`` copies of this pass (vLLM V0's name).
        blocks_to_swap_in: ``(host_block, device_block)`` copies of this pass.
        num_swaps_out, num_swaps_in: requests swapped out / in so far.
        num_blocks_swapped_out, num_blocks_swapped_in: their blocks.
        num_blocks_offloaded: blocks evicted from the device prefix cache and written here.
        num_host_prefix_hit_blocks: host prefix-cache blocks copied back for a request.
        num_host_prefix_hit_tokens: prompt tokens those hits served (a hybrid model's groups share them).
        num_host_evictions: host prefix-cache blocks dropped to make room.
    """

    def __init__(self, num_blocks: int):
        self.allocator = BlockAllocator(num_blocks)
        self._block_of: dict[Hashable, int] = {}             # prefix key → host block
        self._key_of: dict[int, Hashable] = {}               # host block → prefix key
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # prefix blocks, LRU first
        self._locked: set[int] = set()                       # read by a host→device copy of this pass
        self._held: collections.Counter[int] = collections.Counter()  # read by loads in flight (any pass)
        self._deferred: set[int] = set()                     # freed while locked or held: free once neither
        self._device_targets: set[int] = set()               # device blocks written by this pass's swap-ins
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []
        self.num_swaps_out = self.num_swaps_in = 0
        self.num_blocks_swapped_out = self.num_blocks_swapped_in = 0
        self.num_blocks_offloaded = self.num_host_prefix_hit_blocks = self.num_host_evictions = 0
        self.num_host_prefix_hit_tokens = 0

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: free ones plus unlocked prefix-cache blocks."""
        return self.allocator.num_free_blocks + sum(1 for b in self._lru if not self._pinned(b))

    @property
    def num_held_blocks(self) -> int:
        """Host blocks read by loads in flight (:meth:`hold`)."""
        return len(self._held)

    def _pinned(self, block: int) -> bool:
        return block in self._locked or block in self._held

    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def usage(self) -> float:
        """Share of host blocks holding data (swapped-out requests' or the prefix cache's), 0..1."""
        return 1.0 - self.allocator.num_free_blocks / self.num_blocks

    # -- allocation -------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` host blocks, evicting least recently used prefix-cache blocks (not locked ones) when the
        free list is short; ``None`` (nothing taken, nothing evicted) when even that is not enough."""
        short = n - self.allocator.num_free_blocks
        if short > 0:
            victims = [b for b in self._lru if not self._pinned(b)][:short]
            if len(victims) < short:
                return None
            for b in victims:
                self._forget(b)
                self.allocator.free([b])
            self.num_host_evictions += len(victims)
        return self.allocator.allocate(n)

    def free(self, blocks: Sequence[int]) -> None:
        """Give host blocks back (a locked or held one once the copy that reads it has: the pass end,
        :meth:`release`)."""
        for b in blocks:
            if self._pinned(b):
                self._deferred.add(b)
            else:
                self.allocator.free([b])

    def _forget(self, block: int) -> None:
        del self._block_of[self._key_of.pop(block)]
        del self._lru[block]

    # -- the prefix cache ----------------------------------------------------------------------------------
    def match(self, keys: Sequence[Hashable]) -> list[int]:
        """Host blocks of the longest prefix of ``keys`` cached here (no lock taken, LRU unchanged)."""
        blocks = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def offload(self, key: Hashable, device_block: int) -> bool:
        """A full device block leaves the device prefix cache: keep it here under ``key`` (a device→host
        copy of this pass), or refresh its LRU position when the key is here already. Returns ``False``
        when no host block can be had (the block is then dropped)."""
        b = self._block_of.get(key)
        if b is not None:
            self._lru.move_to_end(b)
            return True
        got = self.allocate(1)
        if got is None:
            return False
        (b,) = got
        self._copy_out(device_block, b)
        self._block_of[key], self._key_of[b] = b, key
        self._lru[b] = None
        self.num_blocks_offloaded += 1
        return True

    def load(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copy prefix-cache hits back to the device (host→device copies of this pass); the host blocks
        stay cached (most recently used now)."""
        self.lock(host_blocks)
        for h, d in zip(host_blocks, device_blocks, strict=True):
            self._copy_in(h, d)
            self._lru.move_to_end(h)
        self.num_host_prefix_hit_blocks += len(host_blocks)

    # -- swapping -----------------------------------------------------------------------------------------
    def swap_out(self, device_blocks: Sequence[int]) -> list[int] | None:
        """Host blocks for a preempted request's ``device_blocks`` and their device→host copies; ``None``
        (nothing changed) when the pool cannot hold them even after evicting prefix-cache blocks."""
        host = self.allocate(len(device_blocks))
        if host is None:
            return None
        for d, h in zip(device_blocks, host):
            self._copy_out(d, h)
        self.num_swaps_out += 1
        self.num_blocks_swapped_out += len(host)
        return host

    def swap_in(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Host→device copies of a resumed request's blocks; the host blocks are freed once read."""
        self.lock(host_blocks)
        for h, d in zip(host_blocks, device_blocks, strict=True):
            self._copy_in(h, d)
        self.free(host_blocks)
        self.num_swaps_in += 1
        self.num_blocks_swapped_in += len(host_blocks)

    def reset_prefix_cache(self) -> None:
        """Forget every host prefix-cache block (vLLM ``reset_prefix_cache``); swapped-out blocks stay."""
        blocks = list(self._lru)
        for b in blocks:
            self._forget(b)
        self.free(blocks)

    # -- the pass -----------------------------------------------------------------------------------------
    def lock(self, host_blocks: Sequence[int]) -> None:
        """Keep ``host_blocks`` from eviction and reuse until :meth:`end_pass`."""
        self._locked.update(host_blocks)

    def take_swap_ins(self) -> list[tuple[int, int]]:
        """The host→device copies asked for since the last call (one request's: its swap-in or host
        prefix hits), for a load the engine runs outside the pass: they leave :attr:`blocks_to_swap_in`,
        and their host blocks are held (:meth:`hold`) until :meth:`release`."""
        pairs, self.blocks_to_swap_in = self.blocks_to_swap_in, []
        self.hold([h for h, _ in pairs])
        return pairs

    def hold(self, host_blocks: Sequence[int]) -> None:
        """Keep ``host_blocks`` from eviction and reuse, across passes, until :meth:`release` (once per hold)."""
        self._held.update(host_blocks)

    def release(self, host_blocks: Sequence[int]) -> None:
        """End a :meth:`hold`: the load has read the blocks; a block freed meanwhile is freed now."""
        for b in host_blocks:
            self._held[b] -= 1
            if self._held[b] <= 0:
                del self._held[b]
                if b in self._deferred and b not in self._locked:
                    self._deferred.discard(b)
                    self.allocator.free([b])

    def _copy_out(self, device_block: int, host_block: int) -> None:
        if device_block in self._device_targets:  # it would be read before this pass's swap-in writes it
            raise RuntimeError(f"device block {device_block} is copied out after a copy into it in one pass")
        self.blocks_to_swap_out.append((device_block, host_block))

    def _copy_in(self, host_block: int, device_block: int) -> None:
        self._device_targets.add(device_block)
        self.blocks_to_swap_in.append((host_block, device_block))

    def end_pass(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The pass's ``(blocks_to_swap_out, blocks_to_swap_in)``, handed to the engine (which issues all
        swap-outs, then all swap-ins, before the step); locks are dropped and deferred frees done. A host
        block written twice in the pass keeps only its last copy."""
        # a host block written twice in one pass (offloaded, evicted and reused): the last write is the one
        # that counts (one scatter cannot order them)
        out = list({h: (d, h) for d, h in self.blocks_to_swap_out}.values())
        into = self.blocks_to_swap_in
        self.blocks_to_swap_out, self.blocks_to_swap_in = [], []
        self._locked.clear()
        self._device_targets.clear()
        ready = sorted(b for b in self._deferred if b not in self._held)
        if ready:
            self._deferred.difference_update(ready)
            self.allocator.free(ready)
        return out, into
