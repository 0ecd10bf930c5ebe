"""Tuned launch parameters of the Pallas kernels (measured on an H100 80GB HBM3; docs/perf-notes.md)."""

from __future__ import annotations

import functools
import os

from pallas_kernels._paging import padded_head_size

# Decode. Sweep on the H200 (docs/logs/bench-decode-sweep-h200.txt; 32q/8kv heads, D 128, bf16, block 16):
# 4 pages per step (16 KiB K and V tiles) beat 8 on 7 of 8 shapes, by up to 40 % (batch 256 / ctx 1024:
# 3592 vs 2570 GB/s): with 8 pages Triton's 2-stage pipeline needs ~132 KiB of shared memory, so one
# program fits per SM; with 4, three. Split counts: the best of {x1, x2, x4} times a base rule, per shape, is
# about ~1024 programs in all but no partition shorter than 16 pages (batch 1 / ctx 32768: 32 splits;
# batch 8 / ctx 32768: 16; batch 64: 2; batch 256: 1-2). A 32-page minimum cost batch 1 / ctx 4096 23 %
# (8 splits: 720 vs 932 GB/s with 16; docs/logs/bench-decode-rule32-h200.txt vs bench-decode-h200.txt).
DECODE_PAGES_PER_COMPUTE_BLOCK = 4
DECODE_TARGET_PROGRAMS = 1024           # sequences x KV heads x splits, about 8 per SM of 132
DECODE_MIN_PAGES_PER_PARTITION = 16     # shorter partitions cost more in prologue and merge than they gain
DECODE_MAX_SPLITS = 32                  # the largest split count that won a measured shape
# One K (or V) tile of a compute block at most this many bytes: with Triton's 2-stage pipelining of the
# masked gathers, K + V tiles x stages must fit the 227 KiB of shared memory per SM. f32 with D 128 and
# 8 pages (64 KiB tiles) asked for 264 KiB on the H200 and failed to launch.
DECODE_MAX_TILE_BYTES = 32 * 1024


def decode_pages_per_compute_block(block_size: int, head_size: int, itemsize: int) -> int:
    """Blocks per inner step: ``DECODE_PAGES_PER_COMPUTE_BLOCK``, halved until one tile of the padded
    head size fits ``DECODE_MAX_TILE_BYTES`` (bf16, block 16, D 128: 4 pages = 16 KiB). The kernel then
    raises it to 16 keys per step and reads pages larger than a tile in slices
    (``pallas_kernels._paging.kv_step``)."""
    head_p = padded_head_size(head_size)
    pages = DECODE_PAGES_PER_COMPUTE_BLOCK
    while pages > 1 and pages * block_size * head_p * itemsize > DECODE_MAX_TILE_BYTES:
        pages //= 2
    return pages


