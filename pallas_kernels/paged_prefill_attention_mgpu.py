"""Paged prefill / chunked-prefill attention on Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

Same contract as :func:`pallas_kernels.paged_prefill_attention.paged_prefill_attention` (vLLM's
``PagedAttention.forward_prefix`` / unified attention: varlen batch through ``query_start_loc``, each new
token causal over the cached prefix and the new tokens up to itself) for the subset
:func:`unsupported_reason` accepts; the op-level dispatch (``jaxkv.attention.dispatch``, ``impl="pallas_mosaic"``)
sends everything else to the Triton-lowered kernel with that reason.

Layout. The cache is the Pallas backend's ``[2, num_blocks, num_kv_heads, block_size, head_size]``
unchanged: one page of one KV head is a contiguous ``block_size x head_size`` tile, one 2-D TMA box.
``q`` and the output keep their ``[num_tokens, num_heads, head_size]`` layout: a consumer's 64 query rows
are 64 consecutive tokens of one query head, one strided 2-D TMA box in and one out (FlashAttention-3's
and JAX's ``attention_mgpu`` tiling), so no XLA pass packs or unpacks them. ``q`` is padded with zero rows
to a whole number of programs only when ``num_tokens`` is not one.

Work items: one query head over ``TT = num_consumers * 64`` consecutive tokens of the flattened batch
(``cdiv(num_tokens, TT)`` tiles x ``num_heads``), the query heads of a tile next to each other (the heads
of one KV head read the same pages and share them through L2). The grid is one program per item, last
tiles first (a sequence's last tokens see the most keys), or, by default, one persistent program per
SM looping over the items (below). An item's tokens may belong to
several sequences (and past ``query_start_loc[-1]``, to none): it finds the first and last by binary
search over ``query_start_loc`` and walks, sequence by sequence, the keys its rows of that sequence see
(from the sliding-window start of the first row to the causal end of the last: pages outside are never
read). Each program has ``num_consumers + 1`` warpgroups:

* the *memory* warpgroup issues one TMA copy per page (or page slice) of each ``block_kv``-token step
  into slot ``step % num_stages`` of a shared-memory ring of K and of V tiles, the page ids read from the
  block table; the step counter runs on across sequences. A slot is refilled once every consumer arrived
  on its "consumed" barrier.
* each *consumer* warpgroup owns 64 tokens (its own Q tile in shared memory), computes ``S = Q Kᵀ`` and
  ``O += P V`` with ``wgmma`` and keeps an online softmax in float32 with ``exp2`` (``log2 e`` folded into
  the logit scale). Steps wholly below its first query, with all 64 rows in the step's sequence and no
  window, run without a mask; the others are masked; steps of the program it has no rows for are only
  waited on and released, so every warpgroup sees every barrier phase. With two consumers a scheduling
  barrier makes them take turns on the tensor cores (one's softmax runs during the other's ``wgmma``:
  FA3's ping-pong, as in JAX's ``attention_mgpu``).

Persistent programs (``persistent=True``). One program per SM instead of one per (tile, query head) work
item: program ``p`` takes items ``p, p + G, p + 2G, ...`` (heaviest tiles first) and keeps its K/V ring and
step counter running from one item to the next, so the memory warpgroup fetches the next item's pages
(and, into the second of two Q tiles per consumer, its queries) while the consumers finish the current
one; the per-program start (launch, barrier set-up, the chain of scalar loads before the first copy, the
ring's first fill) is paid once per SM instead of once per item. A consumer releases its Q tile (a "Q free"
barrier) once the output store from it has read shared memory. With one Q tile per consumer (head size
256, where two do not fit beside two ring stages) the next item's queries wait for that release. The two
consumers' ping-pong turns are balanced within each item (consumer 1 starts it half a step behind,
consumer 0 takes the matching turn at its end): carried across items, consumer 1's last turn would wait
for consumer 0's first step of the next item, which with one Q tile waits for consumer 1's output.

What is masked and why. A masked step gives ``-inf`` logits to keys after the row's token (causal), at or
before ``token - sliding_window`` (window), and to every key of rows of another sequence or past
``query_start_loc[-1]`` (their softmax state is untouched: ``p = 0``, ``alpha = 1``). Keys at or past
``seq_len`` (the tail of the last page, pages past the sequence's end, redirected to block 0) and, with a
window, keys before the window start of the program's first row of that sequence (pages a
sliding-window model may have freed, read because they share a step with visible keys) may hold NaN, and
``0 * NaN`` is NaN in ``P V``: in the steps that hold such keys the consumers zero those V rows in shared
memory before ``P V`` (both consumers may write the same values to the shared tile: a race of identical
values), and their logits are ``-inf`` so NaN keys never reach the softmax. Rows that see no key give 0.

``P`` goes from registers straight into the ``P V`` ``wgmma`` with the running accumulator updated in
place (FA3) in the compiled kernel; the Mosaic GPU interpreter runs ``wgmma`` only from shared memory and
without an initialised accumulator, so with ``pv_from_smem=True`` (the default when interpreting) P is
written to a per-consumer shared-memory tile and a fresh accumulator is added. Both paths are lowered for
sm_90 in the tests.

An fp8 cache (``float8_e4m3fn`` / ``float8_e5m2``, with ``k_scale`` / ``v_scale``): the memory warpgroup copies
the fp8 pages into fp8 ring slots (half the bytes); ``k_scale`` is folded into the logit scale and ``v_scale`` into
the output, so softmax and the accumulator stay float32 across steps. How the consumers read the slots
(``fp8_route``, :data:`FP8_ROUTES`):

* "convert" (session 26): each consumer converts a slot into its own 16-bit K or V tile in ``q``'s dtype (through
  registers in the 8-bit ``wgmma`` fragment layout, the decode kernel's ``_convert_tile``), releases the slot, and
  runs the same ``wgmma`` s on the converted tile. Both consumers convert the slot they share (one copy each).
  Compiled on the H100 (session 27): 1.40-1.76x the Triton kernel's fp8 path, 0.52-0.71x the same kernel with a
  bf16 cache: the conversions set its pace.
* "qk8" / "qk8lo" (session 28, e4m3 only): at the start of each item a consumer quantizes its 64 query rows to
  e4m3 with a scale per row (``absmax / 448``, folded into the logit scale per row) into an fp8 tile, and
  ``S = Q Kᵀ`` is an fp8 ``wgmma`` straight from the fp8 K slot (both operands K-major, as sm_90's fp8 ``wgmma``
  requires), so K is never converted; "qk8lo" chains a second fp8 ``wgmma`` of the query's rounding error
  (``e4m3(q / s - hi)``) into the same accumulator (q to ~2**-8 of itself, a bf16 query's precision), "qk8" keeps
  one half (FlashAttention-3's fp8 accuracy: each query element off by up to 2**-4 of itself). V is converted to
  f16 (one ``cvt`` per fp8 pair; bf16 goes through f32) and ``P V`` runs in f16 (P in [0, 1] is finer in f16).
  An fp8 ``P V`` is not built: V's tile is not K-major for it (the decode kernel's docstring). Compiled on the
  H100 (session 28): "qk8lo" 0.71-0.79x the bf16 cache's speed (1.81-1.93x Triton's fp8 path; the default
  route), "qk8" 0.78-0.88x (``tuning.MGPU_PREFILL_FP8_ROUTE``). What is left is V's conversion, done by both
  consumers for the slot they share, and the 64-key steps.

Who converts V (``v_converter``, :data:`V_CONVERTERS`): "consumers" (each its own 16-bit copy of every step, as above)
or "memory" (session 29): the memory warpgroup converts each step's fp8 V slot once, into a ring of
``tuning.MGPU_PREFILL_V_STAGES`` 16-bit slots both consumers read (a "V converted" barrier per slot, released by both
consumers after their ``P V``), ``lag = num_stages - num_stages16`` steps after issuing its copies, so they have
landed; it releases the fp8 slot itself. Before it waits for a Q tile to come free it converts every step of the
item that used it (those consumers wait for that V before they release the tile). It runs with more registers
(``tuning.mgpu_prefill_memory_registers``), the consumers with 224 instead of 232. Compiled on the H100 (session 29):
1.02-1.06x "consumers" with "qk8lo" at 64-key steps; with 128-key steps on prompts of >= 2048 tokens 0.79-0.89x
the bf16 cache's speed (the default there), against 0.70-0.77x for session 28's "qk8lo".

Steps default to 64 keys with an fp8 cache, 128 with V converted by the memory warpgroup and at least 1024 query
tokens per sequence (``tuning.mgpu_prefill_block_kv``). The op-level dispatch
sends fp8 prefill here from ``tuning.MGPU_PREFILL_MIN_QUERY_LEN``'s fp8 entry.

Falls back (``unsupported_reason``): float32 queries (``wgmma`` has no f32 path), an fp8 cache with head size
256 (its converted tiles do not fit beside the Q tiles), head sizes other than 64/128/256, more than 64 query
heads per KV head (the decode kernel's rule, shared), block sizes that are not a power of two >= 8, ALiBi.

In the interpreter the default is one consumer: with three warpgroups (three CPU threads each running an
XLA computation that blocks in barrier callbacks) the interpreter intermittently deadlocks on the 2-core CPU
machine (observed in about 1 of 10 runs, the stacks inside XLA's execution, not in a barrier wait); two
consumers are tested there only on request (``JAXKV_MGPU_FUZZ``) and compiled on the GPU.

Tested in the Mosaic GPU interpreter on CPU and lowered for sm_90 on CPU
(``tests/pallas_kernels/test_paged_prefill_attention_mgpu.py``); the compiled kernel runs only on a Hopper
GPU (``scripts/dev/gpu_mgpu.sh``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tuning
from pallas_kernels._mgpu_paging import issue_kv_step, issue_ring_step
from pallas_kernels._online_softmax import accumulate_pv, softmax_rescale_exp2
from pallas_kernels._reference import kv_scales
from pallas_kernels.paged_attention import FP8_DTYPES
from pallas_kernels.paged_attention_mgpu import (
    COMPUTE_DTYPES,
    HEAD_SIZES,  # noqa: F401  (the head sizes this kernel computes too)
    LOG2E,
    ROWS,
    _convert_tile,
    _tile_transforms,
    convert_ring_step,
    default_num_programs,
    quantize_q_rows,
)
from pallas_kernels.paged_attention_mgpu import unsupported_reason as decode_unsupported_reason
from pallas_kernels.paged_prefill_attention import _is_int, check_prefill_call

MAX_CONSUMERS = 2
FP8_MAX_HEAD_SIZE = 128
# fp8 cache routes (``paged_prefill_attention_mgpu(fp8_route=...)``): "convert" (each consumer converts the K and the
# V slot into 16-bit tiles in q's dtype), "qk8" (the consumer's query rows quantized to e4m3 once per item, a scale per
# row; q·kᵀ an fp8 ``wgmma`` straight from the fp8 K slot; only V converted, to f16, and P·V in f16), "qk8lo" (as
# "qk8", with the query's rounding error as a second e4m3 tile chained into the same q·kᵀ accumulator: q to ~2**-8
# of itself, a bf16 query's precision, for twice the fp8 q·kᵀ work).
FP8_ROUTES = ("convert", "qk8", "qk8lo")
# Who converts an fp8 cache's V slots to 16 bits (``v_converter``): "consumers" (each consumer its own copy of every
# step, beside its own work) or "memory" (the memory warpgroup, once per step, into a shared ring of 16-bit slots).
V_CONVERTERS = ("consumers", "memory")


def unsupported_reason(q_dtype, kv_dtype, num_heads: int, num_kv_heads: int, head_size: int,
                       block_size: int, *, alibi: bool) -> str | None:
    """Why the Mosaic GPU prefill kernel cannot run this call, or ``None`` when it can.

    The op-level dispatch falls back to the Triton prefill kernel with this reason. Static arguments only.
    The decode kernel's rules (:func:`pallas_kernels.paged_attention_mgpu.unsupported_reason`), and no fp8
    cache with head size 256 (each consumer's two converted 16-bit tiles do not fit beside its Q tile).
    """
    if jnp.dtype(q_dtype) in COMPUTE_DTYPES and jnp.dtype(kv_dtype) in FP8_DTYPES and head_size > FP8_MAX_HEAD_SIZE:
        return (f"kv_cache.dtype={jnp.dtype(kv_dtype)} with head_size={head_size} (Mosaic prefill kernel: fp8 up to "
                f"head size {FP8_MAX_HEAD_SIZE})")
    return decode_unsupported_reason(q_dtype, kv_dtype, num_heads, num_kv_heads, head_size, block_size,
                                     alibi=alibi)


def _seq_of(qsl_ref, token, num_seqs: int):
    """The sequence that owns flat token ``token``: the largest ``s < num_seqs`` with
    ``query_start_loc[s] <= token`` (0 when there is none), by binary search (scalar loads)."""
    lo, hi = jnp.int32(0), jnp.int32(num_seqs)         # the answer lies in [lo, hi)
    for _ in range(max(1, num_seqs.bit_length())):
        mid = lax.div(lo + hi, 2)
        ok = qsl_ref[mid] <= token
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    return lo


class _Segment:
    """The rows ``[r0, r1)`` (flat token indices) of a program that belong to sequence ``s``, and the key
    steps ``[first, end)`` they see (empty when there are none)."""

    def __init__(self, qsl_ref, seq_lens_ref, s, r0, r1, *, block_kv: int, sliding_window: int | None):
        self.q_start, self.q_next = qsl_ref[s], qsl_ref[s + 1]
        self.seq_len = seq_lens_ref[s]
        self.context_len = self.seq_len - (self.q_next - self.q_start)
        a, b = jnp.maximum(self.q_start, r0), jnp.minimum(self.q_next, r1)
        self.has_rows = b > a
        self.pos_first = self.context_len + a - self.q_start          # position of its first row
        kv_end = self.context_len + b - self.q_start                  # causal end of its last row (excl.)
        self.kv_start = (0 if sliding_window is None
                         else jnp.maximum(self.pos_first - sliding_window + 1, 0))
        self.first = self.kv_start // block_kv
        self.end = jnp.where(self.has_rows, (kv_end + block_kv - 1) // block_kv, self.first)


def _prefill_kernel(qsl_ref, seq_lens_ref, tables_ref, tile_order_ref, q_ref, kv_ref, k_scale_ref, v_scale_ref, o_ref,
                    scratch, *,
                    scale: float, block_kv: int, tokens_per_copy: int, num_stages: int, num_consumers: int,
                    group: int, num_heads: int, num_tiles: int, num_seqs: int, num_programs: int,
                    num_q_buffers: int, sliding_window: int | None, logits_soft_cap: float | None,
                    pv_from_smem: bool, pingpong: bool, set_registers: bool, num_stages16: int,
                    registers: tuple[int, int]):
    ((q_smem, k_smem, v_smem, p_smem, k16_smem, v16_smem, q8_smem, q8lo_smem), (q_bars, k_bars, v_bars),
     (k_consumed, v_consumed, q_free), schedule, v16_bars) = scratch
    block_size, head_size = kv_ref.shape[3], kv_ref.shape[4]
    dtype = q_smem.dtype
    fp8 = v16_smem is not None           # fp8 ring slots, V (and K: "convert") converted to 16 bits
    v_shared = v16_bars is not None      # v_converter="memory": V converted once per step into a shared 16-bit ring
    v16_ready, v16_consumed = v16_bars if v_shared else (None, None)
    qk8 = q8_smem is not None            # fp8 q·kᵀ from the fp8 K slot (fp8_route "qk8" / "qk8lo")
    pv_dtype = v16_smem.dtype if fp8 else dtype   # P's dtype: V's in the P·V wgmma
    tile_tokens = num_consumers * ROWS
    num_items = num_tiles * num_heads
    wg = lax.axis_index("wg")
    program = lax.axis_index("p")
    persistent = num_programs < num_items
    # Round r hands item r * G + p to program p, in reverse (G - 1 - p) in odd rounds: with the items
    # heaviest first, each program's heavy and light items even out ("snake" order).
    last_round = (num_items - 1) // num_programs
    last_index = last_round * num_programs + (program if last_round % 2 == 0 else num_programs - 1 - program)
    my_items = last_round + (last_index < num_items).astype(jnp.int32)
    segment = functools.partial(_Segment, qsl_ref, seq_lens_ref, block_kv=block_kv,
                                sliding_window=sliding_window)

    def item(k):
        """The program's ``k``-th work item: one query head over ``TT`` tokens, last tiles first, the query
        heads of a tile side by side."""
        i = k * num_programs + jnp.where(lax.rem(k, 2) == 0, program, num_programs - 1 - program)
        if persistent:   # tiles by decreasing key count (computed before the kernel)
            tile = tile_order_ref[lax.div(i, num_heads)]
        else:            # one item per program, the hardware hands them out in order: last tiles first
            tile = num_tiles - 1 - lax.div(i, num_heads)
        qh = lax.rem(i, num_heads)
        tok0 = tile * tile_tokens
        tok_end = jnp.minimum(tok0 + tile_tokens, qsl_ref[num_seqs])   # <= tok0: no rows (padding only)
        s_first = _seq_of(qsl_ref, tok0, num_seqs)
        s_end = jnp.where(tok_end > tok0, _seq_of(qsl_ref, tok_end - 1, num_seqs) + 1, s_first)
        return qh, tok0, tok_end, s_first, s_end, lax.rem(k, num_q_buffers)

    def schedule_barrier():
        if pingpong:
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

    @pl.when(wg < num_consumers)
    def _consumer():
        if set_registers:
            plgpu.set_max_registers(registers[0], action="increase")
        k_factor = k_scale_ref[0] * (scale if logits_soft_cap is not None else scale * LOG2E)
        v_scale = v_scale_ref[0]

        def skip(j, g):
            # A step of the program this consumer has no rows for: keep the barrier phases in step.
            slot = lax.rem(g, num_stages)
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            schedule_barrier()
            if v_shared:
                plgpu.barrier_wait(v16_ready.at[lax.rem(g, num_stages16)])
                plgpu.barrier_arrive(v16_consumed.at[lax.rem(g, num_stages16)])
            else:
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
            schedule_barrier()
            return g + 1

        def wgmma_tile(ring, converted, consumed, slot):
            """The ``wgmma`` operand of a filled ring slot: the slot itself (released after its ``wgmma``), or
            (``converted`` set: an fp8 slot) the consumer's own 16-bit tile, converted from the slot, which is
            released now."""
            if converted is None:
                return ring.at[slot]
            _convert_tile(ring.at[slot], converted.at[wg])
            plgpu.commit_smem()
            plgpu.barrier_arrive(consumed.at[slot])
            return converted.at[wg]

        def step(j, carry, *, q_tile, q_lo, factor, c0, seg, prog, masked: bool):
            g, acc, m, l = carry
            slot = lax.rem(g, num_stages)
            t0 = j * block_kv
            plgpu.barrier_wait(k_bars.at[slot])
            k_tile = wgmma_tile(k_smem, k16_smem, k_consumed, slot)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_tile.T)
                if q_lo is not None:                                 # "qk8lo": the query's rounding error
                    plgpu.wgmma(acc_ref, q_lo, k_tile.T)
                schedule_barrier()
                return acc_ref[...]
            logits = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
            if k16_smem is None:
                plgpu.barrier_arrive(k_consumed.at[slot])
            logits = logits * (lax.broadcast_in_dim(factor, logits.shape, [0]) if qk8 else factor)
            if logits_soft_cap is not None:
                logits = jnp.tanh(logits * (1.0 / logits_soft_cap)) * (logits_soft_cap * LOG2E)
            if masked:
                shape = (ROWS, block_kv)
                tok = c0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                key = t0 + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                pos = seg.context_len + tok - seg.q_start                 # the row's position in its sequence
                visible = (key <= pos) & (tok >= seg.q_start) & (tok < seg.q_next)
                if sliding_window is not None:
                    visible &= key > pos - sliding_window
                logits = jnp.where(visible, logits, -jnp.inf)

            acc, m_next, l, p = softmax_rescale_exp2(acc, m, l, logits)
            p16 = p.astype(pv_dtype)
            if pingpong:
                acc, l, m_next, p16 = lax.optimization_barrier((acc, l, m_next, p16))
                plgpu.barrier_arrive(schedule)                       # softmax done
            if v_shared:                                             # converted by the memory warpgroup
                slot16 = lax.rem(g, num_stages16)
                plgpu.barrier_wait(v16_ready.at[slot16])
                v_tile = v16_smem.at[slot16]
            else:
                plgpu.barrier_wait(v_bars.at[slot])
                v_tile = wgmma_tile(v_smem, v16_smem, v_consumed, slot)  # (fp8: converted before the tensor-core turn)
            if pingpong:
                plgpu.barrier_wait(schedule)                         # the tensor cores are ours
            if masked:
                # V rows no row of the program sees and that may hold NaN: at or past seq_len (unowned
                # slots, block 0) and before the window start of the program's first row of this sequence
                # (pages a sliding-window model may have freed). The same for both consumers (fp8: each
                # zeroes its own converted tile, or both the shared one).
                @pl.when((t0 + block_kv > seg.seq_len) | (t0 < prog.kv_start))
                def _zero_invisible_rows():
                    vrow = t0 + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_size), 0,
                                                       layout=plgpu.Layout.WGMMA)
                    v = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
                    v_tile[...] = jnp.where((vrow < seg.seq_len) & (vrow >= prog.kv_start), v,
                                            jnp.zeros_like(v))
                    plgpu.commit_smem()

            acc = accumulate_pv(acc, p16, v_tile, p_smem.at[wg] if pv_from_smem else None)
            if v_shared:
                plgpu.barrier_arrive(v16_consumed.at[slot16])
            elif not fp8:
                plgpu.barrier_arrive(v_consumed.at[slot])
            return g + 1, acc, m_next, l

        def over_item(k, g):
            qh, tok0, tok_end, s_first, s_end, b = item(k)
            c0 = tok0 + wg * ROWS                        # the consumer's first token
            q_tile = q_smem.at[b, wg]
            plgpu.barrier_wait(q_bars.at[b * num_consumers + wg])
            if qk8:      # this item's query rows in e4m3 (the previous item's wgmmas were all waited)
                q_lo = None if q8lo_smem is None else q8lo_smem.at[wg]
                factor = quantize_q_rows(q_tile, q8_smem.at[wg], q_lo, lo_scale=1.0) * k_factor
                plgpu.commit_smem()
                q_wgmma = q8_smem.at[wg]
            else:
                q_lo, factor, q_wgmma = None, k_factor, q_tile
            if pingpong:
                pl.when(wg == 1)(schedule_barrier)       # consumer 1 starts half a step behind
            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((ROWS, head_size), jnp.float32), plgpu.Layout.WGMMA)

            def over_sequence(s, carry):
                g, acc, m, l = carry
                prog = segment(s, tok0, tok_end)         # the program's steps of sequence s
                mine = segment(s, c0, jnp.minimum(c0 + ROWS, tok_end))
                my_first = jnp.where(mine.has_rows, mine.first, prog.end)
                my_end = jnp.where(mine.has_rows, mine.end, prog.end)
                if sliding_window is None:               # steps wholly below the first row, all rows here
                    all_rows_here = (mine.q_start <= c0) & (mine.q_next >= c0 + ROWS)
                    my_full = jnp.where(all_rows_here,
                                        jnp.clip((mine.pos_first + 1) // block_kv, my_first, my_end), my_first)
                else:
                    my_full = my_first
                run = functools.partial(step, q_tile=q_wgmma, q_lo=q_lo, factor=factor, c0=c0, seg=mine, prog=prog)
                g = lax.fori_loop(prog.first, my_first, skip, g)
                g, acc, m, l = lax.fori_loop(my_first, my_full, functools.partial(run, masked=False),
                                             (g, acc, m, l))
                g, acc, m, l = lax.fori_loop(my_full, my_end, functools.partial(run, masked=True),
                                             (g, acc, m, l))
                g = lax.fori_loop(my_end, prog.end, skip, g)
                return g, acc, m, l

            g, acc, m, l = lax.fori_loop(s_first, s_end, over_sequence, (g, acc, m, l))
            if pingpong:
                # The turn consumer 1 took at the start: the two leave the item in step. (Carried over
                # to the next item, consumer 1's last turn would wait for consumer 0's first step there,
                # which waits for its Q tile, which with one Q buffer waits for consumer 1's output.)
                pl.when(wg == 0)(schedule_barrier)
            l_safe = jnp.where(l == 0.0, 1.0, l)                 # a row that sees nothing gives 0, not NaN
            acc = acc * lax.broadcast_in_dim(v_scale / l_safe, acc.shape, [0])
            q_tile[...] = acc.astype(dtype)                      # the query tile is no longer read
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_ref.at[pl.ds(c0, ROWS), qh])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)      # the tile may take the next Q
            plgpu.barrier_arrive(q_free.at[b])
            return g

        lax.fori_loop(0, my_items, over_item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == num_consumers)
    def _memory():
        if set_registers:
            plgpu.set_max_registers(registers[1], action="decrease")
        # v_shared: step j's fp8 V slot is converted into 16-bit slot j % num_stages16 `lag` steps after its copies
        # were issued (they have landed by then), once the consumers released that slot's previous step.
        lag = min(max(1, num_stages - num_stages16), num_stages - 1)

        def convert_v(j, c):
            convert_ring_step(j, lax.rem(j, num_stages), lax.rem(j, num_stages16), src=v_smem, dst=v16_smem,
                              full=v_bars, consumed=v_consumed, ready=v16_ready, released=v16_consumed,
                              num_stages16=num_stages16)
            return c

        def convert_up_to(c, end):
            """Convert steps ``[c, end)`` (none when ``end <= c``); returns the next step to convert."""
            lax.fori_loop(c, end, convert_v, jnp.int32(0))
            return jnp.maximum(c, end)

        def over_item(k, carry):
            g, c, end_before = carry  # steps issued, steps converted, steps issued before item k - 1
            qh, tok0, tok_end, s_first, s_end, b = item(k)
            h = lax.div(qh, group)                       # the KV head
            if v_shared:   # item k - num_q_buffers's V first: its consumers wait for it before releasing Q tile b
                c = convert_up_to(c, g if num_q_buffers == 1 else end_before)

            @pl.when(k >= num_q_buffers)                 # the buffer's last item has been stored
            def _():
                plgpu.barrier_wait(q_free.at[b])
            for i in range(num_consumers):
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(tok0 + i * ROWS, ROWS), qh], q_smem.at[b, i],
                                        q_bars.at[b * num_consumers + i])

            def over_sequence(s, gc):
                g, c = gc
                prog = segment(s, tok0, tok_end)
                num_pages = (prog.seq_len + block_size - 1) // block_size
                issue = functools.partial(issue_kv_step, kv_ref, tables_ref, s, h, num_pages=num_pages,
                                          block_kv=block_kv, tokens_per_copy=tokens_per_copy)

                def one_step(j, gc):
                    g, c = gc
                    g = issue_ring_step(g, lambda: j * block_kv, issue, num_stages=num_stages,
                                        k_smem=k_smem, v_smem=v_smem, k_bars=k_bars, v_bars=v_bars,
                                        k_consumed=k_consumed, v_consumed=v_consumed)
                    if v_shared:                                 # one earlier step's V, `lag` behind
                        late = c + lag < g
                        pl.when(late)(lambda: convert_v(c, None))
                        c = c + late.astype(jnp.int32)
                    return g, c
                return lax.fori_loop(prog.first, prog.end, one_step, (g, c))

            g_start = g
            g, c = lax.fori_loop(s_first, s_end, over_sequence, (g, c))
            return g, c, g_start

        zero = jnp.int32(0)
        g, c, _ = lax.fori_loop(0, my_items, over_item, (zero, zero, zero))
        if v_shared:
            convert_up_to(c, g)


def _paged_prefill_attention_mgpu(q, kv_cache, block_tables, seq_lens, query_start_loc, scales, *, scale,
                                  sliding_window, logits_soft_cap, block_kv, num_stages, num_consumers,
                                  num_q_buffers, num_programs, pv_from_smem, pingpong, fp8_route, v_converter,
                                  num_stages16, memory_registers, interpret):
    num_tokens, num_heads, head_size = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    num_seqs = block_tables.shape[0]
    dtype = q.dtype
    tile_tokens = num_consumers * ROWS
    num_tiles = pl.cdiv(num_tokens, tile_tokens)
    num_items = num_tiles * num_heads
    num_programs = num_items if num_programs is None else min(num_programs, num_items)
    tokens_per_copy = min(block_size, block_kv)
    pad = num_tiles * tile_tokens - num_tokens
    if pad:   # every program's TMA boxes stay inside q and the output
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))

    # Pad the block table so the last step of a sequence (up to block_kv - 1 keys past its end) reads
    # entries inside the table (they are redirected to block 0 anyway).
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pl.cdiv(block_kv, block_size))))

    tile = _tile_transforms(head_size, dtype)
    kv_dtype = kv_cache.dtype
    fp8 = jnp.dtype(kv_dtype) in FP8_DTYPES
    ring = _tile_transforms(head_size, kv_dtype)
    stage_shape = (num_stages, block_kv, head_size)
    converted = (num_consumers, block_kv, head_size)                            # fp8: each consumer's own tiles
    qk8 = fp8 and fp8_route != "convert"
    v_dtype = jnp.dtype(jnp.float16) if qk8 else dtype       # "qk8*": fp8 -> f16 is one instruction per pair
    pv_dtype = v_dtype if fp8 else dtype
    v_shared = fp8 and v_converter == "memory"
    v16_shape = (num_stages16, block_kv, head_size) if v_shared else converted
    q8 = _tile_transforms(head_size, jnp.float8_e4m3fn)
    smem = (
        plgpu.SMEM((num_q_buffers, num_consumers, ROWS, head_size), dtype, transforms=tile),  # q, then out
        plgpu.SMEM(stage_shape, kv_dtype, transforms=ring),                      # K ring
        plgpu.SMEM(stage_shape, kv_dtype, transforms=ring),                      # V ring
        plgpu.SMEM((num_consumers, ROWS, block_kv), pv_dtype,
                   transforms=_tile_transforms(block_kv, pv_dtype)) if pv_from_smem else None,  # P
        plgpu.SMEM(converted, dtype, transforms=tile) if fp8 and not qk8 else None,  # K in q's dtype ("convert")
        plgpu.SMEM(v16_shape, v_dtype, transforms=_tile_transforms(head_size, v_dtype)) if fp8 else None,  # V
        plgpu.SMEM((num_consumers, ROWS, head_size), jnp.float8_e4m3fn, transforms=q8) if qk8 else None,  # q e4m3
        plgpu.SMEM((num_consumers, ROWS, head_size), jnp.float8_e4m3fn, transforms=q8)
        if qk8 and fp8_route == "qk8lo" else None,                               # its rounding error
    )
    copies = block_kv // tokens_per_copy
    barriers = (plgpu.Barrier(num_barriers=num_q_buffers * num_consumers),
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages))
    released = (plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages),      # K slot consumed
                plgpu.Barrier(num_arrivals=1 if v_shared else num_consumers, num_barriers=num_stages),  # V consumed
                plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_q_buffers))   # Q tile free
    pingpong = pingpong and num_consumers == 2
    schedule = plgpu.Barrier(num_arrivals=num_consumers) if pingpong else None
    v16_bars = ((plgpu.Barrier(num_barriers=num_stages16),                                    # V converted
                 plgpu.Barrier(num_arrivals=num_consumers, num_barriers=num_stages16))         # its slot free
                if v_shared else None)
    consumer_registers = min(232 if num_consumers == 2 else 240, (512 - memory_registers) // num_consumers // 8 * 8)
    kernel = functools.partial(
        _prefill_kernel, scale=scale, block_kv=block_kv, tokens_per_copy=tokens_per_copy,
        num_stages=num_stages, num_consumers=num_consumers, group=num_heads // num_kv_heads,
        num_heads=num_heads, num_tiles=num_tiles, num_seqs=num_seqs, num_programs=num_programs,
        num_q_buffers=num_q_buffers, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        pv_from_smem=pv_from_smem, pingpong=pingpong, set_registers=not interpret, num_stages16=num_stages16,
        registers=(consumer_registers, memory_registers))

    def entry(qsl_ref, seq_lens_ref, tables_ref, tile_order_ref, q_ref, kv_ref, k_scale_ref, v_scale_ref, o_ref):
        pl.run_scoped(lambda *scratch: kernel(qsl_ref, seq_lens_ref, tables_ref, tile_order_ref, q_ref, kv_ref,
                                              k_scale_ref, v_scale_ref, o_ref, scratch),
                      smem, barriers, released, schedule, v16_bars, collective_axes="wg")

    op = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=(num_programs,),
        grid_names=("p",),
        num_threads=num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    out = op(query_start_loc, seq_lens, block_tables, _tile_order(query_start_loc, seq_lens, num_tiles, tile_tokens)
             if num_programs < num_items else jnp.zeros((1,), jnp.int32), q, kv_cache, *scales)
    return out[:num_tokens] if pad else out


def _fp8_route(fp8_route: str | None, *, kv_dtype) -> str:
    """The fp8 route a call runs: ``fp8_route``, or :data:`pallas_kernels.tuning.MGPU_PREFILL_FP8_ROUTE` (an e5m2
    cache: "convert"; a 16-bit cache: "convert", nothing to convert). Raises ``ValueError`` for a route not in
    :data:`FP8_ROUTES` and for "qk8"/"qk8lo" with an e5m2 cache (the query tile is e4m3)."""
    if fp8_route is not None and fp8_route not in FP8_ROUTES:
        raise ValueError(f"fp8_route={fp8_route!r} must be one of {FP8_ROUTES}")
    if jnp.dtype(kv_dtype) not in FP8_DTYPES:
        return "convert"
    e4m3 = jnp.dtype(kv_dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if fp8_route is None:
        return tuning.MGPU_PREFILL_FP8_ROUTE if e4m3 else "convert"
    if fp8_route != "convert" and not e4m3:
        raise ValueError(f"fp8_route={fp8_route!r} needs a float8_e4m3fn cache, not {jnp.dtype(kv_dtype)}")
    return fp8_route


def _tile_order(query_start_loc, seq_lens, num_tiles: int, tile_tokens: int):
    """``int32[num_tiles]``: the tiles by decreasing key count of their last row (the work of a causal
    tile), ties in reverse tile order; the persistent programs take them in this order."""
    num_seqs = seq_lens.shape[0]
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    last = jnp.minimum((tile + 1) * tile_tokens, query_start_loc[-1]) - 1     # the tile's last new token
    seq = jnp.clip(jnp.searchsorted(query_start_loc, last, side="right", method="compare_all") - 1, 0,
                   num_seqs - 1)
    keys = jnp.where(last >= tile * tile_tokens, seq_lens[seq] - (query_start_loc[seq + 1] - 1 - last), 0)
    return (num_tiles - 1 - jnp.argsort(keys[::-1], descending=True, stable=True)).astype(jnp.int32)


_STATIC = ("scale", "sliding_window", "logits_soft_cap", "block_kv", "num_stages", "num_consumers",
           "num_q_buffers", "num_programs", "pv_from_smem", "pingpong", "fp8_route", "v_converter", "num_stages16",
           "memory_registers", "interpret")
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
    pingpong: bool = True,
    persistent: bool = True,
    num_programs: int | None = None,
    fp8_route: str | None = None,
    v_converter: str | None = None,
    memory_registers: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal varlen attention of new tokens over the paged cache on Pallas Mosaic GPU (Hopper).

    vLLM: ``PagedAttention.forward_prefix`` → ``context_attention_fwd`` / unified attention. Same arguments,
    semantics and result as :func:`pallas_kernels.paged_prefill_attention.paged_prefill_attention` for the
    calls :func:`unsupported_reason` accepts (bf16/f16 q; the cache in q's dtype, or fp8 with head size 64/128;
    head size 64/128/256; at most 64 query heads per KV head; block size a power of two >= 8; no ALiBi).

    Args:
        q: ``[num_tokens, num_heads, head_size]`` bf16/f16, the new tokens of all sequences, concatenated;
            tokens past ``query_start_loc[-1]`` are padding (output 0).
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` in ``q.dtype`` or fp8
            (``float8_e4m3fn`` / ``float8_e5m2``, stored as ``x / k_scale`` and ``x / v_scale``), holding every
            token of every sequence up to its ``seq_len`` (the new ones included); 0 keys, 1 values.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]`` cached + new tokens per sequence.
        query_start_loc: ``int32[num_seqs + 1]``; sequence ``s`` owns tokens
            ``[query_start_loc[s], query_start_loc[s+1])`` of ``q``.
        scale, max_query_len, k_scale, v_scale, sliding_window, logits_soft_cap: as in the Triton op
            (``max_query_len`` is only checked: the grid is sized by ``num_tokens``).
        alibi_slopes: must be ``None`` (see :func:`unsupported_reason`).
        block_kv: keys per inner step (static, a positive multiple of 64); ``None``:
            :func:`pallas_kernels.tuning.mgpu_prefill_block_kv` (an fp8 cache: 64, or 128 with V converted by the
            memory warpgroup and >= 1024 query tokens per sequence).
        num_stages: shared-memory ring depth (static, >= 1); ``None``:
            :func:`pallas_kernels.tuning.mgpu_prefill_num_stages`.
        num_consumers: consumer warpgroups per program, 1 or 2 (64 query rows each); ``None``:
            :data:`pallas_kernels.tuning.MGPU_PREFILL_NUM_CONSUMERS`, 1 when interpreting.
        pv_from_smem: P through shared memory and a fresh accumulator per step (what the interpreter
            runs) instead of P from registers into the running accumulator; ``None``: ``interpret``.
        pingpong: with two consumers, make them take turns on the tensor cores through a scheduling
            barrier (FA3's ping-pong); ignored with one.
        persistent: launch one program per SM (``num_programs``), each looping over work items with
            its K/V ring and the next item's Q already in flight, instead of one program per item (the
            default: measured faster or equal at five of the six bench shapes, and the only mode at or
            above 0.9x cuDNN at all six; docs/benchmarks.md).
        num_programs: programs of the persistent grid (static, >= 1, only with ``persistent``); ``None``:
            the device's SM count (the interpreter: 2).
        fp8_route: how an fp8 cache is read (:data:`FP8_ROUTES`; ignored for a 16-bit cache): "convert" (K and V
            converted into q's dtype), "qk8" (the query rows in e4m3 with a scale per row, q·kᵀ an fp8 ``wgmma``
            from the fp8 K slot, V converted to f16: FlashAttention-3's fp8 accuracy, the query off by up to
            2**-4 of itself), "qk8lo" (as "qk8" with the query's rounding error as a second e4m3 half: a bf16
            query's accuracy). e4m3 caches only for "qk8*". ``None``:
            :data:`pallas_kernels.tuning.MGPU_PREFILL_FP8_ROUTE` (e5m2: "convert").
        v_converter: who converts an fp8 cache's V slots (:data:`V_CONVERTERS`; ignored for a 16-bit cache):
            "consumers" (each consumer its own 16-bit copy of every step) or "memory" (the memory warpgroup, once
            per step, into a ring of ``tuning.MGPU_PREFILL_V_STAGES`` 16-bit slots both consumers read); ``None``:
            :func:`pallas_kernels.tuning.mgpu_prefill_v_converter` ("memory" for "qk8"/"qk8lo", "consumers" for
            "convert").
        memory_registers: registers per thread of the memory warpgroup (static, a multiple of 8 in [24, 256];
            the consumers get the rest, at most 232 each with two); ``None``:
            :func:`pallas_kernels.tuning.mgpu_prefill_memory_registers`. Only the compiled kernel uses it.
        interpret: run in the Mosaic GPU interpreter (CPU).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: what the Triton op raises (shapes, dtypes, scales, metadata values), a ``block_kv``
            that is not a positive multiple of 64, ``num_stages`` or ``num_programs`` < 1, ``num_programs``
            without ``persistent``, ``num_consumers`` not 1 or 2, an ``fp8_route`` not in :data:`FP8_ROUTES`
            or "qk8"/"qk8lo" with an e5m2 cache, a ``v_converter`` not in :data:`V_CONVERTERS`, a
            ``memory_registers`` that is not a multiple of 8 in [24, 256].
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
    fp8 = jnp.dtype(kv_cache.dtype) in FP8_DTYPES
    fp8_route = _fp8_route(fp8_route, kv_dtype=kv_cache.dtype)
    if v_converter is None:
        v_converter = tuning.mgpu_prefill_v_converter(fp8_route)
    if v_converter not in V_CONVERTERS:
        raise ValueError(f"v_converter={v_converter!r} must be one of {V_CONVERTERS}")
    if not fp8:
        v_converter = "consumers"                      # nothing to convert
    if memory_registers is None:
        memory_registers = tuning.mgpu_prefill_memory_registers(v_converter)
    if not _is_int(memory_registers) or memory_registers % 8 or not 24 <= memory_registers <= 256:
        raise ValueError(f"memory_registers={memory_registers!r} must be a multiple of 8 in [24, 256]")
    if block_kv is None:
        block_kv = tuning.mgpu_prefill_block_kv(head_size, fp8=fp8, v_converter=v_converter,
                                                tokens_per_seq=q.shape[0] // max(1, block_tables.shape[0]))
    if not _is_int(block_kv) or block_kv < 64 or block_kv % 64:
        raise ValueError(f"block_kv={block_kv!r} must be a positive multiple of 64")
    if num_consumers not in (1, MAX_CONSUMERS):
        raise ValueError(f"num_consumers={num_consumers!r} must be 1 or {MAX_CONSUMERS}")
    if not persistent:
        if num_programs is not None:
            raise ValueError(f"num_programs={num_programs!r} needs persistent=True")
        num_q_buffers = 1                               # one program per item
    else:
        if num_programs is None:
            num_programs = 2 if interpret else default_num_programs()
        if not _is_int(num_programs) or num_programs < 1:
            raise ValueError(f"num_programs={num_programs!r} must be >= 1")
        num_q_buffers = tuning.mgpu_prefill_q_buffers(block_kv, head_size, num_consumers=num_consumers,
                                                      pv_from_smem=pv_from_smem, fp8=fp8, fp8_route=fp8_route,
                                                      v_converter=v_converter)
    if num_stages is None:
        num_stages = tuning.mgpu_prefill_num_stages(block_kv, head_size, num_consumers=num_consumers,
                                                    pv_from_smem=pv_from_smem, num_q_buffers=num_q_buffers, fp8=fp8,
                                                    fp8_route=fp8_route, v_converter=v_converter)
    if not _is_int(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be >= 1")
    return _paged_prefill_attention_mgpu_jit(
        q, kv_cache, block_tables, seq_lens, query_start_loc, kv_scales(k_scale, v_scale), scale=scale,
        sliding_window=None if sliding_window is None else int(sliding_window),
        logits_soft_cap=logits_soft_cap, block_kv=int(block_kv), num_stages=int(num_stages),
        num_consumers=int(num_consumers), num_q_buffers=int(num_q_buffers),
        num_programs=None if num_programs is None else int(num_programs), pv_from_smem=bool(pv_from_smem),
        pingpong=bool(pingpong), fp8_route=fp8_route, v_converter=v_converter,
        num_stages16=min(tuning.MGPU_PREFILL_V_STAGES, int(num_stages)), memory_registers=int(memory_registers),
        interpret=bool(interpret))
