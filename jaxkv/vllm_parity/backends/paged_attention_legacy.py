"""vLLM's legacy PagedAttention layout: one flat buffer per block half, split into K/V "views".

vLLM: ``vllm.attention.ops.paged_attn.PagedAttention`` (``get_kv_cache_shape``, ``split_kv_cache``,
``write_to_paged_cache`` → ``ops.reshape_and_cache``).

Memory order of one block (``x = 16 // itemsize`` elements = 16 bytes)::

    K half: [num_kv_heads, head_size // x, block_size, x]     channel d of token o, head h at
            ((h * (head_size // x) + d // x) * block_size + o) * x + d % x
    V half: [num_kv_heads, head_size, block_size]              at (h * head_size + d) * block_size + o

``split_kv_cache`` is a reshape of the flat buffer (torch ``.view``: same memory order), so a token lands
at ``key[block, h, d // x, offset, d % x]`` / ``value[block, h, d, offset]`` only because the write path
(:func:`write_to_paged_cache_legacy`, :func:`reshape_and_cache_legacy`) scatters it in exactly that order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv_cache.backends.base import FLOAT_DTYPES, check_positive_dims
from jaxkv.kv_cache.dtypes import FP8_DTYPES
from jaxkv.kv_cache.write import check_new_tokens


class PagedAttentionLegacyBackend:
    """Layout ``(2, num_blocks, block_size * num_kv_heads * head_size)``, identity stride order.

    vLLM: ``PagedAttention`` (the v0 CUDA paged-attention kernels' layout). The 16-byte ``x`` packing of
    the key lets one thread load 16 contiguous bytes of one token's key; the value is stored
    channel-major so a thread reads a run of tokens of one channel.
    """

    name = "PAGED_ATTN"
    supported_block_sizes = (8, 16, 32)
    supported_head_sizes = (32, 64, 80, 96, 112, 120, 128, 192, 256)
    supported_dtypes = FLOAT_DTYPES + FP8_DTYPES

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        """vLLM: ``PagedAttention.get_supported_head_sizes``."""
        return list(PagedAttentionLegacyBackend.supported_head_sizes)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, int, int]:
        """``(2, num_blocks, block_size * num_kv_heads * head_size)``.

        vLLM: ``PagedAttention.get_kv_cache_shape``. Raises ``ValueError`` on non-positive sizes.
        """
        check_positive_dims(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_size=head_size)
        return (2, num_blocks, block_size * num_kv_heads * head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, int, int]:
        """Identity: the flat per-block buffer is its own memory order."""
        return (0, 1, 2)

    @staticmethod
    def split_kv_cache(kv_cache: jax.Array, num_kv_heads: int,
                       head_size: int) -> tuple[jax.Array, jax.Array]:
        """The K and V halves reshaped to the kernels' views (same memory order, like torch ``.view``).

        vLLM: ``PagedAttention.split_kv_cache``. In JAX each half is a new array (a slice); under
        ``jax.jit`` the slice and reshape fuse into the consumer.

        Args:
            kv_cache: ``dtype[2, num_blocks, block_size * num_kv_heads * head_size]``.
            num_kv_heads: key/value heads.
            head_size: channels per head; a multiple of ``x = 16 // itemsize``.

        Returns:
            ``key_cache``: ``dtype[num_blocks, num_kv_heads, head_size // x, block_size, x]``;
            ``value_cache``: ``dtype[num_blocks, num_kv_heads, head_size, block_size]``.

        Raises:
            ValueError: ``kv_cache`` is not ``[2, num_blocks, n]`` with ``n`` a multiple of
                ``num_kv_heads * head_size``, ``16`` is not a multiple of the itemsize, or ``head_size``
                is not a multiple of ``x``.
        """
        block_size, x = _legacy_dims(kv_cache, num_kv_heads, head_size)
        num_blocks = kv_cache.shape[1]
        key_cache = kv_cache[0].reshape(num_blocks, num_kv_heads, head_size // x, block_size, x)
        value_cache = kv_cache[1].reshape(num_blocks, num_kv_heads, head_size, block_size)
        return key_cache, value_cache


def _x_of(dtype) -> int:
    itemsize = np.dtype(dtype).itemsize
    if 16 % itemsize:
        raise ValueError(f"dtype={np.dtype(dtype)} (itemsize {itemsize}) does not divide 16 bytes")
    return 16 // itemsize


def _legacy_dims(kv_cache, num_kv_heads: int, head_size: int) -> tuple[int, int]:
    """``(block_size, x)`` of a flat legacy cache; raises ``ValueError`` on inconsistent shapes."""
    check_positive_dims(num_kv_heads=num_kv_heads, head_size=head_size)
    if kv_cache.ndim != 3 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache.shape={kv_cache.shape} must be "
                         "[2, num_blocks, block_size * num_kv_heads * head_size]")
    per_block = kv_cache.shape[2]
    if per_block == 0 or per_block % (num_kv_heads * head_size):
        raise ValueError(f"kv_cache.shape[2]={per_block} is not a positive multiple of "
                         f"num_kv_heads * head_size = {num_kv_heads} * {head_size}")
    x = _x_of(kv_cache.dtype)
    if head_size % x:
        raise ValueError(f"head_size={head_size} is not a multiple of x = 16 // itemsize = {x} "
                         f"({kv_cache.dtype})")
    return per_block // (num_kv_heads * head_size), x


def _block_offset(slot_mapping, num_blocks: int, block_size: int):
    # PAD_SLOT_ID (any negative slot) goes to block num_blocks: out of range, dropped by the scatter.
    slots = slot_mapping.astype(jnp.int32)
    block = jnp.where(slots < 0, num_blocks, slots // block_size)
    offset = jnp.where(slots < 0, 0, slots % block_size)
    return block, offset


@jax.jit
def _scatter_flat(kv_cache, key, value, slot_mapping):
    _, num_blocks, per_block = kv_cache.shape
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = per_block // (num_kv_heads * head_size)
    x = _x_of(kv_cache.dtype)
    block, offset = _block_offset(slot_mapping, num_blocks, block_size)
    # Both halves as views of the whole array (reshapes only), so a donated cache is updated in place.
    k_view = kv_cache.reshape(2, num_blocks, num_kv_heads, head_size // x, block_size, x)
    k_new = key.astype(kv_cache.dtype).reshape(num_tokens, num_kv_heads, head_size // x, x)
    # Advanced indices (0, block, offset) split by slices → indexed dim first: [num_tokens, kvh, hs//x, x].
    k_view = k_view.at[0, block, :, :, offset, :].set(k_new, mode="drop")
    v_view = k_view.reshape(2, num_blocks, num_kv_heads, head_size, block_size)
    # → [num_tokens, num_kv_heads, head_size]
    v_view = v_view.at[1, block, :, :, offset].set(value.astype(kv_cache.dtype), mode="drop")
    return v_view.reshape(kv_cache.shape)


def write_to_paged_cache_legacy(kv_cache: jax.Array, key: jax.Array, value: jax.Array,
                                slot_mapping: jax.Array) -> jax.Array:
    """Scatter new tokens' K/V into a flat legacy cache in the order its split views read.

    vLLM: ``PagedAttention.write_to_paged_cache`` → ``ops.reshape_and_cache`` on the split views
    (``kv_cache_dtype="auto"``, no fp8 scaling). Token ``t`` with slot ``s = block * block_size +
    offset`` is written so that ``split_kv_cache(out, ...)`` gives ``key_cache[block, h, d // x, offset,
    d % x] == key[t, h, d]`` and ``value_cache[block, h, d, offset] == value[t, h, d]``. Negative slots
    (``PAD_SLOT_ID``) are skipped. Functional: returns the new cache; under ``jax.jit`` with the cache
    donated the scatter is done in place.

    Args:
        kv_cache: ``dtype[2, num_blocks, block_size * num_kv_heads * head_size]``.
        key: ``[num_tokens, num_kv_heads, head_size]``; cast to the cache dtype.
        value: ``[num_tokens, num_kv_heads, head_size]``; cast to the cache dtype.
        slot_mapping: ``int32/int64[num_tokens]``.

    Returns:
        The updated cache, same shape and dtype.

    Raises:
        ValueError: inconsistent shapes or dtypes; when ``slot_mapping`` is concrete, a slot
            ``>= num_blocks * block_size``. Nothing is written then.
    """
    if key.ndim != 3:
        raise ValueError(f"key.shape={key.shape} must be [num_tokens, num_kv_heads, head_size]")
    _, num_kv_heads, head_size = key.shape
    block_size, _ = _legacy_dims(kv_cache, num_kv_heads, head_size)
    check_new_tokens(key, value, slot_mapping, num_kv_heads=num_kv_heads, head_size=head_size,
                     capacity=kv_cache.shape[1] * block_size)
    return _scatter_flat(kv_cache, key, value, slot_mapping)


@jax.jit
def _scatter_split(key, value, key_cache, value_cache, slot_mapping):
    num_blocks, num_kv_heads, _, block_size, x = key_cache.shape
    block, offset = _block_offset(slot_mapping, num_blocks, block_size)
    k_new = key.astype(key_cache.dtype).reshape(key.shape[0], num_kv_heads, -1, x)
    key_cache = key_cache.at[block, :, :, offset, :].set(k_new, mode="drop")
    value_cache = value_cache.at[block, :, :, offset].set(value.astype(value_cache.dtype), mode="drop")
    return key_cache, value_cache


def reshape_and_cache_legacy(key: jax.Array, value: jax.Array, key_cache: jax.Array,
                             value_cache: jax.Array,
                             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens into the split K/V views; returns the new views.

    vLLM: ``ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, "auto", ...)``.
    ``key_cache[block, h, d // x, offset, d % x] = key[t, h, d]``, ``value_cache[block, h, d, offset] =
    value[t, h, d]`` for every token ``t`` with a non-negative slot ``block * block_size + offset``.
    The views are separate arrays in JAX: rebuild the flat cache with
    ``jnp.stack([k.reshape(num_blocks, -1), v.reshape(num_blocks, -1)])`` if needed, or write the flat
    cache directly with :func:`write_to_paged_cache_legacy`.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``.
        value: ``[num_tokens, num_kv_heads, head_size]``.
        key_cache: ``dtype[num_blocks, num_kv_heads, head_size // x, block_size, x]``, ``x = 16 //
            itemsize``.
        value_cache: ``dtype[num_blocks, num_kv_heads, head_size, block_size]``.
        slot_mapping: ``int32/int64[num_tokens]``.

    Returns:
        ``(key_cache, value_cache)`` updated.

    Raises:
        ValueError: views whose shapes or dtypes disagree with each other or with ``key``/``value``, or
            a concrete slot ``>= num_blocks * block_size``. Nothing is written then.
    """
    if key_cache.ndim != 5:
        raise ValueError(f"key_cache.shape={key_cache.shape} must be "
                         "[num_blocks, num_kv_heads, head_size // x, block_size, x]")
    num_blocks, num_kv_heads, head_size_x, block_size, x = key_cache.shape
    if x != _x_of(key_cache.dtype):
        raise ValueError(f"key_cache.shape[-1]={x} != x = 16 // itemsize = {_x_of(key_cache.dtype)}")
    head_size = head_size_x * x
    expected_v = (num_blocks, num_kv_heads, head_size, block_size)
    if value_cache.shape != expected_v or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache {value_cache.dtype}{list(value_cache.shape)} must be "
                         f"{key_cache.dtype}{list(expected_v)} to match key_cache")
    check_new_tokens(key, value, slot_mapping, num_kv_heads=num_kv_heads, head_size=head_size,
                     capacity=num_blocks * block_size)
    return _scatter_split(key, value, key_cache, value_cache, slot_mapping)
