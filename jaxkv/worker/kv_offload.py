"""The host tier's memory and copies: host blocks with the device cache's layout, block copies both ways.

vLLM: V0's ``CacheEngine`` CPU cache (``swap_space``) and ``swap_in`` / ``swap_out``; V1's CPU offloading
worker (``--kv-offloading-size``). The bookkeeping (which host block holds what, which copies a pass needs)
is :class:`jaxkv.core.host_kv_pool.HostBlockPool`; this module owns the arrays and issues the copies.

The device cache tensors (a layer's K and V each; for a hybrid model the tensors the KV-cache groups share,
so a host block holds a block of any group, as on the device) are grouped by shape and dtype, and each
*tensor group* has one NumPy array ``[tensors, 2, num_host_blocks, num_kv_heads, block_size, head_size]``, so
a copy of ``n`` blocks is **one transfer per tensor group** (one for a dense model), not one per layer. The
copies:

* **device → host**: one jitted gather stacks the blocks of every tensor of a group into a new device array
  ``[tensors, 2, n, ...]``. With pinned staging a writer thread moves it into a fresh ``pinned_host`` array
  (one DMA) and scatters its blocks into the pool, in order, while the engine thread goes on; without, its
  transfer to pageable memory starts at once (``copy_to_host_async``) and the writer scatters it once it has
  arrived (:meth:`KVOffloader.poll`, after each step's tokens are fetched). A host → device copy first waits
  for the writes of the blocks it reads.
* **host → device**, as a *load* the engine runs beside its steps (:meth:`KVOffloader.start_load`): a loader
  thread waits for the pool writes the blocks need, gathers them and starts the transfer; the request waits
  (``WAITING_FOR_REMOTE_KVS``) while the others step, and once the blocks are on the device the engine thread
  dispatches the scatter into the caches before its next step (:meth:`KVOffloader.finish_load`). The copy:
  the blocks gathered on the host (``np.take``, split by tensors over the copy threads) into a staging buffer
  of the group, moved to the device in one ``device_put``; then one jitted scatter takes the caches donated
  (updated in place) and writes them. Staging buffers are kept per (group, size), two of each, up to
  :data:`STAGING_BYTES` in all, and a buffer is reused once the transfer that read it has completed (a fresh
  buffer costs its page faults: 3x the gather on the CPU machine).
* **pinned staging** (:func:`pinned_sharding`, where the device has ``pinned_host`` memory and the path passes
  its check): staging buffers are ``pinned_host`` arrays that NumPy writes and reads through
  :func:`host_view`; a transfer from or to them is one DMA (H200 host, 90 MiB: 37 GB/s to the device against
  5.3 GB/s from pageable memory; 32 GB/s back against 1.4 GB/s). Loaded arrays are re-wrapped uncommitted
  (:func:`_uncommitted`), so the caches the scatter returns stay uncommitted and no step program compiles again.

Session 17 (H200, multi-turn SmolLM2, 30 layers): a transfer per layer per copy ran at about 1 GB/s, 53 ms
for each host -> device pass (11 s of a 28 s run under cProfile); hence one transfer per group. Session 19:
the loader and writer threads moved ~1 GB/s on the H200 host, and the CPU machine showed why: a gather split
into a NumPy call per tensor (30 for SmolLM2) ran at 0.18 GB/s beside a busy Python thread against 2.2 GB/s
alone, since each call gives up the GIL and waits up to the switch interval to get it back; one call per
group ran at 1.1-1.9 GB/s beside it. Hence one NumPy call per group and copy, on the blocks' bytes.

Ordering: every copy is dispatched between two model steps, in program order with them: the gather reads the
caches the steps before it wrote, and the step after it, which takes the caches donated, runs once the
gather has read them; the scatter is an input of the step after it. The engine issues a pass's device →
host copies before its host → device copies (:mod:`jaxkv.core.host_kv_pool`). A pass's pairs go in chunks
of power-of-two sizes (its count in binary; the last chunk padded to :data:`MIN_PAIRS`), so each copy program
compiles once per size and at most ``MIN_PAIRS - 1`` padding blocks are moved.

Why not a program that reads or writes JAX's ``pinned_host`` memory kind (:func:`jaxkv.vllm_parity.swap.swap_blocks`
supports it): a program that moves data between memory kinds places its outputs (JAX marks them *committed*), and the engine's step
programs, compiled for uncommitted caches, then compile again for committed ones (seen on CPU with JAX
0.12); such a program also runs on the compute stream, so the step after it waits for the copy. The gather
+ a ``device_put`` from or to pinned staging leaves the caches as they were and puts the copy on a transfer
stream.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

MIN_PAIRS = 16
_RING = 2  # staging buffers per (tensor group, size)
STAGING_BYTES = 2 << 30  # host memory kept for reused staging buffers, beyond the pool; larger passes get fresh ones
# (2 GiB: two buffers of a 256-block chunk of an 8B-shaped model, 2 MiB a block)
PARALLEL_BYTES = 4 << 20  # start-up fills of at least this many bytes are split over the thread pool (per tensor)


_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # item size -> unsigned integer of that size


def _raw(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes as unsigned integers of its item size (a view). The copies move blocks, not values, and
    NumPy moves plain integers faster than ml_dtypes' bfloat16 / float8 (CPU machine, a 256-block SmolLM2-shaped
    gather: 3.15 vs 2.18 GB/s)."""
    raw = _RAW.get(a.dtype.itemsize)
    return a if raw is None else a.view(raw)


