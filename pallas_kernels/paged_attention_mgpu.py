"""Paged decode attention on Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

Same contract as :func:`pallas_kernels.paged_attention.paged_attention` (vLLM's
``PagedAttention.forward_decode``) for the subset :func:`unsupported_reason` accepts; the op-level
dispatch (``jaxkv.attention.dispatch``, ``impl="pallas_mosaic"``) sends everything else to the Triton kernel.

Cache layout: the Pallas backend's ``[2, num_blocks, num_kv_heads, block_size, head_size]`` unchanged. One
page of one KV head is a contiguous ``block_size x head_size`` tile, which is exactly what one 2-D TMA
copy moves (a box of ``block_size`` rows of ``head_size`` elements), so no new layout is needed.

One CUDA block (grid ``(num_kv_heads, num_splits, num_seqs)``) handles one (KV head, context partition,
sequence) with two warpgroups:

* the *memory* warpgroup walks the partition ``block_kv`` tokens per step and, for each step, issues one
  TMA copy per page (or page slice) into slot ``step % num_stages`` of a shared-memory ring of K and of V
  tiles; the page ids come from the block table (scalar loads from global memory). A slot is refilled
  once the compute warpgroup has arrived on its "consumed" barrier.
* the *compute* warpgroup holds the group's query heads in the first rows of a 64-row ``wgmma`` tile,
  computes ``S = Q Kᵀ`` with ``wgmma`` from shared memory and ``O += P V`` with P from registers into the
  running accumulator (the interpreter, which runs ``wgmma`` only from shared memory, writes P to a tile
  there: ``pv_from_smem``) and keeps an online softmax in float32 with ``exp2`` (``log2 e`` folded into the logit scale). Its query rows come
  from q's own layout ``[num_seqs * num_heads, head_size]`` in one TMA box of the group's rows into a
  *plain* (untiled) 64-row staging tile, which may take a box starting on any row (a swizzled tile
  takes only whole 8-row tiles, which needed q padded in XLA), and are copied through registers into the
  swizzled tile ``wgmma`` reads. The output goes back the same way: normalised into the staging tile,
  then one TMA box of the group's rows straight into the output, so no XLA pad or slice remains (head
  size 256 is the exception, ``tuning.MGPU_DECODE_STAGED_MAX_HEAD_SIZE``: its staging tile is the
  swizzled one and q is padded to whole 8-row tiles). The tiles' other rows are stale, computed as
  garbage (row by row: no operation mixes rows) and dropped.

Slots a sequence does not own (past ``seq_len`` in its last page, pages outside the sliding window that
share a step with visible ones) are read but get ``-inf`` logits, and their V rows are zeroed in shared
memory before ``P V`` (the page may hold NaN, and ``0 * NaN`` is NaN); steps without such slots skip both.
fp8 pages are copied as fp8 (half the bytes of bf16), converted to the compute dtype in registers and
written to a 16-bit tile for ``wgmma``: on the persistent kernel by default by a third, *converter*
warpgroup into a ring of 16-bit slots (``producer_converts``; it also moves each item's query into the
swizzled tile), else by the compute warpgroup beside the other operand's ``wgmma`` (``convert_ahead``);
``k_scale`` is folded into the logit scale, ``v_scale`` into the output.

fp8 without converting K (``fp8_route``, issue 45; the default "qk8t" on the persistent kernel with the converter
warpgroup, head sizes up to 128 and at most 16 query heads per KV head, else "qk8" or "convert"): the converter
warpgroup quantizes each item's query rows to e4m3 with a scale per row (``s = absmax / 448``; "qk8t" also keeps
the rounding error as a second e4m3 half, ``q / s = hi + lo / 16``, ~8 significant bits, so the result is the
converter route's within the bf16/f16 tolerances) and converts only V. q·kᵀ is an fp8 ``wgmma`` (f32 accumulate)
straight from the fp8 K slot: "qk8" on the 64-row query tile (one e4m3 half: FlashAttention-3's accuracy), "qk8t"
with the keys as the ``wgmma`` rows (``Sᵀ = K qᵀ``, N = the group padded to 8), so the softmax runs on
``block_kv x 8`` logits, not ``64 x block_kv`` (the max over keys a cross-warp reduction), ``Pᵀ`` goes through a
small shared tile and ``Oᵀ += Vᵀ Pᵀ`` is an f16 ``wgmma`` with the converted V read transposed. The query scales
fold into the logit scale; softmax and output stay float32 across steps. An fp8 P·V (FlashAttention-3's V
transposed in shared memory) is not built: sm_90 fp8 ``wgmma`` takes only K-major operands ("Only f16 WGMMA
supports transposes" for V as stored) and Mosaic GPU's transposed 8-bit shared-memory copies are Blackwell-only
("Transposed 8-bit loads and stores are not supported on pre-Blackwell architectures").

With ``num_splits > 1`` each partition writes its normalised output (compute dtype) and its base-2
log-sum-exp (float32); one small XLA pass merges them.

Persistent kernel (``persistent=True``, the default since its H100 run: as fast or faster than the grid
above at most bench shapes, docs/benchmarks.md). With short contexts and many sequences (batch 256 x 1k
tokens; SmolLM2's decode step: 3 KV heads, head size 64, 100-200 tokens) each CTA of the grid above runs
1-8 steps and pays a fixed cost per CTA (launch, barrier init, the dependent scalar loads of ``seq_lens``
and the block table before the first TMA copy, the ring fill, the output store wait). The persistent
kernel launches ``num_programs`` CTAs (the
SM count by default), grid ``(num_programs,)``; work items are the (sequence, KV head, partition) triples,
item ``i`` = sequence ``order[i // (num_kv_heads * num_splits)]`` with the sequences ordered longest first, dealt
in a snake (round ``k`` gives CTA ``c`` item ``k * G + c`` in even rounds, ``k * G + G - 1 - c`` in odd ones), so
CTAs get similar work with mixed lengths (``balance``; session 22: 1.016x at the 8B run's batches, H100).
Both warpgroups count K/V steps across the CTA's items (slot ``g % num_stages``), so the memory warpgroup
fills the ring with the next item's pages while the compute warpgroup finishes the current one. The query
and output share the plain staging tile as above, double-buffered (``[2, 64, head_size]``; one when two leave no room for a
ring stage, ``tuning.mgpu_decode_ring``): the memory warpgroup
copies item ``k``'s query into tile ``k % 2`` before its K/V steps, once the compute warpgroup has signalled
that the output store of item ``k - 2`` finished reading that tile (a "q free" barrier per tile; the
log-sum-exp rows are double-buffered with it). Outputs, per-partition log-sum-exps and the merge are the
non-persistent kernel's (bit for bit in the interpreter).

Tested in the Mosaic GPU interpreter on CPU (``tests/pallas_kernels/test_paged_attention_mgpu.py``; the
persistent kernel with 2-3 programs of several items each) and lowered for sm_90 on CPU; the compiled
kernel runs only on a Hopper GPU (``scripts/dev/gpu_mgpu.sh``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _checks, tuning
from pallas_kernels._mgpu_paging import issue_kv_step, issue_ring_step, produce_kv_ring, step_pages
from pallas_kernels._online_softmax import accumulate_pv, softmax_rescale_exp2
from pallas_kernels._reference import kv_scales
from pallas_kernels.paged_attention import FP8_DTYPES, _check_head_size, _validate

ROWS = 64                      # wgmma M: one warpgroup's tile of query rows (the group's heads, padded)
HEAD_SIZES = (64, 128, 256)    # head sizes the kernel computes (wgmma N/K and 128-byte swizzle rows)
COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_BLOCK_SIZE = 8             # a TMA box of one page: rows a multiple of the 8-row smem tile
# An fp8 cache with a bf16 query computes in f16 (head sizes with the plain staging tile): sm_90 converts
# fp8 pairs to f16 in one instruction (cvt.rn.f16x2.e4m3x2; e4m3 and e5m2 are exact in f16), where bf16
# goes through f32. The query is scaled by 2**-8 on the way (the logit scale by 2**8), so a bf16 query
# overflows f16 only past 1.6e7; P in [0, 1] and fp8 V are exact or finer in f16 than in bf16.
F16_Q_SCALE = 2.0 ** -8
LOG2E = math.log2(math.e)
# fp8 query (``fp8_route`` "qk8" / "qk8t"): each query row scaled by 448 / its absmax into e4m3 (E4M3_MAX),
# "qk8t" also keeps the rounding error as a second e4m3 half scaled by QK8_LO_SCALE; rows whose absmax is
# below QK8_MIN_ABSMAX (all zero) quantize to 0 without dividing by 0.
E4M3_MAX = 448.0
QK8_LO_SCALE = 16.0
QK8_MIN_ABSMAX = 2.0 ** -100
# fp8 cache routes (``paged_attention_mgpu(fp8_route=...)``; docs in the module docstring): "convert" (the
# converter warpgroup turns K and V into 16-bit rings), "qk8" (fp8 q·kᵀ from the fp8 K slots, 64 query rows;
# V converted), "qk8t" (fp8 Kqᵀ with the keys as the wgmma rows, V converted).
FP8_ROUTES = ("convert", "qk8", "qk8t")


# Registers per thread with a third (converter) warpgroup: the compute warpgroup's accumulator, logits and
# P want more than the even split (168 each of 512); the memory warpgroup only issues copies.
MGPU_COMPUTE_REGISTERS = 240
MGPU_MEMORY_REGISTERS = 40

# Extra ``plgpu.CompilerParams`` fields for Mosaic GPU's on-device profiler (``profile_space``,
# ``profile_dir``), set before the first call (jit caches the kernel): each warpgroup then records the
# kernel's named scopes (``wait_k``, ``qk``, ``softmax``, ``pv``, ``store``, ``convert``, ...) with the SM
# clock into a trace per call (scripts/dev/profile_mgpu_decode.py). Empty: no profiling, and the scopes cost
# nothing.
PROFILE: dict = {}


def unsupported_reason(q_dtype, kv_dtype, num_heads: int, num_kv_heads: int, head_size: int,
                       block_size: int, *, alibi: bool) -> str | None:
    """Why the Mosaic GPU decode kernel cannot run this call, or ``None`` when it can.

    The op-level dispatch falls back to the Triton kernel with this reason. Static arguments only.
    """
    if jnp.dtype(q_dtype) not in COMPUTE_DTYPES:
        return f"q.dtype={jnp.dtype(q_dtype)} (Mosaic kernel: bfloat16/float16; wgmma has no f32 path)"
    if jnp.dtype(kv_dtype) != jnp.dtype(q_dtype) and jnp.dtype(kv_dtype) not in FP8_DTYPES:
        return f"kv_cache.dtype={jnp.dtype(kv_dtype)} with q.dtype={jnp.dtype(q_dtype)}"
    if head_size not in HEAD_SIZES:
        return f"head_size={head_size} (Mosaic kernel: {HEAD_SIZES})"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > ROWS:
        return f"num_heads={num_heads}/num_kv_heads={num_kv_heads} (at most {ROWS} heads per KV head)"
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return f"block_size={block_size} (Mosaic kernel: a power of two >= {MIN_BLOCK_SIZE})"
    if alibi:
        return "alibi_slopes (not implemented in the Mosaic kernel)"
    return None


def _tile_transforms(head_size: int, dtype) -> tuple:
    """The (tiling, swizzle) transforms of a ``[rows, head_size]`` shared-memory tile used by wgmma."""
    row_bytes = head_size * jnp.dtype(dtype).itemsize
    swizzle = min(128, row_bytes)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _upcast(x, dtype):
    """fp8 → ``dtype``; to bf16 through f32 (sm_90 converts fp8 only to f16 in hardware; Mosaic refuses
    the direct cast without a newer ptxas), exact either way."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        x = x.astype(jnp.float32)
    return x.astype(dtype)


