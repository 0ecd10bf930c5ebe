"""A layer's paged-cache write + attention, run per shard on a ``(dp, tp)`` mesh.

Under :func:`jax.shard_map` every device sees only its own slice: the query heads and KV heads of its
``tp`` rank, the rows and tokens of its ``dp`` rank, and that rank's block pool, indexed by local block
ids. The kernels (Pallas on GPU, the jnp references on CPU) run unchanged on the slice; nothing is
communicated here (the one all-reduce per layer is the o_proj's, outside).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.metadata import AttentionMetadata
from jaxkv.kv_cache.write import write_to_paged_cache
from jaxkv.parallel.mesh import DP, TP, kv_head_map, mesh_sizes


def paged_attention_layer(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                          metadata: AttentionMetadata, *, scale: float, impl: str, mesh: Mesh | None = None,
                          k_scale=None, v_scale=None, **extras) -> tuple[jax.Array, jax.Array]:
    """Write the batch's new K/V into the paged cache, then attend (one decoder layer's cache work).

    Without a mesh this is :func:`jaxkv.write_to_paged_cache` followed by :func:`jaxkv.paged_attention`.
    With a mesh both run inside one :func:`jax.shard_map` over ``(dp, tp)``:

    * tokens and rows (``q``, ``k``, ``v``, ``slot_mapping``, ``seq_lens``, ``block_tables``,
      ``query_start_loc``) are split over ``dp`` (size 1 in the engine, whose data-parallel ranks are
      engine-core processes of their own; a caller with ``dp > 1`` lays each rank's rows and tokens out as
      a contiguous slice with block ids, slots and ``query_start_loc`` local to it);
    * heads are split over ``tp``: ``q`` on its heads, the cache and ``k``/``v`` on their KV heads. When
      the model has fewer KV heads than ``tp`` ranks, the cache holds one head per rank (a replica, vLLM's
      rule) and ``k``/``v`` are first expanded to ``tp`` heads (rank ``r`` gets head ``r * num_kv_heads //
      tp``, the KV head of its query heads).

    Args:
        q: ``[num_tokens, num_heads, head_size]``.
        k, v: ``[num_tokens, num_kv_heads, head_size]`` (the model's KV heads).
        kv_cache: ``[2, num_blocks, cache_kv_heads, block_size, head_size]``; with a mesh the global
            array (``dp * blocks per rank`` blocks, ``tp * max(1, num_kv_heads // tp)`` heads), sharded as
            :func:`jaxkv.parallel.mesh.kv_cache_sharding`.
        metadata: the batch; with ``dp > 1``, ``query_start_loc`` is ``int32[dp * (rows_per_rank + 1)]``
            of per-rank offsets (ignored for decode-only batches).
        scale, impl, k_scale, v_scale, extras: as :func:`jaxkv.paged_attention`.
        mesh: a ``(dp, tp)`` mesh, or ``None``.

    Returns:
        ``(out [num_tokens, num_heads, head_size], the updated cache)``.

    Raises:
        ValueError: what the ops raise, a cache whose head count does not fit the mesh, or
            ``alibi_slopes`` with a mesh (not supported).
    """
    scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)
    if mesh is None:
        kv_cache = write_to_paged_cache(kv_cache, k, v, metadata.slot_mapping, **scales)
        return paged_attention(q, kv_cache, metadata, scale=scale, impl=impl, **scales, **extras), kv_cache

    if extras.get("alibi_slopes") is not None:
        raise ValueError("alibi_slopes with a mesh: per-head slopes are not sharded over tp (not supported)")
    dp, tp = mesh_sizes(mesh)
    heads = kv_head_map(k.shape[1], tp)
    if heads is not None:  # fewer KV heads than ranks: one replica per rank
        k, v = k[:, heads], v[:, heads]
    if kv_cache.shape[2] != k.shape[1]:
        raise ValueError(f"kv_cache has {kv_cache.shape[2]} KV heads; with num_kv_heads={k.shape[1]} and "
                         f"tensor_parallel_size={tp} it should have {k.shape[1]}")
    tokens, cache_spec = P(DP, TP, None), P(None, DP, TP, None, None)
    decode = metadata.is_decode_only

    def local(q, k, v, kv_cache, slot_mapping, seq_lens, block_tables, query_start_loc):
        kv_cache = write_to_paged_cache(kv_cache, k, v, slot_mapping, **scales)
        md = AttentionMetadata(slot_mapping=slot_mapping, seq_lens=seq_lens, block_tables=block_tables,
                               query_start_loc=query_start_loc, max_query_len=metadata.max_query_len,
                               max_seq_len=metadata.max_seq_len)
        return paged_attention(q, kv_cache, md, scale=scale, impl=impl, **scales, **extras), kv_cache

    qsl = metadata.query_start_loc
    if decode:  # the decode kernel does not read it: a per-rank dummy of the right length
        qsl = jnp.tile(jnp.arange(q.shape[0] // dp + 1, dtype=jnp.int32), dp)
    fn = jax.shard_map(local, mesh=mesh,
                       in_specs=(tokens, tokens, tokens, cache_spec, P(DP), P(DP), P(DP, None), P(DP)),
                       out_specs=(tokens, cache_spec), check_vma=False)
    return fn(q, k, v, kv_cache, metadata.slot_mapping, metadata.seq_lens, metadata.block_tables, qsl)


def gather_logits_rows(x: jax.Array, logits_indices: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """``x[logits_indices]``: the hidden state of each row's last new token.

    With ``dp > 1`` the gather runs per ``dp`` rank (a rank's rows index its own token slice), so no
    rank's activations travel; left to XLA, the global gather became an all-gather of ``x`` over ``dp``.

    Args:
        x: ``[num_tokens, hidden]``.
        logits_indices: ``int32[num_rows]`` token index (into the whole batch) of each row.
        mesh: the ``(dp, tp)`` mesh or ``None``.

    Returns:
        ``[num_rows, hidden]``.
    """
    dp, _ = mesh_sizes(mesh)
    if dp == 1:
        return x[logits_indices]

    def local(x, idx):
        return x[idx - jax.lax.axis_index(DP) * x.shape[0]]

    return jax.shard_map(local, mesh=mesh, in_specs=(P(DP, None), P(DP)), out_specs=P(DP, None),
                         axis_names={DP}, check_vma=False)(x, logits_indices)
