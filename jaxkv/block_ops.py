"""Block ops: copy, swap (device ↔ host) and zero whole blocks of the KV cache of every layer.

vLLM: ``PagedAttention.copy_blocks`` → ``ops.copy_blocks``, ``PagedAttention.swap_blocks`` →
``ops.swap_blocks``, ``KVBlockZeroer.zero_block_ids`` (``vllm/v1/worker/utils.py``).

The caches are a pytree (list, tuple or dict keyed by layer name, or one array) of per-layer arrays
in the Pallas layout ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (the block axis is
``block_axis=1``; layouts with the block axis first, such as FlashInfer's or MLA's, pass
``block_axis=0``). Every op is functional: it returns new arrays and never mutates its inputs. The
``*_donated`` variants are the same ops jitted with the caches donated, so XLA updates the buffers in
place (the returned arrays reuse the input buffers; the inputs are deleted). A block is moved or zeroed
for all of its heads, tokens and both K and V halves.

Validation happens before anything runs: when block ids are concrete (not traced), an id outside
``[0, num_blocks)`` or a duplicate destination raises ``ValueError`` naming the value, and the caches
are left untouched (a donated cache is not consumed). Under an enclosing ``jit`` the ids are traced and
cannot be checked: pairs or ids out of range are then dropped (never wrapped or clamped onto a real
block), and with duplicate destinations one of the writes wins, unspecified which.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KVCaches = Any
"""A pytree of per-layer cache arrays (``list``/``tuple``/``dict`` or a single array)."""

DEFAULT_BLOCK_AXIS = 1
"""Block axis of the Pallas layout ``[2, num_blocks, num_kv_heads, block_size, head_size]``."""


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

def _concrete(x) -> np.ndarray | None:
    """``x`` as a NumPy array when it is concrete, ``None`` when it is traced under ``jit``."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def _as_index_array(x, name: str):
    """Lists become NumPy arrays (an empty list is ``int32``); arrays and tracers pass through."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
        if x.size == 0:
            x = x.astype(np.int32)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={x.dtype} must be an integer dtype")
    return x


def _check_layers(kv_caches: KVCaches, block_axis: int, name: str):
    """Flatten a cache pytree; every layer must be an array of one common shape and dtype.

    Returns:
        ``(leaves, treedef, num_blocks)``; ``num_blocks`` is ``None`` when there are no layers.
    """
    if not isinstance(block_axis, int) or block_axis < 0:
        raise ValueError(f"block_axis={block_axis!r} must be a non-negative int")
    flat, treedef = jax.tree_util.tree_flatten_with_path(kv_caches)
    if not flat:
        return [], treedef, None
    first_path, first = flat[0]
    for path, leaf in flat:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ValueError(f"{where}={type(leaf).__name__} is not an array")
        if leaf.ndim <= block_axis:
            raise ValueError(f"{where}.shape={leaf.shape} has no block_axis={block_axis}")
        if leaf.shape != first.shape or leaf.dtype != first.dtype:
            raise ValueError(
                f"{where} is {leaf.dtype}{list(leaf.shape)} but "
                f"{name}{jax.tree_util.keystr(first_path)} is {first.dtype}{list(first.shape)}: "
                "all layers must have the same shape and dtype")
    return [leaf for _, leaf in flat], treedef, first.shape[block_axis]


def _check_range(ids: np.ndarray, name: str, num_blocks: int) -> None:
    """``ids``: concrete ``int[n]`` whose entry ``i`` is reported as ``{name}[i]``."""
    bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}]={ids[i]} is out of range [0, num_blocks={num_blocks})")


def _check_pairs(src_to_dst, num_src_blocks: int, num_dst_blocks: int):
    """Shape/dtype of ``src_to_dst``; with concrete values, ranges and distinct destinations."""
    src_to_dst = _as_index_array(src_to_dst, "src_to_dst")
    if src_to_dst.ndim != 2 or src_to_dst.shape[1] != 2:
        raise ValueError(f"src_to_dst.shape={src_to_dst.shape} must be [num_pairs, 2]")
    pairs = _concrete(src_to_dst)
    if pairs is None:
        return src_to_dst
    pairs = pairs.astype(np.int64)
    bad = np.flatnonzero((pairs[:, 0] < 0) | (pairs[:, 0] >= num_src_blocks))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"src_to_dst[{i}, 0]={pairs[i, 0]} (source block) is out of range "
                         f"[0, num_blocks={num_src_blocks})")
    bad = np.flatnonzero((pairs[:, 1] < 0) | (pairs[:, 1] >= num_dst_blocks))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"src_to_dst[{i}, 1]={pairs[i, 1]} (destination block) is out of range "
                         f"[0, num_blocks={num_dst_blocks})")
    dst = pairs[:, 1]
    seen: dict[int, int] = {}
    for i, d in enumerate(dst.tolist()):
        if d in seen:
            raise ValueError(f"src_to_dst[{i}, 1]={d} is a duplicate destination block "
                             f"(also src_to_dst[{seen[d]}, 1])")
        seen[d] = i
    return src_to_dst


# ------------------------------------------------------------------------------------------------
# Traceable implementations (ids already validated where concrete)
# ------------------------------------------------------------------------------------------------

def _at_blocks(block_axis: int, ids):
    """Index tuple selecting blocks ``ids`` along ``block_axis`` (other axes whole, kept in place)."""
    return (slice(None),) * block_axis + (ids,)


def _valid_or_dropped(ids, num_blocks: int):
    """Ids outside ``[0, num_blocks)`` → ``num_blocks``, which ``mode="drop"`` scatters discard."""
    ids = ids.astype(jnp.int32)
    return jnp.where((ids >= 0) & (ids < num_blocks), ids, num_blocks)


def _pair_ids(pairs, num_src_blocks: int, num_dst_blocks: int):
    """``(src_ids, dst_ids)``; a pair with either id out of range has its destination dropped."""
    pairs = pairs.astype(jnp.int32)
    src, dst = pairs[:, 0], pairs[:, 1]
    ok = (src >= 0) & (src < num_src_blocks) & (dst >= 0) & (dst < num_dst_blocks)
    return jnp.where(ok, src, 0), jnp.where(ok, dst, num_dst_blocks)


def _copy_impl(kv_caches, src_to_dst, block_axis):
    def copy_layer(cache):
        num_blocks = cache.shape[block_axis]
        src, dst = _pair_ids(jnp.asarray(src_to_dst), num_blocks, num_blocks)
        blocks = cache[_at_blocks(block_axis, src)]  # gathered from the original cache
        return cache.at[_at_blocks(block_axis, dst)].set(blocks, mode="drop")

    return jax.tree_util.tree_map(copy_layer, kv_caches)


def _zero_impl(kv_caches, block_ids, block_axis):
    def zero_layer(cache):
        ids = _valid_or_dropped(jnp.asarray(block_ids), cache.shape[block_axis])
        return cache.at[_at_blocks(block_axis, ids)].set(0, mode="drop")

    return jax.tree_util.tree_map(zero_layer, kv_caches)


def _memory_space(x):
    """The memory space of an array or tracer (``None`` on JAX versions without one)."""
    return getattr(jax.typeof(x), "memory_space", None)


def _to_space(x, space):
    if space is None or _memory_space(x) == space:
        return x
    return jax.device_put(x, space)


def _swap_impl(src, dst, src_to_dst, block_axis):
    """Gather in ``src``'s memory, move only the gathered blocks, scatter in ``dst``'s memory."""
    def swap_layer(s, d):
        src_space, dst_space = _memory_space(s), _memory_space(d)
        src_ids, dst_ids = _pair_ids(jnp.asarray(src_to_dst), s.shape[block_axis], d.shape[block_axis])
        blocks = s[_at_blocks(block_axis, _to_space(src_ids, src_space))]
        blocks = _to_space(blocks, dst_space)
        return d.at[_at_blocks(block_axis, _to_space(dst_ids, dst_space))].set(blocks, mode="drop")

    return jax.tree_util.tree_map(swap_layer, src, dst)


_copy_jit = jax.jit(_copy_impl, static_argnames="block_axis")
_copy_jit_donated = jax.jit(_copy_impl, static_argnames="block_axis", donate_argnums=0)
_zero_jit = jax.jit(_zero_impl, static_argnames="block_axis")
_zero_jit_donated = jax.jit(_zero_impl, static_argnames="block_axis", donate_argnums=0)


@functools.lru_cache(maxsize=64)
def _swap_program(dst_def, dst_shardings: tuple, donate: bool):
    """``_swap_impl`` jitted with its outputs pinned to ``dst``'s shardings (memory kinds).

    The output memory kind must be given: XLA does not infer that a scatter into a host array yields
    a host array, and a donated host buffer with a device-kind output is an error.
    """
    out_shardings = jax.tree_util.tree_unflatten(dst_def, dst_shardings)
    return jax.jit(_swap_impl, static_argnames="block_axis", out_shardings=out_shardings,
                   donate_argnums=(1,) if donate else ())


def _swap_memory_kinds(src, dst, src_to_dst, block_axis: int, donate: bool):
    leaves, dst_def = jax.tree_util.tree_flatten(dst)
    if any(isinstance(x, jax.core.Tracer) for x in leaves + jax.tree_util.tree_leaves(src)):
        # inside an enclosing jit: the caller's jit places (and donates) the outputs
        return _swap_impl(src, dst, src_to_dst, block_axis)
    program = _swap_program(dst_def, tuple(x.sharding for x in leaves), donate)
    return program(src, dst, src_to_dst, block_axis=block_axis)


# ------------------------------------------------------------------------------------------------
# copy_blocks
# ------------------------------------------------------------------------------------------------

def _copy(kv_caches, src_to_dst, block_axis, fn):
    _, _, num_blocks = _check_layers(kv_caches, block_axis, "kv_caches")
    if num_blocks is None:
        return kv_caches
    src_to_dst = _check_pairs(src_to_dst, num_blocks, num_blocks)
    return fn(kv_caches, src_to_dst, block_axis=block_axis)


def copy_blocks(kv_caches: KVCaches, src_to_dst, *, block_axis: int = DEFAULT_BLOCK_AXIS) -> KVCaches:
    """Copy whole blocks to other blocks in every layer (copy-on-write, beam-search forks).

    vLLM: ``copy_blocks`` (``PagedAttention.copy_blocks`` → ``ops.copy_blocks``).

    For each pair ``(src, dst)`` and every layer: ``out[:, dst] = kv_cache[:, src]`` (K and V halves,
    all heads and tokens). All pairs are applied at once as one gather + one scatter, and every source
    is read from the ORIGINAL cache: when a destination block is also the source of another pair,
    that pair copies the block's old contents (pairs ``[[0, 1], [1, 2]]`` give block 1 ← old block 0
    and block 2 ← old block 1, the same result in any pair order). (vLLM's CUDA kernel runs the pairs
    in parallel on one buffer, so that case is a race there.) ``src == dst`` leaves the block as is.

    Args:
        kv_caches: pytree of per-layer ``dtype[2, num_blocks, num_kv_heads, block_size, head_size]``
            caches, all of one shape and dtype.
        src_to_dst: ``int32/int64[num_pairs, 2]`` (or a list of pairs): source and destination block
            ids; destinations distinct.
        block_axis: the block axis of the layout (1 for Pallas, 0 for num_blocks-first layouts).

    Returns:
        A pytree of the same structure with the new caches (same shapes and dtypes).

    Raises:
        ValueError: a layer that is not an array or whose shape/dtype differs from the first layer;
            ``src_to_dst`` not an integer ``[num_pairs, 2]``; when concrete, a block id outside
            ``[0, num_blocks)`` or a duplicate destination (each names the value). Nothing is
            written.
    """
    return _copy(kv_caches, src_to_dst, block_axis, _copy_jit)


def copy_blocks_donated(kv_caches: KVCaches, src_to_dst, *,
                        block_axis: int = DEFAULT_BLOCK_AXIS) -> KVCaches:
    """:func:`copy_blocks` jitted with ``kv_caches`` donated: updated in place, inputs deleted.

    vLLM: ``copy_blocks`` (in place on the CUDA buffers). Validation runs first, so a rejected call
    raises ``ValueError`` (see :func:`copy_blocks`) without consuming the caches.
    """
    return _copy(kv_caches, src_to_dst, block_axis, _copy_jit_donated)


# ------------------------------------------------------------------------------------------------
# zero_blocks
# ------------------------------------------------------------------------------------------------

def _zero(kv_caches, block_ids, block_axis, fn):
    _, _, num_blocks = _check_layers(kv_caches, block_axis, "kv_caches")
    if num_blocks is None:
        return kv_caches
    block_ids = _as_index_array(block_ids, "block_ids")
    if block_ids.ndim != 1:
        raise ValueError(f"block_ids.shape={block_ids.shape} must be [num_ids]")
    ids = _concrete(block_ids)
    if ids is not None:
        _check_range(ids, "block_ids", num_blocks)
    return fn(kv_caches, block_ids, block_axis=block_axis)


def zero_blocks(kv_caches: KVCaches, block_ids, *, block_axis: int = DEFAULT_BLOCK_AXIS) -> KVCaches:
    """Zero whole blocks in every layer (both K and V halves, all heads and tokens).

    vLLM: ``KVBlockZeroer.zero_block_ids`` (one Triton launch over all layers' segments there; here
    one jitted scatter per layer, fused into one XLA program). Repeated ids are allowed (zeroing is
    idempotent), so a caller may pad ``block_ids`` to a fixed length by repeating an id, keeping one
    compilation per length.

    Args:
        kv_caches: pytree of per-layer ``dtype[2, num_blocks, num_kv_heads, block_size, head_size]``
            caches, all of one shape and dtype (fp8 caches included: zero is exact).
        block_ids: ``int32/int64[num_ids]`` (or a list) of block ids to zero.
        block_axis: the block axis of the layout (1 for Pallas, 0 for num_blocks-first layouts).

    Returns:
        A pytree of the same structure with the new caches.

    Raises:
        ValueError: mismatched layers (see :func:`copy_blocks`); ``block_ids`` not integer or not
            1-D; when concrete, an id outside ``[0, num_blocks)`` (names the value). Nothing is
            written.
    """
    return _zero(kv_caches, block_ids, block_axis, _zero_jit)


def zero_blocks_donated(kv_caches: KVCaches, block_ids, *,
                        block_axis: int = DEFAULT_BLOCK_AXIS) -> KVCaches:
    """:func:`zero_blocks` jitted with ``kv_caches`` donated: updated in place, inputs deleted.

    vLLM: ``KVBlockZeroer.zero_block_ids``. A rejected call raises without consuming the caches.
    """
    return _zero(kv_caches, block_ids, block_axis, _zero_jit_donated)


# ------------------------------------------------------------------------------------------------
# Host memory and swap_blocks
# ------------------------------------------------------------------------------------------------

HOST_MEMORY_KIND = "pinned_host"


def _host_sharding(device=None):
    device = device if device is not None else jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind=HOST_MEMORY_KIND)


@functools.cache
def host_memory_kind() -> str | None:
    """``"pinned_host"`` when the default device supports swapping through JAX memory kinds, else ``None``.

    Decided once per process by a tiny swap-out and swap-in of a 2-block cache through the real
    :func:`swap_blocks` path. On CPU with JAX 0.12 this is ``"pinned_host"``. When it is ``None``,
    :func:`allocate_host_kv_cache` and :func:`to_host` return NumPy arrays and :func:`swap_blocks`
    uses its NumPy path.
    """
    try:
        host = _host_zeros((2, 2, 1, 1, 2), jnp.float32)
        device = jnp.arange(8, dtype=jnp.float32).reshape(2, 2, 1, 1, 2)
        pairs = np.array([[1, 0]], np.int32)
        out = _swap_memory_kinds(device, host, pairs, 1, donate=True)
        back = _swap_memory_kinds(out, jnp.zeros_like(device), pairs[:, ::-1], 1, donate=False)
        ok = (out.sharding.memory_kind == HOST_MEMORY_KIND
              and back.sharding.memory_kind != HOST_MEMORY_KIND
              and np.array_equal(np.asarray(back)[:, 1], np.asarray(device)[:, 1])
              and not np.asarray(back)[:, 0].any())
    except Exception:  # noqa: BLE001  any failure (unsupported kind, lowering) means "not supported"
        return None
    return HOST_MEMORY_KIND if ok else None


def _host_zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.jit(jnp.zeros, static_argnums=(0, 1), out_shardings=_host_sharding())(
        tuple(shape), jnp.dtype(dtype))


def allocate_host_kv_cache(shape: tuple[int, ...], dtype):
    """A zero-filled cache array in host memory, e.g. for ``num_cpu_blocks`` swap space.

    vLLM: the CPU cache of ``CacheEngine._allocate_kv_cache(num_cpu_blocks, "cpu")`` (pinned memory).

    Args:
        shape: the layer's cache shape (``[2, num_cpu_blocks, num_kv_heads, block_size, head_size]``).
        dtype: the cache dtype.

    Returns:
        ``jax.Array`` in ``"pinned_host"`` memory when :func:`host_memory_kind` supports it (an
        XLA-owned buffer, so it can be donated), otherwise a ``np.ndarray``.
    """
    if host_memory_kind() is None:
        return np.zeros(shape, dtype)
    return _host_zeros(shape, dtype)


def to_host(x):
    """A copy of one cache array in host memory (``pinned_host`` ``jax.Array`` or ``np.ndarray``).

    Use this rather than ``jax.device_put(np_array, host_sharding)``: on CPU the latter may alias the
    NumPy buffer without copying, and a donated alias cannot be updated in place (XLA copies it).
    """
    if host_memory_kind() is None:
        return np.array(x)
    return jax.jit(lambda a: a, out_shardings=_host_sharding())(x)


def _swap_numpy(src_leaves, dst_leaves, src_to_dst, block_axis, donate):
    """NumPy host path. A NumPy ``dst`` is written in place when ``donate`` (else copied first)."""
    pairs = np.asarray(src_to_dst).astype(np.int64).reshape(-1, 2)
    src_ids, dst_ids = pairs[:, 0], pairs[:, 1]
    out = []
    for s, d in zip(src_leaves, dst_leaves):
        if isinstance(s, np.ndarray):
            blocks = np.take(s, src_ids, axis=block_axis)  # gathered on the host
        else:  # device → host: gather on the device, transfer only the gathered blocks
            blocks = np.asarray(_take_jit(s, jnp.asarray(src_ids, jnp.int32), block_axis=block_axis))
        if isinstance(d, np.ndarray):
            d = d if donate else d.copy()
            d[_at_blocks(block_axis, dst_ids)] = blocks
            out.append(d)
        else:  # host → device: transfer the gathered blocks, scatter on the device
            scatter = _put_blocks_jit_donated if donate else _put_blocks_jit
            out.append(scatter(d, jnp.asarray(dst_ids, jnp.int32), jnp.asarray(blocks),
                               block_axis=block_axis))
    return out


@functools.partial(jax.jit, static_argnames="block_axis")
def _take_jit(x, ids, block_axis):
    return x[_at_blocks(block_axis, ids)]


def _put_blocks(x, ids, blocks, block_axis):
    return x.at[_at_blocks(block_axis, ids)].set(blocks.astype(x.dtype))


_put_blocks_jit = jax.jit(_put_blocks, static_argnames="block_axis")
_put_blocks_jit_donated = jax.jit(_put_blocks, static_argnames="block_axis", donate_argnums=0)


def _swap(src, dst, src_to_dst, block_axis, donate):
    src_leaves, src_def, num_src_blocks = _check_layers(src, block_axis, "src")
    dst_leaves, dst_def, num_dst_blocks = _check_layers(dst, block_axis, "dst")
    if src_def != dst_def:
        raise ValueError(f"src and dst have different structures: {src_def} vs {dst_def}")
    if not src_leaves:
        return dst
    s, d = src_leaves[0], dst_leaves[0]
    if s.dtype != d.dtype:
        raise ValueError(f"src.dtype={s.dtype} != dst.dtype={d.dtype}")
    if s.shape[:block_axis] + s.shape[block_axis + 1:] != d.shape[:block_axis] + d.shape[block_axis + 1:]:
        raise ValueError(f"src.shape={s.shape} and dst.shape={d.shape} must agree except on "
                         f"block_axis={block_axis}")
    src_to_dst = _check_pairs(src_to_dst, num_src_blocks, num_dst_blocks)
    if any(isinstance(x, np.ndarray) for x in src_leaves + dst_leaves):
        if _concrete(src_to_dst) is None:
            raise ValueError("src_to_dst is traced: the NumPy host path needs concrete block ids")
        out = _swap_numpy(src_leaves, dst_leaves, src_to_dst, block_axis, donate)
        return jax.tree_util.tree_unflatten(dst_def, out)
    return _swap_memory_kinds(src, dst, src_to_dst, block_axis, donate)


def swap_blocks(src: KVCaches, dst: KVCaches, src_to_dst, *,
                block_axis: int = DEFAULT_BLOCK_AXIS) -> KVCaches:
    """Copy blocks between two caches in different memories (swap out: device → host; swap in).

    vLLM: ``swap_blocks`` (``PagedAttention.swap_blocks`` → ``ops.swap_blocks``, per layer there;
    here a whole pytree of layers at once, or one array).

    For each pair ``(src_block, dst_block)`` and every layer: ``out[:, dst_block] = src[:, src_block]``.
    The direction follows where the arrays live; only the ``num_pairs`` selected blocks cross between
    memories. Two paths:

    * memory kinds (both sides ``jax.Array``): one jitted program gathers in ``src``'s memory space,
      ``jax.device_put``s the gathered blocks to ``dst``'s memory space and scatters there. Host caches
      are ``jax.Array`` s with ``memory_kind="pinned_host"`` (:func:`allocate_host_kv_cache`,
      :func:`to_host`). This is the path on CPU with JAX 0.12 (see :func:`host_memory_kind`) and it
      also runs inside an enclosing ``jit``.
    * NumPy (either side a ``np.ndarray``, used when :func:`host_memory_kind` is ``None``): the host
      side is gathered/scattered by NumPy and the device side by a small jitted gather/scatter.
      Needs concrete ``src_to_dst``.

    Args:
        src: pytree of per-layer ``dtype[2, num_src_blocks, num_kv_heads, block_size, head_size]``.
        dst: pytree of the same structure: ``dtype[2, num_dst_blocks, num_kv_heads, block_size,
            head_size]`` (same dtype; ``num_dst_blocks`` may differ).
        src_to_dst: ``int32/int64[num_pairs, 2]`` (or a list): block ids in ``src`` and in ``dst``;
            destinations distinct.
        block_axis: the block axis of the layout (1 for Pallas).

    Returns:
        The new ``dst`` pytree, in ``dst``'s memory (``src`` is unchanged). Functional: ``dst`` is not
        modified (a NumPy ``dst`` is copied first; :func:`swap_blocks_donated` avoids that).

    Raises:
        ValueError: mismatched layers, structures, dtypes or non-block dims; ``src_to_dst`` not an
            integer ``[num_pairs, 2]``; when concrete, a source id outside ``[0, num_src_blocks)``, a
            destination id outside ``[0, num_dst_blocks)`` or a duplicate destination (each names the
            value); NumPy path with traced ids. Nothing is written.
    """
    return _swap(src, dst, src_to_dst, block_axis, donate=False)


def swap_blocks_donated(src: KVCaches, dst: KVCaches, src_to_dst, *,
                        block_axis: int = DEFAULT_BLOCK_AXIS) -> KVCaches:
    """:func:`swap_blocks` with ``dst`` consumed: updated in place, like vLLM's in-place copy.

    vLLM: ``swap_blocks``. ``jax.Array`` destinations are donated to the jitted program (the result
    reuses the buffer, the input is deleted); a NumPy destination is written in place and returned. A
    rejected call raises ``ValueError`` (see :func:`swap_blocks`) without consuming ``dst``.
    """
    return _swap(src, dst, src_to_dst, block_axis, donate=True)