def _convert_tile(src, dst) -> None:
    """The fp8 tile ``src`` to ``dst.dtype`` into ``dst`` (both shared memory) through registers, in the
    8-bit wgmma fragment layout: four adjacent bytes per thread and load, where the 16-bit WGMMA layout
    moves two (1.17-1.27x less fp8 kernel time at batch >= 64 on the H100, docs/perf-notes.md)."""
    dst[...] = _upcast(plgpu.load(src, layout=plgpu.Layout.WGMMA_8BIT), dst.dtype)


def convert_ring_step(j, slot, slot16, *, src, dst, full, consumed, ready, released, num_stages16: int) -> None:
    """A converting warpgroup's step ``j``: wait for fp8 ring slot ``slot`` (``j % num_stages``) of ``src`` to fill
    (``full``) and, from step ``num_stages16`` on, for 16-bit slot ``slot16`` (``j % num_stages16``) of ``dst`` to be
    released (``released``), convert the one into the other (:func:`_convert_tile`), then arrive on ``ready`` (the
    16-bit slot holds step ``j``) and ``consumed`` (the fp8 slot may be refilled). The decode kernel's converter
    warpgroup runs it for K and V, the prefill kernel's memory warpgroup for V."""
    with jax.named_scope("wait_fp8"):
        plgpu.barrier_wait(full.at[slot])
    with jax.named_scope("wait_free"):
        pl.when(j >= num_stages16)(functools.partial(plgpu.barrier_wait, released.at[slot16]))
    with jax.named_scope("convert"):
        _convert_tile(src.at[slot], dst.at[slot16])
        plgpu.commit_smem()
    plgpu.barrier_arrive(ready.at[slot16])
    plgpu.barrier_arrive(consumed.at[slot])


def _partition(seq_len, part, *, block_size: int, block_kv: int, steps_per_partition: int,
               sliding_window: int | None):
    """The steps of one (sequence, context partition): ``(num_pages, origin, window_start, first_step, n)``;
    step ``i < n`` covers tokens ``[origin + (first_step + i) * block_kv, ... + block_kv)``."""
    num_pages = (seq_len + block_size - 1) // block_size
    part_tokens = steps_per_partition * block_kv
    origin = part * part_tokens                              # first token of this partition
    window_start = 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)
    local_end = jnp.clip(seq_len - origin, 0, part_tokens)
    num_steps = (local_end + block_kv - 1) // block_kv
    first_step = jnp.minimum(jnp.maximum(window_start - origin, 0) // block_kv, num_steps)
    n = num_steps - first_step                               # steps this program runs (may be 0)
    return num_pages, origin, window_start, first_step, n


class _Ring(NamedTuple):
    """Where the compute warpgroup reads step ``g``'s K and V: slot ``g % num_stages`` of ``k`` and slot
    ``g % v_stages`` of ``v`` (``[stages, block_kv, head_size]``; ``v_stages`` ``None``: ``num_stages``), filled
    when ``k_bars``/``v_bars`` complete that slot's phase, released by arriving on ``k_consumed``/``v_consumed``.
    ``k16``/``v16``: 16-bit tiles the compute warpgroup converts an fp8 slot into before ``wgmma`` (``None``:
    the slots are ``wgmma``-ready: a 16-bit cache, fp8 converted by another warpgroup, or fp8 K read by an
    fp8 ``wgmma``)."""
    k: object
    v: object
    k16: object
    v16: object
    k_bars: object
    v_bars: object
    k_consumed: object
    v_consumed: object
    num_stages: int
    v_stages: int | None = None


def _attend(q_tile, ring: _Ring, p_smem, *, n, origin, first_step, seq_len, window_start, k_factor,
            step_base=None, block_kv: int, logits_soft_cap: float | None, convert_ahead: bool = False):
    """The compute warpgroup's ``n`` steps of one partition: ``(acc, m, l)`` (unnormalised output, running
    max and sum, base 2). Step ``i`` reads ring slot ``(step_base + i) % num_stages`` (``step_base``
    ``None``: 0, the non-persistent kernel's step count); ``p_smem``: P's tile (``None``: P from registers).
    ``k_factor``: the logit scale, a scalar, or ``f32[ROWS]`` (WGMMA row layout) per query row (an fp8
    query with its row scales folded in, ``fp8_route="qk8"``: ``q_tile`` and the K slots fp8).

    fp8 slots (``ring.k16`` set) are converted to 16 bits before their ``wgmma``: in step order (K, then
    QK, softmax, V, then PV: each conversion waits for the previous ``wgmma``), or with ``convert_ahead``
    each beside the other operand's ``wgmma``: V of step ``i`` while step ``i``'s QK runs, K of step
    ``i + 1`` while step ``i``'s PV runs (step 0's K before the loop). Neither ``wgmma`` reads the tile
    being written (QK reads ``k16``, PV ``v16``), and each is waited before its tile is written again."""
    k_smem, v_smem, k16_smem, v16_smem, k_bars, v_bars, k_consumed, v_consumed, num_stages, v_stages = ring
    v_stages = v_stages or num_stages
    head_size = k_smem.shape[-1]
    dtype = (v16_smem if v16_smem is not None else v_smem).dtype    # P's dtype: V's in the PV wgmma
    fp8 = k16_smem is not None
    convert_ahead = convert_ahead and fp8
    m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.zeros((ROWS, head_size), jnp.float32), plgpu.Layout.WGMMA)

    def slot_of(i, stages=num_stages):
        return lax.rem(i if step_base is None else step_base + i, stages)

    def convert(slot, src, dst, bars, consumed):
        """Wait for fp8 slot ``slot`` of ``src``, convert it into ``dst`` and release the slot."""
        with jax.named_scope("wait_fp8"):
            plgpu.barrier_wait(bars.at[slot])
        with jax.named_scope("convert"):
            _convert_tile(src.at[slot], dst)
            plgpu.commit_smem()
        plgpu.barrier_arrive(consumed.at[slot])

    convert_k = functools.partial(convert, src=k_smem, dst=k16_smem, bars=k_bars, consumed=k_consumed)
    convert_v = functools.partial(convert, src=v_smem, dst=v16_smem, bars=v_bars, consumed=v_consumed)
    if convert_ahead:
        pl.when(n > 0)(lambda: convert_k(slot_of(0)))

    def body(i, carry):
        acc, m, l = carry
        slot = slot_of(i)
        vslot = slot_of(i, v_stages)
        first_token = origin + (first_step + i) * block_kv
        if convert_ahead:
            k_tile = k16_smem                                  # converted during the previous step
        elif fp8:
            convert_k(slot)
            k_tile = k16_smem
        else:
            with jax.named_scope("wait_k"):
                plgpu.barrier_wait(k_bars.at[slot])
            k_tile = k_smem.at[slot]

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_tile, k_tile.T)
            if convert_ahead:
                convert_v(slot)                                # beside the QK wgmma
            return acc_ref[...]
        with jax.named_scope("qk"):
            logits = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
        if not fp8:
            plgpu.barrier_arrive(k_consumed.at[slot])
        # Only steps that reach past the sequence's end or start before the window hold invisible slots:
        # their logits are masked and their V rows zeroed; the other steps skip both (a branch per step:
        # 6-7 % less fp8 kernel time at batch >= 64 on the H100; docs/perf-notes.md, session 14).
        edge = (first_token + block_kv > seq_len) | (first_token < window_start)
        with jax.named_scope("softmax"):
            logits = logits * (k_factor if not getattr(k_factor, "shape", ()) else
                               lax.broadcast_in_dim(k_factor, logits.shape, [0]))
            if logits_soft_cap is not None:
                logits = jnp.tanh(logits * (1.0 / logits_soft_cap)) * (logits_soft_cap * LOG2E)

            def mask(logits):
                token = first_token + plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1,
                                                             layout=plgpu.Layout.WGMMA)
                return jnp.where((token < seq_len) & (token >= window_start), logits, -jnp.inf)
            logits = lax.cond(edge, mask, lambda logits: logits, logits)
            acc, m_next, l, p = softmax_rescale_exp2(acc, m, l, logits)

        if fp8:
            if not convert_ahead:
                convert_v(slot)
            v_tile = v16_smem
        else:
            with jax.named_scope("wait_v"):
                plgpu.barrier_wait(v_bars.at[vslot])
            v_tile = v_smem.at[vslot]

        # Zero the V rows of invisible slots (they may hold NaN, and 0 * NaN is NaN).
        @pl.when(edge)
        def _zero_invisible_rows():
            row = first_token + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_size), 0,
                                                       layout=plgpu.Layout.WGMMA)
            v = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
            v_tile[...] = jnp.where((row < seq_len) & (row >= window_start), v, jnp.zeros_like(v))
            plgpu.commit_smem()

        during = None
        if convert_ahead:                                      # the next step's K beside the PV wgmma
            during = lambda: pl.when(i + 1 < n)(lambda: convert_k(slot_of(i + 1)))
        with jax.named_scope("pv"):
            acc = accumulate_pv(acc, p.astype(dtype), v_tile, p_smem, during)   # P from registers unless p_smem
        if not fp8:
            plgpu.barrier_arrive(v_consumed.at[vslot])
        return acc, m_next, l

    return lax.fori_loop(0, n, body, (acc, m, l))