def _pow2_floor(n: int) -> int:
    """The largest power of two <= n, and 1 for n < 2."""
    return 1 << (max(1, n).bit_length() - 1)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_num_blocks_per_seq: int,
                      pages_per_compute_block: int = DECODE_PAGES_PER_COMPUTE_BLOCK) -> int:
    """Context partitions per sequence for the decode kernel (vLLM's v1/v2 choice, measured).

    The largest power of two ``<= DECODE_TARGET_PROGRAMS // (num_seqs * num_kv_heads)``, at most
    ``DECODE_MAX_SPLITS``, and at most one partition per ``max(DECODE_MIN_PAGES_PER_PARTITION,
    pages_per_compute_block)`` pages of the longest sequence; 1 (v1) when the batch alone fills the GPU.
    """
    programs = max(1, num_seqs * num_kv_heads)
    by_programs = _pow2_floor(DECODE_TARGET_PROGRAMS // programs)
    min_pages = max(DECODE_MIN_PAGES_PER_PARTITION, pages_per_compute_block)
    by_length = _pow2_floor(max_num_blocks_per_seq // min_pages)
    return min(by_programs, DECODE_MAX_SPLITS, by_length)


# Prefill (paged_prefill_attention). Sweep on the H200 after the vectorised-load fix
# (docs/logs/bench-prefill-v1-h200.txt; 32q/8kv heads, D 128, bf16, block 16): 128 dot rows (32 tokens x
# 4 heads), 128 keys per step, 8 warps, 3 stages was the fastest at batch 1 / 8192 tokens (304 TF/s vs
# 246 with 64 keys and 2 stages); 256 rows was no faster; 4 warps with 128 keys collapsed (120 TF/s).
# Dot rows per program (block_q tokens x the padded head group): 128, fewer where the query tile
# (rows x padded head size) would exceed PREFILL_MAX_Q_TILE_BYTES (f32 or head size 256), so Q + the
# pipelined K/V tiles fit shared memory and the f32 accumulator the registers.
PREFILL_BLOCK_ROWS = 128
PREFILL_MAX_Q_TILE_BYTES = 32 * 1024
PREFILL_KV_TOKENS = 128           # key/value tokens per inner step (pages_per_compute_block * block_size)
PREFILL_MAX_TILE_BYTES = DECODE_MAX_TILE_BYTES  # one K (or V) tile, as for decode (shared memory)
PREFILL_NUM_STAGES = 3


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_block_q(group: int, head_size: int, max_query_len: int, itemsize: int = 2) -> int:
    """Query tokens per program (a power of two).

    ``block_q x next_power_of_2(group)`` dot rows: ``PREFILL_BLOCK_ROWS``, halved while the query tile
    (``itemsize`` bytes per element of q) exceeds ``PREFILL_MAX_Q_TILE_BYTES``; no more tokens than the
    longest query (short chunks and mixed batches waste fewer rows); at least enough tokens for the 16
    rows a Triton dot needs.
    """
    group_p = _pow2_at_least(group)
    head_p = padded_head_size(head_size)
    rows = PREFILL_BLOCK_ROWS
    while rows > 16 and rows * head_p * itemsize > PREFILL_MAX_Q_TILE_BYTES:
        rows //= 2
    block_q = max(1, rows // group_p)
    block_q = min(block_q, _pow2_at_least(max(1, max_query_len)))
    return max(block_q, _pow2_at_least(-(-16 // group_p)))


def prefill_pages_per_compute_block(block_size: int, head_size: int, itemsize: int) -> int:
    """Blocks per inner step: ``PREFILL_KV_TOKENS // block_size`` (at least 1), halved until one tile of
    the padded head size fits ``PREFILL_MAX_TILE_BYTES``."""
    head_p = padded_head_size(head_size)
    pages = max(1, PREFILL_KV_TOKENS // block_size)
    while pages > 1 and pages * block_size * head_p * itemsize > PREFILL_MAX_TILE_BYTES:
        pages //= 2
    return pages


def prefill_num_warps(rows: int, head_size: int) -> int:
    """4 warps for small tiles, 8 once the float32 accumulator reaches 128 x 128 (Triton's FA choice)."""
    return 8 if rows * padded_head_size(head_size) >= 128 * 128 else 4


# Mosaic GPU decode (pallas_kernels.paged_attention_mgpu): ring depth chosen so the shared-memory ring
# fits the 227 KiB of an H100 SM (not swept).
MGPU_SMEM_BYTES = 200 * 1024      # prefill: what the ring + q tiles may take (headroom for barriers)
MGPU_DECODE_MAX_STAGES = 4
MGPU_DECODE_Q_BUFFERS = 2         # persistent decode: query/output staging tiles before ring depth
# Head sizes whose decode query/output rows go through a plain (untiled) staging tile, so q and the
# output keep their own layout; above it Mosaic's lowering of the 64 x 256 plain-tile load does not finish
# (jax 0.11.2 on the H100 and 0.12 on CPU), and q is padded to whole 8-row tiles in XLA instead.
MGPU_DECODE_STAGED_MAX_HEAD_SIZE = 128
# fp8 decode on the persistent kernel: a converter warpgroup turns the fp8 slots into a 16-bit ring
# (paged_attention_mgpu's ``producer_converts``) of MGPU_DECODE_PRODUCER_STAGES fp8 stages and moves each
# item's query. H100, batch >= 64 (64/256 x 1k/4k), fp8 speed-up over bf16 in one run
# (docs/logs/mgpu-decode-profile-h100/run5/bench-decode.txt, session 14): 1.62-1.70x against 1.45-1.56x with
# the compute warpgroup converting (convert_ahead) and 1.40-1.49x in step order; 2, 3 or 4 fp8 stages within
# ~2 % of each other, 64-key steps 1.42-1.47x (docs/perf-notes.md, session 13).
MGPU_DECODE_PRODUCER_CONVERTS = True
# Persistent decode: items dealt longest sequence first, in a snake over the CTAs (paged_attention_mgpu's
# ``balance``; session 22: 1.016x geomean at the 8B run's decode batches on an H100, the whole run 1.012x in one A/B).
# $JAXKV_MGPU_DECODE_BALANCE=0 deals them in batch order (for A/B runs).
MGPU_DECODE_BALANCE = os.environ.get("JAXKV_MGPU_DECODE_BALANCE", "1") != "0"
MGPU_DECODE_PRODUCER_STAGES = 2
# fp8 decode route (paged_attention_mgpu's ``fp8_route``; issue 45): "convert" (the converter warpgroup turns K and V
# into 16-bit rings, the route of sessions 13-14), "qk8" (the query quantized to e4m3 per row, q·kᵀ as an fp8 wgmma
# straight from the fp8 K slots; only V converted), "qk8t" (as "qk8" with the keys as the wgmma rows, Kqᵀ, so the
# softmax runs on block_kv x 8 logits instead of 64 x block_kv, and the query split into two e4m3 halves: the
# converter route's accuracy). fp8/bf16 time at 8x4k, 8x32k, 64x1k, 64x4k, 256x1k, 256x4k (32q/8kv heads of 128,
# block 16), one process each: H100 run 1 (docs/logs/fp8-decode/run1) convert 1.49/1.68/1.55/1.64/1.61/1.66x, qk8
# 1.57/1.80/1.64/1.75/1.72/1.79x, qk8t 1.61/1.82/1.66/1.76/1.73/1.79x; with page ids first (run 2) qk8t
# 1.68/1.85/1.76/1.89/1.84/1.90x. H200 (run3-h200), page ids first: qk8t 1.42/1.55/1.39/1.46/1.46/1.50x (1.42/1.55/
# 1.43/1.51/1.50/1.56x with prefetch_item), qk8 1.23/1.31/1.15/1.18/1.18/1.23x, the old converter (ids off)
# 1.10/1.15/1.09/1.10/1.11/1.13x. $JAXKV_MGPU_FP8_ROUTE overrides it (for A/B runs).
MGPU_DECODE_FP8_ROUTE = os.environ.get("JAXKV_MGPU_FP8_ROUTE", "qk8t")
# "qk8t": query heads per KV head it takes (the wgmma's N, padded to 8, and its registers grow with it); larger
# groups run "qk8". Its max over the keys is a cross-warp reduction through this much shared memory.
MGPU_DECODE_QK8T_MAX_GROUP = 16
MGPU_DECODE_QK8T_SCRATCH_BYTES = 2048
# Persistent decode: the memory warpgroup loads a step's page ids once, for K and V, before its slot waits
# (paged_attention_mgpu's ``page_ids_first``), instead of one just before each TMA copy, for K and again for V.
# H100 (issue 45, docs/logs/fp8-decode/run2): fp8 "qk8t" 1.02-1.08x faster at the six batch >= 8 shapes (its
# steps are half bf16's bytes, so the issue loop's dependent block-table loads set the pace); bf16 0.98-1.00x.
# So on for an fp8 cache only. $JAXKV_MGPU_DECODE_PAGE_IDS_FIRST=1/0 sets it for both (A/B runs).
MGPU_DECODE_PAGE_IDS_FIRST = os.environ.get("JAXKV_MGPU_DECODE_PAGE_IDS_FIRST")


def _set_or_fp8(setting: str | None, fp8: bool) -> bool:
    """An A/B switch's value: ``setting`` when set ("1"/"0"), else on for an fp8 cache only."""
    return fp8 if setting is None else setting == "1"


def mgpu_decode_page_ids_first(fp8: bool) -> bool:
    """``page_ids_first`` of the persistent Mosaic decode kernel: ``MGPU_DECODE_PAGE_IDS_FIRST`` when set ("1"/"0"),
    else on for an fp8 cache only."""
    return _set_or_fp8(MGPU_DECODE_PAGE_IDS_FIRST, fp8)


# Persistent decode: the memory warpgroup loads the next item's sequence length (and the one after's sequence id)
# during the current item (paged_attention_mgpu's ``prefetch_item``). H200 (docs/logs/fp8-decode/run3-h200), fp8
# "qk8t" with page ids first: 1.00/1.00/1.03/1.03/1.03/1.04x at 8x4k, 8x32k, 64x1k, 64x4k, 256x1k, 256x4k (items of
# 8-32 steps: the dependent order/length loads sat between two items' copies). Not measured on the H100 (the same
# sm_90 binary) nor for bf16: on for an fp8 cache only. $JAXKV_MGPU_DECODE_PREFETCH_ITEM=1/0 sets it for both.
MGPU_DECODE_PREFETCH_ITEM = os.environ.get("JAXKV_MGPU_DECODE_PREFETCH_ITEM")


def mgpu_decode_prefetch_item(fp8: bool) -> bool:
    """``prefetch_item`` of the persistent Mosaic decode kernel: ``MGPU_DECODE_PREFETCH_ITEM`` when set ("1"/"0"),
    else on for an fp8 cache only."""
    return _set_or_fp8(MGPU_DECODE_PREFETCH_ITEM, fp8)
# Mixed batches (prefill chunks beside decodes), where decode runs on the Mosaic kernel: the leading one-token rows
# (the scheduler puts them first) go to it and the rest to the prefill kernel (jaxkv.attention.dispatch._leading_decodes_apart),
# instead of every row to the prefill kernel (session 23: 362 us a call at ~250 decode rows in the 8B run's mixed
# steps, 0.84 s of a 23.9 s run; giving those rows a one-slot context there still left 241 us: a program per row).
# $JAXKV_MIXED_DECODES_APART=0 sends every row to the prefill kernel (for A/B runs).
MIXED_DECODES_FIRST_APART = os.environ.get("JAXKV_MIXED_DECODES_APART", "1") != "0"
# fp8 decode with the compute warpgroup converting (the one-CTA-per-item kernel, or producer_converts=False):
# each fp8 tile converted beside the other operand's wgmma (paged_attention_mgpu's ``convert_ahead``) rather
# than in step order: 1.45-1.56x against 1.40-1.49x at batch >= 64 in the run above.
MGPU_DECODE_CONVERT_AHEAD = True
# (head_size, kv dtype name) -> decode is at least as fast on Mosaic GPU as on Triton on sm_90, at every
# shape measured. H100, bench_attention.py --mode decode --quick (32q/8kv heads, block 16; the issue-4 grid
# batch 1/8/64/256 x 1k-32k; docs/benchmarks.md "session 14", logs docs/logs/mgpu-decode-profile-h100/run5/):
# Mosaic bf16 52.5-103.2 % of copy bandwidth against Triton's 27.8-97.8 %, ahead at all 8 shapes (sessions
# 9-13 too); Mosaic fp8 e4m3 (f16 compute, converter warpgroup) 33.4-87.6 % against Triton fp8's
# 15.1-68.5 % (in fp8 bytes), ahead at all 8 (session 13 too; session 12, before the converter warpgroup:
# behind at 256 x 1k). Head size 256, bf16 (Gemma 3: 4 query heads, 1 KV head; session 14,
# docs/logs/mgpu-decode-heads-h100/heads.txt, batch 1/64/256 x 256/1k/4k tokens, with and without a 512-token
# sliding window): Mosaic 1.05-2.57x Triton's speed at all 18 shapes; Gemma 3's decode step (random weights,
# 1k-token prompts) 1.663 -> 1.484 ms at batch 1, 2.205 -> 2.094 at batch 64. Head size 64 (SmolLM2: 9 query
# heads, 3 KV heads): Mosaic faster at batch 1 (1.21-2.23x), slower at batch 64 and 256 (0.80-1.04x), so it
# stays on Triton. e5m2 is not measured.
MGPU_DECODE_FASTER: frozenset[tuple[int, str]] = frozenset(
    {(128, "bfloat16"), (128, "float8_e4m3fn"), (256, "bfloat16")})


def mgpu_decode_num_splits(num_seqs: int, num_kv_heads: int, max_num_blocks_per_seq: int, block_size: int,
                           block_kv: int, num_programs: int) -> int:
    """Context partitions per sequence for the persistent Mosaic decode kernel: none when the
    (sequence, KV head) items alone fill the ``num_programs`` CTAs, else as many as keep the item count
    within one round of CTAs (``num_programs // items``: a second, partly idle round costs more than it
    spreads), at most one per ``block_kv``-key step of the longest sequence. (The Triton kernel's rule,
    :func:`decode_num_splits`, aims at ~1,024 programs: the per-item kernel's choice.)"""
    items = max(1, num_seqs * num_kv_heads)
    steps = max(1, -(-max_num_blocks_per_seq * block_size // block_kv))
    return max(1, min(num_programs // items, steps))


def mgpu_decode_block_kv(head_size: int) -> int:
    """Keys per step of the Mosaic decode kernel: 128 (64 for head size 256, so two stages fit)."""
    return 64 if head_size > 128 else 128


# Shared memory of the Mosaic decode kernel, counted as Mosaic GPU counts it (a kernel past
# MGPU_CTA_SMEM_BYTES fails to lower: "exceeds available shared memory"): Pallas aligns every allocation to
# MGPU_SMEM_ALIGNMENT bytes, each mbarrier takes MGPU_BARRIER_BYTES, and the decode kernel reserves no
# reduction scratch (CompilerParams(reduction_scratch_bytes=0): its row max and sum stay within a warp).
# tests/pallas_kernels/test_paged_attention_mgpu.py checks this count against Mosaic's own, byte for byte.
# Two or more CTAs on one SM (a persistent grid of more programs than SMs) share its 228 KiB, less 1 KiB
# the system keeps per CTA.
MGPU_CTA_SMEM_BYTES = 227 * 1024          # an sm_90 CTA's opt-in maximum (Mosaic's default bound)
MGPU_SM_SMEM_BYTES = 228 * 1024
MGPU_CTA_RESERVED_BYTES = 1024
MGPU_SMEM_ALIGNMENT = 1024
MGPU_BARRIER_BYTES = 8


def mgpu_decode_smem_budget(ctas_per_sm: int = 1) -> int:
    """Shared memory one CTA of the Mosaic decode kernel may take: ``MGPU_CTA_SMEM_BYTES`` with one CTA per
    SM, else an equal share of ``MGPU_SM_SMEM_BYTES`` less ``MGPU_CTA_RESERVED_BYTES`` (113 KiB each for 2)."""
    if ctas_per_sm <= 1:
        return MGPU_CTA_SMEM_BYTES
    return min(MGPU_CTA_SMEM_BYTES, MGPU_SM_SMEM_BYTES // ctas_per_sm - MGPU_CTA_RESERVED_BYTES)


def _smem_aligned(nbytes: int) -> int:
    return -(-nbytes // MGPU_SMEM_ALIGNMENT) * MGPU_SMEM_ALIGNMENT


def mgpu_decode_smem_bytes(block_kv: int, head_size: int, num_stages: int, *, fp8: bool, q_tiles: int = 1,
                           p_tile: bool = True, persistent: bool = True, num_stages16: int = 0,
                           fp8_route: str = "convert", cols: int = 8) -> int:
    """Bytes of shared memory the Mosaic decode kernel allocates (each allocation aligned, as Mosaic counts):

    * ``q_tiles`` 64-row query/output staging tiles (1 without ``persistent``) and as many 64-row float32
      log-sum-exp rows; the swizzled 64-row query tile ``wgmma`` reads, two with the converter warpgroup
      (head sizes up to ``MGPU_DECODE_STAGED_MAX_HEAD_SIZE``; above, the staging tile is that tile);
    * the K and the V ring of ``num_stages`` slots of ``block_kv x head_size`` (fp8 or 16-bit);
    * for fp8, the 16-bit K and V tiles the compute warpgroup converts into, or the converter warpgroup's
      16-bit rings of ``num_stages16`` slots (``producer_converts``);
    * the 64-row P tile (``p_tile``: P through shared memory, the interpreted kernel);
    * the barriers: per ring slot K and V "full" and "consumed", per staging tile its query's "loaded" and
      (persistent) its "free", four per 16-bit ring slot, and with those the two swizzled query tiles'
      "ready" and "free".

    ``fp8_route`` "qk8" / "qk8t" (with the converter's ``num_stages16``): no 16-bit K ring; the two query tiles
    are fp8 (e4m3), "qk8t" has two more (the low halves) and Mosaic's reduction scratch
    (``MGPU_DECODE_QK8T_SCRATCH_BYTES``); both keep the query rows' scales (two ``f32[64]``); "qk8t"'s P tile is
    ``cols x block_kv`` (the group's heads padded to 8) and always there (it is ``wgmma``'s B operand).
    """
    staged = head_size <= MGPU_DECODE_STAGED_MAX_HEAD_SIZE
    q_tiles = q_tiles if persistent else 1
    tile16 = block_kv * head_size * 2
    qk8 = fp8 and fp8_route != "convert"
    tiles = [q_tiles * 64 * head_size * 2, q_tiles * 64 * 4]
    tiles += [num_stages * block_kv * head_size * (1 if fp8 else 2)] * 2
    if fp8:
        tiles += [max(num_stages16, 1) * tile16] * (1 if qk8 else 2)
    if qk8 and fp8_route == "qk8t":
        tiles += [cols * block_kv * 2, 2 * 64 * head_size, 2 * 64 * 4, MGPU_DECODE_QK8T_SCRATCH_BYTES]
    elif qk8:
        tiles += [64 * block_kv * 2] * p_tile + [2 * 64 * 4]
    elif p_tile:
        tiles.append(64 * block_kv * 2)
    if staged:   # two with the converter warpgroup (it moves the next item's query into one), fp8 with qk8
        tiles.append((2 if num_stages16 else 1) * 64 * head_size * (1 if qk8 else 2))
    barriers = q_tiles * (2 if persistent else 1) + 4 * num_stages + 4 * num_stages16
    barriers += 4 if num_stages16 and staged else 0
    return sum(_smem_aligned(t) for t in tiles) + barriers * MGPU_BARRIER_BYTES


def mgpu_decode_num_stages(block_kv: int, head_size: int, *, fp8: bool, q_tiles: int = 1, p_tile: bool = True,
                           budget: int = MGPU_CTA_SMEM_BYTES, persistent: bool = True) -> int:
    """Ring depth: as many K+V stages as fit ``budget`` bytes (:func:`mgpu_decode_smem_budget`) beside
    ``q_tiles`` staging tiles and the other tiles (:func:`mgpu_decode_smem_bytes`), at most
    ``MGPU_DECODE_MAX_STAGES``, at least 1."""
    size = functools.partial(mgpu_decode_smem_bytes, block_kv, head_size, fp8=fp8, q_tiles=q_tiles, p_tile=p_tile,
                             persistent=persistent)
    stages = 1
    while stages < MGPU_DECODE_MAX_STAGES and size(stages + 1) <= budget:
        stages += 1
    return stages


def mgpu_decode_ring(block_kv: int, head_size: int, *, fp8: bool, p_tile: bool = True,
                     budget: int = MGPU_CTA_SMEM_BYTES, persistent: bool = True,
                     num_stages: int | None = None, num_q_buffers: int | None = None) -> tuple[int, int]:
    """``(num_stages, num_q_buffers)`` of the Mosaic decode kernel: the persistent kernel's second
    query/output staging tile first (the next item's query lands while the current one computes;
    ``MGPU_DECODE_Q_BUFFERS``), then as deep a ring as fits ``budget`` beside it; given values are kept
    (the depth then decides whether two staging tiles fit). Without ``persistent``: one staging tile."""
    want_q = (num_q_buffers or MGPU_DECODE_Q_BUFFERS) if persistent else 1
    if num_stages is not None:
        if num_q_buffers is None and want_q > 1 and mgpu_decode_smem_bytes(
                block_kv, head_size, num_stages, fp8=fp8, q_tiles=want_q, p_tile=p_tile) > budget:
            want_q = 1
        return num_stages, want_q
    stages = mgpu_decode_num_stages(block_kv, head_size, fp8=fp8, q_tiles=want_q, p_tile=p_tile, budget=budget,
                                    persistent=persistent)
    if num_q_buffers is None and want_q > 1 and mgpu_decode_smem_bytes(
            block_kv, head_size, stages, fp8=fp8, q_tiles=want_q, p_tile=p_tile, persistent=persistent) > budget:
        want_q = 1                       # not even one stage beside two staging tiles
        stages = mgpu_decode_num_stages(block_kv, head_size, fp8=fp8, p_tile=p_tile, budget=budget,
                                        persistent=persistent)
    return stages, want_q


def mgpu_decode_producer_stages(block_kv: int, head_size: int, *, p_tile: bool, num_stages: int | None = None,
                                budget: int = MGPU_CTA_SMEM_BYTES, fp8_route: str = "convert",
                                cols: int = 8) -> tuple[int, int, int]:
    """``(num_stages, num_stages16, q_tiles)`` of the Mosaic decode kernel whose converter warpgroup converts
    fp8 pages into 16-bit slots: ``num_stages`` fp8 stages (``None``: ``MGPU_DECODE_PRODUCER_STAGES``,
    fewer where they do not fit), then the first of (2, 2), (1, 2), (2, 1), (1, 1) 16-bit stages and
    staging tiles that fits beside them in ``budget`` bytes (``fp8_route``: :func:`mgpu_decode_smem_bytes`). Head
    size 128, 128 keys, P in registers: (2, 1, 2), 193 KiB; "qk8t" (GQA <= 8): (2, 2, 2), 197 KiB."""
    size = functools.partial(mgpu_decode_smem_bytes, block_kv, head_size, fp8=True, p_tile=p_tile,
                             fp8_route=fp8_route, cols=cols)
    given = num_stages is not None
    num_stages = num_stages or MGPU_DECODE_PRODUCER_STAGES
    while not given and num_stages > 1 and size(num_stages, q_tiles=1, num_stages16=1) > budget:
        num_stages -= 1
    for stages16, q_tiles in ((2, 2), (1, 2), (2, 1), (1, 1)):
        if size(num_stages, q_tiles=q_tiles, num_stages16=stages16) <= budget:
            break
    return num_stages, stages16, q_tiles


# Mosaic GPU prefill (pallas_kernels.paged_prefill_attention_mgpu). FA3's shape (two consumer warpgroups of
# 64 query rows, 128 keys a step for head size <= 128) with as many ring stages as fit MGPU_SMEM_BYTES; not
# swept (the H100 run measured these defaults only); scripts/dev/gpu_mgpu.sh measures it against Triton and cuDNN.
MGPU_PREFILL_NUM_CONSUMERS = 2
MGPU_PREFILL_MAX_STAGES = 4


# fp8 cache with V converted by the memory warpgroup: 128-key steps from this many query-token slots per sequence
# (num_tokens / num_seqs, static). H100 (docs/logs/session29/mgpu-prefill-vmem, qk8lo, 32q/8kv heads of 128, block
# 16), 128 against 64 keys: 1x2048 +7 %, 1x8192 +15 %, 8x2048 +5 %, 8x8192 +11 %, 512-token chunks over 4k / 16k
# +12 / +13 %, 1x512 +2 %, 8x512 -12 %.
MGPU_PREFILL_FP8_BKV128_TOKENS_PER_SEQ = 1024


def mgpu_prefill_block_kv(head_size: int, *, fp8: bool = False, tokens_per_seq: int | None = None,
                          v_converter: str = "consumers") -> int:
    """Keys per step of the Mosaic prefill kernel: 128 (64 for head size 256, so two stages fit). With an fp8 cache
    64, unless the memory warpgroup converts V (``v_converter="memory"``) and the call has at least
    ``MGPU_PREFILL_FP8_BKV128_TOKENS_PER_SEQ`` query tokens per sequence (``tokens_per_seq``: the static
    ``num_tokens // num_seqs``): then 128 (with "consumers" each consumer holds its converted 16-bit tiles of a step
    beside the ring, and converts a 128-key V slot on its own critical path)."""
    if head_size > 128:
        return 64
    if fp8:
        long = tokens_per_seq is not None and tokens_per_seq >= MGPU_PREFILL_FP8_BKV128_TOKENS_PER_SEQ
        return 128 if v_converter == "memory" and long else 64
    return 128


# fp8 prefill route (paged_prefill_attention_mgpu's ``fp8_route``): "convert" (session 26: each consumer converts K
# and V into q's dtype), "qk8" / "qk8lo" (session 28: q·kᵀ an fp8 wgmma from the fp8 K slot, V converted to f16).
# H100 (docs/logs/session28/mgpu-prefill-fp8, bench_attention.py --mode prefill --quick --prefill-fp8, 32q/8kv heads
# of 128, block 16, batch 1/8 x 512/2048/8192 and a 512-token chunk over 4k), against the same kernel with a bf16
# cache: convert 0.53-0.70x, qk8lo 0.71-0.79x (1.81-1.93x the Triton kernel's fp8 path), qk8 0.78-0.88x; 128-key
# steps: qk8lo 0.66-0.85x, qk8 0.76-0.94x. "qk8lo" keeps the query's bf16 precision (the decode default "qk8t"
# does too) and is 1.10-1.36x "convert" at every shape: the default. "qk8" is FlashAttention-3's fp8 accuracy
# (the query off by up to 2**-4 of itself) for another ~1.1x: opt-in.
MGPU_PREFILL_FP8_ROUTE = "qk8lo"


# Who converts an fp8 cache's V in the Mosaic prefill kernel (paged_prefill_attention_mgpu's ``v_converter``):
# "consumers" (sessions 26-28: each consumer converts every step's V slot into its own 16-bit tile) or "memory" (the
# memory warpgroup converts each slot once into a ring of MGPU_PREFILL_V_STAGES 16-bit slots both consumers read,
# with MGPU_PREFILL_CONVERTER_REGISTERS registers per thread).
# H100 (docs/logs/session29/mgpu-prefill-vmem, same call, 64-key steps): "memory" is 1.02-1.06x "consumers" with
# "qk8lo" at all eight bench shapes (0.73-0.81x the bf16 cache against 0.70-0.79x), about equal with "qk8"
# (0.99-1.04x); 72 registers for the memory warpgroup instead of 56: no better (0.98-1.00x).
# The "convert" route (e5m2 caches; V to bf16 goes through f32, more registers than the memory warpgroup has) was
# not measured with it and keeps "consumers" by default.
MGPU_PREFILL_V_CONVERTER = os.environ.get("JAXKV_MGPU_PREFILL_V_CONVERTER", "memory")
MGPU_PREFILL_V_STAGES = 2
MGPU_PREFILL_MEMORY_REGISTERS = 40
MGPU_PREFILL_CONVERTER_REGISTERS = 56


def mgpu_prefill_v_converter(fp8_route: str) -> str:
    """Who converts V by default: MGPU_PREFILL_V_CONVERTER for the "qk8" / "qk8lo" routes (measured), "consumers"
    for "convert" (not measured with the memory warpgroup converting)."""
    return MGPU_PREFILL_V_CONVERTER if fp8_route != "convert" else "consumers"


def mgpu_prefill_memory_registers(v_converter: str = "consumers") -> int:
    """Registers per thread of the Mosaic prefill kernel's memory warpgroup: it only issues copies (40), or also
    converts V ("memory": MGPU_PREFILL_CONVERTER_REGISTERS; the two consumers then get 224 each, not 232)."""
    return MGPU_PREFILL_CONVERTER_REGISTERS if v_converter == "memory" else MGPU_PREFILL_MEMORY_REGISTERS


def _prefill_converted_bytes(block_kv: int, head_size: int, fp8_route: str, v_converter: str = "consumers") -> int:
    """Shared memory of one consumer's fp8 tiles beside the ring: "convert": its 16-bit K and V tiles; "qk8": its
    16-bit V tile and its e4m3 query tile; "qk8lo": and the query's e4m3 rounding-error tile (``v_converter``
    "memory": no V tile of its own)."""
    v_tile = block_kv * head_size * 2 if v_converter == "consumers" else 0
    if fp8_route == "convert":
        return block_kv * head_size * 2 + v_tile
    return v_tile + 64 * head_size * (2 if fp8_route == "qk8lo" else 1)


def mgpu_prefill_num_stages(block_kv: int, head_size: int, *, num_consumers: int, pv_from_smem: bool,
                            num_q_buffers: int = 1, fp8: bool = False, fp8_route: str = "convert",
                            v_converter: str = "consumers") -> int:
    """Ring depth: as many K+V stages (16-bit; fp8: 8-bit) as fit ``MGPU_SMEM_BYTES`` beside the consumers'
    64-row Q tiles (``num_q_buffers`` of each), their P tiles when P goes through shared memory and (fp8) their
    converted tiles (``fp8_route``), at most ``MGPU_PREFILL_MAX_STAGES``, at least 1 (bf16, D 128, 128 keys, two
    consumers, P in registers, one Q buffer: 2 stages, 160 KiB; two Q buffers: 2 stages, 192 KiB; fp8, 64 keys,
    two Q buffers: 4 stages, 192 KiB ("convert"), 4 stages, 176 KiB ("qk8")). ``v_converter`` "memory" (fp8):
    the shared ring of ``MGPU_PREFILL_V_STAGES`` 16-bit V slots instead of each consumer's V tile (qk8lo, 64 keys,
    two Q buffers: 4 stages, 192 KiB)."""
    fixed = (num_q_buffers * num_consumers * 64 * head_size * 2
             + (num_consumers * 64 * block_kv * 2 if pv_from_smem else 0)
             + (num_consumers * _prefill_converted_bytes(block_kv, head_size, fp8_route, v_converter) if fp8 else 0)
             + (MGPU_PREFILL_V_STAGES * block_kv * head_size * 2 if fp8 and v_converter == "memory" else 0))
    per_stage = 2 * block_kv * head_size * (1 if fp8 else 2)
    return max(1, min(MGPU_PREFILL_MAX_STAGES, (MGPU_SMEM_BYTES - fixed) // per_stage))


def mgpu_prefill_q_buffers(block_kv: int, head_size: int, *, num_consumers: int, pv_from_smem: bool,
                           fp8: bool = False, fp8_route: str = "convert", v_converter: str = "consumers") -> int:
    """Q tiles per consumer of the persistent Mosaic prefill kernel: 2 (the next item's Q loads while this
    one computes) where two ring stages still fit beside them, else 1 (head size 256)."""
    two = mgpu_prefill_num_stages(block_kv, head_size, num_consumers=num_consumers, pv_from_smem=pv_from_smem,
                                  num_q_buffers=2, fp8=fp8, fp8_route=fp8_route, v_converter=v_converter)
    return 2 if two >= 2 else 1


# (head_size, kv dtype name) -> the smallest ``max_query_len`` (static bound, tokens) from which prefill runs
# faster on Mosaic GPU than on Triton on sm_90. Measured on the H100 (docs/benchmarks.md, "H100, Mosaic GPU
# prefill kernel"; bench_attention.py --mode prefill --quick, 32q/8kv heads, D 128, bf16, block 16) with the
# second Mosaic kernel (one query head x 64 tokens per consumer, Q/O by TMA in q's layout): 1.84-2.0x Triton
# at 512 tokens, 1.9-2.0x at 2048, 1.8-2.0x at 8192, 2.0-2.1x on 512-token chunks over 4k/16k contexts.
# Shorter prompts were not measured and stay on Triton, as do shapes not measured (other head sizes, e5m2).
# fp8 e4m3 cache (session 27, same bench with --prefill-fp8, H100): the Mosaic kernel's fp8 path at 1.40-1.76x the
# Triton kernel's fp8 path at 512 / 2048 / 8192 tokens (batch 1 and 8) and 1.42x on a 512-token chunk over 4k.
# The measured batches were whole prompts, so a batch must also hold at least MGPU_PREFILL_MIN_TOKENS_PER_SEQ
# token slots per sequence: the engine's mixed steps (256 rows in a 4096-token bucket, mostly decodes: 16
# per row) stay on Triton (a Mosaic tile of 128 tokens would walk the keys of every sequence it touches).
MGPU_PREFILL_MIN_QUERY_LEN: dict[tuple[int, str], int] = {(128, "bfloat16"): 512, (128, "float8_e4m3fn"): 512}
MGPU_PREFILL_MIN_TOKENS_PER_SEQ = 512
# The Mosaic prefill kernel's fp8-cache path (session 26) passed its compiled kernel tests on an H100 in session 27
# (docs/logs/session27/mgpu-prefill-fp8/): the op-level dispatch may send fp8 prefill to it. False sends fp8
# prefill to Triton again, even with attention_impl="pallas_mosaic" (the kernel itself stays callable).
MGPU_PREFILL_FP8_COMPILED = True
