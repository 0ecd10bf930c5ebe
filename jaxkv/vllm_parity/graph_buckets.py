"""Graph-capture analogue: decode batch-size buckets and fixed-shape decode metadata.

vLLM captures one CUDA graph per batch size in ``[1, 2, 4, 8, 16, 24, ...]`` and replays the smallest one
that holds the real batch, after copying the batch into the graph's input buffers and padding the rest
(``PAD_SLOT_ID`` slots, seq len 1, zero block-table rows). In JAX the compiled executable plays the graph:
``jax.jit`` compiles once per distinct input shape (and static fields), so padding every decode batch to a
bucket gives one compilation per bucket. There is no buffer address to keep stable, so the "input
buffers" are host NumPy staging arrays that are filled in place and sent to the device in one copy.

vLLM: ``CommonAttentionState`` (``vllm/attention/backends/utils.py``) and the model runner's
``_BATCH_SIZES_TO_CAPTURE`` / ``_get_graph_batch_size`` / ``_get_max_graph_batch_size``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention.metadata import AttentionMetadata
from jaxkv.checks import as_checked, check_mode, require
from jaxkv.kv_cache.slot_mapping import PAD_SLOT_ID
from jaxkv.vllm_parity.enc_dec_metadata import EncoderDecoderMetadata

BATCH_SIZE_ALIGNMENT = 8
"""Capture sizes past 4 are multiples of this (vLLM ``_BATCH_SIZE_ALIGNMENT``)."""


def capture_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The decode batch sizes to compile: 1, 2, 4, then multiples of 8, up to the bucket of the maximum.

    vLLM: ``_BATCH_SIZES_TO_CAPTURE = [1, 2, 4] + [8 * i for i in range(1, 1025)]`` cut at
    ``_get_max_graph_batch_size(max_num_seqs)`` (``max_batch_size`` rounded up to a capture size), so every
    batch of ``1..max_batch_size`` sequences has a bucket. vLLM's list ends at 8192; this one does not.

    Args:
        max_batch_size: most sequences in a decode step (``max_num_seqs``).

    Returns:
        Increasing sizes; the last is ``>= max_batch_size`` (e.g. 13 → ``(1, 2, 4, 8, 16)``).

    Raises:
        ValueError: ``max_batch_size < 1``.
    """
    if not isinstance(max_batch_size, (int, np.integer)) or max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size!r} must be a positive int")
    if max_batch_size <= 4:
        top = next(s for s in (1, 2, 4) if s >= max_batch_size)
    else:
        top = -(-int(max_batch_size) // BATCH_SIZE_ALIGNMENT) * BATCH_SIZE_ALIGNMENT
    small = [s for s in (1, 2, 4) if s <= top]
    return tuple(small + list(range(BATCH_SIZE_ALIGNMENT, top + 1, BATCH_SIZE_ALIGNMENT)))


def graph_batch_size(batch_size: int, capture_sizes: tuple[int, ...]) -> int:
    """The smallest capture size that holds ``batch_size`` sequences. vLLM: ``_get_graph_batch_size``.

    Raises:
        ValueError: ``batch_size < 1`` or larger than every capture size (vLLM falls back to eager
            mode; a jitted step would compile a new shape instead, so it is refused).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    for size in capture_sizes:
        if size >= batch_size:
            return size
    raise ValueError(f"batch_size={batch_size} > largest capture size {max(capture_sizes, default=0)}")


def _check_decode(md: AttentionMetadata, name: str = "attn_metadata") -> int:
    if not md.is_decode_only:
        raise ValueError(f"{name}.max_query_len={md.max_query_len}: only decode-only metadata "
                         "(max_query_len == 1) is padded to a graph bucket")
    num_seqs = md.seq_lens.shape[0]
    if md.slot_mapping.shape != (num_seqs,) or md.query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"{name}.slot_mapping.shape={md.slot_mapping.shape} and query_start_loc.shape="
                         f"{md.query_start_loc.shape} must be ({num_seqs},) and ({num_seqs + 1},) in a "
                         "decode batch of num_seqs rows")
    return num_seqs


def pad_decode_metadata(attn_metadata, bucket: int, *, max_num_blocks_per_seq: int | None = None,
                        max_seq_len: int | None = None):
    """Pad decode metadata to ``bucket`` sequences (vLLM's CUDA-graph padding), jit-compatible.

    Rows ``num_seqs..bucket`` become dummy sequences: slot ``PAD_SLOT_ID`` (nothing written), seq len 1,
    an all-zero block-table row, one query token each (``query_start_loc`` keeps counting by one). The
    block table is widened with zero columns to ``max_num_blocks_per_seq``. For
    :class:`EncoderDecoderMetadata` the encoder lengths are padded with 1 and the cross block tables with
    zero rows (vLLM ``_update_captured_metadata_for_enc_dec_model`` fills them with 1; any value is
    inert in dummy rows). vLLM: ``CommonMetadataBuilder.build`` with ``cuda_graph_pad_size``.

    Args:
        attn_metadata: decode-only :class:`AttentionMetadata` (or :class:`EncoderDecoderMetadata`),
            ``num_seqs`` rows, one token each.
        bucket: padded number of sequences (a capture size), ``>= num_seqs``.
        max_num_blocks_per_seq: block-table width to pad to; default: unchanged.
        max_seq_len: static bound to record; default: unchanged. Keep both fixed so every batch of a
            bucket has the same treedef and shapes (one compilation).

    Returns:
        Metadata of the same type with ``bucket`` rows.

    Raises:
        ValueError: metadata that is not decode-only, ``bucket < num_seqs``, a width narrower than the
            table, or (concrete ``seq_lens``; traced ones only in the check mode of :mod:`jaxkv.checks`)
            a ``max_seq_len`` below a sequence's length.
    """
    if isinstance(attn_metadata, EncoderDecoderMetadata):
        md = attn_metadata
        decoder = pad_decode_metadata(md.decoder, bucket, max_num_blocks_per_seq=max_num_blocks_per_seq,
                                      max_seq_len=max_seq_len)
        pad = bucket - md.decoder.seq_lens.shape[0]
        enc = None if md.encoder_seq_lens is None else jnp.pad(md.encoder_seq_lens, (0, pad),
                                                               constant_values=1)
        cross = None if md.cross_block_tables is None else jnp.pad(md.cross_block_tables, ((0, pad), (0, 0)))
        return dataclasses.replace(md, decoder=decoder, encoder_seq_lens=enc, cross_block_tables=cross)
    md = attn_metadata
    num_seqs = _check_decode(md)
    if bucket < num_seqs:
        raise ValueError(f"bucket={bucket} < num_seqs={num_seqs}")
    width = md.block_tables.shape[1]
    new_width = width if max_num_blocks_per_seq is None else max_num_blocks_per_seq
    if new_width < width:
        raise ValueError(f"max_num_blocks_per_seq={new_width} < block_tables width {width}")
    bound = md.max_seq_len if max_seq_len is None else max_seq_len
    mode = check_mode(md.seq_lens)  # host when concrete, checkify in the check mode (jaxkv.checks)
    if mode is not None:
        lens = as_checked(mode, md.seq_lens)
        require(mode, lens <= bound, f"max_seq_len={bound} < seq_lens[{{s}}]={{value}}", index_names=("s",),
                value=lens)
    pad = bucket - num_seqs
    last = md.query_start_loc[-1:]
    return AttentionMetadata(
        slot_mapping=jnp.pad(md.slot_mapping, (0, pad), constant_values=PAD_SLOT_ID),
        seq_lens=jnp.pad(md.seq_lens, (0, pad), constant_values=1),
        block_tables=jnp.pad(md.block_tables, ((0, pad), (0, new_width - width))),
        query_start_loc=jnp.concatenate([md.query_start_loc,
                                         last + jnp.arange(1, pad + 1, dtype=last.dtype)]),
        max_query_len=1,
        max_seq_len=bound,
    )


class DecodeGraphState:
    """Per-bucket decode metadata from preallocated staging buffers. vLLM: ``CommonAttentionState``.

    Usage::

        state = DecodeGraphState(block_size=16, max_num_blocks_per_seq=64)
        with state.graph_capture(max_batch_size=13):             # buffers for the largest bucket (16)
            for bs in state.capture_sizes:                        # warm-up: compile each bucket once
                step(q[:bs], cache, state.graph_capture_get_metadata_for_batch(bs))
        md = state.prepare_graph_input_buffers(real_decode_md)   # every step: copy in, pad, one transfer
        out = step(q_padded, cache, md)[:num_seqs]               # replays the bucket's executable

    Unlike vLLM, the buffers outlive the ``graph_capture`` block: replay in JAX means calling the jitted
    step with inputs of a captured shape, which :meth:`prepare_graph_input_buffers` builds from them.

    Args:
        block_size: tokens per block.
        max_num_blocks_per_seq: fixed block-table width of every bucket.
        max_seq_len_to_capture: static ``max_seq_len`` of every bucket's metadata; default
            ``max_num_blocks_per_seq * block_size``. Longer sequences are refused (vLLM runs them eagerly).
        max_num_cross_blocks: cross block-table width for encoder-decoder models; default
            ``max_num_blocks_per_seq``.

    Raises:
        ValueError: a non-positive size, or ``max_seq_len_to_capture`` above the table's capacity.
    """

    def __init__(self, *, block_size: int, max_num_blocks_per_seq: int,
                 max_seq_len_to_capture: int | None = None, max_num_cross_blocks: int | None = None):
        for name, value in (("block_size", block_size), ("max_num_blocks_per_seq", max_num_blocks_per_seq)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        capacity = block_size * max_num_blocks_per_seq
        max_len = capacity if max_seq_len_to_capture is None else max_seq_len_to_capture
        if not 1 <= max_len <= capacity:
            raise ValueError(f"max_seq_len_to_capture={max_len} must be in [1, max_num_blocks_per_seq * "
                             f"block_size={capacity}]")
        cross = max_num_blocks_per_seq if max_num_cross_blocks is None else max_num_cross_blocks
        if not isinstance(cross, (int, np.integer)) or cross < 1:
            raise ValueError(f"max_num_cross_blocks={cross!r} must be a positive int")
        self.block_size = int(block_size)
        self.max_num_blocks_per_seq = int(max_num_blocks_per_seq)
        self.max_seq_len_to_capture = int(max_len)
        self.max_num_cross_blocks = int(cross)
        self.capture_sizes: tuple[int, ...] = ()
        self._is_graph_capturing = False
        self._buffers: dict[str, np.ndarray] | None = None

    @property
    def is_graph_capturing(self) -> bool:
        """Inside :meth:`graph_capture`."""
        return self._is_graph_capturing

    @contextlib.contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator["DecodeGraphState"]:
        """Allocate the staging buffers for ``capture_batch_sizes(max_batch_size)``; capture inside.

        vLLM: ``CommonAttentionState.graph_capture``. Buffers (rows = largest capture size): slot mapping
        ``int32`` filled with ``PAD_SLOT_ID``, seq lens ``int32`` ones, block tables ``int32`` zeros
        ``[rows, max_num_blocks_per_seq]``, encoder seq lens ones, cross block tables zeros.

        Raises:
            ValueError: ``max_batch_size < 1``.
            RuntimeError: already capturing.
        """
        if self._is_graph_capturing:
            raise RuntimeError("graph_capture is already active")
        sizes = capture_batch_sizes(max_batch_size)
        rows = sizes[-1]
        self._buffers = {
            "slot_mapping": np.full(rows, PAD_SLOT_ID, np.int32),
            "seq_lens_tensor": np.ones(rows, np.int32),
            "block_tables": np.zeros((rows, self.max_num_blocks_per_seq), np.int32),
            "encoder_seq_lens_tensor": np.ones(rows, np.int32),
            "cross_block_tables": np.zeros((rows, self.max_num_cross_blocks), np.int32),
        }
        self.capture_sizes = sizes
        self._is_graph_capturing = True
        try:
            yield self
        finally:
            self._is_graph_capturing = False

    def graph_clone(self, batch_size: int) -> "DecodeGraphState":
        """A fresh state with the same configuration. vLLM: ``CommonAttentionState.graph_clone``.

        Raises:
            RuntimeError: not capturing (vLLM asserts).
        """
        del batch_size
        if not self._is_graph_capturing:
            raise RuntimeError("graph_clone is only valid inside graph_capture")
        return DecodeGraphState(block_size=self.block_size,
                                max_num_blocks_per_seq=self.max_num_blocks_per_seq,
                                max_seq_len_to_capture=self.max_seq_len_to_capture,
                                max_num_cross_blocks=self.max_num_cross_blocks)

    def graph_capture_get_metadata_for_batch(self, batch_size: int, is_encoder_decoder_model: bool = False):
        """The dummy decode metadata a bucket is compiled with (all rows are padding).

        vLLM: ``CommonAttentionState.graph_capture_get_metadata_for_batch``: slots ``PAD_SLOT_ID``, seq lens
        1, zero block tables, ``max_query_len = 1``, ``max_seq_len = max_seq_len_to_capture``; for an
        encoder-decoder model also encoder lengths 1, an empty cross slot mapping, zero cross block tables,
        ``max_encoder_seq_len = max_seq_len_to_capture`` and ``num_encoder_tokens = 0``.

        Returns:
            :class:`AttentionMetadata` (or :class:`EncoderDecoderMetadata`) with ``batch_size`` rows.

        Raises:
            RuntimeError: not capturing (vLLM asserts).
            ValueError: ``batch_size`` outside ``[1, largest capture size]``.
        """
        if not self._is_graph_capturing:
            raise RuntimeError("graph_capture_get_metadata_for_batch is only valid inside graph_capture")
        if not 1 <= batch_size <= self.capture_sizes[-1]:
            raise ValueError(f"batch_size={batch_size} must be in [1, {self.capture_sizes[-1]}]")
        md = AttentionMetadata(
            slot_mapping=jnp.full(batch_size, PAD_SLOT_ID, jnp.int32),
            seq_lens=jnp.ones(batch_size, jnp.int32),
            block_tables=jnp.zeros((batch_size, self.max_num_blocks_per_seq), jnp.int32),
            query_start_loc=jnp.arange(batch_size + 1, dtype=jnp.int32),
            max_query_len=1, max_seq_len=self.max_seq_len_to_capture)
        if not is_encoder_decoder_model:
            return md
        return EncoderDecoderMetadata(
            decoder=md, encoder_seq_lens=jnp.ones(batch_size, jnp.int32),
            cross_slot_mapping=jnp.zeros(0, jnp.int32),
            cross_block_tables=jnp.zeros((batch_size, self.max_num_cross_blocks), jnp.int32),
            max_encoder_seq_len=self.max_seq_len_to_capture, num_encoder_tokens=0)

    def get_graph_input_buffers(self) -> dict[str, np.ndarray]:
        """Read-only views of the staging buffers, by vLLM's names. vLLM: ``get_graph_input_buffers``.

        Raises:
            RuntimeError: :meth:`graph_capture` has not run yet.
        """
        buffers = self._require_buffers()
        views = {}
        for name, buf in buffers.items():
            view = buf.view()
            view.flags.writeable = False
            views[name] = view
        return views

    def _require_buffers(self) -> dict[str, np.ndarray]:
        if self._buffers is None:
            raise RuntimeError("no graph input buffers: call graph_capture(max_batch_size) first")
        return self._buffers

    def prepare_graph_input_buffers(self, attn_metadata):
        """Copy a real decode batch into the buffers and return its bucket's padded metadata.

        vLLM: ``CommonAttentionState.prepare_graph_input_buffers`` (copies seq lens and block tables, and the
        cross fields of an encoder-decoder model, into the captured graph's inputs; the runner copies the
        slot mapping). Rows ``[0, num_seqs)`` get the batch, rows ``[num_seqs, bucket)`` are reset to the
        padding values, and the bucket's slices are copied to the device (fresh arrays, so metadata
        returned earlier is never changed by a later call).

        Args:
            attn_metadata: decode-only :class:`AttentionMetadata` or :class:`EncoderDecoderMetadata`
                (concrete arrays) of ``num_seqs <= largest capture size`` rows, one token each, block
                table at most ``max_num_blocks_per_seq`` wide.

        Returns:
            Metadata of the same type with ``graph_batch_size(num_seqs)`` rows, block tables
            ``max_num_blocks_per_seq`` wide, ``max_seq_len = max_seq_len_to_capture`` (and, for an
            encoder-decoder model, the captured statics: empty cross slot mapping, ``num_encoder_tokens =
            0``, ``max_encoder_seq_len = max_seq_len_to_capture``), so its treedef matches the capture.

        Raises:
            RuntimeError: :meth:`graph_capture` has not run yet.
            ValueError: metadata that is not decode-only, too many rows, tables too wide, a sequence
                longer than ``max_seq_len_to_capture``, cross fields missing or too wide, a non-empty
                cross slot mapping (an encoder prefill is not a replayable decode step). Nothing is
                written into the buffers then.
        """
        buffers = self._require_buffers()
        enc_dec = isinstance(attn_metadata, EncoderDecoderMetadata)
        md = attn_metadata.decoder if enc_dec else attn_metadata
        num_seqs = _check_decode(md)
        bucket = graph_batch_size(num_seqs, self.capture_sizes)
        slots, seq_lens, tables = (np.asarray(a) for a in (md.slot_mapping, md.seq_lens, md.block_tables))
        if tables.shape[1] > self.max_num_blocks_per_seq:
            raise ValueError(f"attn_metadata.block_tables width {tables.shape[1]} > max_num_blocks_per_seq="
                             f"{self.max_num_blocks_per_seq}")
        if seq_lens.size and seq_lens.max() > self.max_seq_len_to_capture:
            raise ValueError(f"attn_metadata.seq_lens max {int(seq_lens.max())} > max_seq_len_to_capture="
                             f"{self.max_seq_len_to_capture}")
        if enc_dec:
            if attn_metadata.encoder_seq_lens is None or attn_metadata.cross_block_tables is None:
                raise ValueError("attn_metadata.encoder_seq_lens and cross_block_tables must be set")
            enc = np.asarray(attn_metadata.encoder_seq_lens)
            cross = np.asarray(attn_metadata.cross_block_tables)
            if enc.shape != (num_seqs,) or cross.ndim != 2 or cross.shape[0] != num_seqs:
                raise ValueError(f"attn_metadata.encoder_seq_lens.shape={enc.shape} and cross_block_tables."
                                 f"shape={cross.shape} must have num_seqs={num_seqs} rows")
            if cross.shape[1] > self.max_num_cross_blocks:
                raise ValueError(f"attn_metadata.cross_block_tables width {cross.shape[1]} > "
                                 f"max_num_cross_blocks={self.max_num_cross_blocks}")
            cross_slots = attn_metadata.cross_slot_mapping
            if cross_slots is not None and cross_slots.shape[0] != 0:
                raise ValueError(f"attn_metadata.cross_slot_mapping.shape={cross_slots.shape}: a replayed "
                                 "decode step writes no encoder token (vLLM captures decode steps only)")
            if enc.size and enc.max() > self.max_seq_len_to_capture:
                raise ValueError(f"attn_metadata.encoder_seq_lens max {int(enc.max())} > "
                                 f"max_seq_len_to_capture={self.max_seq_len_to_capture}")

        def fill(name: str, real: np.ndarray, pad_value: int) -> jax.Array:
            buf = buffers[name]  # [rows] or [rows, width]; rows past the bucket are left alone
            buf[:bucket] = pad_value
            if buf.ndim == 1:
                buf[:num_seqs] = real
            else:
                buf[:num_seqs, : real.shape[1]] = real
            return jnp.array(buf[:bucket], copy=True)  # a copy: later fills never alias it

        decoder = AttentionMetadata(
            slot_mapping=fill("slot_mapping", slots, PAD_SLOT_ID),
            seq_lens=fill("seq_lens_tensor", seq_lens, 1),
            block_tables=fill("block_tables", tables, 0),
            query_start_loc=jnp.arange(bucket + 1, dtype=jnp.int32),
            max_query_len=1, max_seq_len=self.max_seq_len_to_capture)
        if not enc_dec:
            return decoder
        return EncoderDecoderMetadata(
            decoder=decoder, encoder_seq_lens=fill("encoder_seq_lens_tensor", enc, 1),
            cross_slot_mapping=jnp.zeros(0, jnp.int32),
            cross_block_tables=fill("cross_block_tables", cross, 0),
            max_encoder_seq_len=self.max_seq_len_to_capture, num_encoder_tokens=0)