def _attend_keys(q_hi, q_lo, col_scale, ring: _Ring, pt_smem, *, n, origin, first_step, seq_len, window_start,
                 k_factor, step_base, block_kv: int, logits_soft_cap: float | None, pv_from_smem: bool):
    """``fp8_route="qk8t"``: the compute warpgroup's ``n`` steps of one partition with the keys as the
    ``wgmma`` rows: ``(accᵀ, m, l)``, ``accᵀ`` ``f32[head_size, cols]`` (WGMMA layout) the unnormalised output
    transposed, ``m``/``l`` ``f32[cols]`` (WGMMA column layout) the running max and sum, base 2.

    ``Sᵀ = K qᵀ`` is one fp8 ``wgmma`` per query half (M = the step's ``block_kv`` keys straight from the fp8
    ring slot, N = ``cols``, the group's query heads padded to whole 8-row tiles, K = head size; fp8 operands
    must both be K-major on sm_90, which K's rows and q's rows are): ``q_hi``/``q_lo`` ``[cols, head_size]``
    e4m3 tiles with ``q / s = hi + lo / QK8_LO_SCALE`` (``s = col_scale``, the row's absmax / 448), so the
    query keeps ~8 significant bits, a bf16 query's precision. The softmax then runs on ``block_kv x cols``
    logits (``4 x 128 / 128`` per thread at GQA 4, where the 64-row tile of :func:`_attend` holds 64):
    the max over the keys is a cross-warp reduction (Mosaic's, through its reduction scratch), the sum stays
    per thread (``l`` is summed once, at the end). ``Pᵀ`` goes to ``pt_smem`` (``[cols, block_kv]`` f16,
    stored transposed) and ``accᵀ += Vᵀ Pᵀ`` is one f16 ``wgmma`` (M = head size, A = the 16-bit V slot
    read transposed, B = ``Pᵀ``). V comes converted to f16 by the converter warpgroup (``ring.v``, f16).
    Invisible slots are masked and their V rows zeroed at edge steps, as in :func:`_attend`."""
    k_smem, v_smem, _, _, k_bars, v_bars, k_consumed, v_consumed, num_stages, v_stages = ring
    head_size = k_smem.shape[-1]
    cols = q_hi.shape[0]
    col = plgpu.Layout.WGMMA.reduce(0)
    f_hi = col_scale * k_factor
    f_lo = f_hi * (1.0 / QK8_LO_SCALE)
    m = plgpu.layout_cast(jnp.full((cols,), -jnp.inf, jnp.float32), col)
    l = plgpu.layout_cast(jnp.zeros((block_kv, cols), jnp.float32), plgpu.Layout.WGMMA)
    acc = plgpu.layout_cast(jnp.zeros((head_size, cols), jnp.float32), plgpu.Layout.WGMMA)

    def cols_of(x, shape):
        return lax.broadcast_in_dim(x, shape, [1])

    def body(i, carry):
        acc, m, l = carry
        g = step_base + i
        slot, vslot = lax.rem(g, num_stages), lax.rem(g, v_stages)
        first_token = origin + (first_step + i) * block_kv
        with jax.named_scope("wait_k"):
            plgpu.barrier_wait(k_bars.at[slot])

        def qk(acc_hi, acc_lo):
            plgpu.wgmma(acc_hi, k_smem.at[slot], q_hi.T)
            plgpu.wgmma(acc_lo, k_smem.at[slot], q_lo.T)
            return acc_hi[...], acc_lo[...]
        with jax.named_scope("qk"):
            s_hi, s_lo = pl.run_scoped(qk, plgpu.ACC((block_kv, cols), jnp.float32),
                                       plgpu.ACC((block_kv, cols), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])
        edge = (first_token + block_kv > seq_len) | (first_token < window_start)
        with jax.named_scope("softmax"):
            logits = s_hi * cols_of(f_hi, s_hi.shape) + s_lo * cols_of(f_lo, s_lo.shape)
            if logits_soft_cap is not None:
                logits = jnp.tanh(logits * (1.0 / logits_soft_cap)) * (logits_soft_cap * LOG2E)

            def mask(logits):
                token = first_token + plgpu.broadcasted_iota(jnp.int32, (block_kv, cols), 0,
                                                             layout=plgpu.Layout.WGMMA)
                return jnp.where((token < seq_len) & (token >= window_start), logits, -jnp.inf)
            logits = lax.cond(edge, mask, lambda logits: logits, logits)
            m_next = jnp.maximum(m, plgpu.layout_cast(logits.max(axis=0), col))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)   # a column with no visible key stays 0
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(logits - cols_of(m_safe, logits.shape))
            l = l * cols_of(alpha, l.shape) + p
            acc = acc * cols_of(alpha, acc.shape)
            pt_smem.T[...] = plgpu.layout_cast(p.astype(pt_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
        with jax.named_scope("wait_v"):
            plgpu.barrier_wait(v_bars.at[vslot])
        v_tile = v_smem.at[vslot]

        @pl.when(edge)
        def _zero_invisible_rows():
            row = first_token + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_size), 0,
                                                       layout=plgpu.Layout.WGMMA)
            v = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
            v_tile[...] = jnp.where((row < seq_len) & (row >= window_start), v, jnp.zeros_like(v))
            plgpu.commit_smem()

        with jax.named_scope("pv"):
            if pv_from_smem:     # the interpreter: no accumulator initialised from registers
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, v_tile.T, pt_smem.T)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
            else:
                def pv_in_place(acc_ref):
                    plgpu.wgmma(acc_ref, v_tile.T, pt_smem.T)
                acc = pl.run_state(pv_in_place)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[vslot])
        return acc, m_next, l

    acc, m, l = lax.fori_loop(0, n, body, (acc, m, l))
    return acc, m, plgpu.layout_cast(l.sum(axis=0), col)