def host_view(a: jax.Array) -> np.ndarray:
    """A writable NumPy view (raw unsigned integers, see :func:`_raw`) of a host-memory ``jax.Array``'s buffer
    (``pinned_host``): NumPy's DLPack import is read-only and has no bfloat16. The view keeps ``a`` alive; the
    caller writes only while no transfer reads the buffer."""
    a.block_until_ready()
    buf = (ctypes.c_uint8 * a.nbytes).from_address(a.unsafe_buffer_pointer())
    buf.array = a  # the view's base is ``buf``: the buffer lives as long as any view of it
    return np.frombuffer(buf, _RAW[a.dtype.itemsize]).reshape(a.shape)


def _uncommitted(x: jax.Array) -> jax.Array:
    """``x``'s buffer as an uncommitted array, as ``jax.device_put(numpy_array)`` gives. ``jax.device_put`` to a
    sharding commits its result, and a committed operand makes every program it meets compile again for it,
    the caches' step programs included once a scatter has passed it on (JAX's private ``ArrayImpl``
    constructor; :func:`pinned_sharding` checks it works before the pinned path is used)."""
    from jax._src import array
    return array.ArrayImpl(x.aval, x.sharding, x._arrays, committed=False)


def pinned_sharding(device) -> SingleDeviceSharding | None:
    """``device``'s ``pinned_host`` memory for the copies, or None where JAX has none or the path fails its
    check: a block written through :func:`host_view` reaches the device as an uncommitted array that is a copy
    (later writes to the host buffer do not change it), and comes back through pinned memory."""
    try:
        if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
            return None
        pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
        staging = jax.device_put(np.zeros(64, np.uint16), pinned)
        view = host_view(staging)
        view[:] = np.arange(64, dtype=np.uint16)
        on_device = _uncommitted(jax.device_put(staging, SingleDeviceSharding(device, memory_kind="device")))
        on_device.block_until_ready()
        view[:] = 0
        back = host_view(jax.device_put(on_device + 1, pinned))
        ok = (not on_device.committed and np.array_equal(np.asarray(on_device), np.arange(64))
              and np.array_equal(back, np.arange(1, 65)))
        return pinned if ok else None
    except Exception:  # noqa: BLE001 - any failure of the check means the pageable path
        return None


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


def tensor_groups(kv_caches) -> tuple[tuple[int, ...], ...]:
    """Indices of the cache tensors grouped by (shape, dtype), in first-seen order."""
    groups: dict = {}
    for i, c in enumerate(kv_caches):
        groups.setdefault((tuple(c.shape), jnp.dtype(c.dtype)), []).append(i)
    return tuple(tuple(g) for g in groups.values())


