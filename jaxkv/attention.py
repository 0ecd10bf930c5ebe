"""The attention op the model calls: picks an implementation and runs it on the paged cache.

vLLM: ``PagedAttention.forward_decode`` / ``forward_prefix`` behind the backend's ``forward``.
"""

from __future__ import annotations

import jax

from jaxkv.checks import check_paged_metadata
from jaxkv.metadata import AttentionMetadata
from pallas_kernels import paged_attention as _decode
from pallas_kernels import paged_prefill_attention as _prefill

ATTENTION_IMPLS = ("pallas", "pallas_interpret", "reference")


def default_attention_impl() -> str:
    """``"pallas"`` when JAX's default backend is a GPU, else ``"reference"`` (XLA, runs anywhere)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def check_attention_impl(impl: str) -> str:
    """Return ``impl`` or raise ``ValueError`` naming it when unknown."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} not one of {ATTENTION_IMPLS}")
    return impl


def paged_attention(q: jax.Array, kv_cache: jax.Array, metadata: AttentionMetadata, *, scale: float,
                    impl: str, k_scale=None, v_scale=None, alibi_slopes=None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None) -> jax.Array:
    """Attention of the batch's new tokens over the paged cache (their own K/V already written).

    Decode-only batches (``metadata.max_query_len == 1``) go to the decode kernel
    (:func:`pallas_kernels.paged_attention.paged_attention`); every other batch (prefill, chunked
    prefill, prefix reuse, and mixed batches where some sequences decode, some prefill and some are
    zero-length padding dummies) goes to the prefill kernel
    (:func:`pallas_kernels.paged_prefill_attention.paged_prefill_attention`), vLLM's ``forward_prefix``.
    ``impl="pallas"``: the compiled Pallas-Triton kernels; ``"pallas_interpret"``: the same kernels in
    the Pallas interpreter (CPU tests); ``"reference"``: the jnp references.

    Args:
        q: ``[num_tokens, num_heads, head_size]``.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]``.
        metadata: the batch (for decode, ``num_tokens == num_seqs``).
        scale: softmax scale.
        impl: one of :data:`ATTENTION_IMPLS`.
        k_scale, v_scale, alibi_slopes, sliding_window, logits_soft_cap: see
            :func:`pallas_kernels.paged_attention.paged_attention` (fp8 scales, ALiBi, window, soft cap).

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``q.dtype``.

    Raises:
        ValueError: unknown ``impl``, a decode batch whose token and sequence counts differ, or what the
            kernels raise; with concrete metadata, for every ``impl``, a ``seq_lens`` entry outside
            ``[0, max_num_blocks_per_seq * block_size]``, a block id outside ``[0, num_blocks)`` among
            the blocks a sequence reads and (prefill) a bad ``query_start_loc``
            (:func:`pallas_kernels._checks.check_paged_metadata`). Under ``jax.jit`` these value checks
            are skipped unless the check mode stages them (:mod:`jaxkv.checks`).
    """
    check_attention_impl(impl)
    extras = dict(k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if metadata.is_decode_only:
        if q.shape[0] != metadata.seq_lens.shape[0]:
            raise ValueError(f"decode batch: num_tokens={q.shape[0]} != num_seqs="
                             f"{metadata.seq_lens.shape[0]}")
        args = (q, kv_cache, metadata.block_tables, metadata.seq_lens)
        if impl == "reference":  # the Pallas ops check their metadata values themselves
            check_paged_metadata(*args[1:])
            return _decode.paged_attention_reference(*args, scale=scale, **extras)
        return _decode.paged_attention(*args, scale=scale, interpret=impl == "pallas_interpret",
                                       **extras)
    args = (q, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc)
    if impl == "reference":
        check_paged_metadata(*args[1:], num_tokens=q.shape[0], max_query_len=metadata.max_query_len)
        return _prefill.paged_prefill_attention_reference(
            *args, scale=scale, max_query_len=metadata.max_query_len, **extras)
    return _prefill.paged_prefill_attention(*args, scale=scale, max_query_len=metadata.max_query_len,
                                            interpret=impl == "pallas_interpret", **extras)
