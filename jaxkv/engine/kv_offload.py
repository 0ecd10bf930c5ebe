"""The host tier's memory and copies: host blocks with the device cache's layout, block copies both ways.

vLLM: V0's ``CacheEngine`` CPU cache (``swap_space``) and ``swap_in`` / ``swap_out``; V1's CPU offloading
worker (``--kv-offloading-size``). The bookkeeping (which host block holds what, which copies a pass needs)
is :class:`jaxkv.core.host_kv_pool.HostBlockPool`; this module owns the arrays and issues the copies.

One NumPy array per device cache tensor, ``[2, num_host_blocks, num_kv_heads, block_size, head_size]`` (for a
hybrid model the tensors the KV-cache groups share, so a host block holds a block of any group, as on the
device). The copies:

* **device → host**: one jitted gather of the blocks into a small new device array, whose transfer to the
  host starts at once (``copy_to_host_async``: on a GPU the copy engine moves it while the next steps run);
  the host writes the arrived blocks into the pool after the next step's tokens are fetched
  (:meth:`KVOffloader.poll`), or at once when a host → device copy reads one of them.
* **host → device**: the blocks gathered on the host (NumPy) into staging buffers reused from call to call
  (a fresh buffer costs its page faults: 3x the gather on the CPU machine), moved to the device, then one
  jitted scatter takes the caches donated (updated in place) and writes them.

Host work runs on a thread pool, one task per cache tensor (a layer's K and V): NumPy's gathers and scatters
and JAX's transfers release the GIL, so the tensors' copies run side by side on the host's cores and their
transfers overlap (session 17 on an H200: one thread gathering 30 layers' blocks and transferring them from
pageable memory was 25 s of a 59 s multi-turn run).

Ordering: every copy is dispatched between two model steps, in program order with them: the gather reads the
caches the steps before it wrote, and the step after it, which takes the caches donated, runs once the
gather has read them; the scatter is an input of the step after it. The engine issues a pass's device →
host copies before its host → device copies (:mod:`jaxkv.core.host_kv_pool`). A pass's pairs go in chunks
of power-of-two sizes (its count in binary; the last chunk padded to :data:`MIN_PAIRS`), so each copy program
compiles once per size and at most ``MIN_PAIRS - 1`` padding blocks are moved.

Why not JAX's ``pinned_host`` memory kind (:func:`jaxkv.swap.swap_blocks` supports it): a program that
moves data between memory kinds places its outputs (JAX marks them *committed*), and the engine's step
programs, compiled for uncommitted caches, then compile again for committed ones (seen on CPU with JAX
0.12); such a program also runs on the compute stream, so the step after it waits for the copy. The gather
+ asynchronous transfer above leaves the caches as they were and puts the copy on the transfer stream.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

MIN_PAIRS = 16


def chunks(n: int) -> list[tuple[int, int, int]]:
    """``(start, count, size)`` pieces of ``n`` pairs: power-of-two ``size`` s down the binary digits of ``n``,
    the rest (fewer than :data:`MIN_PAIRS`) in one piece padded to ``MIN_PAIRS``."""
    out, start = [], 0
    while n - start >= MIN_PAIRS:
        size = 1 << ((n - start).bit_length() - 1)
        out.append((start, size, size))
        start += size
    if start < n:
        out.append((start, n - start, MIN_PAIRS))
    return out


def bytes_per_block(kv_caches) -> int:
    """Bytes of one block in every cache tensor (K and V, all layers sharing the tensors)."""
    return sum(int(c.size) // int(c.shape[1]) * c.dtype.itemsize for c in kv_caches)


def num_host_blocks_for(kv_offloading_size: float, kv_caches) -> int:
    """Host blocks that fit ``kv_offloading_size`` GiB (vLLM's unit), rounded down.

    Raises:
        ValueError: a size that is not a finite number > 0, or one that holds no block (names both).
    """
    if (isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, (int, float))
            or not math.isfinite(kv_offloading_size) or kv_offloading_size <= 0):
        raise ValueError(f"kv_offloading_size={kv_offloading_size!r} must be a finite number of GiB > 0")
    per_block = bytes_per_block(kv_caches)
    n = int(kv_offloading_size * 2**30) // per_block
    if n < 1:
        raise ValueError(f"kv_offloading_size={kv_offloading_size} GiB holds no block of {per_block} bytes")
    return n


@jax.jit
def _gather(caches, ids):
    """``int32[n]`` blocks of every cache (block axis 1) as new arrays ``[2, n, ...]``."""
    return [jnp.take(c, ids, axis=1) for c in caches]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(caches, ids, blocks):
    """``caches[:, ids[i]] = blocks[:, i]``; ids out of range (padding) write nothing."""
    return [c.at[:, ids].set(b.astype(c.dtype), mode="drop") for c, b in zip(caches, blocks)]


class KVOffloader:
    """Host blocks with the device caches' layout and the copies between them.

    Args:
        kv_caches: the engine's device caches, ``dtype[2, num_blocks, num_kv_heads, block_size, head_size]``
            per cache tensor (single device; not kept: every call takes the current ones).
        num_host_blocks: blocks of the host pool.
        num_threads: host threads for the copies (default: one per tensor, at most the CPU count and 16).

    Attributes:
        host_caches: the host arrays, ``dtype[2, num_host_blocks, num_kv_heads, block_size, head_size]``.
        bytes_to_host, bytes_to_device: bytes of the blocks copied so far (padding not counted).
        copy_s: host seconds spent issuing copies, writing arrived blocks into the pool and waiting for them.

    Raises:
        ValueError: ``num_host_blocks < 1``, caches spread over several devices.
    """

    def __init__(self, kv_caches, num_host_blocks: int, num_threads: int | None = None):
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks={num_host_blocks} must be >= 1")
        if any(len(c.sharding.device_set) != 1 for c in kv_caches):
            raise ValueError("the host tier needs single-device caches (no tensor / data parallelism yet)")
        device = next(iter(kv_caches[0].sharding.device_set))
        # a CPU "device" may alias a NumPy buffer it was given (zero-copy): staging is reused elsewhere only
        self._reuse_staging = device.platform != "cpu"
        self._staging: dict[int, list[np.ndarray]] = {}  # chunk size -> one buffer per tensor
        n = num_threads or min(len(kv_caches), os.cpu_count() or 1, 16)
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, n), thread_name_prefix="kv-offload")
        self.num_host_blocks = num_host_blocks
        self.num_device_blocks = int(kv_caches[0].shape[1])
        self.block_bytes = bytes_per_block(kv_caches)
        shape = (kv_caches[0].shape[0], num_host_blocks, *kv_caches[0].shape[2:])
        self.host_caches = [np.zeros(shape, c.dtype) for c in kv_caches]
        self._pending: list[tuple[list[jax.Array], np.ndarray]] = []  # device → host copies on their way
        self.bytes_to_host = self.bytes_to_device = 0
        self.copy_s = 0.0

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds."""
        return sum(h.nbytes for h in self.host_caches)

    def swap_out(self, kv_caches, pairs) -> None:
        """Copy device blocks to host blocks: ``pairs`` ``[(device_block, host_block), ...]`` (host blocks
        distinct). The caches are only read."""
        if not len(pairs):
            return
        t = time.perf_counter()
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        caches = list(kv_caches)
        for start, count, size in chunks(len(pairs)):
            ids = np.zeros(size, np.int32)
            ids[:count] = pairs[start:start + count, 0]
            blocks = _gather(caches, ids)
            for b in blocks:
                b.copy_to_host_async()
            self._pending.append((blocks, pairs[start:start + count, 1].copy()))
        self.bytes_to_host += len(pairs) * self.block_bytes
        self.copy_s += time.perf_counter() - t

    def swap_in(self, kv_caches, pairs):
        """Copy host blocks to device blocks: ``pairs`` ``[(host_block, device_block), ...]`` (device blocks
        distinct); returns the new device caches (the given ones are donated)."""
        if not len(pairs):
            return kv_caches
        t = time.perf_counter()
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        self._flush(pairs[:, 0])
        out = list(kv_caches)
        for start, count, size in chunks(len(pairs)):
            host_ids = np.zeros(size, np.int32)
            host_ids[:count] = pairs[start:start + count, 0]
            dev_ids = np.full(size, self.num_device_blocks, np.int32)  # padding: out of range, dropped
            dev_ids[:count] = pairs[start:start + count, 1]
            blocks = list(self._pool.map(functools.partial(self._load, host_ids), range(len(self.host_caches))))
            out = _scatter(out, dev_ids, blocks)
        self.bytes_to_device += len(pairs) * self.block_bytes
        self.copy_s += time.perf_counter() - t
        return out

    def _load(self, host_ids: np.ndarray, i: int) -> jax.Array:
        """Tensor ``i``'s host blocks ``host_ids`` on the device (a worker thread). Staging buffers are reused
        once the transfer that read them has completed (waited for here, off the engine's thread)."""
        h, size = self.host_caches[i], len(host_ids)
        if self._reuse_staging:
            bufs = self._staging.setdefault(size, [None] * len(self.host_caches))
            if bufs[i] is None:
                bufs[i] = np.empty((h.shape[0], size, *h.shape[2:]), h.dtype)
            on_device = jax.device_put(np.take(h, host_ids, axis=1, out=bufs[i]))
            on_device.block_until_ready()  # the buffer is free for the next call
            return on_device
        return jax.device_put(np.take(h, host_ids, axis=1))

    def poll(self) -> None:
        """Write the device → host copies that have arrived into the pool (oldest first)."""
        if self._pending and all(b.is_ready() for b in self._pending[0][0]):
            t = time.perf_counter()
            while self._pending and all(b.is_ready() for b in self._pending[0][0]):
                self._write(*self._pending.pop(0))
            self.copy_s += time.perf_counter() - t

    def _flush(self, host_ids=None) -> None:
        """Write pending device → host copies in order: all, or up to the last one into ``host_ids``."""
        last = len(self._pending) - 1
        if host_ids is not None:
            wanted = set(np.asarray(host_ids).tolist())
            last = max((i for i, (_, ids) in enumerate(self._pending) if not wanted.isdisjoint(ids.tolist())),
                       default=-1)
        for _ in range(last + 1):
            self._write(*self._pending.pop(0))

    def _write(self, blocks, host_ids) -> None:
        n = len(host_ids)

        def write(i):
            self.host_caches[i][:, host_ids] = np.asarray(blocks[i])[:, :n]

        list(self._pool.map(write, range(len(blocks))))

    def host_block(self, block: int) -> list[np.ndarray]:
        """One host block of every tensor, ``[2, num_kv_heads, block_size, head_size]`` each (tests)."""
        self._flush()
        return [h[:, block].copy() for h in self.host_caches]

    def warmup(self, kv_caches):
        """Compile the copy programs of every chunk size up to the device's block count (the most blocks one
        pass can copy), with copies that write nothing; returns the device caches."""
        size = MIN_PAIRS
        while True:
            jax.block_until_ready(_gather(list(kv_caches), np.zeros(size, np.int32)))
            kv_caches = _scatter(list(kv_caches), np.full(size, self.num_device_blocks, np.int32),
                                 [np.zeros((h.shape[0], size, *h.shape[2:]), h.dtype) for h in self.host_caches])
            size *= 2
            if size > self.num_device_blocks:
                return kv_caches
