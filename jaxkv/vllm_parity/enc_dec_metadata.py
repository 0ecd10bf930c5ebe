"""Encoder-decoder attention metadata and the attention-type helpers of vLLM's backend utils.

vLLM: ``AttentionType``, the encoder / cross-attention fields of the backends' ``AttentionMetadata``, and
``get_num_prefill_decode_query_kv_tokens``, ``get_seq_len_block_table_args``,
``is_all_encoder_attn_metadata_set``, ``is_all_cross_attn_metadata_set``
(``vllm/attention/backends/utils.py``).

:class:`EncoderDecoderMetadata` wraps a decoder :class:`~jaxkv.attention.metadata.AttentionMetadata` and adds encoder
lengths and the cross-attention slot mapping / block tables; :func:`build_encoder_decoder_metadata` builds
it on the host. The helpers accept any of jaxkv's metadata objects (and vLLM v0-style objects that carry
``num_prefill_tokens`` / ``num_decode_tokens``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention.metadata import AttentionMetadata, _as_table
from jaxkv.kv_cache.slot_mapping import PAD_SLOT_ID, compute_slot_mapping_batch


class AttentionType(enum.StrEnum):
    """Which attention an op computes. vLLM: ``AttentionType`` (same names and string values).

    A ``StrEnum``: members compare equal to vLLM's plain strings (``AttentionType.DECODER == "decoder"``).
    """

    DECODER = "decoder"
    """Decoder self-attention (causal, paged KV cache)."""
    ENCODER = "encoder"
    """Encoder self-attention of an encoder-decoder model (prefill only, no KV cache)."""
    ENCODER_ONLY = "encoder_only"
    """Self-attention of an encoder-only model (no KV cache)."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder queries over the encoder's cached K/V."""


def _attn_type(attn_type) -> AttentionType:
    try:
        return AttentionType(attn_type)
    except ValueError:
        raise ValueError(f"attn_type={attn_type!r} not one of {[t.value for t in AttentionType]}") from None


# ----------------------------------------------------------------------------------------------------------
# Pytree
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["decoder", "encoder_seq_lens", "cross_slot_mapping", "cross_block_tables"],
                   meta_fields=["max_encoder_seq_len", "num_encoder_tokens"])
@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderDecoderMetadata:
    """Decoder self-attention metadata plus the encoder / cross-attention fields of an enc-dec model.

    vLLM: the encoder-decoder fields of the backends' ``AttentionMetadata`` (``encoder_seq_lens``,
    ``encoder_seq_lens_tensor``, ``max_encoder_seq_len``, ``num_encoder_tokens``, ``cross_slot_mapping``,
    ``cross_block_tables``). vLLM's host list and device tensor of encoder lengths are one array here. The
    decoder fields are reachable directly (``md.seq_lens`` is ``md.decoder.seq_lens``), so the object can
    be passed to :func:`jaxkv.paged_attention` for decoder self-attention. Build with
    :func:`build_encoder_decoder_metadata`.

    Attributes:
        decoder: the decoder self-attention metadata (``num_seqs`` rows, padded).
        encoder_seq_lens: ``int32[num_seqs]`` encoder tokens of each sequence, or ``None``.
        cross_slot_mapping: ``int32[num_encoder_tokens]`` slots of the encoder K/V written this step
            (prefill), ``int32[0]`` in decode steps, or ``None``.
        cross_block_tables: ``int32[num_seqs, max_num_cross_blocks]`` blocks of the encoder K/V, or
            ``None``.
        max_encoder_seq_len: static bound on ``encoder_seq_lens``, or ``None``.
        num_encoder_tokens: static: encoder tokens processed this step (padded count; 0 in decode), or
            ``None``.
    """

    decoder: AttentionMetadata
    encoder_seq_lens: jax.Array | None = None
    cross_slot_mapping: jax.Array | None = None
    cross_block_tables: jax.Array | None = None
    max_encoder_seq_len: int | None = None
    num_encoder_tokens: int | None = None

    slot_mapping = property(lambda self: self.decoder.slot_mapping, doc="Decoder slots.")
    seq_lens = property(lambda self: self.decoder.seq_lens, doc="Decoder seq lens.")
    block_tables = property(lambda self: self.decoder.block_tables, doc="Decoder block tables.")
    query_start_loc = property(lambda self: self.decoder.query_start_loc, doc="Decoder query offsets.")
    max_query_len = property(lambda self: self.decoder.max_query_len, doc="Decoder static bound.")
    max_seq_len = property(lambda self: self.decoder.max_seq_len, doc="Decoder static bound.")
    is_decode_only = property(lambda self: self.decoder.is_decode_only, doc="Decoder decode-only.")

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        """See :func:`is_all_encoder_attn_metadata_set`."""
        return is_all_encoder_attn_metadata_set(self)

    @property
    def is_all_cross_attn_metadata_set(self) -> bool:
        """See :func:`is_all_cross_attn_metadata_set`."""
        return is_all_cross_attn_metadata_set(self)


