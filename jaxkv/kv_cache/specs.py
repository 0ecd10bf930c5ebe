"""KV-cache specs: what one attention layer needs per block (vLLM ``vllm/v1/kv_cache_interface.py``).

Hierarchy (vLLM's)::

    KVCacheSpec                     block_size; page_size_bytes, type_id, max_memory_usage_bytes, merge
    └── AttentionSpec               + num_kv_heads, head_size, dtype; K and V per token
        ├── FullAttentionSpec       + optional sliding_window (compute-only window, hybrid manager off)
        │   └── MLAAttentionSpec    one latent vector per token (no factor 2), num_kv_heads == 1
        └── SlidingWindowSpec       + sliding_window (blocks outside the window can be dropped)

Specs are frozen, keyword-only, hashable dataclasses: equal specs hash equal, so they work as static
``jax.jit`` arguments and as dict keys. ``dtype`` is stored as a NumPy dtype (``jnp.bfloat16``,
``"float8_e4m3fn"``, ``np.float16`` ... are all accepted).

:func:`jaxkv.kv_cache.layer_specs.get_kv_cache_spec` builds the per-layer specs from a model's attention layers
(vLLM: ``get_kv_cache_spec`` of ``vllm/v1/worker/gpu/attn_utils.py`` / ``GPUModelRunner.get_kv_cache_spec``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence
from typing import Any, Self

import jax.numpy as jnp
import numpy as np


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive_int(name: str, value: Any) -> int:
    """``value`` as a Python int, or ``ValueError`` naming ``name`` (bools and floats are rejected)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a positive int")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be a positive int") from None
    if as_int <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(as_int)


