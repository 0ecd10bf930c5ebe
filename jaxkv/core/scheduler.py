"""Continuous-batching scheduler: which requests run this step, with how many tokens each.

vLLM: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule`` / ``update_from_output``) and
``vllm/v1/core/sched/utils.py`` (``check_stop``). One loop per step, on the host:

1. running requests first, in admission order: each gets ``num_tokens - num_computed_tokens`` tokens (1
   while decoding; a prefill chunk otherwise), capped by ``long_prefill_token_threshold`` and the step's
   token budget ``max_num_batched_tokens``; blocks are allocated on demand; when none is free the most
   recently admitted running request is preempted (``policy="priority"``: the one with the largest
   ``(priority, arrival)``) (recompute: blocks freed, back to the front of the waiting queue (priority: to
   its place by priority), its generated tokens kept; ``preemption_mode="swap"`` with a host tier: its blocks are
   copied to host blocks instead and come back when it resumes, no token recomputed, falling back to
   recompute when the host pool is full);
2. then, if nothing was preempted, waiting requests in arrival order (priority: by ``(priority, arrival)``)
   while the budget, ``max_num_seqs``
   and the free blocks allow (prefix-cache hits skip their cached tokens; with a host tier, hits in its
   prefix cache after the device's hits are copied back and skipped too; a swapped-out request is
   swapped back in); with ``async_loads`` a request whose blocks come from the host tier waits for the copy
   (``WAITING_FOR_REMOTE_KVS``, holding its seat and blocks) while the others run, and runs from the pass
   after its load has landed (:meth:`Scheduler.finish_loading`), as vLLM's KV connectors' loads do;
3. a step in which every running request decodes and no waiting request could be admitted runs up to
   ``num_scheduler_steps`` decode steps on the device (vLLM v0's multi-step scheduling), never more than
   the fewest tokens a running request has left while requests wait, so admission is not delayed by a
   length-capped request finishing inside the loop (a request ending on a stop token frees its seat
   only when the loop returns). ``max_admission_delay_steps > 0`` also lets an admissible waiting
   request wait that many decode steps in total for such a loop, and a loop run while loads are in flight
   (a load that lands during it joins after it: at most that many steps in all; with 0, no loop runs while
   a load is in flight).
"""

from __future__ import annotations

import dataclasses
import time

