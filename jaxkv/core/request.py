"""A request's host-side state through the scheduler. vLLM: ``vllm/v1/request.py``."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxkv.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle: WAITING → [WAITING_FOR_REMOTE_KVS →] RUNNING → (PREEMPTED → RUNNING …) → FINISHED_*.
    vLLM: ``RequestStatus`` (``WAITING_FOR_REMOTE_KVS``: a KV connector's load in flight)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # admitted; its blocks are being copied in from the host tier
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # everything after PREEMPTED is finished (vLLM orders the enum the same way)
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        """``"stop"`` / ``"length"`` / ``"abort"`` (vLLM's ``FinishReason`` strings), ``None`` if live."""
        return _FINISH_REASONS.get(int(status))


_FINISH_REASONS = {int(RequestStatus.FINISHED_STOPPED): "stop", int(RequestStatus.FINISHED_LENGTH_CAPPED): "length",
                   int(RequestStatus.FINISHED_ABORTED): "abort"}


class LogprobStore:
    """A request's generated tokens' logprobs as slices of the steps' host arrays (no per-token Python objects
    until an output needs them): chunks of ``ids`` ``int32[n, 1 + k]`` (the chosen token, then the top ``k``),
    ``logprobs`` ``f32[n, 1 + k]`` and ``ranks`` ``int32[n]`` (the chosen token's)."""

    __slots__ = ("chunks", "count")

    def __init__(self):
        self.chunks: list[tuple] = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, ids, logprobs, ranks) -> None:
        self.chunks.append((ids, logprobs, ranks))
        self.count += len(ranks)

    def arrays(self, start: int = 0):
        """``(ids, logprobs, ranks)`` of positions ``start..``, concatenated (NumPy)."""
        import numpy as np
        if not self.chunks:
            return np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32), np.zeros(0, np.int32)
        ids, lps, ranks = (np.concatenate([c[i] for c in self.chunks]) for i in range(3))
        return ids[start:], lps[start:], ranks[start:]

    def cumulative(self) -> float:
        return float(sum(c[1][:, 0].astype("float64").sum() for c in self.chunks))


