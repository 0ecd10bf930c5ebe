"""Paged prefill / chunked-prefill attention on Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

Same contract as :func:`pallas_kernels.paged_prefill_attention.paged_prefill_attention` (vLLM's
``PagedAttention.forward_prefix`` / unified attention: varlen batch through ``query_start_loc``, each new
token causal over the cached prefix and the new tokens up to itself) for the subset
:func:`unsupported_reason` accepts; the op-level dispatch (``jaxkv.attention``, ``impl="pallas_mosaic"``)
sends everything else to the Triton-lowered kernel with that reason.

Layout. The cache is the Pallas backend's ``[2, num_blocks, num_kv_heads, block_size, head_size]``
unchanged: one page of one KV head is a contiguous ``block_size x head_size`` tile, one 2-D TMA box.
Queries are re-packed on the host (one XLA gather) into ``[num_kv_heads, num_programs * TT * group_p,
head_size]``: row ``(tile_token * group_p + g)``, i.e. query tokens x the KV group's query heads (padded to
``group_p``, a power of two <= 64) packed into the rows of 64-row ``wgmma`` tiles of ``T = 64 / group_p``
tokens; every sequence's tokens start at a program boundary (``TT = num_consumers * T`` tokens per program),
so a program never straddles two sequences and its output tile never overwrites another sequence's rows.
The output comes back in the same packed layout and one gather returns it to ``[num_tokens, num_heads,
head_size]`` (tokens past ``query_start_loc[-1]`` give 0).

Grid ``(num_kv_heads, num_programs)``, ``num_programs = cdiv(num_tokens, TT) + num_seqs`` (a static bound
on the sum of ``cdiv(query_len, TT)``; the extra programs find no rows and exit), run in reverse order so
that a sequence's last tiles, which see the most keys, start first. Each program has ``num_consumers + 1``
warpgroups:

* the *memory* warpgroup walks the program's key range ``block_kv`` tokens a step (from the sliding-window
  start of its first token to the causal end of its last: pages outside are never read) and issues one TMA
  copy per page (or page slice) into slot ``step % num_stages`` of a shared-memory ring of K and of V
  tiles, the page ids read from the block table. A slot is refilled once every consumer arrived on its
  "consumed" barrier.
* each *consumer* warpgroup owns one 64-row query tile (its own Q tile in shared memory), computes
  ``S = Q Kᵀ`` and ``O += P V`` with ``wgmma`` and keeps an online softmax in float32 with ``exp2``
  (``log2 e`` folded into the logit scale). Steps wholly below its first query (and no window) run without
  a mask; the diagonal and window steps are masked; steps of the program outside its own range (the other
  consumer's diagonal, an earlier window start) are only waited on and released, so every warpgroup sees
  every barrier phase.

What is masked and why. A masked step gives ``-inf`` logits to keys after the row's token (causal), at or
before ``token - sliding_window`` (window), and to every key of rows past the sequence's new tokens (their
output is never gathered back; padded head rows hold zero queries and are dropped the same way). Keys at or past ``seq_len`` (the tail of the last page, pages past
the sequence's end, redirected to block 0) and, with a window, keys before the program's window start
(pages a sliding-window model may have freed, read because they share a step with visible keys) may hold
NaN, and ``0 * NaN`` is NaN in ``P V``: in the steps that hold such keys the consumers zero those V rows
in shared memory before ``P V`` (both consumers may write the same values to the shared tile: a race of
identical values), and their logits are ``-inf`` so NaN keys never reach the softmax. Unmasked steps lie
wholly below the tile's first query, inside the owned pages, with no window.

``P`` goes from registers straight into the ``P V`` ``wgmma`` with the running accumulator updated in
place (FA3) in the compiled kernel; the Mosaic GPU interpreter runs ``wgmma`` only from shared memory and
without an initialised accumulator, so with ``pv_from_smem=True`` (the default when interpreting) P is
written to a per-consumer shared-memory tile and a fresh accumulator is added. Both paths are lowered for
sm_90 in the tests.

Falls back (``unsupported_reason``): float32 queries (``wgmma`` has no f32 path), an fp8 cache (not yet
here: the Triton kernel dequantises it), head sizes other than 64/128/256, more than 64 query heads per KV
head, block sizes that are not a power of two >= 8, ALiBi.

In the interpreter the default is one consumer: with three warpgroups (three CPU threads each running an
XLA computation that blocks in barrier callbacks) the interpreter intermittently deadlocks on the 2-core CPU
machine (observed in about 1 of 10 runs, the stacks inside XLA's execution, not in a barrier wait); two
consumers are tested there only on request (``JAXKV_MGPU_FUZZ``) and compiled on the GPU.

Tested in the Mosaic GPU interpreter on CPU and lowered for sm_90 on CPU
(``tests/pallas_kernels/test_paged_prefill_attention_mgpu.py``); the compiled kernel runs only on a Hopper
GPU (``scripts/gpu_mgpu.sh``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tuning
from pallas_kernels._mgpu_paging import produce_kv_ring
from pallas_kernels._reference import kv_scales
from pallas_kernels._tiles import query_tiles
from pallas_kernels.paged_attention import FP8_DTYPES
from pallas_kernels.paged_attention_mgpu import COMPUTE_DTYPES, LOG2E, ROWS, _tile_transforms
from pallas_kernels.paged_attention_mgpu import HEAD_SIZES  # noqa: F401  (the head sizes this kernel computes too)
from pallas_kernels.paged_attention_mgpu import unsupported_reason as decode_unsupported_reason
from pallas_kernels.paged_prefill_attention import _is_int, check_prefill_call

MAX_CONSUMERS = 2


def unsupported_reason(q_dtype, kv_dtype, num_heads: int, num_kv_heads: int, head_size: int,
                       block_size: int, *, alibi: bool) -> str | None:
    """Why the Mosaic GPU prefill kernel cannot run this call, or ``None`` when it can.

    The op-level dispatch falls back to the Triton prefill kernel with this reason. Static arguments only.
    The decode kernel's rules (:func:`pallas_kernels.paged_attention_mgpu.unsupported_reason`), and no fp8
    cache (not implemented here yet).
    """
    if jnp.dtype(q_dtype) in COMPUTE_DTYPES and jnp.dtype(kv_dtype) in FP8_DTYPES:
        return f"kv_cache.dtype={jnp.dtype(kv_dtype)} (fp8 not implemented in the Mosaic prefill kernel)"
    return decode_unsupported_reason(q_dtype, kv_dtype, num_heads, num_kv_heads, head_size, block_size,
                                     alibi=alibi)


def _prefill_kernel(tile_seq_ref, tile_row0_ref, tile_q_len_ref, seq_lens_ref, tables_ref, q_ref, kv_ref,
                    scales_ref, o_ref, scratch, *, scale: float, block_kv: int, tokens_per_copy: int,
                    num_stages: int, num_consumers: int, group_p: int, num_programs: int,
                    sliding_window: int | None,
                    logits_soft_cap: float | None, pv_from_smem: bool, set_registers: bool):
    (q_smem, k_smem, v_smem, p_smem), (q_bars, k_bars, v_bars), (k_consumed, v_consumed) = scratch
    block_size, head_size = kv_ref.shape[3], kv_ref.shape[4]
    dtype = q_smem.dtype
    tile_tokens = ROWS // group_p                        # T: query tokens of one consumer's 64-row tile
    log2_group = group_p.bit_length() - 1

    h = lax.axis_index("h")
    tile = lax.axis_index("t")
    tile = num_programs - 1 - tile                       # heaviest (last) tiles of each sequence first
    wg = lax.axis_index("wg")

    s = tile_seq_ref[tile]
    row0 = tile_row0_ref[tile]                           # first new token of the program (in its sequence)
    q_len = tile_q_len_ref[tile]                         # 0: a program with no rows (nothing to do)
    seq_len = seq_lens_ref[s]
    context_len = seq_len - q_len
    num_pages = (seq_len + block_size - 1) // block_size

    def key_range(first_row, last_row_excl):
        """Steps ``[first, end)`` a run of rows (new-token indices) sees; empty when it has no rows."""
        rows_here = jnp.clip(jnp.minimum(last_row_excl, q_len) - first_row, 0, None)
        kv_end = context_len + first_row + rows_here                         # exclusive
        kv_start = 0 if sliding_window is None else jnp.maximum(context_len + first_row - sliding_window + 1, 0)
        first = kv_start // block_kv
        end = jnp.where(rows_here > 0, (kv_end + block_kv - 1) // block_kv, first)
        return first, end, rows_here

    prog_first, prog_end, _ = key_range(row0, row0 + num_consumers * tile_tokens)
    prog_kv_start = 0 if sliding_window is None else jnp.maximum(context_len + row0 - sliding_window + 1, 0)
    n = prog_end - prog_first                            # steps the memory warpgroup issues (may be 0)

    @pl.when(wg < num_consumers)
    def _consumer():
        if set_registers:
            plgpu.set_max_registers(232 if num_consumers == 2 else 240, action="increase")
        first_row = row0 + wg * tile_tokens
        my_first, my_end, rows_here = key_range(first_row, first_row + tile_tokens)
        my_first = jnp.where(rows_here > 0, my_first, prog_end)
        my_end = jnp.where(rows_here > 0, my_end, prog_end)
        if sliding_window is None:                       # steps wholly below the tile's first query
            my_full = jnp.clip((context_len + first_row) // block_kv, my_first, my_end)
        else:
            my_full = my_first
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[h, pl.ds((tile * num_consumers + wg) * ROWS, ROWS)], q_tile,
                                q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[wg])
        k_factor = scales_ref[0] * (scale if logits_soft_cap is not None else scale * LOG2E)
        v_scale = scales_ref[1]
        m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.zeros((ROWS, head_size), jnp.float32), plgpu.Layout.WGMMA)

        def skip(j, carry):
            # A step of the program outside this tile's range: keep the barrier phases in step, release it.
            slot = lax.rem(j - prog_first, num_stages)
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_wait(v_bars.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            return carry

        def step(j, carry, *, masked: bool):
            acc, m, l = carry
            slot = lax.rem(j - prog_first, num_stages)
            t0 = j * block_kv
            plgpu.barrier_wait(k_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].T)
                return acc_ref[...]
            logits = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            logits = logits * k_factor
            if logits_soft_cap is not None:
                logits = jnp.tanh(logits * (1.0 / logits_soft_cap)) * (logits_soft_cap * LOG2E)
            if masked:
                shape = (ROWS, block_kv)
                row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                token = t0 + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                qi = first_row + lax.shift_right_logical(row, log2_group)   # new-token index of the row
                pos = context_len + qi                                      # its position in the sequence
                visible = (token <= pos) & (qi < q_len)
                if sliding_window is not None:
                    visible &= token > pos - sliding_window
                logits = jnp.where(visible, logits, -jnp.inf)

            m_next = jnp.maximum(m, logits.max(axis=1))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)   # a row with no visible key stays 0
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(logits - lax.broadcast_in_dim(m_safe, logits.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            plgpu.barrier_wait(v_bars.at[slot])
            v_tile = v_smem.at[slot]
            if masked:
                # V rows no row of the program sees and that may hold NaN: at or past seq_len (unowned
                # slots, block 0) and before the program's window start (pages a sliding-window model
                # may have freed). Identical for both consumers, so their writes agree.
                @pl.when((t0 + block_kv > seq_len) | (t0 < prog_kv_start))
                def _zero_invisible_rows():
                    vrow = t0 + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_size), 0,
                                                       layout=plgpu.Layout.WGMMA)
                    v = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
                    v_tile[...] = jnp.where((vrow < seq_len) & (vrow >= prog_kv_start), v, jnp.zeros_like(v))
                    plgpu.commit_smem()

            if pv_from_smem:
                p_tile = p_smem.at[wg]
                p_tile[...] = p.astype(dtype)
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_tile, v_tile)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_size), jnp.float32))
            else:
                p16 = p.astype(dtype)

                def pv_in_place(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)
                acc = pl.run_state(pv_in_place)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_next, l

        lax.fori_loop(prog_first, my_first, skip, None)
        carry = lax.fori_loop(my_first, my_full, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(my_full, my_end, functools.partial(step, masked=True), carry)
        lax.fori_loop(my_end, prog_end, skip, None)

        l_safe = jnp.where(l == 0.0, 1.0, l)                     # a row that sees nothing gives 0, not NaN
        acc = acc * lax.broadcast_in_dim(v_scale / l_safe, acc.shape, [0])
        q_tile[...] = acc.astype(dtype)                          # the query tile is no longer read
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[h, pl.ds((tile * num_consumers + wg) * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == num_consumers)
    def _memory():
        if set_registers:
            plgpu.set_max_registers(40, action="decrease")

        produce_kv_ring(kv_ref, tables_ref, s, h, step_token=lambda i: (prog_first + i) * block_kv,
                        num_steps=n, num_pages=num_pages, block_kv=block_kv, tokens_per_copy=tokens_per_copy,
                        num_stages=num_stages, k_smem=k_smem, v_smem=v_smem, k_bars=k_bars, v_bars=v_bars,
                        k_consumed=k_consumed, v_consumed=v_consumed)


def _paged_prefill_attention_mgpu(q, kv_cache, block_tables, seq_lens, query_start_loc, scales, *, scale,
                                  sliding_window, logits_soft_cap, block_kv, num_stages, num_consumers,
                                  pv_from_smem, interpret):
    num_tokens, num_heads, head_size = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    group_p = pl.next_power_of_2(group)
    dtype = q.dtype
    tile_tokens = ROWS // group_p
    tokens_per_program = num_consumers * tile_tokens
    num_programs = pl.cdiv(num_tokens, tokens_per_program) + num_seqs
    tokens_per_copy = min(block_size, block_kv)

    tile_seq, tile_row0, tile_q_len, first_program = query_tiles(query_start_loc, num_programs,
                                                               tokens_per_program)

    # Pad the block table so the last step of a sequence (up to block_kv - 1 keys past its end) reads
    # entries inside the table (they are redirected to block 0 anyway).
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pl.cdiv(block_kv, block_size))))

    # Queries into the packed layout: padded token u = program * TT + k holds new token row0 + k of the
    # program's sequence (zeros past its query_len and for padded heads).
    u = jnp.arange(num_programs * tokens_per_program, dtype=jnp.int32)
    prog, k = u // tokens_per_program, u % tokens_per_program
    i = tile_row0[prog] + k
    src = jnp.where(i < tile_q_len[prog], query_start_loc[tile_seq[prog]] + i, num_tokens)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_size)
    qp = q4.at[src].get(mode="fill", fill_value=0)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
    qp = qp.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_size)

    tile = _tile_transforms(head_size, dtype)
    stage_shape = (num_stages, block_kv, head_size)
    smem = (
        plgpu.SMEM((num_consumers, ROWS, head_size), dtype, transforms=tile),    # q, then the output
        plgpu.SMEM(stage_shape, dtype, transforms=tile),                         # K ring
        plgpu.SMEM(stage_shape, dtype, transforms=tile),                         # V ring
        plgpu.SMEM((num_consumers, ROWS, block_kv), dtype,
                   transforms=_tile_transforms(block_kv, dtype)) if pv_from_smem else None,  # P
    )
    copies = block_kv // tokens_per_copy
    barriers = (plgpu.Barrier(num_barriers=num_consumers),
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages))
    consumed = (plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages),) * 2
    kernel = functools.partial(
        _prefill_kernel, scale=scale, block_kv=block_kv, tokens_per_copy=tokens_per_copy,
        num_stages=num_stages, num_consumers=num_consumers, group_p=group_p, num_programs=num_programs,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, pv_from_smem=pv_from_smem, set_registers=not interpret)

    def entry(tile_seq_ref, tile_row0_ref, tile_q_len_ref, seq_lens_ref, tables_ref, q_ref, kv_ref,
              scales_ref, o_ref):
        pl.run_scoped(lambda *scratch: kernel(tile_seq_ref, tile_row0_ref, tile_q_len_ref, seq_lens_ref,
                                              tables_ref, q_ref, kv_ref, scales_ref, o_ref, scratch),
                      smem, barriers, consumed, collective_axes="wg")

    op = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(qp.shape, dtype),
        grid=(num_kv_heads, num_programs),
        grid_names=("h", "t"),
        num_threads=num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    op_out = op(tile_seq, tile_row0, tile_q_len, seq_lens, block_tables, qp, kv_cache, scales)

    # Back to [num_tokens, num_heads, head_size]: token t of sequence s sits at padded token
    # first_program[s] * TT + (t - query_start_loc[s]).
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right", method="compare_all") - 1, 0,
                   num_seqs - 1)
    owned = t < query_start_loc[-1]
    u = jnp.where(owned, first_program[seq] * tokens_per_program + t - query_start_loc[seq], 0)
    out = op_out.reshape(num_kv_heads, -1, group_p, head_size)[:, u, :group]   # [kv, tokens, group, D]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_size)
    return jnp.where(owned[:, None, None], out, jnp.zeros((), dtype))


_STATIC = ("scale", "sliding_window", "logits_soft_cap", "block_kv", "num_stages", "num_consumers",
           "pv_from_smem", "interpret")
_paged_prefill_attention_mgpu_jit = jax.jit(_paged_prefill_attention_mgpu, static_argnames=_STATIC)


def paged_prefill_attention_mgpu(
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
    block_kv: int | None = None,
    num_stages: int | None = None,
    num_consumers: int | None = None,
    pv_from_smem: bool | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal varlen attention of new tokens over the paged cache on Pallas Mosaic GPU (Hopper).

    vLLM: ``PagedAttention.forward_prefix`` → ``context_attention_fwd`` / unified attention. Same arguments,
    semantics and result as :func:`pallas_kernels.paged_prefill_attention.paged_prefill_attention` for the
    calls :func:`unsupported_reason` accepts (bf16/f16 q and cache; head size 64/128/256; at most 64 query
    heads per KV head; block size a power of two >= 8; no ALiBi).

    Args:
        q: ``[num_tokens, num_heads, head_size]`` bf16/f16, the new tokens of all sequences, concatenated;
            tokens past ``query_start_loc[-1]`` are padding (output 0).
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` in ``q.dtype``, holding every
            token of every sequence up to its ``seq_len`` (the new ones included); 0 keys, 1 values.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]`` cached + new tokens per sequence.
        query_start_loc: ``int32[num_seqs + 1]``; sequence ``s`` owns tokens
            ``[query_start_loc[s], query_start_loc[s+1])`` of ``q``.
        scale, max_query_len, k_scale, v_scale, sliding_window, logits_soft_cap: as in the Triton op
            (``max_query_len`` is only checked: the grid is sized by ``num_tokens``).
        alibi_slopes: must be ``None`` (see :func:`unsupported_reason`).
        block_kv: keys per inner step (static, a positive multiple of 64); ``None``:
            :func:`pallas_kernels.tuning.mgpu_prefill_block_kv`.
        num_stages: shared-memory ring depth (static, >= 1); ``None``:
            :func:`pallas_kernels.tuning.mgpu_prefill_num_stages`.
        num_consumers: consumer warpgroups per program, 1 or 2 (64 query rows each); ``None``:
            :data:`pallas_kernels.tuning.MGPU_PREFILL_NUM_CONSUMERS`, 1 when interpreting.
        pv_from_smem: P through shared memory and a fresh accumulator per step (what the interpreter
            runs) instead of P from registers into the running accumulator; ``None``: ``interpret``.
        interpret: run in the Mosaic GPU interpreter (CPU).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: what the Triton op raises (shapes, dtypes, scales, metadata values), a ``block_kv``
            that is not a positive multiple of 64, ``num_stages`` < 1, ``num_consumers`` not 1 or 2.
        NotImplementedError: a call the kernel does not support, with :func:`unsupported_reason`.
    """
    check_prefill_call(q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len=max_query_len,
                       k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                       sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale)
    _, num_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    reason = unsupported_reason(q.dtype, kv_cache.dtype, num_heads, num_kv_heads, head_size, block_size,
                                alibi=alibi_slopes is not None)
    if reason:
        raise NotImplementedError(f"paged_prefill_attention_mgpu: {reason}")
    if num_consumers is None:  # the interpreter sometimes deadlocks with three warpgroups (see module doc)
        num_consumers = 1 if interpret else tuning.MGPU_PREFILL_NUM_CONSUMERS
    if pv_from_smem is None:
        pv_from_smem = bool(interpret)
    if block_kv is None:
        block_kv = tuning.mgpu_prefill_block_kv(head_size)
    if not _is_int(block_kv) or block_kv < 64 or block_kv % 64:
        raise ValueError(f"block_kv={block_kv!r} must be a positive multiple of 64")
    if num_consumers not in (1, MAX_CONSUMERS):
        raise ValueError(f"num_consumers={num_consumers!r} must be 1 or {MAX_CONSUMERS}")
    if num_stages is None:
        num_stages = tuning.mgpu_prefill_num_stages(block_kv, head_size, num_consumers=num_consumers,
                                                    pv_from_smem=pv_from_smem)
    if not _is_int(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be >= 1")
    return _paged_prefill_attention_mgpu_jit(
        q, kv_cache, block_tables, seq_lens, query_start_loc, kv_scales(k_scale, v_scale), scale=scale,
        sliding_window=None if sliding_window is None else int(sliding_window),
        logits_soft_cap=logits_soft_cap, block_kv=int(block_kv), num_stages=int(num_stages),
        num_consumers=int(num_consumers), pv_from_smem=bool(pv_from_smem), interpret=bool(interpret))