def _store_output_keys(acc_t, m, l, v_scale, io_tile, lse_tile, o_dst, lse_dst) -> None:
    """:func:`_store_output` for :func:`_attend_keys`' transposed output ``accᵀ`` (``[head_size, cols]``) and
    column vectors: normalised, written transposed into the first ``cols`` rows of the plain staging tile,
    the log-sum-exp into the first ``cols`` entries of ``lse_tile`` (the others stay stale and are dropped
    with the padded rows), then the same TMA stores."""
    rows, cols = o_dst.shape[0], acc_t.shape[1]
    l_safe = jnp.where(l == 0.0, 1.0, l)                     # an empty partition gives 0, not NaN
    acc_t = acc_t * lax.broadcast_in_dim(v_scale / l_safe, acc_t.shape, [1])
    # (WGMMA_TRANSPOSED: the layout Mosaic stores into a transposed view; layout inference does not find it alone)
    io_tile.at[pl.ds(0, cols)].T[...] = plgpu.layout_cast(acc_t.astype(io_tile.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    lse_tile.at[pl.ds(0, cols)][...] = jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(l_safe))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(io_tile.at[pl.ds(0, rows)], o_dst)
    plgpu.copy_smem_to_gmem(lse_tile, lse_dst)


def quantize_q_rows(q_tile, q_hi, q_lo, lo_scale: float = QK8_LO_SCALE):
    """The query rows of ``q_tile`` (``[ROWS, head_size]`` in q's dtype, shared memory) to e4m3 with a scale per row:
    ``s = absmax / 448``; ``hi = e4m3(q / s)`` into the swizzled fp8 tile ``q_hi``, and with ``q_lo`` the rounding
    error ``lo = e4m3((q / s - hi) * lo_scale)`` (``q / s = hi + lo / lo_scale`` to ~2**-8 of each element; ``hi``
    alone: 2**-4). Returns ``s`` (``f32[ROWS]``, WGMMA row layout); an all-zero row gets a tiny scale and quantizes
    to 0. The caller commits shared memory. (The decode kernel scales ``lo`` by QK8_LO_SCALE into its own
    accumulator; the prefill kernel chains it unscaled into the ``hi`` accumulator, ``lo_scale`` 1.)"""
    q = plgpu.load(q_tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(q), axis=1), QK8_MIN_ABSMAX)
    qs = q * lax.broadcast_in_dim(E4M3_MAX / amax, q.shape, [0])
    hi = qs.astype(q_hi.dtype)
    q_hi[...] = hi
    if q_lo is not None:
        lo = qs - hi.astype(jnp.float32)
        q_lo[...] = (lo * lo_scale if lo_scale != 1 else lo).astype(q_lo.dtype)
    return amax * (1.0 / E4M3_MAX)


def _quantize_q(io_tile, q_hi, q_lo, q_scale) -> None:
    """:func:`quantize_q_rows` of the plain staging tile ``io_tile`` with the row scales into ``q_scale``
    (``f32[ROWS]``); rows past the group are stale and quantized as garbage (their logits are dropped)."""
    q_scale[...] = quantize_q_rows(io_tile, q_hi, q_lo)
    plgpu.commit_smem()


def _store_output(acc, m, l, v_scale, io_tile, lse_tile, o_dst, lse_dst) -> None:
    """Normalise, write the output to the plain staging tile ``io_tile`` (its query rows were read at the
    item's start) and the base-2 log-sum-exp to ``lse_tile``, and start the TMA stores of the output's
    first ``o_dst.shape[0]`` rows (the group's heads) to ``o_dst`` and of the log-sum-exp tile to
    ``lse_dst`` (the caller waits for them). The staging tile is plain, so the box may hold any number
    of rows, except at head size 256, where it is the swizzled query tile and ``rows`` whole 8-row tiles."""
    rows = o_dst.shape[0]
    l_safe = jnp.where(l == 0.0, 1.0, l)                     # an empty partition gives 0, not NaN
    acc = acc * lax.broadcast_in_dim(v_scale / l_safe, acc.shape, [0])
    io_tile[...] = acc.astype(io_tile.dtype)
    lse_tile[...] = jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(l_safe))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(io_tile.at[pl.ds(0, rows)], o_dst)
    plgpu.copy_smem_to_gmem(lse_tile, lse_dst)


def _item_rows(s, h, *, num_kv_heads: int, rows: int):
    """The slice of (sequence ``s``, KV head ``h``)'s ``rows`` rows along the row axis of q
    (``[num_seqs * num_kv_heads * rows, head_size]``, q's own layout) and of each output partition."""
    return pl.ds((s * num_kv_heads + h) * rows, rows)


def _copy_q(q_ref, io_tile, bar, s, h, *, num_kv_heads: int, rows: int) -> None:
    """Start the TMA copy of the query rows of (sequence ``s``, KV head ``h``) from ``q_ref`` into the
    first ``rows`` rows of the staging tile ``io_tile`` (plain, so the box may start on any row)."""
    plgpu.copy_gmem_to_smem(q_ref.at[_item_rows(s, h, num_kv_heads=num_kv_heads, rows=rows)],
                            io_tile.at[pl.ds(0, rows)], bar)


def _tile_q(io_tile, q_tile):
    """The swizzled tile ``wgmma`` reads the query from: the query rows copied from the plain staging tile
    into ``q_tile`` (all 64 rows; those past the group are stale and computed as garbage, row by row, then
    dropped), or ``io_tile`` itself when there is no separate ``q_tile`` (head size > 128: the staging tile
    is swizzled, :data:`pallas_kernels.tuning.MGPU_DECODE_STAGED_MAX_HEAD_SIZE`)."""
    if q_tile is None:
        return io_tile
    q = plgpu.load(io_tile, layout=plgpu.Layout.WGMMA)
    if q_tile.dtype != io_tile.dtype:   # fp8 cache: bf16 q to the f16 compute dtype, scaled by F16_Q_SCALE
        # Scaled in q's dtype first (exact: a power of two), then converted: written as f32 -> scale ->
        # f16, the compiled kernel converted before scaling and overflowed past 65504 (H100).
        q = (q * jnp.asarray(F16_Q_SCALE, q.dtype)).astype(q_tile.dtype)
    q_tile[...] = q
    plgpu.commit_smem()
    return q_tile


def _decode_kernel(seq_lens_ref, tables_ref, q_ref, kv_ref, k_scale_ref, v_scale_ref, o_ref, lse_ref,
                   scratch, *,
                   scale: float, block_kv: int, tokens_per_copy: int, num_stages: int,
                   steps_per_partition: int, sliding_window: int | None, logits_soft_cap: float | None,
                   rows: int, q_unscale: float, convert_ahead: bool):
    (io_smem, k_smem, v_smem, k16_smem, v16_smem, p_smem, lse_smem, q_tile, *_), (q_bar, k_bars, v_bars), consumed = scratch
    k_consumed, v_consumed = consumed
    ring = _Ring(k_smem, v_smem, k16_smem, v16_smem, k_bars, v_bars, k_consumed, v_consumed, num_stages)
    block_size = kv_ref.shape[3]
    num_kv_heads = kv_ref.shape[2]

    h = lax.axis_index("h")
    part = lax.axis_index("p")
    s = lax.axis_index("s")
    wg = lax.axis_index("wg")

    seq_len = seq_lens_ref[s]
    num_pages, origin, window_start, first_step, n = _partition(
        seq_len, part, block_size=block_size, block_kv=block_kv, steps_per_partition=steps_per_partition,
        sliding_window=sliding_window)

    @pl.when(wg == 0)
    def _compute():
        _copy_q(q_ref, io_smem, q_bar.at[0], s, h, num_kv_heads=num_kv_heads, rows=rows)
        plgpu.barrier_wait(q_bar.at[0])
        q_wgmma = _tile_q(io_smem, q_tile)
        k_factor = k_scale_ref[0] * (scale if logits_soft_cap is not None else scale * LOG2E) * q_unscale
        v_scale = v_scale_ref[0]
        acc, m, l = _attend(q_wgmma, ring, p_smem, n=n, origin=origin, first_step=first_step, seq_len=seq_len,
                            window_start=window_start, k_factor=k_factor, block_kv=block_kv,
                            logits_soft_cap=logits_soft_cap, convert_ahead=convert_ahead)
        _store_output(acc, m, l, v_scale, io_smem, lse_smem,
                      o_ref.at[part, _item_rows(s, h, num_kv_heads=num_kv_heads, rows=rows)],
                      lse_ref.at[part, s, h])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        produce_kv_ring(kv_ref, tables_ref, s, h, step_token=lambda i: origin + (first_step + i) * block_kv,
                        num_steps=n, num_pages=num_pages, block_kv=block_kv, tokens_per_copy=tokens_per_copy,
                        num_stages=num_stages, k_smem=k_smem, v_smem=v_smem, k_bars=k_bars, v_bars=v_bars,
                        k_consumed=k_consumed, v_consumed=v_consumed)


