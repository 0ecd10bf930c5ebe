"""Layout of jaxkv's Pallas (Triton) paged-attention kernels."""

from __future__ import annotations

import jax

from pallas_kernels import paged_attention as _pa


class PallasAttentionBackend:
    """One array per layer: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (0 = K, 1 = V).

    Why this layout: the decode kernel runs one program per (sequence, KV head) and reads, for each
    block of the sequence, the ``block_size x head_size`` tile of its KV head. With the KV head before
    the token offset ("HND" inside a block) that tile is one contiguous run of
    ``block_size * head_size * itemsize`` bytes (2 KiB for block 16, head 64, bf16), so every load is a
    full, coalesced burst. In vLLM terms this is FlashAttention's logical shape
    ``(2, num_blocks, block_size, num_kv_heads, head_size)`` with the HND stride order; JAX arrays have no
    strides, so we store it in that physical order and call it our logical shape (identity stride order).
    K and V of a layer stay in one array so a ``pallas_call`` can take both halves without slicing
    (a slice would be a copy of the cache). A whole block of a layer (all heads) is contiguous too, which
    keeps block copy/swap/zero one contiguous run per block half.
    """

    name = "PALLAS"
    # Every block size the compiled float64 fuzz of both kernels covered on the H100 (tests/pallas_kernels/
    # fuzz.py BLOCK_SIZES; README): larger pages mean fewer, larger copies per step (the Mosaic kernels' TMA).
    supported_block_sizes = (8, 16, 32, 64, 128)
    supported_head_sizes = _pa.SUPPORTED_HEAD_SIZES
    supported_dtypes = _pa.SUPPORTED_DTYPES + _pa.FP8_DTYPES  # fp8: dequantised in-kernel

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, int, int, int, int]:
        """vLLM: ``AttentionBackend.get_kv_cache_shape``. Raises ``ValueError`` on non-positive sizes."""
        dims = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                    head_size=head_size)
        for name, value in dims.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """vLLM: ``AttentionBackend.get_kv_cache_stride_order``; identity (see the class docstring)."""
        return (0, 1, 2, 3, 4)

    @staticmethod
    def split_kv_cache(kv_cache: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(kv_cache[0], kv_cache[1])``, each ``[num_blocks, num_kv_heads, block_size, head_size]``.

        vLLM: ``kv_cache.unbind(0)`` of the FlashAttention backends (HND memory). The kernel takes the
        whole array (slicing copies in JAX); this is for reading and tests. Raises ``ValueError`` unless
        ``kv_cache`` is ``[2, ...]`` of rank 5.
        """
        if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"kv_cache.shape={kv_cache.shape} must be "
                             "[2, num_blocks, num_kv_heads, block_size, head_size]")
        return kv_cache[0], kv_cache[1]
