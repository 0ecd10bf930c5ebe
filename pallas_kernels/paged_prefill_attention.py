"""Paged prefill / chunked-prefill attention: many new query tokens per sequence.

vLLM: ``PagedAttention.forward_prefix`` (``context_attention_fwd``). Each new token attends causally to
the sequence's cached prefix and to the new tokens up to itself, all read from the paged cache after the
new tokens' K/V were written (one code path for prefill, chunked prefill, prefix reuse and mixed
prefill + decode batches, as vLLM's unified attention).

Layout read by the kernel (jaxkv's Pallas backend)::

    q:        [num_tokens, num_heads, head_size]                    # all sequences' new tokens
    kv_cache: [2, num_blocks, num_kv_heads, block_size, head_size]   # 0 = key, 1 = value

One program handles one (KV head, query tile); the tiles (``block_q`` new tokens of one sequence) are
flattened over the batch (:func:`_query_tiles`), so a mixed batch of many decodes and a few long chunks
launches about ``num_tokens / block_q + num_seqs`` tiles per KV head. It gathers the tile's
tokens (at ``query_start_loc[s] + row``) for every query head of the KV head's group, flattened to
``block_q * next_power_of_2(group)`` rows (>= 16, what a Triton dot needs), and streams the sequence's
pages ``pages_per_compute_block`` at a time from the window start of its first token to the causal end of
its last token (pages outside that range are never read), with an online softmax in float32. Head sizes
that are not powers of two are padded to the next one in registers (extra channels masked on load and
never stored).

File shape (design.md §5): ``_paged_prefill_attention_kernel`` (refs) → ``_paged_prefill_attention_pallas``
(grid, BlockSpecs) → ``paged_prefill_attention`` (public, validated, jitted) and
``paged_prefill_attention_reference`` (plain jnp, same signature).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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
from pallas_kernels._tiles import query_tiles
from pallas_kernels.paged_attention import MIN_DOT_ROWS, _check_extras, _check_head_size, _check_q_and_cache


def _tile_kv_range(context_len, q_len, row0, *, block_q: int, block_size: int,
                   sliding_window: int | None, max_pages: int):
    """Keys a tile of query rows ``[row0, row0 + block_q)`` of one sequence can see.

    From the window start of its first token to the causal end of its last token; pages outside are
    never visited (so a sliding window skips whole pages, not just masks them).

    Returns:
        ``(kv_start, kv_end, first_page, end_page)``: key tokens ``[kv_start, kv_end)`` and logical pages
        ``[first_page, end_page)`` (``end_page`` clipped to ``max_pages``); empty for a tile past the
        sequence's queries.
    """
    rows_here = jnp.clip(q_len - row0, 0, block_q)
    kv_end = jnp.where(rows_here > 0, context_len + row0 + rows_here, 0)  # exclusive
    kv_start = 0 if sliding_window is None else jnp.maximum(context_len + row0 - sliding_window + 1, 0)
    first_page = kv_start // block_size
    end_page = jnp.minimum(pl.cdiv(kv_end, block_size), max_pages)
    return kv_start, kv_end, first_page, end_page


class QueryTiles(NamedTuple):
    """The grid's query tiles, flattened over the batch: tile ``t`` covers query rows ``[row0[t], row0[t] +
    block_q)`` of sequence ``seq[t]``. Arrays are ``int32[num_tiles]``; tiles past the work have
    ``q_len == 0`` (no row is valid, nothing is read or written)."""

    seq: jax.Array
    q_start: jax.Array
    q_len: jax.Array
    seq_len: jax.Array
    row0: jax.Array
    num_tiles: int


def num_query_tiles(num_tokens: int, num_seqs: int, *, block_q: int, max_query_len: int) -> int:
    """Static bound on the query tiles of a batch: ``sum_s cdiv(q_len_s, block_q)`` is at most
    ``cdiv(num_tokens, block_q)`` plus one partial tile per sequence with a token, and at most
    ``num_seqs * cdiv(max_query_len, block_q)``."""
    per_seq = num_seqs * pl.cdiv(max(1, max_query_len), block_q)
    return max(1, min(pl.cdiv(num_tokens, block_q) + min(num_seqs, num_tokens), per_seq))


def _query_tiles(query_start_loc, seq_lens, *, block_q: int, max_query_len: int, num_tokens: int) -> QueryTiles:
    """Flatten every sequence's query tiles into one list (vLLM's unified attention walks "q blocks" the
    same way), so the grid grows with the tokens of the batch, not with ``num_seqs x max_query_len``: a
    mixed batch of 256 rows in a 4096-token bucket launches ~400 tiles per KV head instead of 32,768
    mostly empty ones. Within a sequence the last tile (the most keys, causal) comes first."""
    num_tiles = num_query_tiles(num_tokens, seq_lens.shape[0], block_q=block_q, max_query_len=max_query_len)
    seq, row0, q_len, _ = query_tiles(query_start_loc, num_tiles, block_q, last_first=True)
    return QueryTiles(seq=seq, q_start=query_start_loc[seq], q_len=q_len, seq_len=seq_lens[seq], row0=row0,
                      num_tiles=num_tiles)


def _paged_prefill_attention_kernel(
    q_start_ref,       # i32[1]                           query_start_loc[s] of this tile's sequence s
    q_len_ref,         # i32[1]                           new tokens of s (0 for a tile past the work)
    seq_lens_ref,      # i32[1]                           cached + new tokens of s
    row0_ref,          # i32[1]                           the tile's first query index inside s
    block_table_ref,   # i32[max_num_blocks_per_seq + ppcb]   s's blocks (zero-padded)
    q_ref,             # [num_tokens, group, head_size]   this KV head's query heads, every token
    k_cache_ref,       # [num_blocks, block_size, head_size]   key pages of this KV head
    v_cache_ref,       # [num_blocks, block_size, head_size]   value pages of this KV head
    k_scale_ref,       # f32[1]                           k_scale (fp8 dequantisation)
    v_scale_ref,       # f32[1]                           v_scale
    alibi_ref,         # f32[group_p] | None              ALiBi slope of each query head, zero-padded
    o_ref,             # [num_tokens, group, head_size]   output, only this tile's rows are written
    *,
    scale: float,
    block_q: int,
    group_p: int,
    head_p: int,
    max_pages: int,
    step: KVStep,
    sliding_window: int | None,
    logits_soft_cap: float | None,
):
    num_tokens, group, head_size = q_ref.shape
    num_blocks, block_size, _ = k_cache_ref.shape
    block_k = step.block_k
    rows = block_q * group_p  # dot rows: token-major, row = token_in_tile * group_p + head_in_group

    q_start, q_len, seq_len = q_start_ref[0], q_len_ref[0], seq_lens_ref[0]
    context_len = seq_len - q_len
    row0 = row0_ref[0]
    qi = row0 + jnp.arange(block_q)                    # query index inside the sequence [block_q]
    token = q_start + qi                               # row of q / o                   [block_q]
    row_valid = (qi < q_len) & (token < num_tokens)    # [block_q]

    # Index arrays over the padded head group / channels; extra lanes are masked. The channel index is
    # never clipped (masked lanes are not accessed): a clip would hide its contiguity from Triton's
    # axis analysis, which then emits one 2-byte load per element instead of 16-byte vector loads.
    g = jnp.arange(group_p)
    d = jnp.arange(head_p)
    g_valid, d_valid = g < group, d < head_size
    q_mask = jnp.broadcast_to(row_valid[:, None, None] & g_valid[None, :, None] & d_valid[None, None, :],
                              (block_q, group_p, head_p))
    q_index = (jnp.minimum(token, num_tokens - 1)[:, None, None], jnp.minimum(g, group - 1)[None, :, None],
               d[None, None, :])
    q = plgpu.load(q_ref.at[q_index], mask=q_mask)
    q = jnp.where(q_mask, q, 0).reshape(rows, head_p)

    # Position of each row's token in its sequence; -1 for rows past the sequence (they see nothing).
    pos = jnp.where(row_valid, context_len + qi, -1)
    pos_rows = jnp.broadcast_to(pos[:, None], (block_q, group_p)).reshape(rows)
    if alibi_ref is not None:
        slope_rows = jnp.broadcast_to(alibi_ref[...][None, :], (block_q, group_p)).reshape(rows)

    kv_start, kv_end, _, end_page = _tile_kv_range(
        context_len, q_len, row0, block_q=block_q, block_size=block_size, sliding_window=sliding_window,
        max_pages=max_pages)
    k_scale, v_scale = k_scale_ref[0], v_scale_ref[0]

    def fold(j, carry, *, causal):
        """Fold step ``j`` (key positions ``[j * block_k, (j + 1) * block_k)``) into the running softmax.

        ``causal=False``: every key of the step is visible to every row (strictly below the tile's
        first query, no window), so no mask is computed and the gathers are plain."""
        t0 = j * block_k
        page0 = t0 // block_size
        slot0 = t0 & (block_size - 1) if step.tokens < block_size else 0  # powers of two; `%` fails to lower
        page = page0 + jnp.arange(step.pages)
        block_ids = block_table_ref[pl.ds(page0, step.pages)]
        t = t0 + jnp.arange(block_k)                    # key positions of the step [block_k]
        if causal:
            block_ids = jnp.clip(jnp.where(page < end_page, block_ids, 0), 0, num_blocks - 1)
            visible = ((t >= kv_start) & (t < kv_end)).reshape(step.pages, step.tokens)
        else:
            block_ids, visible = jnp.clip(block_ids, 0, num_blocks - 1), None
        k, v = load_kv_step(k_cache_ref, v_cache_ref, block_ids, slot0, step=step, head_size=head_size,
                            visible=visible, masked_loads=True, dtype=q.dtype)
        rel = t[None, :] - pos_rows[:, None]                        # key position - query position
        alibi_bias = None if alibi_ref is None else slope_rows[:, None] * rel.astype(jnp.float32)
        logits = scaled_logits(dot_f32(q, k, contract_b_dim=1), scale=scale, k_scale=k_scale,
                               logits_soft_cap=logits_soft_cap, alibi_bias=alibi_bias)  # f32[rows, block_k]
        if causal:
            allowed = rel <= 0                                      # causal (also hides rows past q_len)
            if sliding_window is not None:
                allowed &= rel > -sliding_window
            logits = jnp.where(allowed, logits, -jnp.inf)
        return online_softmax_step(*carry, logits, v)

    # Steps wholly below the tile's first query: no mask; the rest (the diagonal, the window): masked.
    num_steps = pl.cdiv(jnp.minimum(kv_end, max_pages * block_size), block_k)
    first_step = jnp.minimum(kv_start // block_k, num_steps)
    num_full = 0 if sliding_window is not None else jnp.minimum(
        jnp.where(kv_end > 0, context_len + row0, 0) // block_k, num_steps)

    acc = jnp.zeros((rows, head_p), jnp.float32)
    m = jnp.full((rows,), -jnp.inf, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    carry = lax.fori_loop(0, num_full, functools.partial(fold, causal=False), (acc, m, l))
    acc, m, l = lax.fori_loop(jnp.maximum(first_step, num_full), num_steps,
                              functools.partial(fold, causal=True), carry)
    l_safe = jnp.where(l == 0.0, 1.0, l)  # a row that sees nothing gives 0, not NaN
    out = (acc * v_scale / l_safe[:, None]).reshape(block_q, group_p, head_p).astype(o_ref.dtype)
    # Unclipped indices: masked lanes (rows of other sequences, padded heads/channels) are not written.
    o_index = (token[:, None, None], g[None, :, None], d[None, None, :])
    plgpu.store(o_ref.at[o_index], out, mask=q_mask)


def _paged_prefill_attention_pallas(
    q: jax.Array,                # [num_tokens, num_heads, head_size]
    kv_cache: jax.Array,         # [2, num_blocks, num_kv_heads, block_size, head_size]
    block_tables: jax.Array,     # i32[num_seqs, max_num_blocks_per_seq]
    seq_lens: jax.Array,         # i32[num_seqs]
    query_start_loc: jax.Array,  # i32[num_seqs + 1]
    kv_scales: tuple,       # (f32[1] k_scale, f32[1] v_scale)
    alibi_slopes: jax.Array | None,  # f32[num_heads]
    *,
    scale: float,
    max_query_len: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    block_q: int,
    step: KVStep,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    debug: bool,
) -> jax.Array:
    num_tokens, num_heads, head_size = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    num_seqs, max_pages = block_tables.shape
    group = num_heads // num_kv_heads
    group_p = pl.next_power_of_2(group)
    head_p = padded_head_size(head_size)
    assert block_q * group_p >= MIN_DOT_ROWS, (block_q, group_p)
    ppcb = step.pages

    # A step starting at the last page reads up to ppcb - 1 entries past the table.
    block_tables = jnp.pad(block_tables, ((0, 0), (0, ppcb)))
    tiles = _query_tiles(query_start_loc, seq_lens, block_q=block_q, max_query_len=max_query_len,
                         num_tokens=num_tokens)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_size)
    alibi_spec = None
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
        alibi_slopes = jnp.pad(alibi_slopes, ((0, 0), (0, group_p - group)))
        alibi_spec = pl.BlockSpec((None, group_p), lambda h, t: (h, 0))

    kernel = functools.partial(
        _paged_prefill_attention_kernel, scale=scale, block_q=block_q, group_p=group_p, head_p=head_p,
        max_pages=max_pages, step=step, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap)
    per_tile = pl.BlockSpec((1,), lambda h, t: (t,))
    tokens_block = pl.BlockSpec((num_tokens, None, group, head_size), lambda h, t: (0, h, 0, 0))
    cache_block = (None, num_blocks, None, block_size, head_size)
    in_specs = [
        per_tile,                                                           # q_start of the tile's seq
        per_tile,                                                           # q_len
        per_tile,                                                           # seq_len
        per_tile,                                                           # the tile's first row
        pl.BlockSpec((None, max_pages + ppcb), lambda h, t: (t, 0)),        # the seq's block table
        tokens_block,                                                       # q
        pl.BlockSpec(cache_block, lambda h, t: (0, 0, h, 0, 0)),            # key pages
        pl.BlockSpec(cache_block, lambda h, t: (1, 0, h, 0, 0)),            # value pages
        pl.BlockSpec((1,), lambda h, t: (0,)),                              # k_scale
        pl.BlockSpec((1,), lambda h, t: (0,)),                              # v_scale
        alibi_spec,                                                         # alibi slopes
    ]
    out = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, tiles.num_tiles),
        in_specs=in_specs,
        out_specs=tokens_block,
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_kv_heads, group, head_size), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        debug=debug,
        name=f"paged_prefill_attention_bq{block_q}_g{group_p}_d{head_p}_p{step.pages}x{step.tokens}",
    )(tiles.q_start, tiles.q_len, tiles.seq_len, tiles.row0, block_tables[tiles.seq], q4, kv_cache, kv_cache,
      *kv_scales, alibi_slopes)
    out = out.reshape(num_tokens, num_heads, head_size)
    # Tokens before query_start_loc[0] or past query_start_loc[-1] belong to no sequence and are never written:
    # give them 0.
    token = jnp.arange(num_tokens)
    owned = (token >= query_start_loc[0]) & (token < query_start_loc[-1])
    return jnp.where(owned[:, None, None], out, jnp.zeros((), q.dtype))


def _validate(q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len, k_scale, v_scale,
              alibi_slopes, sliding_window, logits_soft_cap, scale):
    """Shape, dtype and static-argument checks (work on tracers)."""
    _check_q_and_cache(q, kv_cache, k_scale, v_scale, q_layout="[num_tokens, num_heads, head_size]")
    num_heads = q.shape[1]
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables.shape={block_tables.shape} must be "
                         "[num_seqs, max_num_blocks_per_seq]")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens.shape={seq_lens.shape} must be (num_seqs={num_seqs},)")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc.shape={query_start_loc.shape} must be "
                         f"(num_seqs + 1={num_seqs + 1},)")
    for name, arr in (("block_tables", block_tables), ("seq_lens", seq_lens),
                      ("query_start_loc", query_start_loc)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}.dtype={arr.dtype} must be int32")
    if not _is_int(max_query_len) or max_query_len < 1:
        raise ValueError(f"max_query_len={max_query_len!r} must be a positive int (static)")
    _check_extras(num_heads, scale, alibi_slopes, sliding_window, logits_soft_cap)


def check_prefill_call(q, kv_cache, block_tables, seq_lens, query_start_loc, *, max_query_len, k_scale,
                       v_scale, alibi_slopes, sliding_window, logits_soft_cap, scale,
                       query_offset: bool = False) -> None:
    """The checks every paged prefill kernel (Triton, Mosaic GPU) runs on entry: shapes, dtypes and static
    arguments (:func:`_validate`), the metadata values when concrete
    (:func:`pallas_kernels._checks.check_paged_metadata`; ``query_offset``: a ``query_start_loc`` may start
    past 0) and the head size. Raises ``ValueError``."""
    _validate(q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len, k_scale, v_scale,
              alibi_slopes, sliding_window, logits_soft_cap, scale)
    _checks.check_paged_metadata(kv_cache, block_tables, seq_lens, query_start_loc, num_tokens=q.shape[0],
                                 max_query_len=max_query_len, query_offset=query_offset)
    _check_head_size(q.shape[-1])


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


_STATIC = ("scale", "max_query_len", "sliding_window", "logits_soft_cap")

_paged_prefill_attention_jit = jax.jit(
    _paged_prefill_attention_pallas,
    static_argnames=_STATIC + ("block_q", "step", "num_warps", "num_stages",
                               "interpret", "debug"))


def paged_prefill_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float,
    max_query_len: int,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int = tuning.PREFILL_NUM_STAGES,
    interpret: bool = False,
    debug: bool = False,
) -> jax.Array:
    """Causal varlen attention of new tokens over the paged cache (Pallas, Triton lowering).

    vLLM: ``PagedAttention.forward_prefix`` → ``context_attention_fwd``; also serves mixed prefill +
    decode batches (vLLM's unified attention): sequences with ``query_len == 1`` are ordinary rows.

    New token ``i`` of sequence ``s`` sits at position ``p = seq_len - query_len + i`` and sees the keys
    ``t <= p`` (and ``t > p - sliding_window``). Logits ``scale * k_scale * q·k`` → soft cap → ``+ slope[h]
    * (t - p)`` with ALiBi; output ``v_scale * softmax @ v``. The new tokens' K/V must already be in the
    cache (write first, then attend).

    Jitted internally; the tuning knobs, ``scale``, ``max_query_len``, ``sliding_window``,
    ``logits_soft_cap``, ``interpret`` and ``debug`` are static. With concrete (non-traced) metadata the
    values are checked on the host before launch, which syncs on them; under ``jax.jit`` only shapes are,
    unless the check mode stages the value checks (``jaxkv.checks``).

    Args:
        q: ``[num_tokens, num_heads, head_size]`` f32/bf16/f16, the new tokens of all sequences,
            concatenated. Tokens before ``query_start_loc[0]`` or past ``query_start_loc[-1]`` belong to no
            sequence: their output is 0.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` in ``q.dtype`` or fp8
            (``float8_e4m3fn`` / ``float8_e5m2``, dequantised in registers), holding every token of every
            sequence up to its ``seq_len`` (the new ones included); index 0 keys, 1 values.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``; entries past
            ``cdiv(seq_lens[s], block_size)`` are never read.
        seq_lens: ``int32[num_seqs]`` cached + new tokens per sequence.
        query_start_loc: ``int32[num_seqs + 1]``; sequence ``s`` owns tokens
            ``[query_start_loc[s], query_start_loc[s+1])`` of ``q``; it may start past 0 (the tokens before
            are someone else's: ``jaxkv.attention.dispatch`` runs a mixed batch's leading decodes on the decode kernel
            so). A sequence with no new token (a padding dummy) costs nothing and writes nothing.
        scale: softmax scale, usually ``head_size ** -0.5``.
        max_query_len: bound on every ``query_len`` (static; sets the grid's query-tile count).
        k_scale, v_scale: f32 scalars, fp8 dequantisation scales; required for an fp8 cache, default 1.
        alibi_slopes: ``f32[num_heads]`` or ``None``.
        sliding_window: window in tokens, the query token included, or ``None``.
        logits_soft_cap: soft cap of the logits, or ``None``.
        block_q: query tokens per program, a power of two (raised so that ``block_q *
            next_power_of_2(group) >= 16``); ``None``: :func:`pallas_kernels.tuning.prefill_block_q`.
        pages_per_compute_block: blocks per inner-loop step, a power of two; ``None``:
            :func:`pallas_kernels.tuning.prefill_pages_per_compute_block`.
        num_warps: ``None``: :func:`pallas_kernels.tuning.prefill_num_warps`. num_stages: Triton
            pipelining stages.
        interpret: run the kernel in the Pallas interpreter (CPU).
        debug: print the kernel's jaxpr and Triton IR.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: inconsistent shapes, unsupported dtype, head size > 256, non-int32 metadata, an fp8
            cache without scales, a bad window / cap / tuning knob, a block size that is not a power of
            two; with concrete metadata also a ``query_start_loc`` that starts below 0, decreases or
            runs past ``num_tokens``, a ``query_len`` above ``max_query_len`` or its ``seq_len``, a block
            table too narrow for a ``seq_len`` or holding a block id outside the cache among the blocks
            a sequence reads (:func:`pallas_kernels._checks.check_paged_metadata`, shared with decode).
    """
    check_prefill_call(q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len=max_query_len,
                       k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                       sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                       query_offset=True)
    head_size, block_size = q.shape[-1], kv_cache.shape[3]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two for the Pallas kernel")
    max_query_len = int(max_query_len)
    sliding_window = None if sliding_window is None else int(sliding_window)
    group = q.shape[1] // kv_cache.shape[2]
    if block_q is None:
        block_q = tuning.prefill_block_q(group, head_size, max_query_len, jnp.dtype(q.dtype).itemsize)
    if pages_per_compute_block is None:
        pages_per_compute_block = tuning.prefill_pages_per_compute_block(
            block_size, head_size, jnp.dtype(kv_cache.dtype).itemsize)
    for name, value in (("block_q", block_q), ("pages_per_compute_block", pages_per_compute_block)):
        if not _is_int(value) or value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value!r} must be a power of two >= 1")
    step = kv_step(block_size=block_size, head_size=head_size, itemsize=jnp.dtype(kv_cache.dtype).itemsize,
                   pages=int(pages_per_compute_block), max_tile_bytes=tuning.PREFILL_MAX_TILE_BYTES)
    group_p = pl.next_power_of_2(group)
    block_q = max(int(block_q), pl.cdiv(MIN_DOT_ROWS, group_p))  # powers of two: rows >= 16
    if num_warps is None:
        num_warps = tuning.prefill_num_warps(block_q * group_p, head_size)
    return _paged_prefill_attention_jit(
        q, kv_cache, block_tables, seq_lens, query_start_loc, kv_scales(k_scale, v_scale), alibi_slopes,
        scale=scale, max_query_len=max_query_len, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, block_q=block_q, step=step, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, debug=debug)


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_prefill_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float,
    max_query_len: int,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Causal varlen attention over the paged cache (plain jnp, float32 softmax), same contract as
    :func:`paged_prefill_attention`.

    Gathers every sequence's blocks into dense float32 K/V and its queries into
    ``[num_seqs, max_query_len, ...]``. Used by tests, ``scripts/accuracy.py`` and as the CPU
    implementation of ``jaxkv.attention.dispatch`` (``impl="reference"``).

    Args:
        q: ``[num_tokens, num_heads, head_size]``, the new tokens of all sequences, concatenated.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` holding every token of every
            sequence up to its ``seq_len`` (the new ones included).
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]`` cached + new tokens.
        query_start_loc: ``int32[num_seqs + 1]``; sequence ``s`` owns tokens
            ``[query_start_loc[s], query_start_loc[s+1])`` of ``q``. Tokens past ``query_start_loc[-1]``
            are padding: their output is 0.
        scale: softmax scale.
        max_query_len: static bound on ``query_start_loc[s+1] - query_start_loc[s]``.
        k_scale, v_scale, alibi_slopes, sliding_window, logits_soft_cap: as in
            :func:`pallas_kernels.paged_attention.paged_attention`, with the query token's own position
            ``p`` in place of ``seq_len - 1`` (ALiBi bias ``slope * (t - p)``, window ``t > p - window``).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: the shape / dtype / static-argument checks of :func:`paged_prefill_attention`
            (values are not checked: it is jitted).
    """
    _validate(q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len, k_scale, v_scale,
              alibi_slopes, sliding_window, logits_soft_cap, scale)
    num_tokens, num_heads, head_size = q.shape

    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    context_lens = seq_lens - query_lens
    i = jnp.arange(max_query_len)
    q_valid = i[None, :] < query_lens[:, None]                         # [num_seqs, max_q]
    q_idx = jnp.where(q_valid, query_start_loc[:-1, None] + i[None, :], num_tokens)
    qs = q.at[q_idx].get(mode="fill", fill_value=0)                    # [s, max_q, H, D]
    o = paged_attention_dense(qs, context_lens[:, None] + i[None, :], kv_cache, block_tables, seq_lens,
                              scale=scale, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    out = jnp.zeros((num_tokens, num_heads, head_size), jnp.float32)
    out = out.at[q_idx].set(o, mode="drop")
    return out.astype(q.dtype)