def _decode_kernel_persistent(seq_lens_ref, order_ref, tables_ref, q_ref, kv_ref, k_scale_ref, v_scale_ref, o_ref,
                              lse_ref, scratch, *,
                              scale: float, block_kv: int, tokens_per_copy: int, num_stages: int,
                              steps_per_partition: int, sliding_window: int | None,
                              logits_soft_cap: float | None, num_programs: int, num_kv_heads: int,
                              num_splits: int, num_items: int, num_q_buffers: int, rows: int, q_unscale: float,
                              producer_converts: bool, num_stages16: int, convert_ahead: bool,
                              fp8_route: str = "convert", pv_from_smem: bool = False,
                              page_ids_first: bool = False, prefetch_item: bool = False):
    """The persistent kernel: program ``c`` runs its ``k``-th work item from round ``k`` of ``G = num_programs``
    items, dealt in a snake (item ``k * G + c`` in even rounds, ``k * G + G - 1 - c`` in odd ones); item ``i``
    is (sequence ``order_ref[i // (num_kv_heads * num_splits)]``, KV head, partition). ``order_ref`` lists the
    sequences longest first (:func:`_balanced_order`), so every round deals items of similar length and the
    snake gives the programs that took the longer items of one round the shorter ones of the next.

    Barrier protocol (every waiter sees every phase it waits on, in order):

    * ``k_bars``/``v_bars``/``k_consumed``/``v_consumed``: as in :func:`_decode_kernel`, but both warpgroups
      count steps ``g`` across the program's items (slot ``g % num_stages``); the memory warpgroup waits a
      slot's consumed barrier only for ``g >= num_stages`` (the phase of step ``g - num_stages``).
    * ``q_bars[b]``: item ``k``'s query copy (issued by the memory warpgroup) into tile ``b = k % num_q_buffers``;
      the compute warpgroup waits it once per item.
    * ``q_free[b]``: the compute warpgroup arrives once per item, after the TMA stores of its output and
      log-sum-exp (tiles ``b``) finished reading shared memory; the memory warpgroup waits it before item
      ``k``'s query copy when ``k >= num_q_buffers`` (the phase of item ``k - num_q_buffers``). A second
      arrival on ``q_free[b]`` needs item ``k + num_q_buffers``'s query, so it never overtakes that wait.

    ``producer_converts`` (fp8 cache): a third warpgroup, the *converter*, turns the fp8 slots into a
    second ring of ``num_stages16`` 16-bit slots, so the compute warpgroup's chain per step is the 16-bit
    cache's (QK, softmax, PV) while the next step's tiles convert beside it, and the memory warpgroup only
    copies. The converter walks the program's steps ``j`` as the others do: it waits the fp8 slot's
    ``k_bars``/``v_bars`` phase and, for ``j >= num_stages16``, the 16-bit slot's
    ``k16_consumed``/``v16_consumed`` phase (released by the compute warpgroup), converts, arrives on
    ``k16_ready``/``v16_ready`` (which the compute warpgroup waits as it waits ``k_bars`` otherwise) and
    releases the fp8 slot on ``k_consumed``/``v_consumed`` (which the memory warpgroup waits as usual).
    The compute warpgroup copies its own queries (item ``k + 1``'s at the start of item ``k`` with two
    tiles, after item ``k``'s output store with one), so the memory warpgroup never waits on an output.
    With a separate swizzled query tile (head sizes up to ``MGPU_DECODE_STAGED_MAX_HEAD_SIZE``) the
    converter also moves item ``k``'s query from its staging tile into swizzled tile ``k % 2`` before
    item ``k``'s first step (it waits ``q_bars``, and ``q16_free[k % 2]`` for ``k >= 2``, then arrives
    on ``q16_ready[k % 2]``); the compute warpgroup waits ``q16_ready`` instead of ``q_bars`` and arrives
    on ``q16_free`` after the item's last ``wgmma``, so an item starts at its first ``wgmma``.

    ``fp8_route`` "qk8" / "qk8t" (with ``producer_converts``): the converter warpgroup converts only V, and
    instead of moving item ``k``'s query it quantizes it (:func:`_quantize_q`) into fp8 tile ``k % 2`` (with
    "qk8t" also the low half) and its row scales into ``q_scale[k % 2]``, with the same barriers; the compute
    warpgroup reads K from the fp8 ring itself (waits ``k_bars``, releases ``k_consumed`` after its QK
    ``wgmma``) and V from the 16-bit ring: :func:`_attend` with the row scales ("qk8"), or
    :func:`_attend_keys` and :func:`_store_output_keys` ("qk8t").
    """
    ((io_smem, k_smem, v_smem, k16_smem, v16_smem, p_smem, lse_smem, q_tile, q_lo, q_scale, pt_smem),
     (q_bars, k_bars, v_bars), consumed, q_free) = scratch[:4]
    k_consumed, v_consumed = consumed
    moves_q = producer_converts and q_tile is not None
    qk8 = fp8_route != "convert"
    if qk8 and not producer_converts:
        raise ValueError(f"fp8_route={fp8_route!r} needs the converter warpgroup (producer_converts)")
    if producer_converts:
        k16_ready, v16_ready, k16_consumed, v16_consumed = scratch[4]
        ring = _Ring(k16_smem, v16_smem, None, None, k16_ready, v16_ready, k16_consumed, v16_consumed, num_stages16)
        if qk8:    # K from the fp8 ring (as the memory warpgroup fills it), V from the 16-bit ring
            ring = _Ring(k_smem, v16_smem, None, None, k_bars, v16_ready, k_consumed, v16_consumed, num_stages,
                         num_stages16)
    else:
        ring = _Ring(k_smem, v_smem, k16_smem, v16_smem, k_bars, v_bars, k_consumed, v_consumed, num_stages)
    if moves_q:
        q16_ready, q16_free = scratch[5]
    block_size = kv_ref.shape[3]
    c = lax.axis_index("c")
    wg = lax.axis_index("wg")
    full_rounds, last_round_items = num_items // num_programs, num_items % num_programs

    def dealt(k):   # the position of program c in round k of the snake
        return jnp.where(lax.rem(k, 2) == 0, c, num_programs - 1 - c)
    my_items = full_rounds + jnp.where(dealt(full_rounds) < last_round_items, 1, 0)
    partition = functools.partial(_partition, block_size=block_size, block_kv=block_kv,
                                  steps_per_partition=steps_per_partition, sliding_window=sliding_window)

    def item(k):
        i = k * num_programs + dealt(k)
        s = order_ref[lax.div(i, num_kv_heads * num_splits)]
        r = lax.rem(i, num_kv_heads * num_splits)
        return s, lax.div(r, num_splits), lax.rem(r, num_splits), lax.rem(k, num_q_buffers)

    def seq_of(k):   # item k's sequence, k clamped to the program's items (a prefetch past the last is unused)
        k = jnp.minimum(k, jnp.maximum(my_items - 1, 0))
        return order_ref[jnp.minimum(lax.div(k * num_programs + dealt(k), num_kv_heads * num_splits),
                                     order_ref.shape[0] - 1)]

    def copy_q(k):
        s, h, _, b = item(k)
        _copy_q(q_ref, io_smem.at[b], q_bars.at[b], s, h, num_kv_heads=num_kv_heads, rows=rows)

    @pl.when(wg == 0)
    def _compute():
        k_factor = k_scale_ref[0] * (scale if logits_soft_cap is not None else scale * LOG2E) * q_unscale
        v_scale = v_scale_ref[0]
        if producer_converts:
            plgpu.set_max_registers(MGPU_COMPUTE_REGISTERS, action="increase")
            pl.when(my_items > 0)(lambda: copy_q(0))

        def run_item(k, g):
            s, h, part, b = item(k)
            seq_len = seq_lens_ref[s]
            _, origin, window_start, first_step, n = partition(seq_len, part)
            io_tile, lse_tile = io_smem.at[b], lse_smem.at[b]
            if moves_q:                                     # the converter moved it into tile k % 2
                q2 = lax.rem(k, 2)
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q16_ready.at[q2])
                q_wgmma = q_tile.at[q2]
            else:
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_bars.at[b])
            if producer_converts and num_q_buffers == 2:    # the other tile's store was waited last item
                pl.when(k + 1 < my_items)(lambda: copy_q(k + 1))
            if not moves_q:
                q_wgmma = _tile_q(io_tile, q_tile)
            attend = dict(n=n, origin=origin, first_step=first_step, seq_len=seq_len, window_start=window_start,
                          step_base=g, block_kv=block_kv, logits_soft_cap=logits_soft_cap)
            if fp8_route == "qk8t":
                cols = pt_smem.shape[0]
                col_scale = plgpu.load(q_scale.at[q2, pl.ds(0, cols)], layout=plgpu.Layout.WGMMA.reduce(0))
                acc, m, l = _attend_keys(q_wgmma.at[pl.ds(0, cols)], q_lo.at[q2, pl.ds(0, cols)], col_scale, ring,
                                         pt_smem, k_factor=k_factor, pv_from_smem=pv_from_smem, **attend)
            else:
                factor = k_factor
                if fp8_route == "qk8":                      # the query rows' scales folded into the logit scale
                    factor = plgpu.load(q_scale.at[q2], layout=plgpu.Layout.WGMMA.reduce(1)) * k_factor
                acc, m, l = _attend(q_wgmma, ring, p_smem, k_factor=factor, convert_ahead=convert_ahead, **attend)
            if moves_q:                                     # its wgmmas were waited: tile k % 2 is free
                plgpu.barrier_arrive(q16_free.at[q2])
            with jax.named_scope("store"):
                (_store_output_keys if fp8_route == "qk8t" else _store_output)(
                    acc, m, l, v_scale, io_tile, lse_tile,
                    o_ref.at[part, _item_rows(s, h, num_kv_heads=num_kv_heads, rows=rows)], lse_ref.at[part, s, h])
            with jax.named_scope("store_wait"):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # tiles b may take item k + num_q_buffers
            if not producer_converts:
                plgpu.barrier_arrive(q_free.at[b])
            elif num_q_buffers == 1:
                pl.when(k + 1 < my_items)(lambda: copy_q(k + 1))
            return g + n

        lax.fori_loop(0, my_items, run_item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        if producer_converts:
            plgpu.set_max_registers(MGPU_MEMORY_REGISTERS, action="decrease")

        def run_item(k, carry):
            # prefetch_item: item k's sequence and length came in the carry, loaded during item k - 1 (and its
            # sequence during item k - 2), so no global load sits between two items' copies
            g, s, s_next, seq_len = carry if prefetch_item else (carry, None, None, None)
            if prefetch_item:
                _, h, part, b = item(k)   # (its order load unused: dead code)
                s_next2 = seq_of(k + 2)
                seq_next = seq_lens_ref[s_next]
            else:
                s, h, part, b = item(k)
                seq_len = seq_lens_ref[s]
            num_pages, origin, _, first_step, n = partition(seq_len, part)
            if not producer_converts:
                pl.when(k >= num_q_buffers)(lambda: plgpu.barrier_wait(q_free.at[b]))
                copy_q(k)
            paging = dict(num_pages=num_pages, block_kv=block_kv, tokens_per_copy=tokens_per_copy)
            issue = functools.partial(issue_kv_step, kv_ref, tables_ref, s, h, **paging)
            pages = functools.partial(step_pages, kv_ref, tables_ref, s, **paging) if page_ids_first else None

            def one_step(i, g):
                return issue_ring_step(g, lambda: origin + (first_step + i) * block_kv, issue,
                                       num_stages=num_stages, k_smem=k_smem, v_smem=v_smem, k_bars=k_bars,
                                       v_bars=v_bars, k_consumed=k_consumed, v_consumed=v_consumed, pages=pages)
            g = lax.fori_loop(0, n, one_step, g)
            return (g, s_next, s_next2, seq_next) if prefetch_item else g

        if prefetch_item:
            s0 = seq_of(0)
            lax.fori_loop(0, my_items, run_item, (jnp.int32(0), s0, seq_of(1), seq_lens_ref[s0]))
        else:
            lax.fori_loop(0, my_items, run_item, jnp.int32(0))

    if not producer_converts:
        return

    @pl.when(wg == 2)
    def _converter():
        def convert(j):
            """Step ``j``'s fp8 K (not with an fp8 q·kᵀ) and V slots into its 16-bit slots; the fp8 slots are
            then released."""
            slot, slot16 = lax.rem(j, num_stages), lax.rem(j, num_stages16)
            for src, dst, full, consumed, ready, released in (
                    (k_smem, k16_smem, k_bars, k_consumed, k16_ready, k16_consumed),
                    (v_smem, v16_smem, v_bars, v_consumed, v16_ready, v16_consumed))[1 if qk8 else 0:]:
                convert_ring_step(j, slot, slot16, src=src, dst=dst, full=full, consumed=consumed, ready=ready,
                                  released=released, num_stages16=num_stages16)

        def run_item(k, g):
            s, _, part, b = item(k)
            n = partition(seq_lens_ref[s], part)[4]
            if moves_q:                                     # item k's query into swizzled tile k % 2
                q2 = lax.rem(k, 2)
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_bars.at[b])
                    pl.when(k >= 2)(functools.partial(plgpu.barrier_wait, q16_free.at[q2]))
                with jax.named_scope("move_q"):
                    if qk8:
                        _quantize_q(io_smem.at[b], q_tile.at[q2], None if q_lo is None else q_lo.at[q2],
                                    q_scale.at[q2])
                    else:
                        _tile_q(io_smem.at[b], q_tile.at[q2])
                plgpu.barrier_arrive(q16_ready.at[q2])

            def one_step(i, g):
                convert(g)
                return g + 1
            return lax.fori_loop(0, n, one_step, g)

        lax.fori_loop(0, my_items, run_item, jnp.int32(0))