class Request:
    """One generation request: its tokens, how many of them are in the cache, and its blocks.

    vLLM V1's single-counter model: ``num_computed_tokens`` counts tokens whose K/V are in the cache;
    every step schedules ``num_tokens - num_computed_tokens`` (or a chunk of it): the whole prompt on
    admission, one token while decoding, prompt + generated tokens again after a preemption.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt.
        sampling_params: how to sample and stop.
        output_token_ids: generated tokens; a stop token or EOS that ended it is the last (vLLM).
        all_token_ids: prompt + output.
        num_computed_tokens: tokens whose K/V are in the cache or are being written by a dispatched step
            (advanced when a step is scheduled, as vLLM V1 does).
        num_output_placeholders: tokens that dispatched steps will sample for it (async scheduling: the
            next step is scheduled before they are back).
        block_ids: the request's physical blocks, logical order (hybrid groups: the first group's).
        group_block_ids: hybrid KV-cache groups only: per group, its blocks in logical order (the null
            block where a sliding window skipped one); ``None`` otherwise.
        block_hashes: chained hashes of the full blocks of ``all_token_ids`` (filled lazily).
        num_cached_blocks: leading blocks already offered to the prefix cache.
        cached_block_ids: blocks the request holds through the prefix cache (released, not freed).
        arrival_index: order of ``add_request`` calls.
        priority: with ``scheduling_policy="priority"``, smaller runs first (vLLM's ``priority``; ties by arrival).
        seed: the PRNG seed its tokens are sampled with (the params' seed or one drawn by the engine).
        max_tokens: the tokens it may generate (``sampling_params.max_tokens`` capped by the model length).
        stop_ids_for_min_tokens: every token that would end it (EOS unless ``ignore_eos``, and
            ``stop_token_ids``; both fixed at construction): masked while fewer than ``min_tokens`` were
            generated.
        stop_reason: the stop token that ended it, if any.
        num_cached_prompt_tokens: prompt tokens served from the prefix cache at its first admission.
        host_block_ids: swapped out (swap preemption): per KV-cache group, the host block holding each of
            its logical blocks (``None`` where a sliding window had replaced it by the null block); its
            ``num_computed_tokens`` stay valid. ``None`` otherwise.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: "SamplingParams", *,
                 arrival_index: int, seed: int, max_model_len: int, eos_token_ids: frozenset[int],
                 priority: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.group_block_ids: list[list[int]] | None = None  # hybrid KV-cache groups: one list per group
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.cached_block_ids: set[int] = set()
        self.host_block_ids: list[list[int | None]] | None = None
        # WAITING_FOR_REMOTE_KVS: the (host, device) blocks to load, and the engine's load of them in flight
        self.kv_load_pairs: list[tuple[int, int]] | None = None
        self.kv_load = None  # jaxkv.worker.kv_offload.KVLoad
        self.pending_prefix: list[tuple[list, list[int]]] = []  # host hits to cache once the load lands
        self.arrival_index = arrival_index
        self.priority = priority
        self.seed = seed
        room = max_model_len - len(self.prompt_token_ids)
        wanted = sampling_params.max_tokens
        self.max_tokens = room if wanted is None else min(wanted, room)
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_ids_for_min_tokens = self.eos_token_ids | self.stop_token_ids
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.num_cached_prompt_tokens: int | None = None
        self.new_token_ids: list[int] = []  # tokens of the last step
        self.num_output_placeholders = 0  # tokens sampled by dispatched steps, not yet back
        self.logits: list = []  # per generated token, only when the engine returns logits
        self.final_only = False  # an engine core sends its tokens once, at the end (vLLM FINAL_ONLY)
        # logprobs of its generated tokens, as the steps' arrays (LogprobStore; materialized for an output)
        self.logprobs: LogprobStore | None = LogprobStore() if sampling_params.logprobs is not None else None
        # prompt logprobs of positions 1.. computed so far (the prompt is never taken from the prefix cache)
        self.prompt_logprobs: list[tuple[list[int], list[float], int]] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        self.num_prompt_logprobs_sent = 0  # of them, already in an output
        self.num_logprobs_sent = 0
        # n > 1: the parent's id and this completion's index (the engine's id is child_request_id's)
        self.parent_id: str = request_id
        self.index = 0
        self._multi_token_bad_words = any(len(seq) > 1 for seq in (sampling_params.bad_words_token_ids or ()))
        self.penalty_slot: int | None = None  # penalties: its row of the runner's device counts while it runs
        # structured outputs: the request's matcher (jaxkv.core.structured_output.Grammar), its bitmask width;
        # its rows run one step per pass (the mask of each token comes from the host), unless grammar_in_step:
        # its masks come from a callback inside each step (ModelRunner.use_step_masks) and it runs like any row
        self.grammar = None
        self.grammar_words = 0
        self.grammar_in_step = False
        # any sampling option beyond temperature / top-k / top-p / min_tokens: the runner's fast path skips
        # every per-feature check for a batch without one
        sp = sampling_params
        self.sampling_special = bool(sp.min_p > 0 or sp.has_penalties or sp.logit_bias or sp.allowed_token_ids
                                     or sp.bad_words_token_ids or sp.logprobs is not None
                                     or sp.prompt_logprobs is not None or sp.structured_outputs is not None)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # set by the scheduler (queue time)
        self.queue_time_sent = False
        self.grammar_future = None  # its compiled grammar (concurrent.futures.Future), shared by its n completions
        self._token_buffer = None  # all_token_ids as int32, grown on demand (penalties' history)

    @property
    def needs_known_history(self) -> bool:
        """Its sampling reads its own last tokens on the host (bad words of several tokens, structured outputs
        whose masks the host fills): it is scheduled only when all of them are known (never with an input token
        still being sampled); penalties count tokens on the device, masks inside the step advance on the host in
        device order, and neither needs such a wait."""
        return self._multi_token_bad_words or (self.sampling_params.structured_outputs is not None
                                               and not self.grammar_in_step)

    @property
    def host_grammar(self) -> bool:
        """A structured output whose masks the host fills per dispatch: one token per pass, scheduled only
        with its last token known."""
        return self.grammar is not None and not self.grammar_in_step

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position's logits: the prompt is computed, never looked up
        (vLLM does the same)."""
        return self.prompt_logprobs is not None

    def token_array(self):
        """``all_token_ids`` as an ``int32`` NumPy array (a view of a buffer extended as tokens arrive)."""
        import numpy as np
        n = len(self.all_token_ids)
        buf = self._token_buffer
        if buf is None or len(buf[0]) < n:
            arr = np.zeros(max(64, 2 * n), np.int32)
            arr[:n] = self.all_token_ids
            self._token_buffer = buf = [arr, n]
        elif buf[1] < n:
            buf[0][buf[1]:n] = self.all_token_ids[buf[1]:n]
            buf[1] = n
        elif buf[1] > n:  # tokens were taken back (not expected): rebuild
            buf[0][:n] = self.all_token_ids
            buf[1] = n
        return buf[0][:n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def remaining_tokens(self) -> int:
        """Tokens it may still be scheduled to generate (by ``max_tokens`` and the model length; tokens
        of dispatched steps not back yet count as generated)."""
        return self.max_tokens - self.num_output_tokens - self.num_output_placeholders

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    def hashes_of_full_blocks(self, num_tokens: int, block_size: int) -> list[int]:
        """Chained hashes of the full blocks of ``all_token_ids[:num_tokens]``, extended incrementally;
        equal to :func:`jaxkv.core.prefix_cache.block_hashes` of those tokens."""
        full = num_tokens // block_size
        if len(self.block_hashes) < full:
            prev = self.block_hashes[-1] if self.block_hashes else None
            for b in range(len(self.block_hashes), full):
                prev = hash((prev, tuple(self.all_token_ids[b * block_size:(b + 1) * block_size])))
                self.block_hashes.append(prev)
        return self.block_hashes[:full]

    def append_output_tokens(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        self.all_token_ids.extend(tokens)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_ids)})")

