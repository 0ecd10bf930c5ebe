"""Block ops: copy and zero whole blocks of the KV cache of every layer.

vLLM: ``PagedAttention.copy_blocks`` → ``ops.copy_blocks``, ``KVBlockZeroer.zero_block_ids``
(``vllm/v1/worker/utils.py``). Swapping blocks between device and host memory (``swap_blocks``) is in
:mod:`jaxkv.vllm_parity.swap`, which shares this module's validation helpers.

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
are not checked, unless the check mode stages the same checks with checkify (:mod:`jaxkv.checks`):
pairs or ids out of range are then dropped (never wrapped or clamped onto a real block), and with
duplicate destinations one of the writes wins, unspecified which.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.checks import as_checked, below, check_mode, require, xp

KVCaches = Any
"""A pytree of per-layer cache arrays (``list``/``tuple``/``dict`` or a single array)."""

DEFAULT_BLOCK_AXIS = 1
"""Block axis of the Pallas layout ``[2, num_blocks, num_kv_heads, block_size, head_size]``."""


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

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


def _check_range(ids, name: str, num_blocks: int) -> None:
    """Every entry of ``ids`` (``int[n]``, reported as ``{name}[i]``) is in ``[0, num_blocks)``.

    Host check when concrete, checkify when traced and the check mode is on (:mod:`jaxkv.checks`).
    """
    mode = check_mode(ids)
    if mode is None:
        return
    ids = as_checked(mode, ids)
    require(mode, (ids >= 0) & below(ids, num_blocks),
            f"{name}[{{i}}]={{value}} is out of range [0, num_blocks={num_blocks})", index_names=("i",),
            value=ids)


def _check_pairs(src_to_dst, num_src_blocks: int, num_dst_blocks: int):
    """Shape/dtype of ``src_to_dst``; its values (ranges, distinct destinations) on the host when
    concrete, with checkify when traced and the check mode is on."""
    src_to_dst = _as_index_array(src_to_dst, "src_to_dst")
    if src_to_dst.ndim != 2 or src_to_dst.shape[1] != 2:
        raise ValueError(f"src_to_dst.shape={src_to_dst.shape} must be [num_pairs, 2]")
    mode = check_mode(src_to_dst)
    if mode is None or src_to_dst.shape[0] == 0:
        return src_to_dst
    pairs = as_checked(mode, src_to_dst)
    src, dst = pairs[:, 0], pairs[:, 1]
    require(mode, (src >= 0) & below(src, num_src_blocks), "src_to_dst[{i}, 0]={value} (source block) is "
            f"out of range [0, num_blocks={num_src_blocks})", index_names=("i",), value=src)
    require(mode, (dst >= 0) & below(dst, num_dst_blocks), "src_to_dst[{i}, 1]={value} (destination "
            f"block) is out of range [0, num_blocks={num_dst_blocks})", index_names=("i",), value=dst)
    is_dup, first = _duplicates(mode, dst)
    require(mode, ~is_dup, "src_to_dst[{i}, 1]={value} is a duplicate destination block "
            "(also src_to_dst[{j}, 1])", index_names=("i",), value=dst, j=first)
    return src_to_dst


def _duplicates(mode: str, x):
    """``(is_dup, first)``: ``is_dup[i]`` when ``x[i]`` equals an earlier entry, ``first[i]`` the index
    of the first entry equal to ``x[i]``. One stable sort, NumPy or jnp."""
    np_ = xp(mode)
    order = np_.argsort(x, stable=True)
    ordered = x[order]
    k = np_.arange(x.shape[0])
    repeat = np_.concatenate([np_.zeros(1, bool), ordered[1:] == ordered[:-1]])
    start = np_.where(repeat, 0, k)  # group start position in sorted order, carried forward:
    start = np.maximum.accumulate(start) if mode == "host" else jax.lax.cummax(start)
    if mode == "host":
        is_dup, first = np.empty_like(repeat), np.empty_like(order)
        is_dup[order], first[order] = repeat, order[start]
        return is_dup, first
    return (jnp.zeros_like(repeat).at[order].set(repeat),
            jnp.zeros_like(order).at[order].set(order[start]))


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


_copy_jit = jax.jit(_copy_impl, static_argnames="block_axis")
_copy_jit_donated = jax.jit(_copy_impl, static_argnames="block_axis", donate_argnums=0)
_zero_jit = jax.jit(_zero_impl, static_argnames="block_axis")
_zero_jit_donated = jax.jit(_zero_impl, static_argnames="block_axis", donate_argnums=0)


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
            Under ``jax.jit`` the ids are traced and not checked, unless the check mode of
            :mod:`jaxkv.checks` stages the same checks (reported through checkify).
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
    _check_range(block_ids, "block_ids", num_blocks)
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
            Under ``jax.jit`` the ids are traced and not checked, unless the check mode of
            :mod:`jaxkv.checks` stages the same checks (reported through checkify).
    """
    return _zero(kv_caches, block_ids, block_axis, _zero_jit)


def zero_blocks_donated(kv_caches: KVCaches, block_ids, *,
                        block_axis: int = DEFAULT_BLOCK_AXIS) -> KVCaches:
    """:func:`zero_blocks` jitted with ``kv_caches`` donated: updated in place, inputs deleted.

    vLLM: ``KVBlockZeroer.zero_block_ids``. A rejected call raises without consuming the caches.
    """
    return _zero(kv_caches, block_ids, block_axis, _zero_jit_donated)
