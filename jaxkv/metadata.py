"""Attention metadata: the per-step description of a batch that every attention layer reads.

vLLM: ``CommonAttentionMetadata`` / the backends' ``AttentionMetadata`` and their builders
(``CommonMetadataBuilder.build``, v1 ``build_attn_metadata``), with the CUDA-graph padding rule of
``CommonAttentionState`` (pad slots with ``PAD_SLOT_ID``, seq lens with 1, block tables to a fixed width) so
that one compiled step serves every batch of a bucket, and the encoder / decoder / cross-attention helpers of
``vllm/attention/backends/utils.py``.

Three pytrees (arrays are leaves, bucket sizes and static bounds are treedef metadata):

* :class:`AttentionMetadata` — what the attention op reads (decoder self-attention);
* :class:`CommonAttentionMetadata` — vLLM v1's per-KV-cache-group metadata, built by
  :func:`build_attn_metadata_for_groups` (one object per group, shared by the group's layers);
* :class:`EncoderDecoderMetadata` — an :class:`AttentionMetadata` plus encoder lengths and cross-attention
  slot mapping / block tables.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.slot_mapping import PAD_SLOT_ID, compute_slot_mapping_batch


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
# Pytrees
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "seq_lens", "block_tables", "query_start_loc"],
                   meta_fields=["max_query_len", "max_seq_len"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """A batch's attention metadata (pytree: arrays are leaves, maxima are static).

    vLLM: a backend's ``AttentionMetadata`` (decoder fields; one static ``max_seq_len`` bound stands for
    ``max_prefill_seq_len`` / ``max_decode_seq_len``).

    Attributes:
        slot_mapping: ``int32[num_tokens]`` cache slot of each new token, ``PAD_SLOT_ID`` for padding.
        seq_lens: ``int32[num_seqs]`` cached + new tokens of each sequence.
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        query_start_loc: ``int32[num_seqs + 1]`` offsets of each sequence's new tokens.
        max_query_len: static upper bound on new tokens per sequence (1 ⇒ decode-only batch).
        max_seq_len: static upper bound on ``seq_lens``.
    """

    slot_mapping: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    query_start_loc: jax.Array
    max_query_len: int
    max_seq_len: int

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has exactly one new token (the decode kernel applies)."""
        return self.max_query_len == 1


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["query_start_loc", "seq_lens", "num_computed_tokens", "block_table_tensor",
                                "slot_mapping", "num_reqs", "num_actual_tokens"],
                   meta_fields=["max_query_len", "max_seq_len", "causal"])