def _paged_attention_mgpu(q, kv_cache, block_tables, seq_lens, scales, *, scale, sliding_window,
                          logits_soft_cap, block_kv, num_stages, num_splits, interpret, pv_from_smem,
                          persistent=False, num_programs=None, num_q_buffers=1, num_stages16=0,
                          convert_ahead=False, balance=False, fp8_route="convert", page_ids_first=False,
                          prefetch_item=False):
    """``num_stages16`` > 0 (persistent, fp8 cache): a converter warpgroup turns the fp8 ring into a ring
    of that many 16-bit slots (``producer_converts`` in :func:`_decode_kernel_persistent`); with ``fp8_route``
    "qk8" / "qk8t" only V's slots, and it quantizes each item's query to fp8."""
    num_seqs, num_heads, head_size = q.shape
    _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    dtype = q.dtype
    fp8 = jnp.dtype(kv_cache.dtype) in FP8_DTYPES
    tokens_per_copy = min(block_size, block_kv)

    # Every partition holds whole steps; steps past the block table read its last column, clamped in
    # the kernel (those pages are never visible), so the table is not padded.
    max_pages = block_tables.shape[1]
    steps_needed = pl.cdiv(max_pages * block_size, block_kv)
    steps_per_partition = pl.cdiv(steps_needed, num_splits)
    # The query rows go in q's own layout (no copy) as one TMA box per item into a plain staging tile,
    # except for head size 256 (Mosaic's lowering of the 64 x 256 plain-tile load/store does not finish:
    # the staging tile is the swizzled wgmma tile, whose boxes start on whole 8-row tiles, so q is padded
    # to a multiple of 8 rows).
    staged = head_size <= tuning.MGPU_DECODE_STAGED_MAX_HEAD_SIZE
    rows = group if staged else min(ROWS, -(-group // 8) * 8)
    if rows != group:
        q = jnp.pad(q.reshape(num_seqs, num_kv_heads, group, head_size),
                    ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    q = q.reshape(num_seqs * num_kv_heads * rows, head_size)

    # The dtype wgmma computes in: f16 for an fp8 cache under a bf16 query (see F16_Q_SCALE), else q's.
    cdtype = jnp.dtype(jnp.float16) if fp8 and staged else dtype
    # (the fp8 routes quantize q from its own dtype: no F16_Q_SCALE there)
    q_unscale = 1.0 / F16_Q_SCALE if cdtype != dtype and fp8_route == "convert" else 1.0
    tile = _tile_transforms(head_size, cdtype)
    cache_tile = _tile_transforms(head_size, kv_cache.dtype)
    stage_shape = (num_stages, block_kv, head_size)
    q_tiles = (num_q_buffers,) if persistent else ()
    producer_converts = num_stages16 > 0
    if producer_converts and not (persistent and fp8):
        raise ValueError(f"num_stages16={num_stages16}: a converter warpgroup converts only fp8, persistent")
    converted_shape = (num_stages16, block_kv, head_size) if producer_converts else (block_kv, head_size)
    qk8 = fp8_route != "convert"
    if qk8 and not (producer_converts and staged):
        raise ValueError(f"fp8_route={fp8_route!r}: needs the converter warpgroup and head size <= "
                         f"{tuning.MGPU_DECODE_STAGED_MAX_HEAD_SIZE}")
    cols = -(-group // 8) * 8     # "qk8t": the query heads as wgmma columns, whole 8-row tiles
    q8_tile = _tile_transforms(head_size, jnp.float8_e4m3fn)
    smem = (
        plgpu.SMEM((*q_tiles, ROWS, head_size), dtype,                           # q, then the output
                   **({} if staged else dict(transforms=tile))),               # (cdtype == dtype there)
        plgpu.SMEM(stage_shape, kv_cache.dtype, transforms=cache_tile),          # K ring
        plgpu.SMEM(stage_shape, kv_cache.dtype, transforms=cache_tile),          # V ring
        plgpu.SMEM(converted_shape, cdtype, transforms=tile) if fp8 and not qk8 else None,   # K converted
        plgpu.SMEM(converted_shape, cdtype, transforms=tile) if fp8 else None,   # V converted (tile or ring)
        (plgpu.SMEM((ROWS, block_kv), cdtype, transforms=_tile_transforms(block_kv, cdtype))   # P
         if pv_from_smem and fp8_route != "qk8t" else None),
        plgpu.SMEM((*q_tiles, ROWS), jnp.float32),                               # log-sum-exp
        # q for wgmma (two with the converter warpgroup, which moves the next item's query into one; fp8, the
        # high half, with an fp8 q·kᵀ)
        plgpu.SMEM((2, ROWS, head_size) if producer_converts else (ROWS, head_size),
                   jnp.float8_e4m3fn if qk8 else cdtype, transforms=q8_tile if qk8 else tile)
        if staged else None,
        # "qk8t": the query's low fp8 half; "qk8"/"qk8t": the query rows' scales; "qk8t": Pᵀ
        plgpu.SMEM((2, ROWS, head_size), jnp.float8_e4m3fn, transforms=q8_tile) if fp8_route == "qk8t" else None,
        plgpu.SMEM((2, ROWS), jnp.float32) if qk8 else None,
        (plgpu.SMEM((cols, block_kv), cdtype, transforms=_tile_transforms(block_kv, cdtype))
         if fp8_route == "qk8t" else None),
    )
    copies = block_kv // tokens_per_copy
    barriers = (plgpu.Barrier(num_barriers=num_q_buffers if persistent else 1),
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
                plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages))
    consumed = (plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),) * 2
    kernel = functools.partial(
        _decode_kernel_persistent if persistent else _decode_kernel, scale=scale, block_kv=block_kv,
        tokens_per_copy=tokens_per_copy, num_stages=num_stages, steps_per_partition=steps_per_partition,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, rows=rows, q_unscale=q_unscale,
        convert_ahead=convert_ahead)
    # Persistent: one more barrier group, the query/output tiles' "free" barriers, and with the memory
    # warpgroup converting fp8 the 16-bit ring's ready and consumed barriers (kernel docstring).
    extra = ((plgpu.Barrier(num_arrivals=1, num_barriers=num_q_buffers),) if persistent else ())
    if producer_converts:
        extra += ((plgpu.Barrier(num_arrivals=1, num_barriers=num_stages16),) * 4,)
        if staged:   # the swizzled query tiles' ready and free barriers
            extra += ((plgpu.Barrier(num_arrivals=1, num_barriers=2),) * 2,)
    if persistent:
        kernel = functools.partial(kernel, num_programs=num_programs, num_kv_heads=num_kv_heads,
                                   num_splits=num_splits, num_items=num_seqs * num_kv_heads * num_splits,
                                   num_q_buffers=num_q_buffers, producer_converts=producer_converts,
                                   num_stages16=num_stages16, fp8_route=fp8_route, pv_from_smem=pv_from_smem,
                                   page_ids_first=page_ids_first, prefetch_item=prefetch_item)
        grid, grid_names = (num_programs,), ("c",)
    else:
        grid, grid_names = (num_kv_heads, num_splits, num_seqs), ("h", "p", "s")

    # the persistent kernel also reads the order its items are dealt in (sequence ids, longest first)
    metadata = (seq_lens, block_tables) if not persistent else (
        seq_lens, _balanced_order(seq_lens) if balance else jnp.arange(num_seqs, dtype=jnp.int32), block_tables)

    def entry(*refs):   # metadata refs, q, kv, k_scale, v_scale, o, lse: the kernel's positional refs
        pl.run_scoped(lambda *scratch: kernel(*refs, scratch), smem, barriers, consumed, *extra, collective_axes="wg")

    part = (num_splits, num_seqs, num_kv_heads)
    o, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((num_splits, num_seqs * num_kv_heads * rows, head_size), dtype),
                  jax.ShapeDtypeStruct((*part, ROWS), jnp.float32)),
        grid=grid,
        grid_names=grid_names,
        num_threads=3 if producer_converts else 2,
        thread_name="wg",
        # No reduction scratch: the row max and sum stay within a warp (tuning.mgpu_decode_smem_bytes), except
        # "qk8t"'s max over the keys, which are the rows (a cross-warp reduction).
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=tuning.MGPU_DECODE_QK8T_SCRATCH_BYTES if fp8_route == "qk8t"
            else 0, **PROFILE),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*metadata, q, kv_cache, *scales)

    o = o.reshape(num_splits, num_seqs, num_kv_heads, rows, head_size)[:, :, :, :group]   # free: rows == group
    o = o.reshape(num_splits, num_seqs, num_heads, head_size)
    if num_splits == 1:
        return o[0]
    lse = lse[:, :, :, :group].reshape(num_splits, num_seqs, num_heads)
    return merge_partitions(o, lse)


