"""Tuned launch parameters of the Pallas kernels (measured on an H100 80GB HBM3; docs/perf-notes.md)."""

from __future__ import annotations

# Decode: a split-K partition count that gives the GPU at least about two programs per SM.
# Measured (bench_attention, 32q/8kv heads, D 128, bf16, block 16): batch 1 → 16 splits, batch 8 → 4,
# batch ≥ 64 → 1 were each the fastest of {1, 4, 16}.
DECODE_TARGET_PROGRAMS = 264  # 2 x 132 SMs
DECODE_MAX_SPLITS = 16        # the largest split count measured
DECODE_PAGES_PER_COMPUTE_BLOCK = 8
# One K (or V) tile of a compute block at most this many bytes: with Triton's 2-stage pipelining of the
# masked gathers, K + V tiles x stages must fit the 227 KiB of shared memory per SM. f32 with D 128 and
# 8 pages (64 KiB tiles) asked for 264 KiB on the H200 and failed to launch.
DECODE_MAX_TILE_BYTES = 32 * 1024


def decode_pages_per_compute_block(block_size: int, head_size: int, itemsize: int) -> int:
    """Blocks per inner step: ``DECODE_PAGES_PER_COMPUTE_BLOCK``, halved until one tile fits
    ``DECODE_MAX_TILE_BYTES`` (bf16, block 16, D 128: 8 pages = 32 KiB)."""
    pages = DECODE_PAGES_PER_COMPUTE_BLOCK
    while pages > 1 and pages * block_size * head_size * itemsize > DECODE_MAX_TILE_BYTES:
        pages //= 2
    return pages


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_num_blocks_per_seq: int,
                      pages_per_compute_block: int = DECODE_PAGES_PER_COMPUTE_BLOCK) -> int:
    """Context partitions per sequence for the decode kernel (vLLM's v1/v2 choice, measured).

    The largest power of two ``<= DECODE_TARGET_PROGRAMS // (num_seqs * num_kv_heads)``, at most
    ``DECODE_MAX_SPLITS`` and at most one partition per compute block of the longest sequence; 1 (v1)
    when the batch alone fills the GPU.
    """
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, DECODE_TARGET_PROGRAMS // programs)
    splits = 1 << (want.bit_length() - 1)
    max_useful = max(1, max_num_blocks_per_seq // pages_per_compute_block)
    return max(1, min(splits, DECODE_MAX_SPLITS, 1 << (max_useful.bit_length() - 1)))