@dataclasses.dataclass(frozen=True, kw_only=True)
class CommonAttentionMetadata:
    """One KV-cache group's view of a batch. vLLM: ``CommonAttentionMetadata`` (v1).

    Arrays are padded to the bucket (``num_reqs_padded`` sequences, ``num_tokens_padded`` tokens), so
    their shapes are the static sizes. The real counts ``num_reqs`` / ``num_actual_tokens`` vary from step
    to step inside a bucket, so they are traced ``int32[]`` leaves (vLLM keeps them as host ints; a static
    field would recompile the step for every real batch size).

    Attributes:
        query_start_loc: ``int32[num_reqs_padded + 1]`` offsets of each request's new tokens.
        seq_lens: ``int32[num_reqs_padded]`` cached + new tokens per request.
        num_computed_tokens: ``int32[num_reqs_padded]`` tokens already cached (context lens). vLLM:
            ``num_computed_tokens_cpu``.
        block_table_tensor: ``int32[num_reqs_padded, max_num_blocks_per_seq]`` this group's block table.
        slot_mapping: ``int32[num_tokens_padded]`` this group's slots, ``PAD_SLOT_ID`` for padding.
        num_reqs: ``int32[]`` real requests (rows past it are dummies).
        num_actual_tokens: ``int32[]`` real new tokens (slots past it are ``PAD_SLOT_ID``).
        max_query_len: static bound on new tokens per request (1 ⇒ decode-only).
        max_seq_len: static bound on ``seq_lens`` (``max_num_blocks_per_seq * block_size`` by default).
        causal: static; always ``True`` for decoder self-attention, as in vLLM's ``build_attn_metadata``.
    """

    query_start_loc: jax.Array
    seq_lens: jax.Array
    num_computed_tokens: jax.Array
    block_table_tensor: jax.Array
    slot_mapping: jax.Array
    num_reqs: jax.Array
    num_actual_tokens: jax.Array
    max_query_len: int
    max_seq_len: int
    causal: bool = True

    @property
    def is_decode_only(self) -> bool:
        """Every request has exactly one new token."""
        return self.max_query_len == 1

    @property
    def query_lens(self) -> jax.Array:
        """``int32[num_reqs_padded]`` new tokens per request."""
        return jnp.diff(self.query_start_loc)

    def to_attention_metadata(self) -> AttentionMetadata:
        """The :class:`AttentionMetadata` :func:`jaxkv.paged_attention` reads (same arrays, no copy).

        Pass it as a builder to :func:`build_attn_metadata_for_groups` (vLLM: a backend's
        ``AttentionMetadataBuilder.build``).
        """
        return AttentionMetadata(slot_mapping=self.slot_mapping, seq_lens=self.seq_lens,
                                 block_tables=self.block_table_tensor,
                                 query_start_loc=self.query_start_loc,
                                 max_query_len=self.max_query_len, max_seq_len=self.max_seq_len)


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
# Host-side padding plan shared by the builders
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _BatchPlan:
    num_seqs: int
    num_seqs_padded: int
    dummy_len: int                # tokens (= seq_len) of a dummy sequence: 1 in decode buckets, else 0
    context_lens: np.ndarray      # int64[num_seqs]
    query_lens: np.ndarray        # int64[num_seqs_padded], dummies included
    seq_lens: np.ndarray          # int64[num_seqs_padded], dummies included
    num_real_tokens: int
    num_tokens_padded: int
    max_query_len: int

    @property
    def real_seq_lens(self) -> np.ndarray:
        return self.seq_lens[: self.num_seqs]

    def pad_slots(self, slots: np.ndarray) -> np.ndarray:
        """``int32[num_tokens_padded]``: real slots then ``PAD_SLOT_ID`` (dummy and padding tokens)."""
        return np.concatenate([slots, np.full(self.num_tokens_padded - len(slots), PAD_SLOT_ID)]
                              ).astype(np.int32)

    def pad_rows(self, table: np.ndarray) -> np.ndarray:
        """``int32[num_seqs_padded, width]``: real rows then zero rows."""
        pad = np.zeros((self.num_seqs_padded - self.num_seqs, table.shape[1]), np.int32)
        return np.concatenate([table.astype(np.int32), pad])

    def query_start_loc(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int32)


def _plan_batch(context_lens, query_lens, num_seqs_padded, num_tokens_padded, max_query_len) -> _BatchPlan:
    context_lens = np.asarray(context_lens, np.int64)
    query_lens = np.asarray(query_lens, np.int64)
    num_seqs = len(query_lens)
    if num_seqs and query_lens.min() < 1:
        raise ValueError(f"query_lens={query_lens.tolist()} must all be >= 1")
    if num_seqs and context_lens.min() < 0:
        raise ValueError(f"context_lens={context_lens.tolist()} must all be >= 0")
    num_seqs_padded = num_seqs if num_seqs_padded is None else int(num_seqs_padded)
    if num_seqs_padded < num_seqs:
        raise ValueError(f"num_seqs_padded={num_seqs_padded} < num_seqs={num_seqs}")
    decode_only = bool(num_seqs == 0 or query_lens.max() == 1)
    dummy_len = 1 if decode_only else 0  # vLLM CUDA-graph padding: one PAD token, seq_len 1
    pad = num_seqs_padded - num_seqs
    seq_lens = np.concatenate([context_lens + query_lens, np.full(pad, dummy_len)])
    query_lens = np.concatenate([query_lens, np.full(pad, dummy_len)])
    num_real_tokens = int(query_lens[:num_seqs].sum())
    num_tokens = num_real_tokens + pad * dummy_len
    num_tokens_padded = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
    if num_tokens_padded < num_tokens:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} < num_tokens={num_tokens}")
    max_q = int(query_lens.max(initial=1)) if max_query_len is None else int(max_query_len)
    if max_q < max(1, int(query_lens.max(initial=0))):
        raise ValueError(f"max_query_len={max_q} < longest query {int(query_lens.max(initial=1))}")
    return _BatchPlan(num_seqs, num_seqs_padded, dummy_len, context_lens, query_lens, seq_lens,
                      num_real_tokens, num_tokens_padded, max_q)


def _as_table(block_tables, num_seqs: int, name: str) -> np.ndarray:
    table = np.asarray(block_tables, np.int64)
    if table.ndim != 2 or table.shape[0] != num_seqs:
        raise ValueError(f"{name}.shape={table.shape} must be [num_seqs={num_seqs}, max_num_blocks_per_seq]")
    return table


# ----------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------

