"""Paged decode attention: one query token per sequence over a paged KV cache.

vLLM: ``PagedAttention.forward_decode`` (``paged_attention_v1`` / ``paged_attention_v2`` CUDA kernels).

Layout read by the kernel (jaxkv's Pallas backend, see ``jaxkv/kv_cache/backends/pallas.py``)::

    kv_cache: [2, num_blocks, num_kv_heads, block_size, head_size]   # 0 = key, 1 = value

One program handles one (sequence, KV head, context partition). It loads the query rows of every query
head of the KV head's group at once (padded to the 16 rows a Triton dot needs), streams the sequence's
blocks through the block table one step at a time (``pallas_kernels._paging``: whole pages, at least 16
keys per step, or slices of pages too large for one tile), and keeps an online softmax in float32. Head
sizes that are not powers of two are computed padded to the next one. q is read and the output written
in their own layout (``[num_seqs, num_heads, head_size]`` seen as ``[num_seqs, num_kv_heads, group,
head_size]``, a free reshape): the padding rows and lanes exist only in registers, by masked loads and
stores, so no XLA pad, slice or cast runs around the kernel. Each K/V tile is read from memory once per
KV head and used by the whole group.
With ``num_splits > 1`` (vLLM's v2) the context is cut into partitions whose partial outputs, maxima and
sums are written in float32 and merged by a second Pallas kernel (``_merge_partitions_kernel``, vLLM's
``paged_attention_v2_reduce_kernel``), which writes the output in q's dtype and layout: one call is two
kernel launches. The former XLA merge (``merge_impl="xla"``: a max, the weights, two weighted sums, a
divide, a slice and a cast, several small kernels on a GPU) is kept as the reference path.

File shape (design.md §5): ``_paged_attention_kernel`` (refs) → ``_paged_attention_pallas`` (grid,
BlockSpecs, split merge) → ``paged_attention`` (public, validated, jitted) and
``paged_attention_reference`` (plain jnp, same signature).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _checks, tuning
from pallas_kernels._online_softmax import dot_f32, online_softmax_step, scaled_logits
from pallas_kernels._paging import KVStep, kv_step, load_kv_step, padded_head_size
from pallas_kernels._reference import kv_scales, paged_attention_dense

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# vLLM's head sizes (plus 16). Any head size up to MAX_HEAD_SIZE works: the kernels compute with the next
# power of two (>= 16) and mask the extra channels, which never change the result.
SUPPORTED_HEAD_SIZES = (16, 32, 64, 80, 96, 112, 120, 128, 192, 256)
MAX_HEAD_SIZE = 256
MIN_DOT_ROWS = 16  # a Triton dot needs at least 16 rows
MERGE_IMPLS = ("pallas", "xla")  # how split partitions are merged (``paged_attention(merge_impl=...)``)
# Launch parameters of the merge kernel: it moves num_splits x block_h x head_p floats per program; not
# tuned (nothing measured yet).
MERGE_NUM_WARPS = 4
MERGE_NUM_STAGES = 2


def _paged_attention_kernel(
    seq_lens_ref,      # i32[1]                          this sequence's length in tokens
    block_table_ref,   # i32[pages_per_partition]        this sequence's blocks in this partition
    q_ref,             # [group, head_size]              the group's query heads (unpadded)
    k_cache_ref,       # [num_blocks, block_size, head_size]   key pages of this KV head
    v_cache_ref,       # [num_blocks, block_size, head_size]   value pages of this KV head
    k_scale_ref,       # f32[1]                          k_scale (fp8 dequantisation)
    v_scale_ref,       # f32[1]                          v_scale
    alibi_ref,         # f32[block_h] | None             ALiBi slope of each query head
    o_ref,             # [group, head_size] q.dtype (num_splits == 1) | f32[block_h, head_p] partial
    *stats_refs,       # ([block_h] f32 max, [block_h] f32 sum) when num_splits > 1
    scale: float,
    step: KVStep,
    block_h: int,
    normalize: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    masked_loads: bool,
):
    partition = pl.program_id(2)
    num_blocks, block_size, head_size = k_cache_ref.shape
    head_p = padded_head_size(head_size)
    pages_per_partition = block_table_ref.shape[0]
    block_k = step.block_k

    seq_len = seq_lens_ref[0]
    num_pages = pl.cdiv(seq_len, block_size)
    origin = partition * (pages_per_partition * block_size)  # first token of this partition
    window_start = 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)
    # Steps j cover the partition's tokens [j * block_k, (j + 1) * block_k): from the step holding the
    # window start (0 without a window) to the step holding the last token.
    local_end = jnp.minimum(seq_len - origin, pages_per_partition * block_size)
    num_steps = pl.cdiv(jnp.maximum(local_end, 0), block_k)
    first_step = jnp.minimum(jnp.maximum(window_start - origin, 0) // block_k, num_steps)

    q = _load_group_rows(q_ref, block_h, head_p)   # [block_h, head_p], padding rows/lanes 0
    k_scale, v_scale = k_scale_ref[0], v_scale_ref[0]

    def body(i, carry):
        local = (first_step + i) * block_k                  # partition-local first token of the step
        local_page = local // block_size
        slot0 = local & (block_size - 1) if step.tokens < block_size else 0  # block_size: a power of two
        token = origin + local + jnp.arange(block_k)        # [block_k]
        valid = (token < seq_len) & (token >= window_start)
        page = origin // block_size + local_page + jnp.arange(step.pages)
        page_visible = (page < num_pages) & (page >= window_start // block_size)
        block_ids = block_table_ref[pl.ds(local_page, step.pages)]
        block_ids = jnp.clip(jnp.where(page_visible, block_ids, 0), 0, num_blocks - 1)
        # Masked gathers: slots that are not visible (past seq_len, outside the window, pages the
        # sequence does not own) are never read from memory; plain gathers read and zero them.
        k, v = load_kv_step(k_cache_ref, v_cache_ref, block_ids, slot0, step=step, head_size=head_size,
                            visible=valid.reshape(step.pages, step.tokens), masked_loads=masked_loads,
                            dtype=q.dtype)

        alibi_bias = None
        if alibi_ref is not None:
            alibi_bias = alibi_ref[...][:, None] * (token - (seq_len - 1)).astype(jnp.float32)[None, :]
        logits = scaled_logits(dot_f32(q, k, contract_b_dim=1), scale=scale, k_scale=k_scale,
                               logits_soft_cap=logits_soft_cap, alibi_bias=alibi_bias)  # f32[block_h, block_k]
        logits = jnp.where(valid[None, :], logits, -jnp.inf)

        return online_softmax_step(*carry, logits, v)

    acc = jnp.zeros((block_h, head_p), jnp.float32)
    m = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_h,), jnp.float32)
    acc, m, l = lax.fori_loop(0, num_steps - first_step, body, (acc, m, l))
    acc = acc * v_scale

    if normalize:
        l_safe = jnp.where(l == 0.0, 1.0, l)  # an empty sequence gives 0, not NaN
        _store_group_rows(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype))
    else:
        m_ref, l_ref = stats_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _group_rows_index(block_h: int, head_p: int, group: int, head_size: int, *, clip: bool):
    """Index arrays and mask addressing a ``[group, head_size]`` ref as a ``[block_h, head_p]`` tile.

    ``clip``: clip the row index into the ref (loads, so that the interpreter's gather stays in range).
    The channel index is never clipped: masked lanes are not accessed, and a clip would hide the
    index's contiguity from Triton (scalar instead of vector accesses; see paged_prefill_attention).
    """
    g, d = jnp.arange(block_h), jnp.arange(head_p)
    mask = (g < group)[:, None] & (d < head_size)[None, :]
    rows = jnp.minimum(g, group - 1) if clip else g
    return (rows[:, None], d[None, :]), mask


def _load_group_rows(ref, block_h: int, head_p: int):
    """``[group, head_size]`` ref → ``[block_h, head_p]`` value, rows ``>= group`` and lanes
    ``>= head_size`` 0 (masked loads, so nothing outside the ref is read)."""
    group, head_size = ref.shape
    if (group, head_size) == (block_h, head_p):
        return ref[...]
    index, mask = _group_rows_index(block_h, head_p, group, head_size, clip=True)
    value = plgpu.load(ref.at[index], mask=mask)
    return jnp.where(mask, value, jnp.zeros((), value.dtype))  # masked lanes are undefined


def _store_group_rows(ref, value):
    """Store the ``[group, head_size]`` corner of a ``[block_h, head_p]`` value into ``ref`` (masked
    stores: nothing outside the ref is written)."""
    group, head_size = ref.shape
    block_h, head_p = value.shape
    if (group, head_size) == (block_h, head_p):
        ref[...] = value
        return
    index, mask = _group_rows_index(block_h, head_p, group, head_size, clip=False)
    plgpu.store(ref.at[index], value, mask=mask)


def _merge_partitions_kernel(
    acc_ref,   # f32[num_splits, block_h, head_p]  partial outputs (scaled to each partition's max)
    m_ref,     # f32[num_splits, block_h]          partition maxima, -inf for a partition with no key
    l_ref,     # f32[num_splits, block_h]          partition sums of exp(logit - max)
    o_ref,     # [group, head_size] q.dtype        the normalised output of this (sequence, KV head)
):
    """vLLM's ``paged_attention_v2_reduce_kernel``: ``sum_p w_p acc_p / sum_p w_p l_p`` with ``w_p =
    exp(m_p - max_p m_p)``, ``w_p = 0`` for an empty partition, and 0 (not NaN) for an empty sequence.

    Same float32 arithmetic as :func:`_merge_partitions_xla`, one partition at a time (two passes: the
    maximum, then the weighted sums), so any split count works and no more than one ``[block_h, head_p]``
    tile is held at once.
    """
    num_splits, block_h, head_p = acc_ref.shape

    m_max = lax.fori_loop(1, num_splits, lambda p, mx: jnp.maximum(mx, m_ref[p]), m_ref[0])
    m_safe = jnp.where(jnp.isneginf(m_max), 0.0, m_max)  # no partition saw a key: every weight is 0

    def fold(p, carry):
        acc, l_sum = carry
        m = m_ref[p]
        weight = jnp.where(jnp.isneginf(m), 0.0, jnp.exp(m - m_safe))
        return acc + acc_ref[p] * weight[:, None], l_sum + l_ref[p] * weight

    acc, l_sum = lax.fori_loop(0, num_splits, fold, (jnp.zeros((block_h, head_p), jnp.float32),
                                                     jnp.zeros((block_h,), jnp.float32)))
    out = acc / jnp.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    _store_group_rows(o_ref, out.astype(o_ref.dtype))


def _merge_partitions_pallas(acc, m, l, *, group: int, head_size: int, dtype, interpret: bool,
                             debug: bool = False) -> jax.Array:
    """Merge the partitions in one Pallas kernel, grid ``(num_seqs, num_kv_heads)``.

    Args:
        acc: ``f32[num_splits, num_seqs, num_kv_heads, block_h, head_p]`` partial outputs.
        m, l: ``f32[num_splits, num_seqs, num_kv_heads, block_h]`` partition maxima and sums.
        group, head_size: the real rows and channels (``<= block_h``, ``<= head_p``).
        dtype: the output dtype (q's).

    Returns:
        ``[num_seqs, num_kv_heads, group, head_size]`` in ``dtype`` (reshapes freely to
        ``[num_seqs, num_heads, head_size]``).
    """
    num_splits, num_seqs, num_kv_heads, block_h, head_p = acc.shape
    return pl.pallas_call(
        _merge_partitions_kernel,
        grid=(num_seqs, num_kv_heads),
        in_specs=[
            pl.BlockSpec((num_splits, None, None, block_h, head_p), lambda s, h: (0, s, h, 0, 0)),
            pl.BlockSpec((num_splits, None, None, block_h), lambda s, h: (0, s, h, 0)),
            pl.BlockSpec((num_splits, None, None, block_h), lambda s, h: (0, s, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, group, head_size), lambda s, h: (s, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_seqs, num_kv_heads, group, head_size), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=MERGE_NUM_WARPS, num_stages=MERGE_NUM_STAGES),
        interpret=interpret,
        debug=debug,
        name=f"paged_attention_merge_bh{block_h}_d{head_p}_s{num_splits}",
    )(acc, m, l)


def _merge_partitions_xla(acc, m, l, *, group: int, head_size: int, dtype) -> jax.Array:
    """The reference merge in plain XLA ops (same arguments and result as
    :func:`_merge_partitions_pallas`); on a GPU it runs as several small kernels."""
    m_max = m.max(axis=0)
    weight = jnp.where(jnp.isneginf(m), 0.0, jnp.exp(m - m_max[None]))
    l_sum = (l * weight).sum(axis=0)
    o = (acc * weight[..., None]).sum(axis=0)
    o = o / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]
    return o[:, :, :group, :head_size].astype(dtype)


def _paged_attention_pallas(
    q: jax.Array,            # [num_seqs, num_heads, head_size]
    kv_cache: jax.Array,     # [2, num_blocks, num_kv_heads, block_size, head_size]
    block_tables: jax.Array,  # i32[num_seqs, max_num_blocks_per_seq]
    seq_lens: jax.Array,     # i32[num_seqs]
    kv_scales: tuple,   # (f32[1] k_scale, f32[1] v_scale)
    alibi_slopes: jax.Array | None,  # f32[num_heads]
    *,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    masked_loads: bool,
    step: KVStep,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    debug: bool,
    merge_impl: str = "pallas",
) -> jax.Array:
    num_seqs, num_heads, head_size = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    block_h = max(MIN_DOT_ROWS, pl.next_power_of_2(group))
    head_p = padded_head_size(head_size)

    # Pad the block table so each partition holds a whole number of steps (padding is never visible).
    max_pages = block_tables.shape[1]
    pages_per_partition = pl.cdiv(pl.cdiv(max_pages, num_splits), step.pages) * step.pages
    padded_pages = pages_per_partition * num_splits
    if padded_pages != max_pages:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - max_pages)))
    block_tables = block_tables.reshape(num_seqs, num_splits, pages_per_partition)

    # q and the output keep their layout (a free reshape): the kernels pad the group's rows to block_h
    # and the channels to head_p in registers only (masked loads and stores).
    q4 = q.reshape(num_seqs, num_kv_heads, group, head_size)
    group_block = (None, None, group, head_size)
    alibi_spec = None
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
        alibi_slopes = jnp.pad(alibi_slopes, ((0, 0), (0, block_h - group)))
        alibi_spec = pl.BlockSpec((None, block_h), lambda s, h, p: (h, 0))

    normalize = num_splits == 1
    kernel = functools.partial(_paged_attention_kernel, scale=scale, step=step, block_h=block_h,
                               normalize=normalize, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, masked_loads=masked_loads)
    cache_block = (None, num_blocks, None, block_size, head_size)
    in_specs = [
        pl.BlockSpec((1,), lambda s, h, p: (s,)),                                 # seq_lens
        pl.BlockSpec((None, None, pages_per_partition), lambda s, h, p: (s, p, 0)),  # block_tables
        pl.BlockSpec(group_block, lambda s, h, p: (s, h, 0, 0)),                  # q
        pl.BlockSpec(cache_block, lambda s, h, p: (0, 0, h, 0, 0)),               # key pages
        pl.BlockSpec(cache_block, lambda s, h, p: (1, 0, h, 0, 0)),               # value pages
        pl.BlockSpec((1,), lambda s, h, p: (0,)),                                 # k_scale
        pl.BlockSpec((1,), lambda s, h, p: (0,)),                                 # v_scale
        alibi_spec,                                                               # alibi slopes
    ]
    if normalize:
        out_shape = jax.ShapeDtypeStruct((num_seqs, num_kv_heads, group, head_size), q.dtype)
        out_specs = pl.BlockSpec(group_block, lambda s, h, p: (s, h, 0, 0))
    else:
        part = (num_splits, num_seqs, num_kv_heads, block_h)
        out_shape = [jax.ShapeDtypeStruct((*part, head_p), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, block_h, head_p), lambda s, h, p: (p, s, h, 0, 0)),
                     pl.BlockSpec((None, None, None, block_h), lambda s, h, p: (p, s, h, 0)),
                     pl.BlockSpec((None, None, None, block_h), lambda s, h, p: (p, s, h, 0))]

    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        debug=debug,
        name=f"paged_attention_bh{block_h}_d{head_p}_p{step.pages}x{step.tokens}_s{num_splits}",
    )(seq_lens, block_tables, q4, kv_cache, kv_cache, *kv_scales, alibi_slopes)

    if normalize:
        o = out
    elif merge_impl == "pallas":  # merge the partitions (vLLM v2's reduce kernel), all in float32
        o = _merge_partitions_pallas(*out, group=group, head_size=head_size, dtype=q.dtype,
                                     interpret=interpret, debug=debug)
    else:
        o = _merge_partitions_xla(*out, group=group, head_size=head_size, dtype=q.dtype)
    return o.reshape(num_seqs, num_heads, head_size)


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _check_q_and_cache(q, kv_cache, k_scale, v_scale, *, q_layout: str) -> None:
    """Checks shared by the decode and prefill ops: q ``[rows, num_heads, head_size]`` vs the cache."""
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape} must be {q_layout}")
    _, num_heads, head_size = q.shape
    if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache.shape={kv_cache.shape} must be "
                         "[2, num_blocks, num_kv_heads, block_size, head_size]")
    _, _, num_kv_heads, _, cache_head_size = kv_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"kv_cache head_size={cache_head_size} != q head_size={head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    fp8 = jnp.dtype(kv_cache.dtype) in FP8_DTYPES
    if kv_cache.dtype != q.dtype and not fp8:
        raise ValueError(f"kv_cache.dtype={kv_cache.dtype} must equal q.dtype={q.dtype} or be fp8 "
                         f"{[str(d) for d in FP8_DTYPES]}")
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError(f"kv_cache.dtype={kv_cache.dtype} (fp8) needs k_scale and v_scale")


def _check_head_size(head_size: int) -> None:
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size={head_size} not supported by the Pallas kernels (1..{MAX_HEAD_SIZE}; "
                         f"vLLM's sizes: {SUPPORTED_HEAD_SIZES})")


def _check_extras(num_heads: int, scale, alibi_slopes, sliding_window, logits_soft_cap) -> None:
    """Checks of the softmax scale (a positive number) and the optional ALiBi slopes, sliding window and
    soft cap (decode and prefill)."""
    if not (isinstance(scale, (int, float, np.integer, np.floating)) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive number (static)")
    if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
        raise ValueError(f"alibi_slopes.shape={alibi_slopes.shape} must be (num_heads={num_heads},)")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, (int, np.integer))
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int or None")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be > 0 or None")


def _validate(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, sliding_window,
              logits_soft_cap, scale):
    _check_q_and_cache(q, kv_cache, k_scale, v_scale, q_layout="[num_seqs, num_heads, head_size]")
    num_seqs, num_heads, _ = q.shape
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables.shape={block_tables.shape} must be [num_seqs={num_seqs}, "
                         "max_num_blocks_per_seq]")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens.shape={seq_lens.shape} must be (num_seqs={num_seqs},)")
    for name, arr in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={arr.dtype} must be int32")
    _check_extras(num_heads, scale, alibi_slopes, sliding_window, logits_soft_cap)


_STATIC = ("scale", "sliding_window", "logits_soft_cap")


@_checks.host_checked(_checks.check_decode_args)
@functools.partial(jax.jit, static_argnames=_STATIC + (
    "pages_per_compute_block", "num_splits", "num_warps", "num_stages", "masked_loads", "merge_impl",
    "interpret", "debug"))
def paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    pages_per_compute_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    masked_loads: bool | None = None,
    merge_impl: str = "pallas",
    interpret: bool = False,
    debug: bool = False,
) -> jax.Array:
    """Paged decode attention, one new query token per sequence (Pallas, Triton lowering).

    vLLM: ``PagedAttention.forward_decode`` → ``ops.paged_attention_v1`` (``num_splits == 1``) /
    ``ops.paged_attention_v2`` (``num_splits > 1``, partial results merged in float32).

    Logits of query head ``h`` against key token ``t`` of a sequence of ``seq_len`` tokens:
    ``s = scale * k_scale * q·k``; ``s = cap * tanh(s / cap)`` with a soft cap; ``s += slope[h] * (t -
    seq_len + 1)`` with ALiBi; keys with ``t < seq_len - sliding_window`` are invisible (and blocks made
    only of them are not read). Output ``v_scale * softmax(s) @ v``.

    Args:
        q: ``[num_seqs, num_heads, head_size]`` f32/bf16/f16, the query of each sequence's last token.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, ``q.dtype`` or fp8
            (``float8_e4m3fn`` / ``float8_e5m2``, dequantised in-kernel); index 0 keys, 1 values.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``; logical block ``i`` of sequence ``s``
            lives in physical block ``block_tables[s, i]``. Entries past ``cdiv(seq_lens[s], block_size)``
            are never read.
        seq_lens: ``int32[num_seqs]``, tokens of each sequence in the cache (including the new one).
            A length of 0 gives a zero output.
        scale: softmax scale, usually ``head_size ** -0.5`` (static).
        k_scale, v_scale: f32 scalars, the fp8 dequantisation scales (vLLM's ``k_scale``/``v_scale``);
            required for an fp8 cache, default 1.
        alibi_slopes: ``f32[num_heads]`` or ``None``.
        sliding_window: window in tokens, the current token included (static), or ``None``.
        logits_soft_cap: soft cap of the logits (static), or ``None``.
        pages_per_compute_block: blocks loaded per inner-loop step (static); ``None`` picks
            :func:`pallas_kernels.tuning.decode_pages_per_compute_block`. Raised to ``cdiv(16,
            block_size)`` (a dot needs 16 keys), lowered to the block table's width; pages too large
            for one tile are read in slices (``pallas_kernels._paging.kv_step``).
        num_splits: context partitions per sequence (static); 1 is vLLM's v1; ``None`` picks
            :func:`pallas_kernels.tuning.decode_num_splits` from the shapes.
        num_warps, num_stages: Triton launch parameters (static).
        masked_loads: gather K/V with masked loads, so invisible slots are never read (static); with
            ``False`` they are read (from block 0 for pages the sequence does not own) and discarded.
            ``None``: masked only with a sliding window (so blocks outside it are not read); plain
            gathers measured 1-11 % faster otherwise (docs/perf-notes.md).
        merge_impl: how ``num_splits > 1`` partitions are merged (static): ``"pallas"``, one kernel
            writing the output (vLLM's v2 reduce kernel), or ``"xla"``, the former reduction in XLA
            ops (kept as a reference; several small kernels on a GPU). Same float32 arithmetic.
        interpret: run the kernel in the Pallas interpreter (CPU).
        debug: print the kernel's jaxpr and Triton IR.

    Returns:
        ``[num_seqs, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: inconsistent shapes, unsupported dtype, a head size above 256, non-int32
            metadata, an fp8 cache without scales, a bad window or cap, an unknown ``merge_impl``;
            with concrete (non-traced) metadata also, before launch (a host sync), a ``seq_lens``
            entry outside ``[0, max_num_blocks_per_seq * block_size]`` or a block id outside ``[0,
            num_blocks)`` among the blocks a sequence reads
            (:func:`pallas_kernels._checks.check_paged_metadata`). Under ``jax.jit`` these value
            checks are skipped, unless staged by the check mode (``jaxkv.checks``).
    """
    _validate(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, sliding_window,
              logits_soft_cap, scale)
    _check_head_size(q.shape[-1])
    block_size = kv_cache.shape[3]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two for the Pallas kernel")
    if merge_impl not in MERGE_IMPLS:
        raise ValueError(f"merge_impl={merge_impl!r} must be one of {MERGE_IMPLS}")
    if masked_loads is None:
        masked_loads = sliding_window is not None
    if pages_per_compute_block is None:
        pages_per_compute_block = tuning.decode_pages_per_compute_block(
            block_size, q.shape[-1], jnp.dtype(kv_cache.dtype).itemsize)
    if num_splits is None:
        num_splits = tuning.decode_num_splits(q.shape[0], kv_cache.shape[2], block_tables.shape[1],
                                              pages_per_compute_block)
    for name, value in (("pages_per_compute_block", pages_per_compute_block), ("num_splits", num_splits)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if pages_per_compute_block & (pages_per_compute_block - 1):
        raise ValueError(f"pages_per_compute_block={pages_per_compute_block} must be a power of two")
    itemsize = max(jnp.dtype(q.dtype).itemsize, jnp.dtype(kv_cache.dtype).itemsize)
    step = kv_step(block_size=block_size, head_size=q.shape[-1], itemsize=itemsize,
                   pages=pages_per_compute_block, max_tile_bytes=tuning.DECODE_MAX_TILE_BYTES,
                   max_pages=block_tables.shape[1])
    return _paged_attention_pallas(
        q, kv_cache, block_tables, seq_lens, kv_scales(k_scale, v_scale), alibi_slopes, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, masked_loads=masked_loads,
        step=step, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, debug=debug, merge_impl=merge_impl)


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Plain-jnp paged decode attention, same contract as :func:`paged_attention`.

    Gathers every sequence's blocks into a dense ``[num_seqs, num_kv_heads, max_len, head_size]``
    float32 copy and runs a masked float32 softmax. Used by tests, ``scripts/accuracy.py`` and as the
    CPU implementation of ``jaxkv.attention.dispatch``.
    """
    _validate(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, sliding_window,
              logits_soft_cap, scale)
    # decode = one query per sequence, at position seq_len - 1
    out = paged_attention_dense(q[:, None], (seq_lens - 1)[:, None], kv_cache, block_tables, seq_lens,
                                scale=scale, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return out[:, 0].astype(q.dtype)


def default_scale(head_size: int) -> float:
    """The usual softmax scale ``1 / sqrt(head_size)``."""
    return 1.0 / math.sqrt(head_size)
