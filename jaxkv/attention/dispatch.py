"""The attention op the model calls: picks an implementation and runs it on the paged cache.

vLLM: ``PagedAttention.forward_decode`` / ``forward_prefix`` behind the backend's ``forward``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.attention import xla as _xla
from jaxkv.attention.metadata import AttentionMetadata
from jaxkv.checks import check_paged_metadata
from jaxkv.config import ATTENTION_IMPLS
from pallas_kernels import paged_attention as _decode
from pallas_kernels import paged_attention_mgpu as _decode_mgpu
from pallas_kernels import paged_prefill_attention as _prefill
from pallas_kernels import paged_prefill_attention_mgpu as _prefill_mgpu
from pallas_kernels import tuning as _tuning

_MOSAIC_IMPLS = ("pallas_mosaic", "pallas_mosaic_interpret")
_warned_fallbacks: set[str] = set()


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
    (:func:`pallas_kernels.paged_prefill_attention.paged_prefill_attention`), vLLM's ``forward_prefix``;
    where the decode kernel is the Mosaic GPU one, a mixed batch's leading one-token rows go to it instead
    (:func:`_leading_decodes_apart`; ``pallas_kernels.tuning.MIXED_DECODES_FIRST_APART``).
    ``impl="pallas"``: the compiled Pallas-Triton kernels; ``"pallas_interpret"``: the same kernels in
    the Pallas interpreter (CPU tests); ``"pallas_mosaic"``: the Pallas Mosaic GPU kernels (Hopper;
    :mod:`pallas_kernels.paged_attention_mgpu` for decode, :mod:`pallas_kernels.paged_prefill_attention_mgpu`
    for prefill / mixed batches), falling back to the Triton kernel, with a one-time warning naming the
    reason, for what they do not support; ``"pallas_mosaic_interpret"``: the same in the interpreters (CPU
    tests); ``"reference"``: plain XLA (:mod:`jaxkv.attention.xla`: the same contract in loops over the
    batch's own decodes, query tiles and key chunks, so memory follows the scheduled tokens, not the
    buckets; the CPU default). The kernels' dense jnp references stay test oracles.

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
    interpret = impl in ("pallas_interpret", "pallas_mosaic_interpret")
    extras = dict(k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if metadata.is_decode_only:
        if q.shape[0] != metadata.seq_lens.shape[0]:
            raise ValueError(f"decode batch: num_tokens={q.shape[0]} != num_seqs="
                             f"{metadata.seq_lens.shape[0]}")
        args = (q, kv_cache, metadata.block_tables, metadata.seq_lens)
        if impl == "reference":  # the Pallas ops check their metadata values themselves
            check_paged_metadata(*args[1:])
            return _xla.paged_attention_xla(*args, scale=scale, **extras)
        if _use_mosaic("decode", q, kv_cache, impl, alibi_slopes is not None):
            return _decode_mgpu.paged_attention_mgpu(*args, scale=scale, interpret=interpret, **extras)
        return _decode.paged_attention(*args, scale=scale, interpret=interpret, **extras)
    args = (q, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc)
    if impl == "reference":
        check_paged_metadata(*args[1:], num_tokens=q.shape[0], max_query_len=metadata.max_query_len)
        return _xla.paged_prefill_attention_xla(*args, scale=scale, max_query_len=metadata.max_query_len, **extras)
    mosaic_prefill = _use_mosaic("prefill", q, kv_cache, impl, alibi_slopes is not None,
                                 max_query_len=metadata.max_query_len, num_seqs=metadata.seq_lens.shape[0])
    if (_tuning.MIXED_DECODES_FIRST_APART and not mosaic_prefill
            and _use_mosaic("decode", q, kv_cache, impl, alibi_slopes is not None)):
        return _leading_decodes_apart(q, kv_cache, metadata, scale=scale, interpret=interpret, **extras)
    if mosaic_prefill:
        return _prefill_mgpu.paged_prefill_attention_mgpu(
            *args, scale=scale, max_query_len=metadata.max_query_len, interpret=interpret, **extras)
    return _prefill.paged_prefill_attention(*args, scale=scale, max_query_len=metadata.max_query_len,
                                            interpret=interpret, **extras)


def _leading_decodes_apart(q, kv_cache, metadata: AttentionMetadata, *, scale, interpret, **extras):
    """A mixed batch whose leading one-token rows run on the Mosaic decode kernel and the rest on the Triton prefill
    kernel (the only one that takes a ``query_start_loc`` starting past 0; batches the Mosaic prefill kernel would
    take do not come here).

    The scheduler puts a mixed step's one-token rows first (``Scheduler._schedule_mixed``, as
    vLLM's model runner reorders decodes first for its FlashInfer and MLA backends), so their tokens are the
    batch's first ``D`` and ``query_start_loc[i] == i`` for ``i <= D``. The prefill kernel then gets
    ``max(query_start_loc, D)``: the leading rows have no new token there, hence no query tile (the kernel's
    grid had given each a program of its own, a fixed cost per row that reading its context did not explain:
    session 23). The decode kernel reads every row's first token with the other rows' lengths set to 0, which
    it skips, and its first ``D`` rows replace the prefill kernel's output there. Only the leading run counts
    as ``D``; a one-token row after a longer one goes to the prefill kernel, which is exact for it too, so the
    result does not depend on the order, only the speed. A one-token row is exactly a decode whatever its
    history (a one-token last prefill chunk included).
    """
    qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens
    num_rows, num_tokens = seq_lens.shape[0], q.shape[0]
    one_token = (qsl[1:] - qsl[:-1]) == 1
    num_decodes = jnp.sum(jnp.cumprod(one_token.astype(jnp.int32)))  # the leading run
    leading = jnp.arange(num_rows) < num_decodes
    out = _prefill.paged_prefill_attention(q, kv_cache, metadata.block_tables, jnp.where(leading, 0, seq_lens),
                                           jnp.maximum(qsl, num_decodes), scale=scale,
                                           max_query_len=metadata.max_query_len, interpret=interpret, **extras)
    n = min(num_rows, num_tokens)  # row i < D is token i
    q_rows = q[:num_rows] if num_tokens >= num_rows else jnp.pad(q, ((0, num_rows - num_tokens), (0, 0), (0, 0)))
    decoded = _decode_mgpu.paged_attention_mgpu(q_rows, kv_cache, metadata.block_tables,
                                                jnp.where(leading, seq_lens, 0), scale=scale, interpret=interpret,
                                                **extras)
    head = jnp.where(leading[:n, None, None], decoded[:n], out[:n])
    return lax.dynamic_update_slice(out, head, (0, 0, 0))


def _use_mosaic(kind: str, q: jax.Array, kv_cache: jax.Array, impl: str, alibi: bool, *,
                max_query_len: int = 1, num_seqs: int = 1) -> bool:
    """Whether a ``kind`` (``"decode"`` / ``"prefill"``) batch runs on the Mosaic GPU kernel: asked for
    (``pallas_mosaic*``) and supported (else a one-time warning with the reason, and the Triton kernel), or
    ``impl="pallas"`` on an sm_90 GPU where the measured tables of :mod:`pallas_kernels.tuning` say it is
    faster: ``MGPU_DECODE_FASTER`` (``(head_size, kv dtype)`` pairs measured at least as fast at every shape) and
    ``MGPU_PREFILL_MIN_QUERY_LEN`` (``(head_size, kv dtype)`` -> smallest static ``max_query_len``, for
    batches of at least ``MGPU_PREFILL_MIN_TOKENS_PER_SEQ`` token slots per sequence (``num_seqs`` rows))."""
    _, num_heads, head_size = q.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    module = _decode_mgpu if kind == "decode" else _prefill_mgpu
    reason = module.unsupported_reason(q.dtype, kv_cache.dtype, num_heads, num_kv_heads, head_size,
                                       block_size, alibi=alibi)
    if (kind == "prefill" and reason is None and kv_cache.dtype in _decode.FP8_DTYPES
            and not _tuning.MGPU_PREFILL_FP8_COMPILED):
        reason = f"kv_cache.dtype={kv_cache.dtype} (the Mosaic prefill kernel's fp8 path awaits its compiled GPU tests)"
    if impl in _MOSAIC_IMPLS:
        key = f"{kind}: {reason}"
        if reason and key not in _warned_fallbacks:
            _warned_fallbacks.add(key)
            warnings.warn(f"attention_impl={impl!r}: {kind} falls back to the Triton kernel: {reason}",
                          stacklevel=3)
        return reason is None
    if impl != "pallas" or reason:
        return False
    shape = (head_size, str(kv_cache.dtype))
    if kind == "decode":
        faster = shape in _tuning.MGPU_DECODE_FASTER
    else:
        min_len = _tuning.MGPU_PREFILL_MIN_QUERY_LEN.get(shape)
        faster = (min_len is not None and max_query_len >= min_len
                  and q.shape[0] >= _tuning.MGPU_PREFILL_MIN_TOKENS_PER_SEQ * max(1, num_seqs))
    if not faster:
        return False
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"