def build_attn_metadata(
    block_tables: np.ndarray,
    context_lens,
    query_lens,
    block_size: int,
    *,
    num_seqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    is_prompt=None,
) -> AttentionMetadata:
    """Host-side (NumPy) construction of :class:`AttentionMetadata`, padded for a compiled bucket.

    vLLM: the metadata builders' ``build`` plus ``CommonAttentionState.graph_capture_get_metadata_for_batch``.
    Padding: sequences ``num_seqs..num_seqs_padded`` are dummies; in a decode-only batch they get one
    token, ``seq_len = 1`` and a ``PAD_SLOT_ID`` slot (as vLLM pads CUDA graphs), otherwise no token and
    ``seq_len = 0``. Tokens past the real ones get ``PAD_SLOT_ID`` and belong to no sequence.

    Args:
        block_tables: ``int[num_seqs, max_num_blocks_per_seq]`` (its width is kept, so keep it fixed).
        context_lens: ``int[num_seqs]`` tokens already cached (``num_computed_tokens``).
        query_lens: ``int[num_seqs]`` new tokens, ``>= 1`` each.
        block_size: tokens per block.
        num_seqs_padded, num_tokens_padded: bucket sizes (default: no padding).
        max_query_len: static bound to record (default: the batch's maximum).
        sliding_window: window in tokens: a prompt's tokens before ``query_len - sliding_window`` get
            ``PAD_SLOT_ID`` (vLLM ``compute_slot_mapping_start_idx``); default ``None`` (no masking).
        is_prompt: ``bool[num_seqs]`` for the window rule; default ``context_lens == 0``.

    Returns:
        :class:`AttentionMetadata` with ``num_seqs_padded`` rows and ``num_tokens_padded`` slots,
        ``max_seq_len = max_num_blocks_per_seq * block_size``.

    Raises:
        ValueError: shapes that disagree, a query length < 1, a negative context length, a padded size
            smaller than the real one, ``max_query_len`` below the longest query, ``sliding_window < 1``,
            or a block table too narrow for a sequence.
    """
    block_tables = np.asarray(block_tables, np.int32)
    context_lens = np.asarray(context_lens, np.int64)
    query_lens = np.asarray(query_lens, np.int64)
    num_seqs = len(query_lens)
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables.shape={block_tables.shape}, context_lens.shape="
                         f"{context_lens.shape} and query_lens.shape={query_lens.shape} disagree")
    plan = _plan_batch(context_lens, query_lens, num_seqs_padded, num_tokens_padded, max_query_len)
    slots = compute_slot_mapping_batch(block_tables, plan.context_lens, plan.real_seq_lens, block_size,
                                       sliding_window=sliding_window, is_prompt=is_prompt)
    return AttentionMetadata(
        slot_mapping=jnp.asarray(plan.pad_slots(slots), jnp.int32),
        seq_lens=jnp.asarray(plan.seq_lens, jnp.int32),
        block_tables=jnp.asarray(plan.pad_rows(block_tables), jnp.int32),
        query_start_loc=jnp.asarray(plan.query_start_loc(), jnp.int32),
        max_query_len=plan.max_query_len,
        max_seq_len=block_tables.shape[1] * block_size,
    )


def _group_spec(group, i: int) -> tuple[tuple[str, ...], int, int | None]:
    try:
        names = tuple(group.layer_names)
        spec = group.kv_cache_spec
        block_size = spec.block_size
    except AttributeError as e:
        raise ValueError(f"kv_cache_groups[{i}]={group!r} needs .layer_names and .kv_cache_spec.block_size"
                         ) from e
    window = getattr(spec, "sliding_window", None)
    if not names:
        raise ValueError(f"kv_cache_groups[{i}].layer_names=() names no layer")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"kv_cache_groups[{i}].kv_cache_spec.block_size={block_size!r} must be a "
                         "positive int")
    if window is not None and window < 1:
        raise ValueError(f"kv_cache_groups[{i}].kv_cache_spec.sliding_window={window!r} must be >= 1 or None")
    return names, int(block_size), window


