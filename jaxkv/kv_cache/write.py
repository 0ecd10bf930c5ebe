"""Cache writes: the functional ``reshape_and_cache``.

vLLM: ``PagedAttention.write_to_paged_cache`` → ``ops.reshape_and_cache``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.checks import as_checked, below, check_mode, require, xp
from jaxkv.kv_cache.dtypes import check_scale, is_fp8_dtype, quantize_to_cache
from jaxkv.kv_cache.slot_mapping import PAD_SLOT_ID


def check_new_tokens(key, value, slot_mapping, *, num_kv_heads: int, head_size: int,
                     capacity: int) -> None:
    """Checks shared by every cache write: K/V ``[num_tokens, num_kv_heads, head_size]``, one integer
    slot per token and every slot ``PAD_SLOT_ID`` (-1) or in ``[0, capacity)`` (in tokens).

    The slot values are checked on the host when ``slot_mapping`` is concrete, staged with checkify when
    it is traced and the check mode is on (:mod:`jaxkv.checks`), not at all otherwise.

    Raises:
        ValueError: naming the field and value.
    """
    if key.shape != value.shape:
        raise ValueError(f"key.shape={key.shape} != value.shape={value.shape}")
    if key.ndim != 3 or key.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(f"key.shape={key.shape} must be [num_tokens, num_kv_heads={num_kv_heads}, "
                         f"head_size={head_size}]")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping.shape={slot_mapping.shape} must be (num_tokens={key.shape[0]},)")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping.dtype={slot_mapping.dtype} must be an integer dtype")
    check_slots(slot_mapping, capacity)


def check_slots(slot_mapping, capacity: int, name: str = "slot_mapping") -> None:
    """Every entry of ``slot_mapping`` is ``PAD_SLOT_ID`` (-1) or a slot in ``[0, capacity)``, and no slot occurs
    twice (the write's scatter is declared to have unique indices).

    Host check when concrete, checkify when traced and the check mode is on (:mod:`jaxkv.checks`).

    Raises:
        ValueError: (host) ``slot_mapping[i]=-5 is neither PAD_SLOT_ID=-1 nor a slot in [0,
            num_blocks*block_size=...)``; ``slot_mapping[i]=7 is an earlier token's slot too``.
    """
    mode = check_mode(slot_mapping)
    if mode is None:
        return
    slots = as_checked(mode, slot_mapping)
    ok = (slots == PAD_SLOT_ID) | ((slots >= 0) & below(slots, capacity))
    require(mode, ok, f"{name}[{{i}}]={{value}} is neither PAD_SLOT_ID={PAD_SLOT_ID} nor a slot in "
            f"[0, num_blocks*block_size={capacity})", index_names=("i",), value=slots)
    if slots.shape[0] > 1:  # sorted stably, a valid slot equal to its predecessor repeats an earlier token's
        np_ = xp(mode)
        order = np_.argsort(slots, stable=True)
        ordered = slots[order]
        repeat = np_.concatenate([np_.zeros(1, bool), (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)])
        require(mode, ~repeat[np_.argsort(order)], f"{name}[{{i}}]={{value}} is an earlier token's slot too",
                index_names=("i",), value=slots)


def write_to_paged_cache(kv_cache: jax.Array, key: jax.Array, value: jax.Array,
                         slot_mapping: jax.Array, *, k_scale=None, v_scale=None) -> jax.Array:
    """Scatter new tokens' K/V into their slots and return the updated cache.

    vLLM: ``reshape_and_cache`` (``PagedAttention.write_to_paged_cache``). Tokens whose slot is
    ``PAD_SLOT_ID`` (-1) are dropped, never written; all other slots of the cache keep
    their contents. Functional: the input is not mutated. Under ``jax.jit(..., donate_argnums=...)`` of
    the cache, XLA performs the scatter in place on the donated buffer (no copy of the cache).

    fp8 cache (``kv_cache.dtype`` is ``float8_e4m3fn`` or ``float8_e5m2``, i.e. vLLM's
    ``kv_cache_dtype != "auto"``): keys are stored as ``quantize_to_cache(key, k_scale, dtype)`` and
    values as ``quantize_to_cache(value, v_scale, dtype)`` (``x * (1 / scale)``, saturated to the fp8 range;
    see :mod:`jaxkv.kv_cache.dtypes`). For any other cache dtype the scales are ignored, as vLLM ignores
    them for ``"auto"``.

    Args:
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (Pallas backend layout).
        key: ``[num_tokens, num_kv_heads, head_size]``; cast (or quantised) to the cache dtype.
        value: ``[num_tokens, num_kv_heads, head_size]``; cast (or quantised) to the cache dtype.
        slot_mapping: ``int32/int64[num_tokens]`` slot of each token, ``PAD_SLOT_ID`` to skip; no slot twice
            (the scatter is declared to have unique indices, as a scheduler's step has).
        k_scale: ``f32[]`` key scale (``real ≈ stored * k_scale``); required for an fp8 cache.
        v_scale: ``f32[]`` value scale; required for an fp8 cache.

    Returns:
        The new cache, same shape and dtype.

    Raises:
        ValueError: inconsistent shapes; when ``slot_mapping`` is concrete (not traced), a slot that
            is neither ``PAD_SLOT_ID`` nor in ``[0, num_blocks * block_size)`` (names the index, the
            slot and the bound); fp8 cache with ``k_scale`` or ``v_scale`` missing, not of one element,
            or (when concrete) not finite and positive. Nothing is written in that case. Under
            ``jax.jit`` the slot values are not checked (a traced slot out of range, or any negative
            one, is dropped, never wrapped) unless the check mode stages the check (:mod:`jaxkv.checks`).
    """
    if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache.shape={kv_cache.shape} must be "
                         "[2, num_blocks, num_kv_heads, block_size, head_size]")
    _, num_blocks, num_kv_heads, block_size, head_size = kv_cache.shape
    check_new_tokens(key, value, slot_mapping, num_kv_heads=num_kv_heads, head_size=head_size,
                     capacity=num_blocks * block_size)
    if is_fp8_dtype(kv_cache.dtype):
        k_scale, v_scale = check_scale(k_scale, "k_scale"), check_scale(v_scale, "v_scale")
    else:
        k_scale = v_scale = None
    return _scatter(kv_cache, key, value, slot_mapping, k_scale, v_scale)


@jax.jit
def _scatter(kv_cache, key, value, slot_mapping, k_scale, v_scale):
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[3]
    slot_mapping = slot_mapping.astype(jnp.int32)
    # Slots outside the cache (PAD_SLOT_ID = -1; a negative index would otherwise wrap around to the last block)
    # go to blocks past its end, a different one per token, and the scatter drops them. Every index is then
    # unique (the scheduler gives each token of a step its own slot), which XLA is told: its GPU scatter then
    # stores each element once instead of taking the path for colliding indices.
    outside = (slot_mapping < 0) | (slot_mapping >= num_blocks * block_size)
    block = jnp.where(outside, num_blocks + jnp.arange(slot_mapping.shape[0], dtype=jnp.int32),
                      slot_mapping // block_size)
    offset = jnp.where(outside, 0, slot_mapping % block_size)
    if k_scale is not None:  # fp8 cache: quantise each half with its own scale
        key = quantize_to_cache(key, k_scale, kv_cache.dtype)
        value = quantize_to_cache(value, v_scale, kv_cache.dtype)
    update = jnp.stack([key, value], axis=1).astype(kv_cache.dtype)  # [num_tokens, 2, kvh, hs]
    # Advanced indices separated by slices: the indexed dims come first → [num_tokens, 2, kvh, hs].
    return kv_cache.at[:, block, :, offset, :].set(update, mode="drop", unique_indices=True)

