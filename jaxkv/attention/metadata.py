"""Attention metadata: the per-step description of a batch that every attention layer reads.

vLLM: ``CommonAttentionMetadata`` / the backends' ``AttentionMetadata`` and their builders
(``CommonMetadataBuilder.build``, v1 ``build_attn_metadata``), with the CUDA-graph padding rule of
``CommonAttentionState`` (pad slots with ``PAD_SLOT_ID``, seq lens with 1, block tables to a fixed width) so
that one compiled step serves every batch of a bucket.

Two pytrees (arrays are leaves, bucket sizes and static bounds are treedef metadata):

* :class:`AttentionMetadata` — what the attention op reads (decoder self-attention);
* :class:`CommonAttentionMetadata` — vLLM v1's per-KV-cache-group metadata, built by
  :func:`build_attn_metadata_for_groups` (one object per group, shared by the group's layers).

Encoder-decoder metadata (:class:`~jaxkv.vllm_parity.enc_dec_metadata.EncoderDecoderMetadata`) and the attention-type
helpers of ``vllm/attention/backends/utils.py`` are in :mod:`jaxkv.vllm_parity.enc_dec_metadata`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.checks import check_block_ids
from jaxkv.kv_cache.slot_mapping import PAD_SLOT_ID, compute_slot_mapping_batch

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


def _check_used_blocks(table: np.ndarray, seq_lens: np.ndarray, block_size: int, num_blocks: int | None,
                       name: str) -> None:
    """Block ids of the blocks each sequence reads (``i < cdiv(seq_len, block_size)``) are in
    ``[0, num_blocks)`` (``>= 0`` without ``num_blocks``); later entries are never read."""
    tables = np.asarray(table, np.int64)
    if tables.shape[1] == 0:
        return
    used = np.arange(tables.shape[1])[None, :] * block_size < np.asarray(seq_lens)[:, None]
    check_block_ids("host", tables, used, name + "[{s}, {i}]", num_blocks, index_names=("s", "i"))


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
    num_blocks: int | None = None,
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
        num_blocks: blocks in the cache; every block id a sequence reads or writes (its first
            ``cdiv(seq_len, block_size)`` entries) must be in ``[0, num_blocks)``. Default ``None``:
            those ids must only be ``>= 0``.

    Returns:
        :class:`AttentionMetadata` with ``num_seqs_padded`` rows and ``num_tokens_padded`` slots,
        ``max_seq_len = max_num_blocks_per_seq * block_size``.

    Raises:
        ValueError: shapes that disagree, a query length < 1, a negative context length, a padded size
            smaller than the real one, ``max_query_len`` below the longest query, ``sliding_window < 1``,
            a block table too narrow for a sequence, or a block id a sequence uses that is negative or
            (with ``num_blocks``) ``>= num_blocks`` (names the entry and the bound). Nothing is built.
    """
    block_tables = np.asarray(block_tables, np.int32)
    context_lens = np.asarray(context_lens, np.int64)
    query_lens = np.asarray(query_lens, np.int64)
    num_seqs = len(query_lens)
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables.shape={block_tables.shape}, context_lens.shape="
                         f"{context_lens.shape} and query_lens.shape={query_lens.shape} disagree")
    plan = _plan_batch(context_lens, query_lens, num_seqs_padded, num_tokens_padded, max_query_len)
    _check_used_blocks(block_tables, plan.real_seq_lens, block_size, num_blocks, "block_tables")
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
    num_blocks: int | Sequence[int | None] | None = None,
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
        num_blocks: blocks in each group's cache (one int for all groups, or one per group) to check
            the block ids each sequence uses, as in :func:`build_attn_metadata`; ``None``: ids ``>= 0``.

    Returns:
        ``dict[layer_name, metadata]``; layers of one group map to the same object.

    Raises:
        ValueError: a group without layer names or with a bad block size / window, a layer in two groups,
            a count of block tables or builders different from the number of groups, a block table whose
            rows differ from ``num_seqs`` or too narrow for its group, a count of ``num_blocks`` entries
            different from the number of groups, and every error of :func:`build_attn_metadata`
            (block ids are reported as ``block_tables[g][s, i]``).
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
    if num_blocks is None or isinstance(num_blocks, (int, np.integer)):
        num_blocks = [num_blocks] * len(groups)
    num_blocks = list(num_blocks)
    if len(num_blocks) != len(groups):
        raise ValueError(f"num_blocks has {len(num_blocks)} entries for {len(groups)} kv_cache_groups")

    per_group = []  # everything validated and computed before any output is made
    for i, ((_, block_size, window), table) in enumerate(zip(specs, block_tables)):
        table = _as_table(table, plan.num_seqs, f"block_tables[{i}]")
        _check_used_blocks(table, plan.real_seq_lens, block_size, num_blocks[i], f"block_tables[{i}]")
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