@functools.partial(jax.jit, static_argnums=2)
def _gather(caches, ids, groups):
    """``int32[n]`` blocks of every cache (block axis 1), stacked per tensor group: ``[tensors, 2, n, ...]``."""
    return [jnp.stack([jnp.take(caches[i], ids, axis=1) for i in g]) for g in groups]


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _scatter(caches, ids, blocks, groups):
    """``caches[t][:, ids[k]] = blocks[group of t][index of t in it, :, k]``; ids out of range (padding) write
    nothing."""
    out = list(caches)
    for g, b in zip(groups, blocks):
        for j, i in enumerate(g):
            out[i] = caches[i].at[:, ids].set(b[j].astype(caches[i].dtype), mode="drop")
    return out


class KVLoad:
    """A host → device copy in flight (:meth:`KVOffloader.start_load`).

    Attributes:
        pairs: ``int32[n, 2]`` ``(host_block, device_block)`` rows.
        host_blocks: the host blocks it reads (held in the host pool until :attr:`gathered`).
        cancelled: the request ended before the copy landed: it is never scattered into the caches.
    """

    def __init__(self, pairs: np.ndarray, future: concurrent.futures.Future):
        self.pairs = pairs
        self.host_blocks = pairs[:, 0].tolist()
        self.future = future
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def gathered(self) -> bool:
        """The loader thread has read the host blocks (or failed: :meth:`KVOffloader.finish_load` raises)."""
        return self.future.done()

    @property
    def ready(self) -> bool:
        """Gathered and on the device: scattering it now makes no step wait for the transfer."""
        if not self.future.done():
            return False
        if self.future.exception() is not None:
            return True  # finish_load raises it
        return all(a.is_ready() for a in self._arrays())

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for the gather, then for the transfer (an engine with nothing else to
        run)."""
        done, _ = concurrent.futures.wait([self.future], timeout=timeout_s)
        if done and self.future.exception() is None:
            jax.block_until_ready(self._arrays())

    def _arrays(self) -> list[jax.Array]:
        return [a for _, arrays in self.future.result() for a in arrays]


class KVOffloader:
    """Host blocks with the device caches' layout and the copies between them.

    Args:
        kv_caches: the engine's device caches, ``dtype[2, num_blocks, num_kv_heads, block_size, head_size]``
            per cache tensor (single device; not kept: every call takes the current ones).
        num_host_blocks: blocks of the host pool.
        num_threads: host threads that write the pool once at start-up (default: one per tensor, at most the
            CPU count and 16).
        num_copy_threads: threads that split each copy's NumPy gather or scatter by tensors during a run (NumPy
            releases the GIL while it copies), beside the one writer and one loader thread (default: half the
            CPUs, at most 8; 1 copies in the writer or loader thread itself).
        pinned: stage the copies in ``pinned_host`` memory, which the GPU's copy engines read and write
            directly (None: where :func:`pinned_sharding` finds it works); False: pageable NumPy staging.

    Attributes:
        groups: the cache tensors' indices per tensor group (same shape and dtype).
        host_caches: one host array per group, ``dtype[tensors, 2, num_host_blocks, num_kv_heads, block_size,
            head_size]``.
        bytes_to_host, bytes_to_device: bytes of the blocks copied so far (padding not counted).
        copy_s: seconds of the caller's thread (the engine's) spent issuing copies and waiting for them;
            the writer thread's pool writes are not in it (``write_s``). ``copy_s_by`` splits it by method.
        pinned: the ``pinned_host`` sharding the copies are staged in, or None (pageable staging).
        write_s: seconds the writer thread spent writing arrived blocks into the pool.
        load_s: seconds the loader thread spent gathering loads and starting their transfers.

    Raises:
        ValueError: ``num_host_blocks < 1``, caches spread over several devices.
    """

    def __init__(self, kv_caches, num_host_blocks: int, num_threads: int | None = None,
                 num_copy_threads: int | None = None, pinned: bool | None = None):
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks={num_host_blocks} must be >= 1")
        if any(len(c.sharding.device_set) != 1 for c in kv_caches):
            raise ValueError("the host tier needs single-device caches (no tensor / data parallelism yet)")
        device = next(iter(kv_caches[0].sharding.device_set))
        # a CPU "device" may alias a NumPy buffer it was given (zero-copy): staging is reused elsewhere only
        self._reuse_staging = device.platform != "cpu"
        self._device = SingleDeviceSharding(device, memory_kind="device")
        self.pinned = None if pinned is False else pinned_sharding(device)
        if pinned and self.pinned is None:
            raise ValueError(f"pinned=True: {device} has no usable pinned_host memory")
        if self.pinned is not None:
            self._reuse_staging = True  # a transfer from pinned memory is a copy on every platform (checked)
        self._staging: dict[tuple[int, int], list[list]] = {}  # (group, size) -> [[buffer, its transfer]]
        self.staging_bytes = 0  # host bytes of the kept staging buffers (at most STAGING_BYTES)
        self.num_host_blocks = num_host_blocks
        self.num_device_blocks = int(kv_caches[0].shape[1])
        self.block_bytes = bytes_per_block(kv_caches)
        self.groups = tensor_groups(kv_caches)
        fill_threads = max(1, num_threads or min(len(kv_caches), os.cpu_count() or 1, 16))
        self.num_copy_threads = max(1, num_copy_threads or min(8, (os.cpu_count() or 2) // 2))
        workers = max(fill_threads, self.num_copy_threads)
        self._pool = (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kv-copy")
                      if workers > 1 else None)
        self.host_caches = []
        for g in self.groups:
            c = kv_caches[g[0]]
            h = np.empty((len(g), c.shape[0], num_host_blocks, *c.shape[2:]), c.dtype)
            # written now, a tensor per task: the pages are faulted in (zeroed by the kernel) here, at start-up,
            # not by the first copy into each of them during a run (a 256-block SmolLM2 pass into a fresh pool
            # took 0.84 s on the CPU machine, 17 ms into written pages)
            if h.nbytes >= PARALLEL_BYTES:
                self._split(lambda lo, hi, h=h: h[lo:hi].fill(0), len(h), fill_threads)
            else:
                h.fill(0)
            self.host_caches.append(h)
        self._pending: list[tuple[list[jax.Array], np.ndarray]] = []  # device → host copies on their way
        # arrived device → host copies are written into the pool here, one at a time, in arrival order
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-offload-write")
        self._writes: list[concurrent.futures.Future] = []
        # loads: gathered and put on the device by one loader thread, in order (the staging buffers are taken
        # under the lock, so swap_in's synchronous path and the loader never share one)
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-offload-load")
        self._staging_lock = threading.Lock()
        self.bytes_to_host = self.bytes_to_device = 0
        self.copy_s = self.write_s = self.load_s = 0.0
        self.copy_s_by = dict.fromkeys(("swap_out", "swap_in", "start_load", "finish_load", "poll"), 0.0)

    def _took(self, what: str, t: float) -> None:
        dt = time.perf_counter() - t
        self.copy_s += dt
        self.copy_s_by[what] += dt

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
            blocks = _gather(caches, ids, self.groups)
            host_ids = pairs[start:start + count, 1].copy()
            if self.pinned is not None:
                # the writer thread moves the blocks into pinned memory (no pageable bounce) and writes the pool:
                # waiting for the gather, which runs after the steps already dispatched, is its, not the engine's
                self._writes.append(self._writer.submit(self._write, blocks, host_ids))
                continue
            for b in blocks:
                b.copy_to_host_async()
            self._pending.append((blocks, host_ids))
        self.bytes_to_host += len(pairs) * self.block_bytes
        self._took("swap_out", t)

    def swap_in(self, kv_caches, pairs):
        """Copy host blocks to device blocks: ``pairs`` ``[(host_block, device_block), ...]`` (device blocks
        distinct); returns the new device caches (the given ones are donated)."""
        if not len(pairs):
            return kv_caches
        t = time.perf_counter()
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        self._flush(pairs[:, 0])
        out = self._scatter_chunks(kv_caches, self._gather_chunks(pairs), len(pairs))
        self._took("swap_in", t)
        return out

    def start_load(self, pairs) -> KVLoad:
        """Start copying host blocks to device blocks beside the engine's steps: ``pairs``
        ``[(host_block, device_block), ...]`` (device blocks distinct, not read or written by any step until
        :meth:`finish_load`; host blocks kept unchanged until :attr:`KVLoad.gathered`). The pool writes
        pending for those host blocks are queued first; the loader thread waits for them, gathers the blocks
        and puts them on the device."""
        t = time.perf_counter()
        pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
        self._flush(pairs[:, 0], wait=False)
        before = self._writes[-1] if self._writes else None
        load = KVLoad(pairs, self._loader.submit(self._gather_load, pairs, before))
        self._took("start_load", t)
        return load

    def _gather_load(self, pairs: np.ndarray, before) -> list[tuple[np.ndarray, list[jax.Array]]]:
        """(loader thread) Per chunk of ``pairs``: its padded device block ids and the blocks on the device,
        one array per tensor group."""
        if before is not None:
            before.result()  # the pool writes this load reads (the writer runs them in order)
        t = time.perf_counter()
        out = self._gather_chunks(pairs)
        self.load_s += time.perf_counter() - t
        return out

    def finish_load(self, kv_caches, load: KVLoad):
        """Scatter a gathered load into the caches (given donated; the new ones are returned); a copy the
        loader thread failed raises its error here."""
        t = time.perf_counter()
        out = self._scatter_chunks(kv_caches, load.future.result(), len(load.pairs))
        self._took("finish_load", t)
        return out

    def _gather_chunks(self, pairs: np.ndarray) -> list[tuple[np.ndarray, list[jax.Array]]]:
        """Per chunk of ``pairs`` (:func:`chunks`): its device block ids (padding out of range) and its host
        blocks on the device, one array per tensor group."""
        out = []
        with self._staging_lock:  # the staging buffers: the loader thread's, or swap_in's caller's
            for start, count, size in chunks(len(pairs)):
                host_ids = np.zeros(size, np.int32)
                host_ids[:count] = pairs[start:start + count, 0]
                dev_ids = np.full(size, self.num_device_blocks, np.int32)  # padding: out of range, dropped
                dev_ids[:count] = pairs[start:start + count, 1]
                out.append((dev_ids, [self._load(gi, host_ids) for gi in range(len(self.groups))]))
        return out

    def _scatter_chunks(self, kv_caches, gathered, num_pairs: int):
        """Write :meth:`_gather_chunks`' blocks into the caches (given donated; the new ones are returned)."""
        out = list(kv_caches)
        for dev_ids, arrays in gathered:
            out = _scatter(out, dev_ids, arrays, self.groups)
        self.bytes_to_device += num_pairs * self.block_bytes
        return out

    def _load(self, gi: int, host_ids: np.ndarray) -> jax.Array:
        """Group ``gi``'s host blocks ``host_ids`` gathered into a staging buffer (one NumPy call) and put on
        the device in one transfer (the caller holds the staging lock)."""
        h = self.host_caches[gi]
        shape = (*h.shape[:2], len(host_ids), *h.shape[3:])
        nbytes = math.prod(shape) * h.dtype.itemsize
        slot = None
        if self._reuse_staging:
            ring = self._staging.setdefault((gi, len(host_ids)), [])
            slot = next((s for s in ring if s[1] is None or s[1].is_ready()), None)
            if slot is None and len(ring) < _RING and self.staging_bytes + nbytes <= STAGING_BYTES:
                slot = [self._staging_buffer(shape, h.dtype), None]
                ring.append(slot)
                self.staging_bytes += nbytes
            elif slot is None and ring:  # the kept buffers are still being read: wait for the older transfer
                slot = ring[0]
                slot[1].block_until_ready()
                ring.append(ring.pop(0))
        if slot is None:
            slot = [self._staging_buffer(shape, h.dtype), None]
        staging, view = slot[0]
        # one NumPy call per copy thread (a slice of the group's tensors), on the arrays' bytes (see _raw);
        # mode="clip" (the ids are pool blocks or the padding 0, all in range) because take's default
        # mode="raise" with ``out`` gathers into a temporary and copies that: 3x slower (2.0 vs 6.3 GB/s on the
        # CPU machine)
        src = _raw(h)
        self._split(lambda lo, hi: np.take(src[lo:hi], host_ids, axis=2, out=view[lo:hi], mode="clip"), len(h))
        on_device = (jax.device_put(view.view(h.dtype)) if self.pinned is None
                     else _uncommitted(jax.device_put(staging, self._device)))
        slot[1] = on_device
        return on_device

    def _staging_buffer(self, shape, dtype) -> tuple[object, np.ndarray]:
        """A staging buffer and its raw NumPy view: ``pinned_host`` memory where :attr:`pinned`, else NumPy."""
        if self.pinned is None:
            buf = np.empty(shape, dtype)
            return buf, _raw(buf)
        staging = jax.device_put(np.empty(shape, dtype), self.pinned)
        return staging, host_view(staging)

    def _split(self, fn, n: int, threads: int | None = None) -> None:
        """``fn(lo, hi)`` over slices of ``n`` tensors, one per thread (``threads``, default
        :attr:`num_copy_threads`; with one, here). One NumPy call per slice: during a run every other Python
        thread competes for the GIL, and each call that gives it up waits up to the interpreter's switch
        interval (5 ms) to get it back, so a copy makes as few calls as it has threads (see :func:`_raw`)."""
        k = min(threads or self.num_copy_threads, n)
        if k <= 1 or self._pool is None:
            fn(0, n)
            return
        bounds = [n * i // k for i in range(k + 1)]
        for f in [self._pool.submit(fn, lo, hi) for lo, hi in zip(bounds, bounds[1:])]:
            f.result()

    def poll(self) -> None:
        """Hand the device → host copies that have arrived (oldest first) to the writer thread (pinned staging
        hands each over when it is issued), and surface a writer's error."""
        done = [f for f in self._writes if f.done()]
        for f in done:
            f.result()  # a writer's error surfaces here
        self._writes = [f for f in self._writes if f not in done]
        if self._pending and all(b.is_ready() for b in self._pending[0][0]):
            t = time.perf_counter()
            while self._pending and all(b.is_ready() for b in self._pending[0][0]):
                self._writes.append(self._writer.submit(self._write, *self._pending.pop(0)))
            self._took("poll", t)

    def _flush(self, host_ids=None, wait: bool = True) -> None:
        """Write pending device → host copies in order (all, or up to the last one into ``host_ids``), then
        (``wait``) wait for every write the writer thread has: the pool is then up to date for what is read
        next."""
        last = len(self._pending) - 1
        if host_ids is not None:
            wanted = set(np.asarray(host_ids).tolist())
            last = max((i for i, (_, ids) in enumerate(self._pending) if not wanted.isdisjoint(ids.tolist())),
                       default=-1)
        for _ in range(last + 1):
            self._writes.append(self._writer.submit(self._write, *self._pending.pop(0)))
        if not wait:
            return
        for f in self._writes:
            f.result()
        self._writes.clear()

    def _write(self, blocks, host_ids) -> None:
        """(writer thread) Scatter one arrived copy's blocks into the pool (pinned staging: first move them from
        the device into pinned memory, waiting for the gather that made them)."""
        if self.pinned is not None:
            blocks = [jax.device_put(b, self.pinned) for b in blocks]
        t = time.perf_counter()
        n = len(host_ids)
        for h, b in zip(self.host_caches, blocks):
            src = _raw(np.asarray(b)) if self.pinned is None else host_view(b)
            dst = _raw(h)

            def write(lo, hi, dst=dst, src=src):  # one NumPy call per copy thread (see _raw, _split)
                dst[lo:hi, :, host_ids] = src[lo:hi, :, :n]
            self._split(write, len(h))
        self.write_s += time.perf_counter() - t

    def host_block(self, block: int) -> list[np.ndarray]:
        """One host block of every tensor, ``[2, num_kv_heads, block_size, head_size]`` each, in the caches'
        order (tests)."""
        self._flush()
        out = [None] * sum(len(g) for g in self.groups)
        for g, h in zip(self.groups, self.host_caches):
            for j, i in enumerate(g):
                out[i] = h[j][:, block].copy()
        return out

    def warmup(self, kv_caches):
        """Compile the copy programs of every chunk size up to the device's block count (the most blocks one
        pass can copy), with copies that write nothing; returns the device caches."""
        size = MIN_PAIRS
        while True:
            jax.block_until_ready(_gather(list(kv_caches), np.zeros(size, np.int32), self.groups))
            kv_caches = _scatter(list(kv_caches), np.full(size, self.num_device_blocks, np.int32),
                                 [np.zeros((*h.shape[:2], size, *h.shape[3:]), h.dtype) for h in self.host_caches],
                                 self.groups)
            size *= 2
            if size > self.num_device_blocks:
                return kv_caches
