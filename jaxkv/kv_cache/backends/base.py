"""The attention-backend protocol (vLLM ``AttentionBackend``: the layout half of it) and layout helpers.

A backend fixes the memory layout of one layer's KV cache with two functions:

* ``get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)``: the *logical* shape, the
  order in which kernels index the cache (e.g. FlashAttention's ``[2, num_blocks, block_size,
  num_kv_heads, head_size]``);
* ``get_kv_cache_stride_order()``: the order of those logical dims in memory, outermost first. The
  *physical* shape is ``tuple(logical_shape[i] for i in stride_order)``; the logical view of a physical
  array is ``physical.transpose(inverse_stride_order(stride_order))``.

In PyTorch the logical view is a strided view of the same memory. JAX arrays have no strides and
cannot alias: :func:`to_logical` of a non-identity order is a transposed *copy* (under ``jax.jit`` XLA
usually fuses the transpose into its consumer, but the array it returns is laid out in logical order).
Code that must update the cache in place (buffer donation) works on the physical array.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class MultipleOf:
    """A supported size given as "any positive multiple of ``base``". vLLM: ``MultipleOf``.

    Attributes:
        base: the positive int every supported size is a multiple of.
    """

    base: int

    def __post_init__(self):
        if not isinstance(self.base, int) or self.base <= 0:
            raise ValueError(f"base={self.base!r} must be a positive int")

    def __contains__(self, size) -> bool:
        return isinstance(size, int) and size > 0 and size % self.base == 0


class AttentionBackend(Protocol):
    """What the cache allocator needs to know of a backend.

    vLLM: ``AttentionBackend.get_name`` (here the ``name`` attribute), ``get_kv_cache_shape``,
    ``get_kv_cache_stride_order`` (the simple form without ``include_num_layers_dimension``),
    ``get_supported_head_sizes``, ``get_supported_kernel_block_sizes`` and the supported dtypes.

    Backends are plain classes with class attributes and static methods; the class itself is what is
    passed around (``allocate_kv_cache(config, PallasAttentionBackend)``).

    Attributes:
        name: registry name (``get_backend(name)``), upper case.
        supported_block_sizes: ints and/or :class:`MultipleOf` entries (tokens per block).
        supported_head_sizes: channels per head the backend accepts.
        supported_dtypes: cache element dtypes (NumPy dtypes).
    """

    name: str
    supported_block_sizes: tuple[int | MultipleOf, ...]
    supported_head_sizes: tuple[int, ...]
    supported_dtypes: tuple[np.dtype, ...]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """Logical shape of one layer's cache."""
        ...

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Order of the logical dims in memory, outermost first (identity = row-major logical shape)."""
        ...


def check_positive_dims(**dims) -> None:
    """Raise ``ValueError`` naming the first of ``dims`` that is not a positive int."""
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")


def supports_block_size(backend: AttentionBackend, block_size: int) -> bool:
    """Whether ``block_size`` is one of ``backend.supported_block_sizes`` (ints or :class:`MultipleOf`).

    vLLM: the per-backend test inside ``select_common_block_size``.
    """
    return any(block_size in entry if isinstance(entry, MultipleOf) else block_size == entry
               for entry in backend.supported_block_sizes)


def validate_backend_args(backend: AttentionBackend, *, block_size: int, head_size: int,
                          dtype) -> None:
    """Raise ``ValueError`` naming the value when ``backend`` cannot hold such a cache."""
    if not supports_block_size(backend, block_size):
        raise ValueError(f"block_size={block_size} not supported by backend {backend.name}; "
                         f"supported: {backend.supported_block_sizes}")
    if head_size not in backend.supported_head_sizes:
        raise ValueError(f"head_size={head_size} not supported by backend {backend.name}; "
                         f"supported: {backend.supported_head_sizes}")
    if np.dtype(dtype) not in backend.supported_dtypes:
        raise ValueError(f"dtype={np.dtype(dtype)} not supported by backend {backend.name}; "
                         f"supported: {[str(d) for d in backend.supported_dtypes]}")


def inverse_stride_order(stride_order) -> tuple[int, ...]:
    """The permutation that maps a physical array back to logical order.

    ``inv[i] = stride_order.index(i)`` (the seed's ``inv_order`` in ``_reshape_kv_cache``), so
    ``physical.transpose(inv)`` is the logical view when ``physical.shape == tuple(logical_shape[i]
    for i in stride_order)``.

    Raises:
        ValueError: ``stride_order`` is not a permutation of ``0..n-1``.
    """
    order = tuple(stride_order)
    if sorted(order) != list(range(len(order))):
        raise ValueError(f"stride_order={order} is not a permutation of 0..{len(order) - 1}")
    return tuple(order.index(i) for i in range(len(order)))


def physical_kv_cache_shape(backend: AttentionBackend, num_blocks: int, block_size: int,
                            num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """The backend's logical shape permuted by its stride order (the shape of the memory).

    vLLM: ``tuple(kv_cache_shape[i] for i in kv_cache_stride_order)`` in ``_reshape_kv_cache``.

    Raises:
        ValueError: bad sizes (from ``get_kv_cache_shape``), or a stride order that is not a permutation
            of the shape's dims.
    """
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    order = tuple(backend.get_kv_cache_stride_order())
    if len(order) != len(shape):
        raise ValueError(f"stride_order={order} of backend {backend.name} does not match "
                         f"kv_cache_shape={shape}")
    inverse_stride_order(order)
    return tuple(shape[i] for i in order)


def to_logical(physical, stride_order):
    """Logical view of a physical cache array: ``physical.transpose(inverse_stride_order(order))``.

    vLLM: ``raw_tensor.view(kv_cache_shape).permute(*inv_order)``. A copy in JAX when the order is not
    the identity (the identity returns ``physical`` itself).

    Args:
        physical: ``Array[physical shape]`` (``jax.Array`` or ``np.ndarray``).
        stride_order: the backend's ``get_kv_cache_stride_order()``.

    Raises:
        ValueError: ``stride_order`` is not a permutation of ``physical``'s dims.
    """
    inv = inverse_stride_order(stride_order)
    if len(inv) != physical.ndim:
        raise ValueError(f"stride_order={tuple(stride_order)} does not match physical.shape="
                         f"{physical.shape}")
    return physical if inv == tuple(range(len(inv))) else physical.transpose(inv)


def to_physical(logical, stride_order):
    """Physical (memory-order) array of a logical cache: ``logical.transpose(stride_order)``.

    The inverse of :func:`to_logical`; a copy in JAX unless the order is the identity.

    Raises:
        ValueError: ``stride_order`` is not a permutation of ``logical``'s dims.
    """
    order = tuple(stride_order)
    inverse_stride_order(order)
    if len(order) != logical.ndim:
        raise ValueError(f"stride_order={order} does not match logical.shape={logical.shape}")
    return logical if order == tuple(range(len(order))) else logical.transpose(order)


FLOAT_DTYPES = (np.dtype("float32"), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
"""Cache dtypes of 2- and 4-byte floats every jaxkv layout backend stores (plus
:data:`jaxkv.kv_cache.dtypes.FP8_DTYPES`, storage only for the non-Pallas layouts)."""