from jaxkv.core.host_kv_pool import has_host_blocks
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.request_queue import SCHEDULING_POLICIES, make_waiting_queue


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Scheduler limits (vLLM ``SchedulerConfig`` names).

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most new tokens in one step (the token budget).
        max_model_len: longest sequence, prompt + output, in tokens.
        long_prefill_token_threshold: a request gets at most this many prompt tokens per step (0 = only
            the budget limits it).
        num_scheduler_steps: most decode steps per host round trip (1 = one step per round trip).
        max_admission_delay_steps: decode steps a waiting request that could be admitted may wait so
            that running requests decode in a device loop first (0 = admit at the next step, as vLLM;
            > 0 trades that much admission latency for fewer host round trips).
        preemption_mode: ``"recompute"`` (free the blocks, prefill again on resume; vLLM V1's only mode)
            or ``"swap"`` (copy the blocks to the KV-cache manager's host tier and back; vLLM V0's names).
        policy: ``"fcfs"`` (arrival order; the most recently admitted request is preempted first) or
            ``"priority"`` (vLLM's: waiting requests by ``(priority, arrival)``, smaller first; the running request
            with the largest ``(priority, arrival)`` is preempted first; :mod:`jaxkv.core.request_queue`).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0
    num_scheduler_steps: int = 8
    max_admission_delay_steps: int = 0
    preemption_mode: str = "recompute"
    policy: str = "fcfs"

    def __post_init__(self):
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} is not one of 'recompute', 'swap'")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {SCHEDULING_POLICIES}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_admission_delay_steps < 0:
            raise ValueError(f"max_admission_delay_steps={self.max_admission_delay_steps} must be >= 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                             f"{self.max_num_seqs}: a step could not give every running request a token")


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan. vLLM: ``SchedulerOutput``.

    Attributes:
        scheduled: ``(request, num_new_tokens)`` in batch order; in a multi-step decode, the number of
            decode steps that request runs (``<= num_decode_steps``).
        num_decode_steps: 0 = one mixed step (prefill chunks and decodes); ``k >= 1`` = a pure-decode
            device loop of ``k`` steps.
        preempted: requests preempted while scheduling.
        context_lens: per row, tokens computed before this step (the step's first position).
        gen_idx: per row, index among the request's outputs of the first token this step samples.
        pending_input: per row, whether its input token is still being sampled by the previous
            (dispatched, not yet fetched) step: the runner takes it from that step's device output.
        samples: per row, tokens this step samples for the request (0 for a prompt chunk that does not
            finish the known tokens).
        blocks_to_swap_out: ``(device_block, host_block)`` copies to issue before this step (swap
            preemption, blocks evicted from the device prefix cache), all before ``blocks_to_swap_in``.
        blocks_to_swap_in: ``(host_block, device_block)`` copies to issue before this step (swap-ins,
            host prefix-cache hits). vLLM V0: ``SchedulerOutputs.blocks_to_swap_out`` / ``_in``.
        loads: with ``async_loads``, the requests that began waiting for a load this pass (not in
            ``scheduled``): each one's ``(host_block, device_block)`` copies are in ``request.kv_load_pairs``,
            to start after this pass's ``blocks_to_swap_out``.
    """

    scheduled: list[tuple[Request, int]]
    num_decode_steps: int = 0
    preempted: list[Request] = dataclasses.field(default_factory=list)
    context_lens: list[int] = dataclasses.field(default_factory=list)
    gen_idx: list[int] = dataclasses.field(default_factory=list)
    pending_input: list[bool] = dataclasses.field(default_factory=list)
    samples: list[int] = dataclasses.field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    loads: list[Request] = dataclasses.field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting queue, running list, the step loop's decisions; owns no device state.

    Args:
        config: the limits.
        kv_cache_manager: the blocks (and the optional host tier).
        async_loads: host→device copies (swap-ins, host prefix hits) run outside the pass: the request
            waits in :attr:`loading` until the engine calls :meth:`finish_loading` (default: the copies
            are this pass's ``blocks_to_swap_in``, issued before its step).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, *, async_loads: bool = False):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting = make_waiting_queue(config.policy)  # a deque (fcfs) or kept in priority order
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, waiting for their host→device load (async_loads)
        self.num_preemptions = 0
        self.num_swap_fallbacks = 0  # swap preemptions that recomputed: the host pool was full
        self.host_pool = getattr(kv_cache_manager, "host_pool", None)
        if config.preemption_mode == "swap" and self.host_pool is None:
            raise ValueError("preemption_mode='swap' needs a host tier (kv_offloading_size > 0)")
        self._admission_delayed = 0  # decode steps run while an admissible request waited
        self.async_loads = bool(async_loads) and self.host_pool is not None
        kv_cache_manager.async_loads = self.async_loads
        self._loads: list[Request] = []  # requests that began loading in this pass

    # -- queues ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` (stop, length or abort): out of the queues, blocks back at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.loading:
            # its blocks are freed now: the load that would fill them is cancelled before it lands (the
            # engine never copies it in; the host blocks it reads stay held until it has read them)
            self.loading.remove(request)
            if request.kv_load is not None:
                request.kv_load.cancel()
        request.status = status
        self.kv_cache_manager.free(request)

    def finish_loading(self, request: Request) -> None:
        """``request``'s load has landed (the copy into its device blocks is dispatched, before any later
        step): its host hits join the device prefix cache and it runs from this pass on."""
        self.loading.remove(request)
        request.kv_load = request.kv_load_pairs = None
        self.kv_cache_manager.finish_load(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    # -- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if any(r.needs_known_history and r.num_output_placeholders and r.grammar is None for r in self.running):
            # a request whose sampling reads its own last tokens (bad words of several tokens) is in the step in flight:
            # nothing is scheduled until its tokens are back, so every request runs together again (a device
            # loop when all decode) instead of two halves alternating one step each. A structured output (one
            # step per token anyway) only sits out the steps dispatched before its token is back; the others
            # keep overlapping the host with the device
            out = SchedulerOutput([], 0, [])
        else:
            out = self._try_schedule_decode_loop()
            if out is None:
                out = self._schedule_mixed()
        if self.host_pool is not None:
            out.blocks_to_swap_out, out.blocks_to_swap_in = self.host_pool.end_pass()
        out.loads, self._loads = self._loads, []
        return self._commit(out)

    def _commit(self, out: SchedulerOutput) -> SchedulerOutput:
        """Advance every scheduled request as if its step already ran (vLLM V1 advances
        ``num_computed_tokens`` at scheduling); the tokens it will sample become placeholders."""
        now = None
        for req, n in out.scheduled:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now = now or time.monotonic()
            out.context_lens.append(req.num_computed_tokens)
            out.gen_idx.append(req.num_output_tokens + req.num_output_placeholders)
            out.pending_input.append(req.num_output_placeholders > 0)
            req.num_computed_tokens += n
            if out.num_decode_steps:
                samples = n
            else:
                samples = int(req.num_computed_tokens >= req.num_tokens_with_placeholders)
            req.num_output_placeholders += samples
            out.samples.append(samples)
        return out

    def _schedule_mixed(self) -> SchedulerOutput:
        cfg, kv = self.config, self.kv_cache_manager
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.remaining_tokens <= 0 or (req.needs_known_history and req.num_output_placeholders):
                # only waits for its last (dispatched) token; or its sampling reads its own tokens, the last
                # of which is still being sampled: it runs once that token is back
                i += 1
                continue
            n = self._num_new_tokens(req, req.num_computed_tokens, budget)
            while not kv.allocate_slots(req, n):
                j = self._victim_index()
                victim = self.running.pop(j)
                if j < i:  # (priority) a request already in this step: out of it again, its tokens back
                    i -= 1
                    k = next((k for k, (r, _) in enumerate(scheduled) if r is victim), None)
                    if k is not None:
                        budget += scheduled.pop(k)[1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req preempted itself: the requests after it wait (fcfs: they were preempted first)

        if not preempted:
            self._admission_delayed = 0
            while self.waiting and budget > 0 and len(self.running) + len(self.loading) < cfg.max_num_seqs:
                req = self.waiting[0]
                if req.num_output_placeholders:  # preempted while its token was in flight: next step
                    break
                if req.host_block_ids is not None:  # swapped out: back from the host, nothing recomputed
                    n = self._num_new_tokens(req, req.num_computed_tokens, budget)
                    n = n if kv.swap_in(req, n) else None
                else:
                    n = self._admit(req, budget)
                if n is None:
                    break
                self.waiting.popleft()
                if self.async_loads and (pairs := self.host_pool.take_swap_ins()):
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    req.kv_load_pairs = pairs  # the engine starts the load (request.kv_load)
                    self.loading.append(req)
                    self._loads.append(req)
                    continue
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append((req, n))
                budget -= n
        # one-token rows first (stable): the attention op runs them on the decode kernel as a leading block
        # (jaxkv.attention.dispatch._leading_decodes_apart), as vLLM's model runner reorders decodes first for FlashInfer/MLA
        scheduled.sort(key=lambda rn: rn[1] != 1)
        return SchedulerOutput(scheduled, 0, preempted)

    def _victim_index(self) -> int:
        """Where in :attr:`running` the next request to preempt is: the most recently admitted (fcfs), or the
        largest ``(priority, arrival)`` (priority; vLLM's choice)."""
        if self.config.policy == "fcfs":
            return len(self.running) - 1
        return max(range(len(self.running)), key=lambda j: (self.running[j].priority, self.running[j].arrival_index))

    def _admit(self, req: Request, budget: int) -> int | None:
        """Blocks for a waiting request (prefix-cache hits first: the device's, then, with a host tier, the
        host's); sets its computed tokens; returns the tokens it runs this step, ``None`` when blocks are
        short. When the host hits' blocks and the step's new tokens do not fit together, it tries the
        device hits alone."""
        kv = self.kv_cache_manager
        for use_host in ((True, False) if self.host_pool is not None else (False,)):
            options = dict(use_host=True) if use_host else {}  # (a data-parallel manager has no host tier)
            hits, num_hit_tokens = kv.get_computed_blocks(req, **options)
            n = self._num_new_tokens(req, num_hit_tokens, budget)
            if kv.allocate_slots(req, n, hits):
                break
            if not has_host_blocks(hits):  # without host hits the device-only try would fail the same way
                return None
        else:
            return None
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_prompt_tokens is None:  # first admission: prefix-cache statistics
            req.num_cached_prompt_tokens = num_hit_tokens
            kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
        return n

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        n = req.num_tokens_with_placeholders - num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return min(n, budget)

    def _preempt(self, req: Request) -> None:
        """vLLM recompute preemption: blocks freed, front of the waiting queue, outputs kept. In swap mode
        the blocks go to the host tier instead and the computed tokens stay (recompute when it is full)."""
        swapped = False
        if self.config.preemption_mode == "swap" and req.num_computed_tokens:
            swapped = self.kv_cache_manager.swap_out(req)
            self.num_swap_fallbacks += not swapped
        if not swapped:
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _try_schedule_decode_loop(self) -> SchedulerOutput | None:
        """A pure-decode device loop when every running request decodes and no waiting request can be
        admitted (or may still be held back by ``max_admission_delay_steps``)."""
        cfg = self.config
        # a structured output's mask comes from the host for each token: one whose last token is in flight sits
        # the loop out, one whose token is back decodes once in it (its mask for that step); the others loop
        live = [r for r in self.running if r.remaining_tokens > 0
                and not (r.host_grammar and r.num_output_placeholders)]
        if not live or any(r.num_tokens_with_placeholders - r.num_computed_tokens != 1 for r in live):
            return None
        if any(r.needs_known_history and r.num_output_placeholders for r in live):
            return None  # such a request waits for its token: a mixed step runs the others
        if all(r.host_grammar for r in live):
            return None  # only structured outputs: one mixed step, no idle loop iterations
        remaining = [1 if r.host_grammar else r.remaining_tokens for r in live]
        if not self.waiting and not self.loading:
            k, delayed = min(cfg.num_scheduler_steps, max(remaining)), 0
        else:
            # steps that delay no admission: none when the head could be admitted now or a load may land (its
            # request joins at the next pass), else until the first running request reaches its length cap
            # (its seat frees then); beyond them, at most max_admission_delay_steps in all
            admissible = bool(self.loading) or (len(self.running) < cfg.max_num_seqs and self._can_admit_head())
            free_steps = 0 if admissible else min(r.remaining_tokens for r in live)
            allowed = cfg.max_admission_delay_steps - self._admission_delayed
            k = min(cfg.num_scheduler_steps, max(remaining), max(free_steps, allowed))
            if k < 1:
                return None  # admit now: a mixed step
            delayed = max(0, k - free_steps)
        steps = [min(k, rem) for rem in remaining]
        kv = self.kv_cache_manager
        for req, s in zip(live, steps):
            if not kv.allocate_slots(req, s):
                # short of blocks for the loop (blocks already taken stay with their requests and are
                # used by the next steps): fall back to single steps, which preempt as needed
                return None
        self._admission_delayed += delayed
        return SchedulerOutput(list(zip(live, steps)), k, [])

    def _can_admit_head(self) -> bool:
        req = self.waiting[0]
        if req.num_output_placeholders:
            return False
        if req.host_block_ids is not None:
            budget = self.config.max_num_batched_tokens - len(self.running)
            n = self._num_new_tokens(req, req.num_computed_tokens, budget)
            kv = self.kv_cache_manager
            return n > 0 and kv.num_blocks_to_swap_in(req, n) <= kv.num_free_blocks
        hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(req)
        n = self._num_new_tokens(req, num_hit_tokens, self.config.max_num_batched_tokens - len(self.running))
        return n > 0 and self.kv_cache_manager.can_allocate(req, n, hits)

    # -- after the step ------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled) -> list[Request]:
        """Apply a step's sampled tokens; return the requests that got a token or finished.

        Args:
            output: the plan the step ran (already committed by :meth:`schedule`).
            sampled: per scheduled row, its sampled tokens as a list of Python ints (one per decode step
                in a device loop, else one); only the first ``output.samples[row]`` count.
        """
        touched = []
        for (req, _), tokens, expected in zip(output.scheduled, sampled, output.samples):
            if req.is_finished:  # stopped by an earlier step's token, or aborted: a wasted token
                continue
            req.num_output_placeholders -= expected
            req.new_token_ids = new = self._append(req, tokens[:expected])
            if req.is_finished:
                self._remove(req)
            else:
                self.kv_cache_manager.cache_blocks(req)
            if new or req.is_finished:
                touched.append(req)
        return touched

    def _remove(self, req: Request) -> None:
        """A request that just finished leaves its queue; its computed full blocks are offered to the
        prefix cache, then every block is given back."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.block_ids:
            self.kv_cache_manager.cache_blocks(req)
        self.kv_cache_manager.free(req)

    @staticmethod
    def _append(req: Request, tokens: list[int]) -> list[int]:
        """vLLM ``check_stop`` over one row's sampled ``tokens``, in order: a stop token or EOS (counted only
        once ``min_tokens`` are generated; kept as the request's last token, as vLLM keeps it) ends the
        request, then the length cap. Appends the kept tokens (one list extend; the per-token scan runs only
        when a token could stop it) and returns them."""
        room = req.max_tokens - req.num_output_tokens
        stop_at = None
        if not req.stop_ids_for_min_tokens.isdisjoint(tokens):
            first_counted = req.sampling_params.min_tokens - req.num_output_tokens - 1  # vLLM: once num_output >= min
            stop_at = next((i for i, t in enumerate(tokens)
                            if i >= first_counted and t in req.stop_ids_for_min_tokens), None)
        if stop_at is not None and stop_at < room - 1:  # before the length cap (vLLM checks the length first)
            kept = tokens[:stop_at + 1]
            token = tokens[stop_at]
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None if token in req.eos_token_ids else token  # EOS (checked first, as vLLM): none
        else:
            kept = tokens[:room]
            if len(kept) == room:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        req.append_output_tokens(kept)
        return kept
