"""Attention metadata: the per-step description of a batch that every attention layer reads.

vLLM: ``CommonAttentionMetadata`` / the backends' ``AttentionMetadata`` and their builders, with the
CUDA-graph padding rule of ``CommonAttentionState`` (pad slots with ``PAD_SLOT_ID``, seq lens with 1,
block tables to a fixed width) so that one compiled step serves every batch of a bucket.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.slot_mapping import PAD_SLOT_ID, compute_slot_mapping_batch


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "seq_lens", "block_tables", "query_start_loc"],
                   meta_fields=["max_query_len", "max_seq_len"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """A batch's attention metadata (pytree: arrays are leaves, maxima are static).

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


def build_attn_metadata(
    block_tables: np.ndarray,
    context_lens,
    query_lens,
    block_size: int,
    *,
    num_seqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
    max_query_len: int | None = None,
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

    Raises:
        ValueError: a query length < 1, a padded size smaller than the real one, or a block table
            too narrow for a sequence.
    """
    block_tables = np.asarray(block_tables, np.int32)
    context_lens = np.asarray(context_lens, np.int64)
    query_lens = np.asarray(query_lens, np.int64)
    num_seqs = len(query_lens)
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables.shape={block_tables.shape}, context_lens.shape="
                         f"{context_lens.shape} and query_lens.shape={query_lens.shape} disagree")
    if num_seqs and query_lens.min() < 1:
        raise ValueError(f"query_lens={query_lens.tolist()} must all be >= 1")
    seq_lens = context_lens + query_lens
    slots = compute_slot_mapping_batch(block_tables, context_lens, seq_lens, block_size)
    decode_only = bool(num_seqs == 0 or query_lens.max() == 1)
    num_seqs_padded = num_seqs if num_seqs_padded is None else num_seqs_padded
    if num_seqs_padded < num_seqs:
        raise ValueError(f"num_seqs_padded={num_seqs_padded} < num_seqs={num_seqs}")
    dummy_len = 1 if decode_only else 0
    pad = num_seqs_padded - num_seqs
    query_lens = np.concatenate([query_lens, np.full(pad, dummy_len)])
    seq_lens = np.concatenate([seq_lens, np.full(pad, dummy_len)])
    slots = np.concatenate([slots, np.full(pad * dummy_len, PAD_SLOT_ID)])
    block_tables = np.concatenate([block_tables, np.zeros((pad, block_tables.shape[1]), np.int32)])
    num_tokens = len(slots)
    num_tokens_padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    if num_tokens_padded < num_tokens:
        raise ValueError(f"num_tokens_padded={num_tokens_padded} < num_tokens={num_tokens}")
    slots = np.concatenate([slots, np.full(num_tokens_padded - num_tokens, PAD_SLOT_ID)])
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    max_q = int(query_lens.max(initial=1)) if max_query_len is None else max_query_len
    if max_q < query_lens.max(initial=0):
        raise ValueError(f"max_query_len={max_q} < longest query {query_lens.max()}")
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        block_tables=jnp.asarray(block_tables, jnp.int32),
        query_start_loc=jnp.asarray(query_start_loc, jnp.int32),
        max_query_len=max_q,
        max_seq_len=block_tables.shape[1] * block_size,
    )