def build_attn_metadata_for_groups(
    kv_cache_groups,
    block_tables: Sequence[np.ndarray],
    context_lens,
    query_lens,
    *,
    num_seqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
    max_query_len: int | None = None,
    is_prompt=None,
    builders: Sequence[Callable[[CommonAttentionMetadata], Any] | None] | None = None,
) -> dict[str, Any]:
    """One metadata object per KV-cache group, shared by every layer of the group.

    vLLM: ``build_attn_metadata`` (``vllm/v1/worker/gpu/attn_utils.py``). Request-level arrays
    (``query_start_loc``, ``seq_lens``, ``num_computed_tokens``) are built once and shared by all groups;
    each group gets its own block table and a slot mapping computed with its own ``block_size`` and, for a
    sliding-window spec, its window (vLLM v0 ``compute_slot_mapping`` prompt masking). Padding follows
    :func:`build_attn_metadata`. Each group's :class:`CommonAttentionMetadata` is passed through its builder
    (vLLM: ``attn_metadata_builders[i].build``), e.g. ``CommonAttentionMetadata.to_attention_metadata``.

    Args:
        kv_cache_groups: objects with ``.layer_names`` and ``.kv_cache_spec.block_size`` (optional
            ``.kv_cache_spec.sliding_window``), e.g. :class:`jaxkv.KVCacheGroupSpec`; or an object with
            ``.kv_cache_groups`` (a :class:`jaxkv.KVCacheConfig`).
        block_tables: one ``int[num_seqs, max_num_blocks_per_seq_g]`` per group, in group order.
        context_lens: ``int[num_seqs]`` tokens already cached.
        query_lens: ``int[num_seqs]`` new tokens, ``>= 1`` each.
        num_seqs_padded, num_tokens_padded, max_query_len: bucket sizes / static bound, as in
            :func:`build_attn_metadata`.
        is_prompt: ``bool[num_seqs]`` for the sliding-window rule; default ``context_lens == 0``.
        builders: one callable (or ``None`` = identity) per group mapping the group's
            :class:`CommonAttentionMetadata` to the metadata its layers receive.

    Returns:
        ``dict[layer_name, metadata]``; layers of one group map to the same object.

    Raises:
        ValueError: a group without layer names or with a bad block size / window, a layer in two groups,
            a count of block tables or builders different from the number of groups, a block table whose
            rows differ from ``num_seqs`` or too narrow for its group, and every error of
            :func:`build_attn_metadata`.
    """
    groups = tuple(getattr(kv_cache_groups, "kv_cache_groups", kv_cache_groups))
    if not groups:
        raise ValueError("kv_cache_groups=() holds no group")
    specs = [_group_spec(g, i) for i, g in enumerate(groups)]
    seen: dict[str, int] = {}
    for i, (names, _, _) in enumerate(specs):
        for name in names:
            if name in seen:
                raise ValueError(f"layer_name={name!r} is in kv_cache_groups[{seen[name]}] and [{i}]")
            seen[name] = i
    block_tables = list(block_tables)
    if len(block_tables) != len(groups):
        raise ValueError(f"block_tables has {len(block_tables)} tables for {len(groups)} kv_cache_groups")
    builders = [None] * len(groups) if builders is None else list(builders)
    if len(builders) != len(groups):
        raise ValueError(f"builders has {len(builders)} entries for {len(groups)} kv_cache_groups")
    query_lens = np.asarray(query_lens, np.int64)
    context_lens = np.asarray(context_lens, np.int64)
    if context_lens.shape != query_lens.shape or query_lens.ndim != 1:
        raise ValueError(f"context_lens.shape={context_lens.shape} != query_lens.shape={query_lens.shape}")
    plan = _plan_batch(context_lens, query_lens, num_seqs_padded, num_tokens_padded, max_query_len)

    per_group = []  # everything validated and computed before any output is made
    for i, ((_, block_size, window), table) in enumerate(zip(specs, block_tables)):
        table = _as_table(table, plan.num_seqs, f"block_tables[{i}]")
        slots = compute_slot_mapping_batch(table, plan.context_lens, plan.real_seq_lens, block_size,
                                           sliding_window=window, is_prompt=is_prompt)
        per_group.append((plan.pad_rows(table), plan.pad_slots(slots), table.shape[1] * block_size))

    query_start_loc = jnp.asarray(plan.query_start_loc(), jnp.int32)
    seq_lens = jnp.asarray(plan.seq_lens, jnp.int32)
    computed = np.zeros(plan.num_seqs_padded, np.int32)
    computed[: plan.num_seqs] = plan.context_lens
    computed = jnp.asarray(computed)
    num_reqs = jnp.asarray(plan.num_seqs, jnp.int32)
    num_actual_tokens = jnp.asarray(plan.num_real_tokens, jnp.int32)
    out: dict[str, Any] = {}
    for (names, _, _), (table, slots, max_seq_len), builder in zip(specs, per_group, builders):
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, num_computed_tokens=computed,
            block_table_tensor=jnp.asarray(table), slot_mapping=jnp.asarray(slots), num_reqs=num_reqs,
            num_actual_tokens=num_actual_tokens, max_query_len=plan.max_query_len, max_seq_len=max_seq_len,
            causal=True)
        metadata = common if builder is None else builder(common)
        for name in names:
            out[name] = metadata
    return out


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