# ----------------------------------------------------------------------------------------------------------
# Builder
# ----------------------------------------------------------------------------------------------------------

def build_encoder_decoder_metadata(
    decoder: AttentionMetadata,
    encoder_seq_lens,
    cross_block_tables: np.ndarray,
    block_size: int,
    *,
    is_prompt: bool,
    num_encoder_tokens_padded: int | None = None,
    max_encoder_seq_len: int | None = None,
) -> EncoderDecoderMetadata:
    """Add encoder lengths and cross-attention slots / block tables to decoder metadata.

    vLLM: the encoder-decoder model runner's ``_prepare_encoder_model_input_tensors`` (cross slot mapping
    over each sequence's encoder tokens at prefill, empty in decode) and, for the padding,
    ``CommonAttentionState._update_captured_metadata_for_enc_dec_model``. Rows past the real sequences get
    encoder length 1 in a decode-only batch (0 otherwise) and an all-zero cross block-table row.

    Args:
        decoder: the decoder's metadata, ``num_seqs_padded >= num_seqs`` rows.
        encoder_seq_lens: ``int[num_seqs]`` encoder tokens per sequence, ``>= 0``.
        cross_block_tables: ``int[num_seqs, max_num_cross_blocks]`` blocks holding the encoder K/V.
        block_size: tokens per block.
        is_prompt: prefill step: the encoder K/V is written now (``cross_slot_mapping`` covers every
            encoder token); otherwise ``cross_slot_mapping`` is ``int32[0]``.
        num_encoder_tokens_padded: pad ``cross_slot_mapping`` to this many tokens (prefill only).
        max_encoder_seq_len: static bound; default ``max_num_cross_blocks * block_size``.

    Raises:
        ValueError: ``block_size < 1``, negative encoder lengths, more sequences than decoder rows,
            cross block tables of the wrong rows or too narrow, a padded count or bound that is too small.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    enc = np.asarray(encoder_seq_lens, np.int64).reshape(-1)
    num_seqs, num_rows = len(enc), decoder.seq_lens.shape[0]
    if num_seqs > num_rows:
        raise ValueError(f"encoder_seq_lens has {num_seqs} sequences; decoder has {num_rows} rows")
    if num_seqs and enc.min() < 0:
        raise ValueError(f"encoder_seq_lens={enc.tolist()} must all be >= 0")
    table = _as_table(cross_block_tables, num_seqs, "cross_block_tables")
    width = table.shape[1]
    if num_seqs and -(-int(enc.max()) // block_size) > width:
        raise ValueError(f"cross_block_tables width {width} < {-(-int(enc.max()) // block_size)} blocks "
                         f"needed by encoder_seq_lens max {int(enc.max())}")
    bound = width * block_size if max_encoder_seq_len is None else int(max_encoder_seq_len)
    if num_seqs and bound < enc.max():
        raise ValueError(f"max_encoder_seq_len={bound} < longest encoder sequence {int(enc.max())}")
    if is_prompt:
        slots = compute_slot_mapping_batch(table, np.zeros_like(enc), enc, block_size)
        n = len(slots) if num_encoder_tokens_padded is None else int(num_encoder_tokens_padded)
        if n < len(slots):
            raise ValueError(f"num_encoder_tokens_padded={n} < encoder tokens {len(slots)}")
        slots = np.concatenate([slots, np.full(n - len(slots), PAD_SLOT_ID)])
    else:
        if num_encoder_tokens_padded not in (None, 0):
            raise ValueError(f"num_encoder_tokens_padded={num_encoder_tokens_padded} must be None or 0 in "
                             "a decode step (no encoder token is written)")
        slots = np.zeros(0, np.int64)
    dummy = 1 if decoder.is_decode_only else 0
    enc = np.concatenate([enc, np.full(num_rows - num_seqs, dummy)])
    table = np.concatenate([table, np.zeros((num_rows - num_seqs, width), np.int64)])
    return EncoderDecoderMetadata(
        decoder=decoder, encoder_seq_lens=jnp.asarray(enc, jnp.int32),
        cross_slot_mapping=jnp.asarray(slots, jnp.int32), cross_block_tables=jnp.asarray(table, jnp.int32),
        max_encoder_seq_len=bound, num_encoder_tokens=len(slots))


# ----------------------------------------------------------------------------------------------------------
# Attention-type helpers (vllm/attention/backends/utils.py)
# ----------------------------------------------------------------------------------------------------------

def is_all_encoder_attn_metadata_set(attn_metadata) -> bool:
    """Encoder lengths and their bound are set. vLLM: ``is_all_encoder_attn_metadata_set``.

    vLLM also checks ``encoder_seq_lens_tensor``; here the lengths are one array. Works on any object
    (``False`` for :class:`AttentionMetadata`, which has no encoder fields).
    """
    return (getattr(attn_metadata, "encoder_seq_lens", None) is not None
            and getattr(attn_metadata, "max_encoder_seq_len", None) is not None)


def is_all_cross_attn_metadata_set(attn_metadata) -> bool:
    """Encoder fields plus cross slot mapping and block tables are set (superset of the encoder check).

    vLLM: ``is_all_cross_attn_metadata_set``.
    """
    return (is_all_encoder_attn_metadata_set(attn_metadata)
            and getattr(attn_metadata, "cross_slot_mapping", None) is not None
            and getattr(attn_metadata, "cross_block_tables", None) is not None)


def _prefill_decode_tokens(md) -> tuple[int, int]:
    explicit = (getattr(md, "num_prefill_tokens", None), getattr(md, "num_decode_tokens", None))
    if None not in explicit:  # a vLLM v0-style object that carries its counts
        return int(explicit[0]), int(explicit[1])
    if isinstance(md, EncoderDecoderMetadata):
        md = md.decoder
    if md.max_query_len == 1:  # static: every row (dummies included) is one decode token
        return 0, int(md.seq_lens.shape[0])
    try:
        query_lens = np.diff(np.asarray(md.query_start_loc))
    except jax.errors.TracerArrayConversionError:
        raise ValueError("attn_metadata.query_start_loc is traced: the prefill/decode split of a batch "
                         "with max_query_len > 1 needs concrete metadata (call outside jit)") from None
    return int(query_lens[query_lens > 1].sum()), int((query_lens == 1).sum())


def _num_encoder_tokens(md, attn_type: AttentionType) -> int:
    n = getattr(md, "num_encoder_tokens", None)
    if n is None:
        raise ValueError(f"attn_type={attn_type.value!r} needs attn_metadata.num_encoder_tokens; it is None")
    return int(n)


def get_num_prefill_decode_query_kv_tokens(attn_metadata, attn_type) -> tuple[int, int, int]:
    """Prefill query tokens, prefill key/value tokens and decode query tokens of a batch.

    vLLM: ``get_num_prefill_decode_query_kv_tokens``. ``ENCODER``: ``(num_encoder_tokens,
    num_encoder_tokens, 0)``; ``ENCODER_DECODER``: ``(num_prefill_tokens, num_encoder_tokens,
    num_decode_tokens)``; ``DECODER`` / ``ENCODER_ONLY``: ``(num_prefill_tokens, num_prefill_tokens,
    num_decode_tokens)``. Objects with ``num_prefill_tokens`` / ``num_decode_tokens`` attributes (vLLM v0
    style) use them. For jaxkv metadata a sequence with one new token is a decode (vLLM v1's split;
    v0 counts a 1-token prompt as prefill); in a decode-only bucket (static ``max_query_len == 1``) every
    row, dummies included, is one decode token, as in vLLM's padded CUDA graphs (works under ``jit``).
    Otherwise the counts are read from ``query_start_loc`` and need concrete arrays; tokens past the last
    sequence (bucket padding) count in neither.

    Args:
        attn_metadata: :class:`AttentionMetadata`, :class:`CommonAttentionMetadata`,
            :class:`EncoderDecoderMetadata` or a v0-style object.
        attn_type: an :class:`AttentionType` or its string value.

    Returns:
        ``(num_prefill_query_tokens, num_prefill_kv_tokens, num_decode_query_tokens)`` Python ints.

    Raises:
        ValueError: unknown ``attn_type``; ``num_encoder_tokens`` is ``None`` for an encoder type (vLLM
            asserts); a traced mixed batch.
    """
    attn_type = _attn_type(attn_type)
    if attn_type is AttentionType.ENCODER:
        n = _num_encoder_tokens(attn_metadata, attn_type)
        return n, n, 0
    if attn_type is AttentionType.ENCODER_DECODER:
        n = _num_encoder_tokens(attn_metadata, attn_type)
        prefill, decode = _prefill_decode_tokens(attn_metadata)
        return prefill, n, decode
    prefill, decode = _prefill_decode_tokens(attn_metadata)
    return prefill, prefill, decode


def get_seq_len_block_table_args(attn_metadata, is_prompt: bool, attn_type) -> tuple:
    """The seq lens, max seq len and block tables an attention op of ``attn_type`` reads.

    vLLM: ``get_seq_len_block_table_args``. ``DECODER``: the decoder's ``seq_lens``, ``max_seq_len``,
    ``block_tables`` (``block_table_tensor`` of a :class:`CommonAttentionMetadata`); ``ENCODER_DECODER``:
    ``encoder_seq_lens``, ``max_encoder_seq_len``, ``cross_block_tables``; ``ENCODER``: ``encoder_seq_lens``,
    ``max_encoder_seq_len``, ``None``. vLLM picks ``max_prefill_seq_len`` or ``max_decode_seq_len`` by
    ``is_prompt``; jaxkv metadata keeps one static bound, so ``is_prompt`` does not change the result.

    Args:
        attn_metadata: :class:`AttentionMetadata`, :class:`CommonAttentionMetadata` or
            :class:`EncoderDecoderMetadata`.
        is_prompt: prefill step (kept for vLLM parity).
        attn_type: an :class:`AttentionType` or its string value.

    Returns:
        ``(int32[num_seqs] seq lens, int max seq len, int32[num_seqs, width] block tables or None)``.

    Raises:
        ValueError: unknown ``attn_type`` or ``ENCODER_ONLY`` (vLLM raises ``AttributeError``), or the
            encoder / cross fields the type needs are not set (vLLM would return ``None`` fields).
    """
    del is_prompt
    attn_type = _attn_type(attn_type)
    if attn_type is AttentionType.DECODER:
        md = attn_metadata.decoder if isinstance(attn_metadata, EncoderDecoderMetadata) else attn_metadata
        tables = getattr(md, "block_tables", None)
        tables = md.block_table_tensor if tables is None else tables
        return md.seq_lens, md.max_seq_len, tables
    if attn_type is AttentionType.ENCODER_DECODER:
        if not is_all_cross_attn_metadata_set(attn_metadata):
            raise ValueError("attn_type='encoder_decoder' needs encoder_seq_lens, max_encoder_seq_len, "
                             "cross_slot_mapping and cross_block_tables; attn_metadata lacks one")
        return (attn_metadata.encoder_seq_lens, attn_metadata.max_encoder_seq_len,
                attn_metadata.cross_block_tables)
    if attn_type is AttentionType.ENCODER:
        if not is_all_encoder_attn_metadata_set(attn_metadata):
            raise ValueError("attn_type='encoder' needs encoder_seq_lens and max_encoder_seq_len; "
                             "attn_metadata lacks one")
        return attn_metadata.encoder_seq_lens, attn_metadata.max_encoder_seq_len, None
    raise ValueError(f"attn_type={attn_type.value!r} has no seq-len / block-table arguments")
