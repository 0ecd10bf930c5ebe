"""Probe for the host tier's next copy path: blocks gathered by XLA from a pinned host pool, no NumPy, no GIL.

    python scripts/dev/probe_pinned_gather.py [--host-blocks 23301] [--blocks 256] [--layers 30]

The pool is one ``pinned_host`` array ``[tensors, 2, host_blocks, kv_heads, block_size, head_size]`` (SmolLM2's
shapes by default). Three ways to put ``--blocks`` random blocks of it on the device, each timed over repeats:

* ``numpy``: what ``jaxkv.worker.kv_offload`` does today on a pageable pool (``np.take`` into a staging buffer,
  one ``device_put``);
* ``host-gather``: one jitted program that gathers on the host (``compute_on("device_host")``, XLA's host
  offloading) from the pinned pool and moves the result to device memory;
* ``device-put-all``: the baseline a plain jitted ``jnp.take`` would lower to (the whole pool to the device
  first), at a small pool only, to show why that is not an option.

On the CPU machine all three run (host and device memory are the same there); whether the GPU backend runs the
host computation, and at what GB/s, is the question for the GPU (docs/perf-notes.md, session 19).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.core import MemorySpace
from jax.experimental.compute_on import compute_on
from jax.sharding import SingleDeviceSharding

from jaxkv.worker.kv_offload import _uncommitted, host_view


def host_gather(pool, ids):
    """``pool[:, :, ids]`` without constants (a constant in device memory cannot meet host operands)."""
    idx = lax.expand_dims(ids, (1,))
    dims = lax.GatherDimensionNumbers(offset_dims=(0, 1, 3, 4, 5), collapsed_slice_dims=(2,), start_index_map=(2,))
    return lax.gather(pool, idx, dims, slice_sizes=(*pool.shape[:2], 1, *pool.shape[3:]),
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-blocks", type=int, default=23301)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = jax.devices()[0]
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = SingleDeviceSharding(device, memory_kind="device")
    shape = (args.layers, 2, args.host_blocks, 3, 16, 64)
    pool_np = np.ones(shape, jnp.bfloat16)
    pool = jax.device_put(pool_np, pinned)
    rng = np.random.default_rng(0)
    nbytes = pool_np.nbytes // args.host_blocks * args.blocks
    print(f"{device.device_kind}: pool {pool_np.nbytes / 2**30:.2f} GiB pinned, {args.blocks} blocks = "
          f"{nbytes / 2**20:.1f} MiB a copy")

    def timed(name, fn):
        jax.block_until_ready(fn(rng.permutation(args.host_blocks)[:args.blocks].astype(np.int32)))
        t = time.perf_counter()
        for _ in range(args.repeats):
            jax.block_until_ready(fn(rng.permutation(args.host_blocks)[:args.blocks].astype(np.int32)))
        dt = (time.perf_counter() - t) / args.repeats
        print(f"{name:15} {dt * 1e3:8.2f} ms  {nbytes / dt / 1e9:6.2f} GB/s")

    staging = np.empty((*shape[:2], args.blocks, *shape[3:]), pool_np.dtype)
    timed("numpy", lambda ids: jax.device_put(
        np.take(pool_np.view(np.uint16), ids, axis=2, out=staging.view(np.uint16), mode="clip").view(pool_np.dtype)))
    # its two halves, and what a pinned staging buffer would give the second
    timed("  np.take", lambda ids: np.take(pool_np.view(np.uint16), ids, axis=2, out=staging.view(np.uint16),
                                           mode="clip"))
    timed("  pageable put", lambda ids: jax.device_put(staging, on_device))
    staging_pinned = jax.device_put(staging.view(np.uint16), pinned)  # uint16: DLPack has no bfloat16 for NumPy
    timed("  pinned put", lambda ids: jax.device_put(staging_pinned, on_device))
    # a writable NumPy view of a pinned_host array's buffer (NumPy's DLPack import is read-only)
    view = host_view(staging_pinned)
    timed("  np.take->pinned", lambda ids: np.take(pool_np.view(np.uint16), ids, axis=2, out=view, mode="clip"))
    for k in (2, 4, 8):
        pool_k = concurrent.futures.ThreadPoolExecutor(k)
        parts = np.array_split(np.arange(args.layers), k)
        timed(f"  take x{k} thr", lambda ids: list(pool_k.map(lambda js: np.take(
            pool_np.view(np.uint16)[js[0]:js[-1] + 1], ids, axis=2, out=view[js[0]:js[-1] + 1], mode="clip"), parts)))
    timed("  put(np pinned)", lambda ids: jax.device_put(view))  # does PJRT see that the NumPy memory is pinned?
    timed("  put+uncommit", lambda ids: _uncommitted(jax.device_put(staging_pinned, on_device)))
    print(f"uncommitted: {_uncommitted(jax.device_put(staging_pinned, on_device)).committed is False}")
    # device -> host: into pinned memory (a fresh pinned_host array) against copy_to_host_async + np.asarray
    blocks = jax.device_put(staging_pinned, on_device)

    def to_host_async(ids):
        b = blocks + 0
        b.copy_to_host_async()
        return np.asarray(b)
    timed("d2h async+np", to_host_async)
    timed("d2h pinned", lambda ids: jax.device_put(blocks + 0, pinned))
    timed("d2h add only", lambda ids: blocks + 0)

    gather = jax.jit(lambda p, ids: jax.device_put(
        compute_on(host_gather, compute_type="device_host", out_memory_spaces=MemorySpace.Host)(p, ids), on_device))
    try:
        timed("host-gather", lambda ids: gather(pool, jax.device_put(ids, pinned)))
    except Exception as e:  # noqa: BLE001 - a probe: report what the backend says
        print(f"host-gather    unsupported here: {type(e).__name__}: {str(e)[:300]}")

    small = jax.device_put(pool_np[:, :, :1024], pinned)
    whole = jax.jit(lambda p, ids: jnp.take(jax.device_put(p, on_device), ids, axis=2))
    timed("device-put-all", lambda ids: whole(small, ids % 1024))


if __name__ == "__main__":
    main()