def _first_difference(specs: Sequence[KVCacheSpec], field_names: Iterable[str]) -> str | None:
    """Message naming the first field in which some ``specs[i]`` differs from ``specs[0]``, else None."""
    field_names = tuple(field_names)
    for i, spec in enumerate(specs[1:], start=1):
        for name in field_names:
            a, b = getattr(specs[0], name), getattr(spec, name)
            if a != b:
                return f"specs[{i}].{name}={b!r} differs from specs[0].{name}={a!r}"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of all specs: the KV-cache format of one layer. vLLM: ``KVCacheSpec``.

    Attributes:
        block_size: tokens per block (the KV-cache manager's block size).
    """

    block_size: int

    def __post_init__(self):
        object.__setattr__(self, "block_size", _check_positive_int("block_size", self.block_size))

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of ``block_size`` tokens occupies for one layer. vLLM: ``page_size_bytes``."""
        raise NotImplementedError

    @property
    def type_id(self) -> str:
        """Identifier of the KV-cache type; layers with equal ``type_id`` can share one block table.

        It differs when the number of cached tokens differs (full vs sliding window, different windows)
        or when the bytes per block differ. vLLM: ``KVCacheSpec.type_id``.
        """
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """Most bytes one request can hold in this layer. vLLM: ``max_memory_usage_bytes(vllm_config)``."""
        raise NotImplementedError

    def replace(self, **changes) -> Self:
        """A copy with ``changes`` applied (validated again; raises ``ValueError`` like the constructor)."""
        return dataclasses.replace(self, **changes)

    def copy_with_new_block_size(self, block_size: int) -> Self:
        """A copy with another ``block_size`` (e.g. the kernel one). vLLM: ``copy_with_new_block_size``."""
        return self.replace(block_size=block_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        """One spec for the layers of one KV-cache group. vLLM: ``KVCacheSpec.merge``.

        The base rule: every spec must be of the same class (``cls`` or a subclass of it) and equal.

        Args:
            specs: the specs of the group's layers (at least one).

        Returns:
            The common spec (specs are immutable, so ``specs[0]`` itself).

        Raises:
            ValueError: ``specs`` is empty, a spec is of another class, or a field differs (the message
                names the field and both values).
        """
        specs = cls._check_merge_inputs(specs)
        diff = _first_difference(specs, (f.name for f in dataclasses.fields(specs[0])))
        if diff is not None:
            raise ValueError(f"cannot merge {cls.__name__}s of one KV-cache group: {diff}")
        return specs[0]

    @classmethod
    def _check_merge_inputs(cls, specs: Sequence[KVCacheSpec]) -> tuple[KVCacheSpec, ...]:
        specs = tuple(specs)
        if not specs:
            raise ValueError("specs=() is empty; merge needs at least one spec")
        for i, spec in enumerate(specs):
            if not isinstance(spec, cls) or type(spec) is not type(specs[0]):
                raise ValueError(f"specs[{i}] is a {type(spec).__name__}; {cls.__name__}.merge needs all "
                                 f"specs of one class, specs[0] is a {type(specs[0]).__name__}")
        return specs


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A layer that caches K and V of every token. vLLM: ``AttentionSpec``.

    Attributes:
        num_kv_heads: key/value heads of the layer.
        head_size: channels per head.
        dtype: element dtype of the cache (any JAX/NumPy dtype, float8 included); stored as a NumPy dtype.
    """

    num_kv_heads: int
    head_size: int
    dtype: np.dtype

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_kv_heads", "head_size"):
            object.__setattr__(self, name, _check_positive_int(name, getattr(self, name)))
        if self.dtype is None:
            raise ValueError("dtype=None is not a dtype")
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
    """Causal attention over the whole context: blocks for every token. vLLM: ``FullAttentionSpec``.

    Attributes:
        sliding_window: ``None`` for plain full attention. When the hybrid allocator is disabled, a
            sliding-window layer is stored as full attention (blocks for all tokens) and computed as
            sliding window: its window is recorded here.
    """

    sliding_window: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window",
                               _check_positive_int("sliding_window", self.sliding_window))

    @property
    def type_id(self) -> str:
        """``f"full_attention_{block_size}_{page_size_bytes}"`` (vLLM's; the window is not part of it)."""
        return f"full_attention_{self.block_size}_{self.page_size_bytes}"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """``cdiv(max_model_len, block_size) * page_size_bytes``: whole blocks for the longest request.

        vLLM: ``FullAttentionSpec.max_memory_usage_bytes`` (without context parallelism).

        Args:
            max_model_len: tokens of the longest request.
            max_num_batched_tokens: ignored here (full attention keeps every token); checked if given.

        Raises:
            ValueError: a length that is not a positive int.
        """
        max_model_len = _check_positive_int("max_model_len", max_model_len)
        if max_num_batched_tokens is not None:
            _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        return _cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: Sequence[FullAttentionSpec]) -> Self:
        """One spec for a group of full-attention layers. vLLM: ``FullAttentionSpec.merge``.

        ``block_size``, ``num_kv_heads``, ``head_size`` and ``dtype`` must agree. Sliding windows: layers
        without one are ignored; the windows that are given must all be equal and the merged spec keeps it
        (so a group of full + windowed layers with the hybrid allocator off keeps its window).

        Raises:
            ValueError: empty ``specs``, a spec that is not a ``FullAttentionSpec`` (an ``MLAAttentionSpec``
                must be merged with ``MLAAttentionSpec.merge``), a differing field, or two different
                sliding windows (the message names the field and the values).
        """
        specs = tuple(specs)
        if cls is FullAttentionSpec and any(isinstance(s, MLAAttentionSpec) for s in specs):
            raise ValueError("MLAAttentionSpec layers must be merged with MLAAttentionSpec.merge, "
                             "not in a FullAttentionSpec group")
        specs = cls._check_merge_inputs(specs)
        diff = _first_difference(specs, (f.name for f in dataclasses.fields(AttentionSpec)))
        if diff is not None:
            raise ValueError(f"cannot merge {cls.__name__}s of one KV-cache group: {diff}")
        windows = sorted({s.sliding_window for s in specs if s.sliding_window is not None})
        if len(windows) > 1:
            raise ValueError(f"sliding_window={windows} differ; all attention layers of one KV-cache "
                             "group must have the same window size")
        return specs[0].replace(sliding_window=windows[0] if windows else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent vector per token. vLLM: ``MLAAttentionSpec``.

    The cache of a layer is one tensor ``dtype[num_blocks, block_size, head_size]`` with
    ``head_size = kv_lora_rank + qk_rope_head_dim`` (e.g. 512 + 64 = 576 for DeepSeek-V2/V3): the latent
    ``c_kv`` and the rotary part of the key, shared by every head; there is no separate V.

    Attributes:
        num_kv_heads: must be 1 (the latent is shared by all heads); defaults to 1.
        sliding_window: must be ``None`` (vLLM: "MLA is not supported for sliding window").
    """

    num_kv_heads: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must be 1 for MLA (one shared latent)")
        if self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} is not supported with MLA")

    @classmethod
    def from_mla_dims(cls, *, block_size: int, kv_lora_rank: int, qk_rope_head_dim: int,
                      dtype) -> MLAAttentionSpec:
        """Spec for a latent of ``kv_lora_rank + qk_rope_head_dim`` channels (vLLM's MLA ``head_size``).

        Raises:
            ValueError: a dimension that is not a positive int (named), or a bad ``dtype``.
        """
        rank = _check_positive_int("kv_lora_rank", kv_lora_rank)
        rope = _check_positive_int("qk_rope_head_dim", qk_rope_head_dim)
        return cls(block_size=block_size, head_size=rank + rope, dtype=dtype)

    @property
    def page_size_bytes(self) -> int:
        """``block_size * num_kv_heads * head_size * itemsize``: one latent per token, no factor 2.

        vLLM: ``AttentionSpec.page_size_bytes`` with ``use_mla=True`` (``coef = 1``).
        """
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @classmethod
    def merge(cls, specs: Sequence[MLAAttentionSpec]) -> Self:
        """One spec for a group of MLA layers: all must be ``MLAAttentionSpec`` and equal.

        vLLM: ``MLAAttentionSpec.merge``.

        Raises:
            ValueError: empty, another class, or a differing field (named with both values).
        """
        return super(FullAttentionSpec, cls).merge(specs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens; older blocks can be freed.

    vLLM: ``SlidingWindowSpec``.

    Attributes:
        sliding_window: tokens each query attends to (itself included).
    """

    sliding_window: int

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "sliding_window", _check_positive_int("sliding_window", self.sliding_window))

    @property
    def type_id(self) -> str:
        """``f"sliding_window_{sliding_window}_{block_size}_{page_size_bytes}"`` (vLLM's)."""
        return f"sliding_window_{self.sliding_window}_{self.block_size}_{self.page_size_bytes}"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        """Bytes one request can hold: the window plus one step's tokens, plus one partial block.

        ``num_tokens = min(sliding_window - 1 + max_num_batched_tokens, max_model_len)``, then
        ``(cdiv(num_tokens, block_size) + 1) * page_size_bytes``: during chunked prefill the cache holds the
        last ``sliding_window - 1`` computed tokens plus the newly scheduled ones, and the window may start
        inside a block (block 4, window of 4 over 6 tokens: ``[XXCD][EF]`` is two blocks).
        vLLM: ``SlidingWindowSpec.max_memory_usage_bytes``.

        Args:
            max_model_len: tokens of the longest request.
            max_num_batched_tokens: most tokens scheduled in one step; ``None`` means a whole request may be
                scheduled at once (no chunked prefill), i.e. ``max_model_len``.

        Raises:
            ValueError: a length that is not a positive int.
        """
        max_model_len = _check_positive_int("max_model_len", max_model_len)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        max_num_batched_tokens = _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (_cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes
