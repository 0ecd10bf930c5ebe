"""KV-cache specs: what one attention layer needs per block (vLLM ``kv_cache_interface.py``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of all specs. vLLM: ``KVCacheSpec``.

    Attributes:
        block_size: tokens per block.
    """

    block_size: int

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size={self.block_size!r} must be a positive int")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block occupies for one layer."""
        raise NotImplementedError

    def replace(self, **changes) -> "KVCacheSpec":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A layer that caches K and V per token. vLLM: ``AttentionSpec``.

    Attributes:
        num_kv_heads: key/value heads of the layer.
        head_size: channels per head.
        dtype: element dtype of the cache (``jnp.bfloat16``, ...); stored as a NumPy dtype.
    """

    num_kv_heads: int
    head_size: int
    dtype: np.dtype

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as e:
            raise ValueError(f"dtype={self.dtype!r} is not a dtype") from e
        object.__setattr__(self, "dtype", dtype)

    @property
    def page_size_bytes(self) -> int:
        """``2 * block_size * num_kv_heads * head_size * itemsize`` (K and V of one block, one layer)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context. vLLM: ``FullAttentionSpec``."""

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Bytes one sequence of ``max_model_len`` tokens needs in this layer (whole blocks)."""
        return -(-max_model_len // self.block_size) * self.page_size_bytes
