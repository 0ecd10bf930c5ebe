"""Swap blocks between device and host memory (swap out: device → host; swap in: host → device).

vLLM: ``PagedAttention.swap_blocks`` → ``ops.swap_blocks`` and the pinned CPU cache of
``CacheEngine._allocate_kv_cache(num_cpu_blocks, "cpu")``.

Same cache pytrees, block axis and validation as :mod:`jaxkv.vllm_parity.block_ops` (ids checked when concrete,
nothing written on error; traced ids checked only in the check mode of :mod:`jaxkv.checks`, and traced
out-of-range pairs dropped). The direction follows where the arrays live: host caches are
``jax.Array`` s with ``memory_kind="pinned_host"`` when the platform supports JAX memory kinds
(:func:`host_memory_kind`), otherwise NumPy arrays. Functional like the other block ops:
:func:`swap_blocks` returns a new ``dst``; :func:`swap_blocks_donated` consumes ``dst`` and updates it
in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.vllm_parity.block_ops import DEFAULT_BLOCK_AXIS, KVCaches, _at_blocks, _check_layers, _check_pairs, _pair_ids


def concrete(x) -> np.ndarray | None:
    """``x`` as a NumPy array when it is concrete, ``None`` when it is traced under ``jit``."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


# ------------------------------------------------------------------------------------------------
# Memory-kinds path (both sides jax.Array)
# ------------------------------------------------------------------------------------------------

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
        if concrete(src_to_dst) is None:
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
            Under ``jax.jit`` the ids are traced and not checked, unless the check mode of
            :mod:`jaxkv.checks` stages the same checks (reported through checkify).
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