def _balanced_order(seq_lens: jax.Array) -> jax.Array:
    """``int32[num_seqs]``: the sequences longest first (ties in batch order), the persistent kernel's deal.

    With the batch's own order, a program's items are every ``G``-th (sequence, KV head) of the batch; with
    the 8B ShareGPT run's lengths the busiest program gets 1.2-1.7x the mean's pages at 64-255 sequences, and
    1.02-1.15x dealt longest first in a snake (a simulation). Measured on an H100 at 13 of that run's batches
    the kernel gained only 1.016x (geomean; ``scripts/dev/bench_decode_balance.py``, docs/perf-notes.md,
    session 22): it is bound by the sum of bytes, and CTAs that finish early leave their bandwidth to the
    others. Inside a model step every layer sorts the same ``seq_lens`` (XLA's CSE may merge them; no sort kernel
    was among the 8B decode step's 22 largest on the H100, docs/logs/engine-core-h100/s22-ad)."""
    return jnp.argsort(-seq_lens, stable=True).astype(jnp.int32)


def merge_partitions(o: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge the context partitions of a split decode in float32 with base-2 log-sum-exp weights (XLA).

    One XLA loop fusion: written partition by partition (``num_splits`` is static), element-wise only,
    and each partition's log-sum-exp is taken to ``o``'s shape as ``lse + 0 * o`` so the running max is
    computed per output element inside the fusion. (With ``[..., None]`` broadcasts, XLA computes the
    max in a fusion of its own, and with ``max``/``sum`` reductions in three; on the H100 at 16
    partitions x 8 KV heads x 4 rows x 128: 1.6 us against 2.7 us for two fusions and 3.7 us for three,
    5.7 us for one variadic online-softmax reduction, 1.9 us for a Pallas Triton merge kernel;
    docs/perf-notes.md.) ``0 * o`` is 0: ``o`` is finite (each partition's output is a convex
    combination of visible V rows, the invisible ones zeroed; an empty partition writes zeros).

    Args:
        o: ``[num_splits, ...]`` each partition's normalised output (any float dtype).
        lse: ``f32[num_splits, ...]`` its base-2 log-sum-exp, ``-inf`` for an empty partition; ``o``'s
            shape without the last axis.

    Returns:
        ``o.shape[1:]`` in ``o.dtype``; zero where every partition is empty.
    """
    parts = [lse[p][..., None] + 0.0 * o[p].astype(jnp.float32) for p in range(o.shape[0])]
    # The floor keeps m finite where every partition is empty: their weights are then exp2(-inf) = 0.
    m = functools.reduce(jnp.maximum, parts, jnp.float32(jnp.finfo(jnp.float32).min))
    weights = [jnp.exp2(x - m) for x in parts]
    total = functools.reduce(jnp.add, weights)
    out = functools.reduce(jnp.add, [o[p].astype(jnp.float32) * w for p, w in enumerate(weights)])
    return (out / jnp.where(total == 0.0, 1.0, total)).astype(o.dtype)


def _fp8_route(fp8_route: str | None, *, fp8: bool, persistent: bool, producer_converts: bool, head_size: int,
               group: int) -> str:
    """The fp8 route a call runs: ``fp8_route`` (raises ``ValueError`` where it cannot run), or the default
    :data:`pallas_kernels.tuning.MGPU_DECODE_FP8_ROUTE` where it can ("qk8t" past its group limit: "qk8"),
    else "convert". A 16-bit cache: "convert" (nothing to convert)."""
    if fp8_route is not None and fp8_route not in FP8_ROUTES:
        raise ValueError(f"fp8_route={fp8_route!r} must be one of {FP8_ROUTES}")
    if not fp8:
        return "convert"
    route = fp8_route or tuning.MGPU_DECODE_FP8_ROUTE
    if route == "convert":
        return route
    why = None
    if not (persistent and producer_converts):
        why = "needs persistent=True and the converter warpgroup (producer_converts)"
    elif head_size > tuning.MGPU_DECODE_STAGED_MAX_HEAD_SIZE:
        why = f"head_size={head_size} > {tuning.MGPU_DECODE_STAGED_MAX_HEAD_SIZE}"
    elif route == "qk8t" and group > tuning.MGPU_DECODE_QK8T_MAX_GROUP:
        if fp8_route is None:
            return "qk8"
        why = f"{group} query heads per KV head > {tuning.MGPU_DECODE_QK8T_MAX_GROUP}"
    if why and fp8_route is not None:
        raise ValueError(f"fp8_route={fp8_route!r}: {why}")
    return "convert" if why else route


_STATIC = ("scale", "sliding_window", "logits_soft_cap", "block_kv", "num_stages", "num_splits",
           "interpret", "persistent", "num_programs", "pv_from_smem", "producer_converts",
           "convert_ahead", "num_q_buffers", "balance", "fp8_route", "page_ids_first", "prefetch_item")
INTERPRET_MAX_PROGRAMS = 4     # the persistent grid in the interpreter (it runs programs one by one)


def default_num_programs() -> int:
    """CTAs of the persistent grid: the device's SM count (132 when it does not say: an H100 SXM)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


@_checks.host_checked(_checks.check_decode_args)
@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention_mgpu(
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
    block_kv: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
    persistent: bool = True,
    num_programs: int | None = None,
    pv_from_smem: bool | None = None,
    producer_converts: bool | None = None,
    convert_ahead: bool | None = None,
    num_q_buffers: int | None = None,
    balance: bool | None = None,
    fp8_route: str | None = None,
    page_ids_first: bool | None = None,
    prefetch_item: bool | None = None,
) -> jax.Array:
    """Paged decode attention on Pallas Mosaic GPU (Hopper), one new query token per sequence.

    vLLM: ``PagedAttention.forward_decode`` (``paged_attention_v1`` / ``v2``). Same arguments, semantics
    and result as :func:`pallas_kernels.paged_attention.paged_attention` for the calls
    :func:`unsupported_reason` accepts (bf16/f16 q; cache of q's dtype or fp8 e4m3/e5m2; head size
    64/128/256; at most 64 query heads per KV head; block size a power of two >= 8; no ALiBi).

    ``persistent=True`` (the default) runs the persistent kernel (module docstring): ``num_programs``
    CTAs, each walking several (sequence, KV head, partition) items through one K/V ring, so short
    contexts pay the per-CTA cost once per CTA rather than once per item. Same result; on the H100 it was
    as fast or faster at 6 of the 8 bench shapes and within 0.3 points at the other two
    (docs/benchmarks.md); ``persistent=False`` launches one CTA per item.

    Args:
        q: ``[num_seqs, num_heads, head_size]`` bf16/f16.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``, ``q.dtype`` or fp8.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]`` (0 gives a zero output).
        scale, k_scale, v_scale, sliding_window, logits_soft_cap: as in the Triton op.
        alibi_slopes: must be ``None`` (see :func:`unsupported_reason`).
        block_kv: keys per inner step (static, a multiple of 64); ``None``:
            :func:`pallas_kernels.tuning.mgpu_decode_block_kv`.
        num_stages: shared-memory ring depth (static, >= 1); ``None``:
            :func:`pallas_kernels.tuning.mgpu_decode_num_stages`.
        num_splits: context partitions per sequence (static); ``None``:
            :func:`pallas_kernels.tuning.mgpu_decode_num_splits` (persistent: fill one round of CTAs),
            :func:`pallas_kernels.tuning.decode_num_splits` (one CTA per item: the Triton kernel's rule).
        interpret: run in the Mosaic GPU interpreter (CPU).
        persistent: the persistent kernel (static).
        num_programs: CTAs of the persistent grid (static, >= 1, only with ``persistent``); ``None``: the
            device's SM count (:func:`default_num_programs`), at most ``INTERPRET_MAX_PROGRAMS`` when
            interpreting; never more than ``num_seqs * num_kv_heads * num_splits``. More than the SM count
            puts several CTAs on an SM: the ring depth and staging tiles then fit that share of an SM's
            shared memory (:func:`pallas_kernels.tuning.mgpu_decode_smem_budget`).
        pv_from_smem: P through shared memory into a fresh accumulator each step (what the interpreter
            runs) instead of P from registers into the running accumulator (static); ``None``:
            ``interpret``.
        producer_converts: with an fp8 cache and ``persistent``, a third warpgroup converts the fp8
            pages into a ring of 16-bit tiles and the compute warpgroup runs the 16-bit cache's steps
            (static; :func:`pallas_kernels.tuning.mgpu_decode_producer_stages` sizes the rings); ``None``:
            :data:`pallas_kernels.tuning.MGPU_DECODE_PRODUCER_CONVERTS` with ``persistent``. Ignored for a
            16-bit cache.
        convert_ahead: with an fp8 cache converted by the compute warpgroup, convert each fp8 tile beside
            the other operand's ``wgmma`` (V during QKᵀ, the next step's K during PV) instead of in step
            order (static; :func:`_attend`); ``None``: :data:`pallas_kernels.tuning.MGPU_DECODE_CONVERT_AHEAD`.
            Ignored for a 16-bit cache and with ``producer_converts``.
        num_q_buffers: query/output staging tiles of the persistent kernel, 1 or 2 (static); ``None``:
            :func:`pallas_kernels.tuning.mgpu_decode_ring` (two where they fit beside the ring).
        balance: the persistent kernel deals its items longest sequence first, in a snake over the programs
            (static; an ``argsort`` of ``seq_lens`` per call); ``False``: in batch order. Same result. ``None``:
            :data:`pallas_kernels.tuning.MGPU_DECODE_BALANCE`.
        fp8_route: how an fp8 cache is computed (static; :data:`FP8_ROUTES`, module docstring): "convert" (K and
            V converted to f16 by the converter warpgroup), "qk8" (the query quantized to e4m3 with a scale per
            row and q·kᵀ an fp8 ``wgmma`` on the fp8 K slots, V converted), "qk8t" (the same product with the
            keys as the ``wgmma`` rows, the query as two e4m3 halves). The fp8 routes need ``persistent``, the
            converter warpgroup and head size <= ``tuning.MGPU_DECODE_STAGED_MAX_HEAD_SIZE``; "qk8t" at most
            ``tuning.MGPU_DECODE_QK8T_MAX_GROUP`` query heads per KV head (more: "qk8"). ``None``:
            :data:`pallas_kernels.tuning.MGPU_DECODE_FP8_ROUTE` where it applies, else "convert" (or "qk8").
            Ignored for a 16-bit cache. Accuracy: "convert" and "qk8t" keep the query's bf16 precision; "qk8"
            rounds it to e4m3 (3 mantissa bits, FlashAttention-3's fp8 q·kᵀ), ~2**-4 relative per element.
        page_ids_first: the persistent kernel's memory warpgroup loads a step's page ids from the block table
            once, for K and V, before its slot waits (static; :func:`pallas_kernels._mgpu_paging.step_pages`),
            instead of each just before its TMA copy, for K and again for V. Same result. ``None``:
            :func:`pallas_kernels.tuning.mgpu_decode_page_ids_first` (on for an fp8 cache, off for 16 bits).
        prefetch_item: the persistent kernel's memory warpgroup loads the next item's sequence length (and the one
            after's sequence id) during the current item (static), so no dependent global loads sit between two
            items' copies. Same result. ``None``: :func:`pallas_kernels.tuning.mgpu_decode_prefetch_item` (on for
            an fp8 cache, off for 16 bits).

    Returns:
        ``[num_seqs, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: what the Triton op raises (shapes, dtypes, scales, metadata values), a ``block_kv``
            that is not a positive multiple of 64, ``num_stages`` or ``num_splits`` < 1, ``num_programs``
            < 1 or given without ``persistent``, ``num_q_buffers`` not 1 or 2 or given without
            ``persistent``, an ``fp8_route`` not in :data:`FP8_ROUTES` or given for a call it cannot run.
        NotImplementedError: a call the kernel does not support, with :func:`unsupported_reason`.
    """
    _validate(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, alibi_slopes, sliding_window,
              logits_soft_cap, scale)
    _check_head_size(q.shape[-1])
    _, num_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    reason = unsupported_reason(q.dtype, kv_cache.dtype, num_heads, num_kv_heads, head_size, block_size,
                                alibi=alibi_slopes is not None)
    if reason:
        raise NotImplementedError(f"paged_attention_mgpu: {reason}")
    fp8 = jnp.dtype(kv_cache.dtype) in FP8_DTYPES
    if block_kv is None:
        block_kv = tuning.mgpu_decode_block_kv(head_size)
    if pv_from_smem is None:
        pv_from_smem = bool(interpret)
    if not persistent and num_programs is not None:
        raise ValueError(f"num_programs={num_programs} needs persistent=True")
    if num_programs is not None and num_programs < 1:
        raise ValueError(f"num_programs={num_programs} must be >= 1")
    if num_q_buffers is not None and (not persistent or num_q_buffers not in (1, 2)):
        raise ValueError(f"num_q_buffers={num_q_buffers} must be 1 or 2, with persistent=True")
    if persistent and num_programs is None:
        num_programs = min(default_num_programs(), INTERPRET_MAX_PROGRAMS) if interpret else default_num_programs()
    # More programs than SMs: several CTAs share an SM's shared memory (the grid's CTAs are dealt to SMs).
    ctas_per_sm = 1 if not persistent or interpret else -(-num_programs // default_num_programs())
    budget = tuning.mgpu_decode_smem_budget(ctas_per_sm)
    if producer_converts is None:
        producer_converts = tuning.MGPU_DECODE_PRODUCER_CONVERTS and persistent
    producer_converts = bool(producer_converts) and fp8
    if producer_converts and not persistent:
        raise ValueError("producer_converts=True needs persistent=True")
    group = num_heads // num_kv_heads
    route = _fp8_route(fp8_route, fp8=fp8, persistent=persistent, producer_converts=producer_converts,
                       head_size=head_size, group=group)
    num_stages16 = 0
    if producer_converts:
        num_stages, num_stages16, producer_q_tiles = tuning.mgpu_decode_producer_stages(
            block_kv, head_size, p_tile=pv_from_smem, num_stages=num_stages, budget=budget, fp8_route=route,
            cols=-(-group // 8) * 8)
    else:
        num_stages, num_q_buffers = tuning.mgpu_decode_ring(
            block_kv, head_size, fp8=fp8, p_tile=pv_from_smem, budget=budget, persistent=persistent,
            num_stages=num_stages, num_q_buffers=num_q_buffers)
    if num_splits is None and persistent:
        num_splits = tuning.mgpu_decode_num_splits(q.shape[0], num_kv_heads, block_tables.shape[1], block_size,
                                                   block_kv, num_programs)
    elif num_splits is None:
        num_splits = tuning.decode_num_splits(q.shape[0], num_kv_heads, block_tables.shape[1],
                                              max(1, block_kv // block_size))
    if block_kv < 64 or block_kv % 64:
        raise ValueError(f"block_kv={block_kv} must be a positive multiple of 64")
    for name, value in (("num_stages", num_stages), ("num_splits", num_splits)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    common = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, block_kv=block_kv,
                  num_stages=num_stages, num_splits=num_splits, interpret=interpret, pv_from_smem=pv_from_smem,
                  convert_ahead=tuning.MGPU_DECODE_CONVERT_AHEAD if convert_ahead is None else bool(convert_ahead))
    if not persistent:
        return _paged_attention_mgpu(q, kv_cache, block_tables, seq_lens, kv_scales(k_scale, v_scale), **common)
    num_programs = min(num_programs, q.shape[0] * num_kv_heads * num_splits)   # no idle programs
    return _paged_attention_mgpu(
        q, kv_cache, block_tables, seq_lens, kv_scales(k_scale, v_scale), **common, persistent=True,
        num_programs=num_programs, num_stages16=num_stages16, fp8_route=route,
        page_ids_first=(tuning.mgpu_decode_page_ids_first(fp8) if page_ids_first is None else bool(page_ids_first)),
        prefetch_item=tuning.mgpu_decode_prefetch_item(fp8) if prefetch_item is None else bool(prefetch_item),
        num_q_buffers=producer_q_tiles if producer_converts else num_q_buffers,
        balance=tuning.MGPU_DECODE_BALANCE if balance is None else bool(balance))
