"""Paged attention in plain XLA whose memory follows the scheduled tokens: the CPU implementation.

What ``jaxkv.paged_attention(..., impl="reference")`` runs (the default off GPU, so ``LLM`` and every
script on CPU). The kernels' jnp references (:func:`pallas_kernels.paged_prefill_attention.
paged_prefill_attention_reference`, :func:`pallas_kernels.paged_attention.paged_attention_reference`) gather
``[num_seqs, max_query_len, max_num_blocks_per_seq * block_size]`` logits per head, which the engine's mixed
step (256 request rows, a 4096-token bucket, a 2048-token context) makes 155 GB; they stay as test oracles.
Here the same contract (arguments, outputs, masks, fp8 scales, ALiBi, GQA/MQA) is computed the way the
Triton prefill kernel walks its grid, in XLA loops whose trip counts are the batch's own:

* decode batches (:func:`paged_attention_xla`, one token per sequence): ``DECODE_GROUP`` sequences a step;
* everything else (:func:`paged_prefill_attention_xla`): every sequence's new tokens cut into query tiles
  of ``QUERY_TILE`` tokens (:func:`pallas_kernels._tiles.query_tiles`; a decode beside prefills is a tile
  of one token), one tile a step;
* each group or tile reads its sequences' pages ``chunk_tokens`` keys at a time (whole blocks), only from
  the window start of its first query to the causal end of its last one, with an online softmax in
  float32.

Live memory is one group's or tile's gathered chunk and logits (about ``DECODE_GROUP * chunk_tokens *
num_heads`` floats), whatever the bucket sizes; padding rows (``seq_len`` 0, no token) cost no loop step.
A call whose dense form (every sequence's whole table at once, :func:`dense_bytes`) fits
``DENSE_MAX_BYTES`` runs that form in one step instead, with the same masks: small batches (the decode
buckets of a few sequences, the test suite's engines) then compile and run a handful of ops rather than
loops.
One loop nest per call, not one per kind of row: the engine's step holds one call per layer, and each nest
is compiled code (a mixed step with a separate decode loop beside the tile loop compiled ~2x the attention
code: ~7.5 s and ~90 MB per SmolLM2 step program instead of ~5 s and ~60 MB, at 18 buckets). vLLM: the
unified attention's "q blocks" walk (``triton_unified_attention``), here without a kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._reference import kv_scales
from pallas_kernels._tiles import query_tiles
from pallas_kernels.paged_attention import _validate as _validate_decode
from pallas_kernels.paged_prefill_attention import _validate as _validate_prefill

CHUNK_TOKENS = 256   # keys per step of a context loop (rounded down to whole blocks, at least one block)
QUERY_TILE = 16      # new tokens per query tile (prefill / mixed batches)
DECODE_GROUP = 16    # sequences per step of a decode batch
DENSE_MAX_BYTES = 16 << 20  # a call whose dense form fits this runs as one step, without loops


def dense_bytes(num_seqs: int, max_query_len: int, num_heads: int, num_kv_heads: int, max_len: int,
                head_size: int) -> int:
    """Bytes of the dense form's float32 logits ``[num_seqs, num_heads, max_query_len, max_len]`` and
    gathered K and V ``[num_seqs, num_kv_heads, max_len, head_size]``."""
    return 4 * num_seqs * max_len * (num_heads * max_query_len + 2 * num_kv_heads * head_size)


def _check_knobs(chunk_tokens, query_tile, decode_group, dense_max_bytes) -> None:
    for name, value, low in (("chunk_tokens", chunk_tokens, 1), ("query_tile", query_tile, 1),
                             ("decode_group", decode_group, 1), ("dense_max_bytes", dense_max_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low} (static)")


def _attend(q, q_pos, q_ok, rows, kv_cache, block_tables, seq_lens, *, chunk_tokens, scale, k_scale, v_scale,
            alibi_slopes, sliding_window, logits_soft_cap):
    """``G`` query tiles of ``Tq`` tokens each, tile ``g`` of sequence ``rows[g]``.

    Query ``(g, i)`` at position ``p = q_pos[g, i]`` sees key ``t`` iff ``q_ok[g, i]``, ``t <= p``,
    ``t < seq_lens[rows[g]]`` and, with a window, ``t > p - sliding_window`` (the references' rule).

    Args:
        q: ``f32[G, Tq, num_heads, head_size]``.
        q_pos: ``int32[G, Tq]``; q_ok: ``bool[G, Tq]``; rows: ``int32[G]`` in ``[0, num_seqs)``.
        chunk_tokens: keys per loop step, rounded down to whole blocks (at least one block); one that
            covers ``max_num_blocks_per_seq`` blocks gives the dense form: one step, no loop.
        kv_cache, block_tables, seq_lens, and the options: as in the public ops.

    Returns:
        ``f32[G, Tq, num_heads, head_size]`` (0 for a query that sees no key).
    """
    num_tiles, tq, num_heads, head_size = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    pages = max(1, chunk_tokens // block_size)
    chunk = pages * block_size
    max_blocks = block_tables.shape[1]
    num_chunks = -(-max_blocks // pages)
    k_scale, v_scale = kv_scales(k_scale, v_scale)

    lens = seq_lens[rows]                                                   # [G]
    tables = jnp.clip(block_tables[rows], 0, num_blocks - 1)
    tables = jnp.pad(tables, ((0, 0), (0, num_chunks * pages - max_blocks)))  # whole chunks, never sliced short
    qg = q.reshape(num_tiles, tq, num_kv_heads, group, head_size).transpose(0, 2, 3, 1, 4)  # [G, kvh, g, Tq, D]

    # keys the tiles can see: [kv_start, kv_end)
    pos_ok = jnp.where(q_ok, q_pos, -1)
    kv_end = jnp.max(jnp.minimum(pos_ok.max(axis=1) + 1, lens))
    if sliding_window is None:
        tile_start = jnp.zeros((num_tiles,), jnp.int32)
    else:  # keys before every query's window may be freed pages (any bytes, NaN): never read into p @ v
        first = jnp.where(q_ok, q_pos, jnp.iinfo(jnp.int32).max).min(axis=1)
        tile_start = jnp.maximum(first - sliding_window + 1, 0)
    c_first = tile_start.min() // chunk
    c_end = jnp.maximum((kv_end + chunk - 1) // chunk, c_first)

    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1)

    def step(c, carry):
        acc, m, l = carry
        ids = lax.dynamic_slice_in_dim(tables, c * pages, pages, axis=1)     # [G, pages]
        kv = kv_cache[:, ids]                                                 # [2, G, pages, kvh, bs, D]
        kv = kv.transpose(0, 1, 3, 2, 4, 5).reshape(2, num_tiles, num_kv_heads, chunk, head_size)
        t = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        t_ok = (t[None, :] < lens[:, None]) & (t[None, :] >= tile_start[:, None])  # [G, chunk]
        kv = jnp.where(t_ok[None, :, None, :, None], kv.astype(jnp.float32), 0.0)  # pages may hold NaN
        logits = jnp.einsum("gkhqd,gktd->gkhqt", qg, kv[0], precision=lax.Precision.HIGHEST)
        logits = logits * (scale * k_scale[0])
        if logits_soft_cap is not None:
            logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
        rel = t[None, None, :] - q_pos[:, :, None]                            # [G, Tq, chunk]: t - p
        if alibi_slopes is not None:
            logits += slopes * rel[:, None, None].astype(jnp.float32)
        allowed = t_ok[:, None, :] & (rel <= 0) & q_ok[:, :, None]
        if sliding_window is not None:
            allowed &= rel > -sliding_window
        logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
        m_next = jnp.maximum(m, logits.max(axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_next), 0.0, m_next)                # a query that sees nothing stays 0
        p = jnp.exp(logits - m_safe[..., None])
        correction = jnp.exp(m - m_safe)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("gkhqt,gktd->gkhqd", p, kv[1],
                                                       precision=lax.Precision.HIGHEST)
        return acc, m_next, l

    shape = (num_tiles, num_kv_heads, group, tq)
    init = (jnp.zeros(shape + (head_size,), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32))
    if num_chunks == 1:  # the dense form
        acc, _, l = step(0, init)
    else:
        acc, _, l = lax.fori_loop(c_first, c_end, step, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None] * v_scale[0]
    return out.transpose(0, 3, 1, 2, 4).reshape(num_tiles, tq, num_heads, head_size)


_STATIC = ("scale", "sliding_window", "logits_soft_cap", "chunk_tokens", "dense_max_bytes")


@functools.partial(jax.jit, static_argnames=_STATIC + ("decode_group",))
def paged_attention_xla(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array, *,
                        scale: float, k_scale: jax.Array | float | None = None,
                        v_scale: jax.Array | float | None = None, alibi_slopes: jax.Array | None = None,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        chunk_tokens: int = CHUNK_TOKENS, decode_group: int = DECODE_GROUP,
                        dense_max_bytes: int = DENSE_MAX_BYTES) -> jax.Array:
    """Paged decode attention (one new token per sequence), same contract as
    :func:`pallas_kernels.paged_attention.paged_attention`, in XLA loops (module docstring).

    Args:
        q: ``[num_seqs, num_heads, head_size]``, each sequence's token at position ``seq_len - 1``.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, the model dtype or fp8.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]``; a sequence of length 0 gets 0.
        scale: softmax scale (static).
        k_scale, v_scale: fp8 dequantisation scales (needed with an fp8 cache).
        alibi_slopes: ``f32[num_heads]`` or None; sliding_window, logits_soft_cap: static or None.
        chunk_tokens: keys per loop step (rounded down to whole blocks, at least one); decode_group:
            sequences per loop step; dense_max_bytes: calls whose dense form (:func:`dense_bytes`) fits
            run it in one step instead (static tuning knobs; the result does not depend on them).

    Returns:
        ``[num_seqs, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: the shape / dtype / static-argument checks of the decode kernel (values are not
            checked here; :func:`jaxkv.paged_attention` checks concrete metadata first), or a tuning
            knob out of range.
    """
    _validate_decode(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, sliding_window,
                     logits_soft_cap, scale)
    _check_knobs(chunk_tokens, 1, decode_group, dense_max_bytes)
    num_seqs, num_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    max_len = block_tables.shape[1] * block_size
    options = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if dense_bytes(num_seqs, 1, num_heads, num_kv_heads, max_len, head_size) <= dense_max_bytes:
        rows = jnp.arange(num_seqs, dtype=jnp.int32)
        out = _attend(q[:, None].astype(jnp.float32), (seq_lens - 1)[:, None], jnp.ones((num_seqs, 1), bool),
                      rows, kv_cache, block_tables, seq_lens, chunk_tokens=max_len, **options)
        return out[:, 0].astype(q.dtype)
    g = min(decode_group, num_seqs)
    q_pad = jnp.pad(q, ((0, g), (0, 0), (0, 0)))
    out = jnp.zeros((num_seqs + g, num_heads, head_size), jnp.float32)

    def step(i, out):  # sequences [i * g, i * g + g), one query each at position seq_len - 1
        rows = i * g + jnp.arange(g, dtype=jnp.int32)
        ok = rows < num_seqs
        rows = jnp.minimum(rows, num_seqs - 1)
        qs = lax.dynamic_slice_in_dim(q_pad, i * g, g).astype(jnp.float32)[:, None]
        o = _attend(qs, (seq_lens[rows] - 1)[:, None], ok[:, None], rows, kv_cache, block_tables, seq_lens,
                    chunk_tokens=chunk_tokens, **options)
        return lax.dynamic_update_slice_in_dim(out, o[:, 0], i * g, axis=0)

    out = lax.fori_loop(0, -(-num_seqs // g), step, out)
    return out[:num_seqs].astype(q.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC + ("max_query_len", "query_tile"))
def paged_prefill_attention_xla(q: jax.Array, kv_cache: jax.Array, block_tables: jax.Array,
                                seq_lens: jax.Array, query_start_loc: jax.Array, *, scale: float,
                                max_query_len: int, k_scale: jax.Array | float | None = None,
                                v_scale: jax.Array | float | None = None, alibi_slopes: jax.Array | None = None,
                                sliding_window: int | None = None,
                                logits_soft_cap: float | None = None, chunk_tokens: int = CHUNK_TOKENS,
                                query_tile: int = QUERY_TILE, dense_max_bytes: int = DENSE_MAX_BYTES) -> jax.Array:
    """Causal varlen attention over the paged cache (prefill, chunked prefill, prefix reuse, mixed
    batches), same contract as :func:`pallas_kernels.paged_prefill_attention.paged_prefill_attention`, in
    XLA loops (module docstring). vLLM: ``PagedAttention.forward_prefix``.

    Args:
        q: ``[num_tokens, num_heads, head_size]``, the new tokens of all sequences, back to back.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` holding every token of every
            sequence up to its ``seq_len`` (the new ones included).
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]``, cached + new tokens.
        query_start_loc: ``int32[num_seqs + 1]``; sequence ``s`` owns tokens ``[query_start_loc[s],
            query_start_loc[s+1])``, at positions ``seq_len - query_len + i``. Tokens past
            ``query_start_loc[-1]`` are padding: their output is 0.
        scale: softmax scale (static).
        max_query_len: static bound on a sequence's new tokens.
        k_scale, v_scale, alibi_slopes, sliding_window, logits_soft_cap: as in :func:`paged_attention_xla`,
            with the token's own position ``p`` (ALiBi ``slope * (t - p)``, window ``t > p - window``).
        chunk_tokens, query_tile, dense_max_bytes: keys per loop step, new tokens per query tile, the
            largest dense form (:func:`dense_bytes`) run in one step instead of loops (static tuning knobs;
            the result does not depend on them).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: the shape / dtype / static-argument checks of the prefill kernel, or a tuning knob
            out of range.
    """
    _validate_prefill(q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len, k_scale, v_scale,
                      alibi_slopes, sliding_window, logits_soft_cap, scale)
    _check_knobs(chunk_tokens, query_tile, 1, dense_max_bytes)
    num_tokens, num_heads, head_size = q.shape
    num_seqs = seq_lens.shape[0]
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    max_len = block_tables.shape[1] * block_size
    options = dict(scale=scale, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    context_lens = seq_lens - q_lens
    if dense_bytes(num_seqs, max_query_len, num_heads, num_kv_heads, max_len, head_size) <= dense_max_bytes:
        i = jnp.arange(max_query_len, dtype=jnp.int32)
        ok = i[None, :] < q_lens[:, None]                                 # [num_seqs, max_query_len]
        idx = jnp.where(ok, query_start_loc[:-1, None] + i[None, :], num_tokens)
        qs = q.at[idx].get(mode="fill", fill_value=0).astype(jnp.float32)
        o = _attend(qs, context_lens[:, None] + i[None, :], ok, jnp.arange(num_seqs, dtype=jnp.int32), kv_cache,
                    block_tables, seq_lens, chunk_tokens=max_len, **options)
        out = jnp.zeros((num_tokens, num_heads, head_size), jnp.float32).at[idx].set(o, mode="drop")
        return out.astype(q.dtype)
    options["chunk_tokens"] = chunk_tokens
    tq = min(query_tile, max_query_len)
    # one spare tile of rows past the end, so a tile's slice is never shifted back into range
    out = jnp.zeros((num_tokens + tq, num_heads, head_size), jnp.float32)

    # every sequence's new tokens in tiles of tq (a decode is a tile of one token), one tile a step
    bound = max(1, min(-(-num_tokens // tq) + min(num_seqs, num_tokens), num_seqs * -(-max_query_len // tq)))
    tile_seq, tile_row0, _, _ = query_tiles(query_start_loc, bound, tq)
    num_tiles = jnp.sum((q_lens + tq - 1) // tq)
    q_pad = jnp.pad(q, ((0, tq), (0, 0), (0, 0)))

    def tile(j, out):
        s, row0 = tile_seq[j], tile_row0[j]
        i = row0 + jnp.arange(tq, dtype=jnp.int32)
        ok = i < q_lens[s]
        start = query_start_loc[s] + row0
        qs = lax.dynamic_slice_in_dim(q_pad, start, tq).astype(jnp.float32)
        o = _attend(qs[None], (context_lens[s] + i)[None], ok[None], s[None], kv_cache, block_tables, seq_lens,
                    **options)[0]
        old = lax.dynamic_slice_in_dim(out, start, tq)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(ok[:, None, None], o, old), start, axis=0)

    out = lax.fori_loop(0, num_tiles, tile, out)
    return out[:num_tokens].astype(q.dtype)
