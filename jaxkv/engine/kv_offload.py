"""The host tier's memory and copies: host blocks with the device cache's layout, block copies both ways.

vLLM: V0's ``CacheEngine`` CPU cache (``swap_space``, pinned) and ``swap_in`` / ``swap_out``; V1's CPU
offloading worker (``--kv-offloading-size``). The bookkeeping (which host block holds what, which copies a
pass needs) is :class:`jaxkv.core.host_kv_pool.HostBlockPool`; this module owns the arrays.

One host array per device cache tensor, ``[2, num_host_blocks, num_kv_heads, block_size, head_size]`` (for a
hybrid model the tensors shared by the KV-cache groups, so a host block holds a block of any group, as on
the device). Two implementations, chosen once per process by :func:`jaxkv.swap.host_memory_kind`:

* **memory kinds** (``"pinned_host"``): the host arrays are ``jax.Array`` s in pinned host memory; a copy
  is one jitted program (:func:`jaxkv.swap.swap_blocks_padded_donated`: gather in the source memory, move
  only the selected blocks, scatter into the destination, which is donated: updated in place). Device to
  host reads the device caches; host to device consumes them and returns the new ones.
* **NumPy** (no memory kinds): device to host is a jitted gather of the blocks, whose transfer to the host
  starts at once (``copy_to_host_async``) and is written into the NumPy arrays later (before any host to
  device copy, and after each step: :meth:`KVOffloader.poll`); host to device gathers on the host and
  scatters on the device (caches donated).

Ordering: every copy is dispatched between two model steps, in program order with them (JAX runs the
programs of one device in dispatch order where they share buffers: a copy out of the caches reads what the
steps before it wrote, and the step after it, which takes the caches donated, starts once the copy has read
them). The engine issues a pass's device-to-host copies before its host-to-device copies. Pair counts are
padded to powers of two (at least :data:`MIN_PAIRS`), so the copy programs compile once per size.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.swap import allocate_host_kv_cache, host_memory_kind, swap_blocks_padded_donated

MIN_PAIRS = 4


def _padded(n: int) -> int:
    return max(MIN_PAIRS, 1 << max(0, n - 1).bit_length())


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


@functools.partial(jax.jit, static_argnames="block_axis")
def _gather(caches, ids, block_axis=1):
    return [jnp.take(c, ids, axis=block_axis) for c in caches]


@functools.partial(jax.jit, donate_argnums=0, static_argnames="block_axis")
def _scatter(caches, ids, blocks, block_axis=1):
    return [c.at[(slice(None),) * block_axis + (ids,)].set(b.astype(c.dtype), mode="drop")
            for c, b in zip(caches, blocks)]


class KVOffloader:
    """Host blocks with the device caches' layout and the copies between them.

    Args:
        kv_caches: the engine's device caches, ``dtype[2, num_blocks, num_kv_heads, block_size, head_size]``
            per cache tensor (single device; not kept: every call takes the current ones).
        num_host_blocks: blocks of the host pool.
        memory_kind: ``"pinned_host"``, ``None`` (NumPy host arrays) or ``"auto"``
            (:func:`jaxkv.swap.host_memory_kind`).

    Attributes:
        host_caches: the host arrays, ``dtype[2, num_host_blocks, num_kv_heads, block_size, head_size]``.
        bytes_to_host, bytes_to_device: bytes of the blocks copied so far (padding not counted).
        copy_s: host seconds spent issuing copies (and, NumPy path, waiting for device-to-host data).

    Raises:
        ValueError: ``num_host_blocks < 1``, caches on several devices, an unknown ``memory_kind``.
    """

    def __init__(self, kv_caches, num_host_blocks: int, *, memory_kind: str | None = "auto"):
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks={num_host_blocks} must be >= 1")
        if any(len(c.sharding.device_set) != 1 for c in kv_caches):
            raise ValueError("the host tier needs single-device caches (no tensor / data parallelism yet)")
        if memory_kind == "auto":
            memory_kind = host_memory_kind()
        if memory_kind not in (None, "pinned_host"):
            raise ValueError(f"memory_kind={memory_kind!r} is not one of 'auto', 'pinned_host', None")
        self.memory_kind = memory_kind
        self.num_host_blocks = num_host_blocks
        self.num_device_blocks = int(kv_caches[0].shape[1])
        self.block_bytes = bytes_per_block(kv_caches)
        shape = (kv_caches[0].shape[0], num_host_blocks, *kv_caches[0].shape[2:])
        if memory_kind is None:
            self.host_caches = [np.zeros(shape, c.dtype) for c in kv_caches]
        else:
            self.host_caches = [allocate_host_kv_cache(shape, c.dtype) for c in kv_caches]
        self._pending: list[tuple[list[jax.Array], np.ndarray]] = []  # NumPy path: copies on their way
        self.bytes_to_host = self.bytes_to_device = 0
        self.copy_s = 0.0

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds."""
        return sum(int(h.size) * h.dtype.itemsize for h in self.host_caches)

    # -- copies ---------------------------------------------------------------------------------------
    def swap_out(self, kv_caches, pairs) -> None:
        """Copy device blocks to host blocks: ``pairs`` ``[(device_block, host_block), ...]``."""
        if not len(pairs):
            return
        t = time.perf_counter()
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        size = _padded(len(pairs))
        if self.memory_kind is not None:
            self.host_caches = swap_blocks_padded_donated(list(kv_caches), self.host_caches, pairs, size)
        else:
            ids = np.zeros(size, np.int32)
            ids[:len(pairs)] = pairs[:, 0]
            blocks = _gather(list(kv_caches), jnp.asarray(ids))
            for b in blocks:
                b.copy_to_host_async()
            self._pending.append((blocks, pairs[:, 1].copy()))
        self.bytes_to_host += len(pairs) * self.block_bytes
        self.copy_s += time.perf_counter() - t

    def swap_in(self, kv_caches, pairs):
        """Copy host blocks to device blocks: ``pairs`` ``[(host_block, device_block), ...]``; returns the
        new device caches (the given ones are donated)."""
        if not len(pairs):
            return kv_caches
        t = time.perf_counter()
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        size = _padded(len(pairs))
        if self.memory_kind is not None:
            out = swap_blocks_padded_donated(self.host_caches, list(kv_caches), pairs, size)
        else:
            self._flush()
            host_ids = np.zeros(size, np.int32)
            host_ids[:len(pairs)] = pairs[:, 0]
            dev_ids = np.full(size, self.num_device_blocks, np.int32)  # padding: dropped
            dev_ids[:len(pairs)] = pairs[:, 1]
            blocks = [np.take(h, host_ids, axis=1) for h in self.host_caches]
            out = _scatter(list(kv_caches), jnp.asarray(dev_ids), blocks)
        self.bytes_to_device += len(pairs) * self.block_bytes
        self.copy_s += time.perf_counter() - t
        return out

    def poll(self) -> None:
        """NumPy path: write the device-to-host copies that have arrived into the host arrays."""
        if self._pending and all(b.is_ready() for b in self._pending[0][0]):
            t = time.perf_counter()
            while self._pending and all(b.is_ready() for b in self._pending[0][0]):
                self._write(*self._pending.pop(0))
            self.copy_s += time.perf_counter() - t

    def _flush(self) -> None:
        while self._pending:
            self._write(*self._pending.pop(0))

    def _write(self, blocks, host_ids) -> None:
        n = len(host_ids)
        for h, b in zip(self.host_caches, blocks):
            h[:, host_ids] = np.asarray(b)[:, :n]

    def host_block(self, block: int) -> list[np.ndarray]:
        """One host block of every tensor as NumPy (``[2, num_kv_heads, block_size, head_size]``; tests)."""
        self._flush()
        return [np.asarray(h[:, block]) for h in self.host_caches]

    def warmup(self, kv_caches):
        """Compile the copy programs of every padded size up to the device's block count, with pairs that
        write nothing; returns the device caches (donated through the host-to-device programs)."""
        none = np.zeros((0, 2), np.int32)
        size = MIN_PAIRS
        while True:
            if self.memory_kind is not None:
                self.host_caches = swap_blocks_padded_donated(list(kv_caches), self.host_caches, none, size)
                kv_caches = swap_blocks_padded_donated(self.host_caches, list(kv_caches), none, size)
            else:
                jax.block_until_ready(_gather(list(kv_caches), jnp.zeros(size, jnp.int32)))
                kv_caches = _scatter(list(kv_caches), jnp.full(size, self.num_device_blocks, jnp.int32),
                                     [np.zeros((h.shape[0], size, *h.shape[2:]), h.dtype) for h in self.host_caches])
            if size >= self.num_device_blocks:
                return kv_caches
            size *= 2
