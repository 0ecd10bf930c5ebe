"""The request-level engine: add requests, abort them, step, read outputs. Model-agnostic.

vLLM: ``vllm/v1/engine/core.py`` (``EngineCore.step``: schedule → execute → update) and the offline
``LLMEngine`` (``add_request``, ``abort_request``, ``step``, ``has_unfinished_requests``). One step:

1. :meth:`Scheduler.schedule` picks requests and token counts, allocating blocks on demand;
2. :class:`ModelRunner` pads the flat batch to a bucket and dispatches the jitted step (cache donated);
3. the host blocks only on the sampled tokens (``int32`` per request, or per request and decode step);
4. :meth:`Scheduler.update_from_output` appends them, checks stops, frees finished requests' blocks.

Timing: ``stats.device_wait_s`` sums the host's blocking waits for results; ``stats.device_idle_s``
bounds from above the time the device had no program queued: from the moment a result was fetched (the
device was busy until then) to the end of the next dispatch, counted only when at that moment the device
has nothing left to run (always in synchronous mode; with ``async_scheduling`` only when the step queued
behind is already done). It does not see gaps between the kernels of one program (launch overhead), which
a profiler or the driver's utilization counter does (``scripts/bench_throughput.py --nvml-busy``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import sys
import time
from typing import Iterable

import numpy as np

from jaxkv.core.grammar_dfa import DFAGrammar
from jaxkv.core.host_kv_pool import HostBlockPool
from jaxkv.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.scheduler import Scheduler, SchedulerConfig
from jaxkv.core.structured_output import accept_tokens
from jaxkv.engine.protocol import EngineCoreOutput, LogprobsLists, child_request_id
from jaxkv.kv_cache.specs import SlidingWindowSpec
from jaxkv.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from jaxkv.sampling_params import SamplingParams
from jaxkv.worker.kv_offload import KVLoad, KVOffloader, num_host_blocks_for
from jaxkv.worker.model_runner import ModelFn, ModelRunner

log = logging.getLogger(__name__)
# the interpreter's thread switch interval once a request's masks come from host callbacks inside the steps: with
# one busy Python thread beside them, a callback cost 2.3-2.7 ms a step at 0.5 ms and 0.9-1.2 ms at 0.1 ms (0.4-0.5
# ms with no other thread; H200, scripts/dev/probe_loop_callback.py, session 30)
GIL_SWITCH_INTERVAL_S = 0.0001


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (``LLMEngine.stats``).

    Attributes:
        num_running, num_waiting: requests in each queue now.
        kv_cache_usage: share of blocks held by live requests (0..1).
        num_preemptions: preemptions so far (recompute and swap).
        prefix_cache_hit_rate: prompt tokens found cached (on the device or in the host tier) / prompt
            tokens looked up (first admissions).
        num_compiles: jitted-step compilations so far; ``num_buckets`` bounds it.
        steps: host round trips (``step()`` calls that ran the model); ``model_steps`` counts decode-loop
            iterations individually.
        num_generated_tokens: tokens appended to outputs; ``num_prompt_tokens_computed``: prompt (and
            re-prefill) tokens run through the model.
        step_s: wall seconds inside ``step()``; ``device_wait_s``: of which blocked on device results;
            ``device_idle_s``: an upper bound of the time the device had nothing queued (from the last
            fetched result, when the device was busy, to a dispatch that found nothing queued or the
            queued step already done).
        decode_s, decode_steps, decode_tokens: the same for pure-decode loops only, excluding calls that
            compiled.
        schedule_s, execute_s, update_s: the host's part of ``step_s`` by phase: scheduling, building and
            dispatching the step's inputs, applying the sampled tokens (outputs included).
        transfer_s, call_s: of ``execute_s`` (warm-up included), the input transfers and the time inside
            the jitted calls (which return at once unless the program makes the host wait).
        num_host_blocks: blocks of the host tier (0: no tier); ``host_kv_cache_usage``: share of them
            holding data (swapped-out requests' blocks or the host prefix cache's), 0..1.
        num_swaps_out, num_swaps_in: requests swapped out to / in from the host tier;
            ``num_blocks_swapped_out`` / ``_in``: their blocks.
        num_swap_recompute_fallbacks: swap preemptions that recomputed instead (the host pool was full).
        num_blocks_offloaded: blocks evicted from the device prefix cache and kept in the host tier.
        num_host_prefix_hit_tokens: tokens whose blocks came back from the host prefix cache.
        kv_offload_bytes_to_host, kv_offload_bytes_to_device: bytes of the blocks copied each way.
        kv_offload_copy_s: seconds of the engine thread spent issuing those copies and waiting for them
            (device time is not seen here; a profiler trace shows it).
        kv_offload_write_s: seconds of the host tier's writer thread writing arrived blocks into the pool.
        kv_offload_load_s: seconds of its loader thread gathering host blocks and starting their transfers
            to the device (the requests they are for wait, the others step).
        step_mask_calls, step_mask_wait_s: structured outputs' masks inside the steps
            (``structured_outputs_in_step``): the steps whose masks the host computed, and the seconds the
            second callback waited for them after the forward pass (the fill the device did not hide).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_compiles: int
    num_buckets: int
    steps: int
    model_steps: int
    num_generated_tokens: int
    num_prompt_tokens_computed: int
    step_s: float
    device_wait_s: float
    device_idle_s: float
    decode_s: float
    decode_steps: int
    decode_tokens: int
    schedule_s: float = 0.0
    execute_s: float = 0.0
    update_s: float = 0.0
    transfer_s: float = 0.0
    call_s: float = 0.0
    num_host_blocks: int = 0
    host_kv_cache_usage: float = 0.0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_swap_recompute_fallbacks: int = 0
    num_blocks_offloaded: int = 0
    num_host_prefix_hit_tokens: int = 0
    kv_offload_bytes_to_host: int = 0
    kv_offload_bytes_to_device: int = 0
    kv_offload_copy_s: float = 0.0
    kv_offload_write_s: float = 0.0
    kv_offload_load_s: float = 0.0
    step_mask_calls: int = 0
    step_mask_wait_s: float = 0.0

    @property
    def gpu_idle_share(self) -> float:
        """Upper bound of the device's idle share of ``step()`` time: ``device_idle_s / step_s``."""
        return self.device_idle_s / self.step_s if self.step_s > 0 else float("nan")

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def _check_params(request_id: str, params: SamplingParams, *, vocab_size: int | None, max_logprobs: int) -> None:
    """What :class:`SamplingParams` cannot check alone: token ids against the vocabulary, logprobs against
    ``max_logprobs``, fields this engine does not implement (refused, never ignored).

    Raises:
        ValueError: naming the request, the field and the value.
    """
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= max_logprobs:
            raise ValueError(f"request_id={request_id!r}: {name}={k} must be in [0, max_logprobs={max_logprobs}]")
    if params.has_penalties and vocab_size is None:
        raise ValueError(f"request_id={request_id!r}: presence/frequency/repetition penalties need the engine's "
                         "vocab_size (LLMEngine(vocab_size=...))")
    if params.bad_words and params.bad_words_token_ids is None:
        raise ValueError(f"request_id={request_id!r}: bad_words={params.bad_words!r} need their token ids "
                         "(SamplingParams.with_bad_words_tokenized: the engine has no tokenizer)")
    if vocab_size is None:
        return
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids),
                      ("bad_words", [t for seq in params.bad_words_token_ids or () for t in seq])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"request_id={request_id!r}: {name} has token ids {bad[:4]} outside the vocabulary "
                             f"[0, {vocab_size})")


def _lists(entries) -> LogprobsLists | None:
    """Prompt-logprob rows ``(ids, logprobs, rank)`` as :class:`LogprobsLists` (``None`` for none)."""
    if not entries:
        return None
    return LogprobsLists.from_arrays([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])


def _store_lists(store, start: int = 0) -> LogprobsLists:
    """Positions ``start..`` of a request's :class:`jaxkv.core.request.LogprobStore` as :class:`LogprobsLists`."""
    return LogprobsLists.from_arrays(*store.arrays(start))


def _dicts(lists: LogprobsLists) -> list[dict[int, Logprob]]:
    """Logprob rows as vLLM's ``{token_id: Logprob}`` per position (chosen token first; no text)."""
    return list(FlatLogprobs(lists.token_ids, lists.logprobs, lists.ranks))


STEP_TRACE_ENV = "JAXKV_STEP_TRACE"


class LLMEngine:
    """Continuous batching over a paged KV cache, driving any ``model_fn``.

    Args:
        model_fn: ``(params, input_ids, positions, kv_caches, metadata, logits_indices) ->
            (f32[num_logits, vocab] logits, kv_caches)``, traceable by ``jax.jit``.
        params: pytree passed to ``model_fn`` (not donated).
        kv_caches: one ``[2, num_blocks, num_kv_heads, block_size, head_size]`` cache per layer; the
            engine owns them from now on (donated to every step).
        block_size: tokens per block.
        max_model_len: longest sequence (prompt + output) in tokens.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: the step's token budget (prefill chunks + decodes).
        enable_prefix_caching: reuse computed full blocks across requests and re-prefills (vLLM V1 default).
        eos_token_id: an id or a set of ids that end a request unless ``ignore_eos``; ``None``: none.
        long_prefill_token_threshold: most prompt tokens a request gets per step (0 = budget only).
        num_scheduler_steps: most decode steps run on the device per host round trip.
        max_admission_delay_steps: decode steps an admissible waiting request may be held back so that
            running requests decode in a device loop (0 = admit at the next step, vLLM's behaviour).
        async_scheduling: schedule and dispatch step N+1 before fetching step N's tokens (vLLM V1 async
            scheduling); the pending tokens are read on the device.
        seed: draws the seeds of requests whose ``SamplingParams.seed`` is ``None``.
        max_num_stop_token_ids: most EOS + stop tokens of a request with ``min_tokens > 0``.
        return_logits: keep every sampled token's logits (``CompletionOutput.logits``; tests only).
        kv_cache_groups: the model's KV-cache groups (``KVCacheConfig.kv_cache_groups``); with more than one
            (a hybrid model), every request gets one block table per group (:class:`HybridKVCacheManager`)
            and ``model_fn`` receives a tuple of metadata, one per group; ``kv_caches`` are then the
            config's tensors (shared by one layer of each group). ``None``: one group.
        check_kernel_inputs: debug mode: check every attention call's metadata and written slots on the
            device (checkify) and raise ``ValueError`` at the first violation (slower: no overlap).
        mesh: a :func:`jaxkv.parallel.mesh.make_mesh` mesh (``dp == 1``) the model and caches are sharded over
            for tensor parallelism (``model_fn`` attends through it). Data parallelism is one engine per
            rank, each in its own process (:mod:`jaxkv.engine.core_client`).
        kv_offloading_size: GiB of host memory for the KV cache's host tier (vLLM V1's
            ``--kv-offloading-size``; ``None``: no tier): host blocks with the device cache's layout
            (:mod:`jaxkv.worker.kv_offload`). With prefix
            caching, full blocks evicted from the device prefix cache are kept there (least recently used
            out first) and a prompt's prefix lookup continues there after the device's hits (copied back
            before the step); with ``preemption_mode="swap"`` preempted requests' blocks go there.
            Single-device caches only (hybrid groups included: blocks are kept per ``(group, hash)``).
        preemption_mode: ``"recompute"`` (default; vLLM V1's behaviour) or ``"swap"`` (vLLM V0's: a
            preempted request's blocks are copied to the host tier and back when it resumes, without
            recomputing; when the tier is full it recomputes, counted in
            ``stats.num_swap_recompute_fallbacks``). ``"swap"`` needs ``kv_offloading_size``.
        vocab_size: the model's vocabulary: token ids of requests (``logit_bias``, ``allowed_token_ids``,
            stop tokens, bad words) are checked against it (``None``: not checked).
        max_logprobs: most ``logprobs`` / ``prompt_logprobs`` per token a request may ask for (vLLM's).
        structured_outputs: a :class:`jaxkv.core.structured_output.StructuredOutputManager` for the model's
            tokenizer (``None``: requests with ``structured_outputs`` are refused).
        scheduling_policy: ``"fcfs"`` (default) or ``"priority"`` (vLLM's ``--scheduling-policy``: requests'
            ``priority`` orders admission and preemption; :class:`jaxkv.core.scheduler.SchedulerConfig`).
        structured_outputs_in_step: a constrained request's masks are computed inside each step (host callbacks
            per step: :meth:`jaxkv.worker.model_runner.ModelRunner.use_step_masks`), so it decodes in device
            loops like any request instead of one token per pass (one device only; no vLLM counterpart).

    Raises:
        ValueError: non-positive sizes, caches that disagree with ``block_size``, ``max_num_seqs >
            max_num_batched_tokens``, a bad ``preemption_mode`` or ``kv_offloading_size``, swap without a
            host tier, a host tier with a mesh.
    """

    def __init__(self, model_fn: ModelFn, params, kv_caches, *, block_size: int, max_model_len: int,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, eos_token_id: int | Iterable[int] | None = None,
                 long_prefill_token_threshold: int = 0, num_scheduler_steps: int = 8,
                 max_admission_delay_steps: int = 0, async_scheduling: bool = False, seed: int = 0,
                 max_num_stop_token_ids: int = 8, return_logits: bool = False,
                 check_kernel_inputs: bool = False, kv_cache_groups=None, mesh=None,
                 kv_offloading_size: float | None = None, preemption_mode: str = "recompute",
                 vocab_size: int | None = None, max_logprobs: int = 20, structured_outputs=None,
                 scheduling_policy: str = "fcfs", structured_outputs_in_step: bool = False):
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      long_prefill_token_threshold=long_prefill_token_threshold,
                                      num_scheduler_steps=num_scheduler_steps,
                                      max_admission_delay_steps=max_admission_delay_steps,
                                      preemption_mode=preemption_mode, policy=scheduling_policy)
        if preemption_mode == "swap" and not kv_offloading_size:
            raise ValueError(f"preemption_mode='swap' needs a host tier: kv_offloading_size={kv_offloading_size!r}")
        if kv_offloading_size is not None and mesh is not None:
            raise ValueError(f"kv_offloading_size={kv_offloading_size} with a mesh {dict(mesh.shape)}: the host "
                             "tier supports single-device caches only")
        self.mesh = mesh
        if mesh is not None and mesh.shape.get("dp", 1) > 1:
            raise ValueError(f"mesh with dp={mesh.shape['dp']}: data-parallel ranks are engines of their own "
                             "(engine-core processes, LLM(data_parallel_size=...)); an engine's mesh has dp == 1")
        self.runner = ModelRunner(model_fn, params, kv_caches, block_size=block_size,
                                  max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  num_scheduler_steps=num_scheduler_steps,
                                  max_num_stop_token_ids=max_num_stop_token_ids, return_logits=return_logits,
                                  check_kernel_inputs=check_kernel_inputs,
                                  num_kv_cache_groups=len(kv_cache_groups or ()) or 1, max_logprobs=max_logprobs,
                                  vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.structured_outputs = structured_outputs
        if structured_outputs is not None and structured_outputs_in_step:
            self.runner.use_step_masks(structured_outputs.bitmask_words)
        if structured_outputs is not None and structured_outputs.backend != "guidance":
            self.runner.use_dfa_tables(structured_outputs.new_tables())
        self._fsm_waiting: list[Request] = []  # requests whose grammar is compiling (vLLM WAITING_FOR_FSM)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_groups = tuple(kv_cache_groups or ())
        self.offloader = None
        self.host_pool = None
        if kv_offloading_size is not None:
            num_host_blocks = num_host_blocks_for(kv_offloading_size, self.runner.kv_caches)
            self.offloader = KVOffloader(self.runner.kv_caches, num_host_blocks)
            self.host_pool = HostBlockPool(num_host_blocks)
        self.kv_cache_manager = self._new_kv_cache_manager(enable_prefix_caching)
        # host → device copies as loads beside the steps; JAXKV_ASYNC_KV_LOADS=0 issues them inside the pass
        # instead, before its step (the A side of A/B measurements)
        self._async_loads = self.offloader is not None and os.environ.get("JAXKV_ASYNC_KV_LOADS", "1") != "0"
        self.scheduler = Scheduler(self.config, self.kv_cache_manager, async_loads=self._async_loads)
        self._loads: list[tuple[Request, KVLoad]] = []  # host → device loads in flight (cancelled ones too)
        if eos_token_id is None:
            self.eos_token_ids = frozenset()
        elif isinstance(eos_token_id, (int, np.integer)):
            self.eos_token_ids = frozenset({int(eos_token_id)})
        else:
            self.eos_token_ids = frozenset(int(t) for t in eos_token_id)
        self.return_logits = return_logits
        self.async_scheduling = async_scheduling
        self._inflight = None  # (SchedulerOutput, StepResult) dispatched, tokens not fetched yet
        self._busy_until = None
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        # n > 1: each parent's completions (by index), those waiting for the first one's prompt to be
        # computed (they then take its blocks from the prefix cache), and finished ones of final_only parents
        self._children: dict[str, list[Request]] = {}
        self._held: dict[str, list[Request]] = {}
        self._done_children: dict[str, dict[int, Request]] = {}
        self._arrivals = 0
        self._seed_rng = np.random.default_rng(seed)
        # $JAXKV_STEP_TRACE (a folder): one record per round trip, written by write_step_trace (docs/serving.md)
        self._step_trace: list[tuple] | None = [] if os.environ.get(STEP_TRACE_ENV) else None
        self._arrival_trace: list[tuple] = []  # (time, prompt tokens, max_tokens, n) per request, when tracing
        self._counters = dict(steps=0, model_steps=0, num_generated_tokens=0, num_prompt_tokens_computed=0,
                              step_s=0.0, device_wait_s=0.0, device_idle_s=0.0, decode_s=0.0, decode_steps=0, decode_tokens=0,
                              schedule_s=0.0, execute_s=0.0, update_s=0.0)

    # -- properties ------------------------------------------------------------------------------------
    @property
    def _per_group_blocks(self) -> bool:
        """Several KV-cache groups, or one sliding-window group (Mistral): the hybrid manager's per-group
        block lists, with the blocks that leave a window freed."""
        return len(self.kv_cache_groups) > 1 or any(isinstance(g.kv_cache_spec, SlidingWindowSpec)
                                                    for g in self.kv_cache_groups)

    @property
    def kv_caches(self):
        return self.runner.kv_caches

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    @property
    def num_buckets(self) -> int:
        return self.runner.num_buckets

    @property
    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(num_running=len(self.scheduler.running),
                           num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
                           kv_cache_usage=kv.usage, num_preemptions=self.scheduler.num_preemptions,
                           prefix_cache_hit_rate=kv.prefix_cache_hit_rate, num_compiles=self.num_compiles,
                           num_buckets=self.num_buckets, transfer_s=self.runner.transfer_s,
                           call_s=self.runner.call_s, **self._counters, **self._host_tier_stats(),
                           **self._step_mask_stats())

    def _step_mask_stats(self) -> dict:
        masks = self.runner.step_masks
        return {} if masks is None else dict(step_mask_calls=masks.num_calls, step_mask_wait_s=masks.wait_s)

    def _host_tier_stats(self) -> dict:
        host, off = self.host_pool, self.offloader
        if host is None:
            return {}
        return dict(num_host_blocks=host.num_blocks, host_kv_cache_usage=host.usage,
                    num_swaps_out=host.num_swaps_out, num_swaps_in=host.num_swaps_in,
                    num_blocks_swapped_out=host.num_blocks_swapped_out,
                    num_blocks_swapped_in=host.num_blocks_swapped_in,
                    num_swap_recompute_fallbacks=self.scheduler.num_swap_fallbacks,
                    num_blocks_offloaded=host.num_blocks_offloaded,
                    num_host_prefix_hit_tokens=host.num_host_prefix_hit_tokens,
                    kv_offload_bytes_to_host=off.bytes_to_host, kv_offload_bytes_to_device=off.bytes_to_device,
                    kv_offload_copy_s=off.copy_s, kv_offload_write_s=off.write_s, kv_offload_load_s=off.load_s)

    def warmup(self, max_workers: int | None = None, top_k_top_p: bool = False, run: bool | None = None,
               executable_cache=None, structured_outputs: bool = False) -> None:
        """Compile every bucket before serving (so no request pays for a compile), ``max_workers``
        compiles at a time (default: one per CPU core); afterwards ``num_compiles == num_buckets``.
        ``top_k_top_p``: also the buckets' programs for batches with a top-k/top-p request (otherwise
        compiled when first needed; ``num_compiles == 2 * num_buckets`` then). ``run``: run each bucket
        once on a dummy batch too (default: except on CPU; :meth:`ModelRunner.warmup`).
        ``executable_cache``: a :class:`jaxkv.worker.executable_cache.ExecutableCache` to load the
        programs from (a warm start traces none of them) and store new ones in. ``structured_outputs``: also
        each of those programs with a grammar bitmask (twice the programs), so a constrained request compiles
        nothing while serving (the server's default: ``--compile-structured-outputs``).

        Raises:
            ValueError: ``structured_outputs=True`` on an engine without a structured-output manager.
        """
        if structured_outputs and self.structured_outputs is None:
            raise ValueError("warmup(structured_outputs=True) needs LLMEngine(structured_outputs=...)")
        words = self.structured_outputs.bitmask_words if structured_outputs else None
        self.runner.warmup(max_workers, top_k_top_p, run, executable_cache=executable_cache, bitmask_words=words)
        if self.offloader is not None:  # the host tier's copy programs, one per padded size
            self.runner.kv_caches = self.offloader.warmup(self.runner.kv_caches)

    # -- RL: new weights between generations, the device's memory lent to a trainer ----------------------
    def get_params(self):
        """The model's parameters as ``model_fn`` takes them (the engine's own device arrays)."""
        return self.runner.get_params()

    def update_weights(self, params) -> None:
        """Generate with ``params`` from now on (vLLM's weight-sync hook, ``load_weights``): a pytree of the
        model's structure (:meth:`get_params`'), e.g. a JAX trainer's arrays; they stay on the device (moved
        device to device only onto the engine's shardings) and no step is traced or compiled again. The
        prefix cache is reset: cached blocks hold the old weights' K/V.

        Raises:
            ValueError: requests are unfinished, or the pytree's structure, shapes or dtypes differ.
        """
        self._require_idle("update_weights")
        self.runner.set_params(params)
        self.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache's device memory (and the weights': level 1 keeps a host copy, level 2 discards
        them) for a trainer; the prefix cache is reset. vLLM ``LLM.sleep``.

        Raises:
            ValueError: requests are unfinished, already asleep, or a bad level.
        """
        self._require_idle("sleep")
        if self.offloader is not None:
            raise ValueError("sleep with a host KV tier (kv_offloading_size) is not supported")
        self.reset_prefix_cache()
        self.runner.sleep(level)

    def wake_up(self) -> None:
        """Undo :meth:`sleep`: a zeroed KV cache and the weights back. vLLM ``LLM.wake_up``.

        Raises:
            ValueError: not asleep, or level 2 and no :meth:`update_weights` since.
        """
        self.runner.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self.runner.is_sleeping

    def _require_idle(self, what: str) -> None:
        while (self._inflight is not None or self._loads) and not self.scheduler.has_unfinished_requests():
            self.step()
        if self.has_unfinished_requests():
            raise ValueError(f"{what}: {self.get_num_unfinished_requests()} requests are unfinished")

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM ``LLM.reset_prefix_cache``).

        Raises:
            ValueError: requests are still running or waiting.
        """
        while (self._inflight is not None or self._loads) and not self.scheduler.has_unfinished_requests():
            self.step()  # a step dispatched for requests that have finished since, or cancelled loads still reading
        if self.has_unfinished_requests():
            raise ValueError(f"{self.get_num_unfinished_requests()} requests are unfinished")
        if self.host_pool is not None:
            self.host_pool.reset_prefix_cache()
        self.kv_cache_manager = self._new_kv_cache_manager(self.kv_cache_manager.prefix_cache is not None)
        old = self.scheduler
        self.scheduler = Scheduler(self.config, self.kv_cache_manager, async_loads=self._async_loads)
        self.scheduler.num_preemptions = old.num_preemptions
        self.scheduler.num_swap_fallbacks = old.num_swap_fallbacks

    def _new_kv_cache_manager(self, enable_prefix_caching: bool):
        if self._per_group_blocks:
            return HybridKVCacheManager(self.kv_cache_groups, self.runner.num_blocks,
                                        enable_prefix_caching=enable_prefix_caching, host_pool=self.host_pool)
        return KVCacheManager(self.runner.num_blocks, self.block_size, enable_prefix_caching=enable_prefix_caching,
                              host_pool=self.host_pool)

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    *, final_only: bool = False, priority: int = 0) -> None:
        """Queue a request (WAITING). vLLM: ``LLMEngine.add_request``. ``priority`` orders the waiting queue
        with ``scheduling_policy="priority"`` (smaller first, ties by arrival; vLLM's).

        ``final_only``: :meth:`step_core_outputs` reports it only when it finishes (vLLM
        ``RequestOutputKind.FINAL_ONLY``).

        Raises:
            ValueError: a live request with this id, an empty prompt, a prompt of ``>= max_model_len``
                tokens, a request whose longest sequence needs more blocks than the whole cache, too
                many stop tokens for ``min_tokens``, or ``priority != 0`` under ``scheduling_policy="fcfs"``
                (vLLM's rule); nothing changes.
        """
        if priority != 0 and self.config.policy != "priority":
            raise ValueError(f"request_id={request_id!r}: priority={priority} needs scheduling_policy='priority' "
                             f"(this engine's is {self.config.policy!r})")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params={sampling_params!r} is not a SamplingParams")
        if self.runner.is_sleeping:
            raise ValueError(f"request_id={request_id!r}: the engine is asleep (wake_up first)")
        _check_params(request_id, sampling_params, vocab_size=self.vocab_size, max_logprobs=self.max_logprobs)
        if request_id in self._requests or request_id in self._children:
            raise ValueError(f"request_id={request_id!r} is already running or waiting")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request_id={request_id!r}: prompt_token_ids is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"request_id={request_id!r}: the prompt has {len(prompt)} tokens; "
                             f"max_model_len={self.max_model_len} leaves no room to generate")
        grammar = None
        if sampling_params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise ValueError(f"request_id={request_id!r}: structured_outputs need the model's tokenizer; this "
                                 "engine was built without one")
            grammar = self.structured_outputs.compile(sampling_params.structured_outputs)  # raises if invalid
        n = sampling_params.n
        seed = sampling_params.seed
        if seed is None:
            seed = int(self._seed_rng.integers(0, 2 ** 32))
        reqs = []
        for i in range(n):
            # completion i: seed + i; only the first computes the prompt's logprobs (the others share its blocks)
            params = sampling_params if i == 0 else sampling_params.replace(prompt_logprobs=None)
            rid = request_id if n == 1 else child_request_id(request_id, i)
            req = Request(rid, prompt, params, arrival_index=self._arrivals, seed=seed + i,
                          max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, priority=priority)
            req.parent_id, req.index, req.final_only = request_id, i, final_only
            req.grammar_future = grammar
            reqs.append(req)
        req = reqs[0]
        longest = req.num_prompt_tokens + req.max_tokens
        need = self.kv_cache_manager.max_num_blocks(longest, self.config.max_num_batched_tokens)
        if need > self.kv_cache_manager.num_blocks:
            raise ValueError(f"request_id={request_id!r} needs {need} blocks ({longest} tokens), the cache "
                             f"has {self.kv_cache_manager.num_blocks} in all")
        if sampling_params.min_tokens and len(req.stop_ids_for_min_tokens) > self.runner.max_num_stop_token_ids:
            raise ValueError(f"request_id={request_id!r}: {len(req.stop_ids_for_min_tokens)} EOS/stop token "
                             f"ids with min_tokens > 0; max_num_stop_token_ids="
                             f"{self.runner.max_num_stop_token_ids}")
        self._arrivals += 1
        if self._step_trace is not None:
            self._arrival_trace.append((time.perf_counter(), req.num_prompt_tokens, req.max_tokens, n))
        for r in reqs:
            self._requests[r.request_id] = r
        if grammar is None:
            self.scheduler.add_request(req)
        else:
            self._fsm_waiting.append(req)
            self._admit_compiled()
        if n > 1:
            self._children[request_id] = reqs
            self._held[request_id] = reqs[1:]

    def _attach_grammar(self, req: Request) -> bool:
        """Give ``req`` its own matcher once its grammar compiled; False while it compiles. A grammar that
        failed to compile ends the request (aborted; the error is logged)."""
        future = req.grammar_future
        if future is None or req.grammar is not None:
            return True
        if not future.done():
            return False
        try:
            grammar = self.structured_outputs.grammar(future.result())
            if isinstance(grammar, DFAGrammar):
                if not self.runner.hold_dfa(grammar.dfa):
                    # no room beside the running requests' automata: llguidance's masks for this one
                    log.info("request %s: the automata's tables are full: llguidance's masks", req.request_id)
                    self.structured_outputs.num_fallbacks += 1
                    req.grammar_future = self.structured_outputs.compile(req.sampling_params.structured_outputs,
                                                                         backend="guidance")
                    return self._attach_grammar(req)
                grammar.held = True
            req.grammar = grammar
            req.grammar_words = self.structured_outputs.bitmask_words
            # its masks come from inside the steps: an automaton's on the device, llguidance's by callbacks
            req.grammar_in_step = grammar.on_device or self.runner.step_masks is not None
            if (not grammar.on_device and req.grammar_in_step
                    and sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S):
                # a step's callbacks (and the mask worker) need the GIL while this thread may be preparing the next
                # step in Python: a waiting thread gets it after at most the switch interval (5 ms by default, more
                # than a SmolLM2 step), so it is shortened for the process once constrained requests run
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        except Exception as e:  # noqa: BLE001 - validated at add_request: a library failure
            log.error("request %s: its grammar did not compile: %s", req.request_id, e)
            self.abort_request(req.request_id)
        return True

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled join the scheduler's queue (vLLM: out of WAITING_FOR_FSM)."""
        waiting = []
        for req in self._fsm_waiting:
            if req.is_finished:
                continue
            if self._attach_grammar(req):
                if not req.is_finished:
                    self.scheduler.add_request(req)
            else:
                waiting.append(req)
        self._fsm_waiting = waiting

    def _release_held(self) -> None:
        """Completions 1.. of an ``n > 1`` request join the queue once the first one's prompt is computed (its
        full blocks are in the prefix cache then: they compute only the prompt's last partial block)."""
        for parent, held in list(self._held.items()):
            first = self._children[parent][0]
            if first.num_output_tokens or first.is_finished:
                for req in held:
                    if not req.is_finished:
                        self._attach_grammar(req)  # compiled already: the first completion ran
                        self.scheduler.add_request(req)
                del self._held[parent]

    def add_requests(self, requests: Iterable[tuple[str, list[int], SamplingParams, bool]]) -> None:
        """Queue ``(request_id, prompt_token_ids, sampling_params, final_only[, priority])`` requests: all or
        none.

        Raises:
            ValueError: what :meth:`add_request` raises for one of them; none of them is then queued
                (and no output is produced for them).
        """
        added: list[str] = []
        try:
            for rid, prompt, params, final_only, *priority in requests:
                self.add_request(rid, prompt, params, final_only=final_only, priority=priority[0] if priority else 0)
                added.append(rid)
        except ValueError:
            aborted = len(self._aborted)
            self.abort_request(added)
            del self._aborted[aborted:]  # rolled back, not aborted: no output for them
            raise

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Finish requests as aborted and free their blocks now; unknown ids are ignored. Their final
        output (``finish_reason="abort"``) comes with the next :meth:`step`."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for req in ([c for c in self._children[rid]] if rid in self._children else [self._requests.get(rid)]):
                if req is None or self._requests.pop(req.request_id, None) is None:
                    continue
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
                self._release(req)
                req.new_token_ids = []
                self._aborted.append(req)

    def _release(self, req: Request) -> None:
        """A finished request's device state: its slot, and its automaton's hold on the tables."""
        self.runner.release_slot(req)
        if getattr(req.grammar, "held", False):
            req.grammar.held = False
            self.runner.dfa_tables.release(req.grammar.dfa)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting, loading or running, a dispatched step not fetched, or a cancelled load that has
        not read its host blocks yet (steps release them)."""
        return (self.scheduler.has_unfinished_requests() or self._inflight is not None or bool(self._loads)
                or bool(self._held) or bool(self._fsm_waiting))

    def get_num_unfinished_requests(self) -> int:
        return (self.scheduler.get_num_unfinished_requests() + sum(map(len, self._held.values()))
                + len(self._fsm_waiting))

    # -- the loop ---------------------------------------------------------------------------------------
    def step(self, *, final_only: bool = False) -> list[RequestOutput]:
        """Schedule, run the model once (one mixed step or a decode loop), apply the tokens.

        With ``async_scheduling``, the next step is scheduled and dispatched before this step's tokens
        are fetched, so the host's work overlaps the device's; a request that ends on a stop token then
        costs one discarded step of work.

        Args:
            final_only: return only finished requests (vLLM ``RequestOutputKind.FINAL_ONLY``, what the
                offline ``LLM`` uses; saves building an output per running request per step).

        Returns:
            A :class:`RequestOutput` for every request that got tokens or finished (aborts included).
        """
        aborted, touched = self.step_requests()
        outs = []
        for req in aborted + touched:
            if req.parent_id == req.request_id:  # n == 1
                if req.is_finished or not final_only:
                    outs.append(self._output([req]))
            elif not final_only:
                outs.append(self._output([req]))
            elif req.is_finished:  # n > 1, final only: once every completion finished
                done = self._done_children.setdefault(req.parent_id, {})
                done[req.index] = req
                if len(done) == len(self._children[req.parent_id]):
                    del self._done_children[req.parent_id]
                    del self._children[req.parent_id]
                    outs.append(self._output([done[i] for i in sorted(done)]))
        for req in aborted + touched:  # streamed n > 1 parents: forgotten once every completion finished
            children = self._children.get(req.parent_id)
            if children is not None and not final_only and all(c.is_finished for c in children):
                del self._children[req.parent_id]
        return outs

    def write_step_trace(self) -> str | None:
        """With ``$JAXKV_STEP_TRACE`` set to a folder: write this engine's round trips there as JSON lines
        (``step-trace-PID.jsonl``) and return the path; ``None`` without it. Each record: ``t0`` / ``t1``
        (``time.perf_counter`` seconds of the round trip), ``steps`` (decode-loop length; 0: a mixed step),
        ``rows`` and ``tokens`` scheduled, ``generated`` tokens, ``running`` / ``waiting`` requests after it,
        ``arrivals`` (requests added so far); then one record per request in arrival order: ``arrival`` time,
        ``prompt_tokens``, ``max_tokens``, ``n``; last a ``clock`` record (``perf_counter`` and ``time.time()`` read
        together) that puts the records on the wall clock. A maintainer's tool (``scripts/dev/step_trace.py``)."""
        folder = os.environ.get(STEP_TRACE_ENV)
        if not folder or self._step_trace is None:
            return None
        import json
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"step-trace-{os.getpid()}.jsonl")
        keys = ("t0", "t1", "steps", "rows", "tokens", "generated", "running", "waiting", "arrivals")
        with open(path, "w") as f:
            for rec in self._step_trace:
                f.write(json.dumps(dict(zip(keys, rec))) + "\n")
            for t, prompt, max_tokens, n in self._arrival_trace:
                f.write(json.dumps(dict(arrival=t, prompt_tokens=prompt, max_tokens=max_tokens, n=n)) + "\n")
            f.write(json.dumps(dict(clock=dict(perf_counter=time.perf_counter(), time=time.time()))) + "\n")
        return path

    def step_core_outputs(self) -> list[EngineCoreOutput]:
        """:meth:`step` as an engine-core process sends it: only token ids (and logprobs), one
        :class:`EngineCoreOutput` per completion that got tokens or finished; a request added with
        ``final_only`` appears once per completion, when it finishes, with all its tokens."""
        aborted, touched = self.step_requests()
        outs = []
        for req in aborted + touched:
            finished = req.is_finished
            if req.final_only and not finished:
                continue
            new = list(req.output_token_ids) if req.final_only else req.new_token_ids
            new_lp = None
            if req.logprobs is not None:
                start = 0 if req.final_only else req.num_logprobs_sent
                if len(req.logprobs) > start:
                    new_lp = _store_lists(req.logprobs, start)
                req.num_logprobs_sent = len(req.logprobs)
            new_plp = None
            if req.prompt_logprobs is not None and req.num_prompt_logprobs_sent < len(req.prompt_logprobs):
                new_plp = _lists(req.prompt_logprobs[req.num_prompt_logprobs_sent:])
                req.num_prompt_logprobs_sent = len(req.prompt_logprobs)
            queue_time = None
            if not req.queue_time_sent and req.first_scheduled_time is not None:
                queue_time = req.first_scheduled_time - req.arrival_time
                req.queue_time_sent = True
            outs.append(EngineCoreOutput(
                req.parent_id, new, RequestStatus.get_finished_reason(req.status) if finished else None,
                req.stop_reason, req.num_cached_prompt_tokens or 0, None, req.index, new_lp, new_plp, queue_time))
            if finished and req.parent_id in self._children and all(c.is_finished for c in self._children[req.parent_id]):
                del self._children[req.parent_id]
        return outs

    def step_requests(self) -> tuple[list[Request], list[Request]]:
        """One step (see :meth:`step`); returns ``(aborted, touched)``: the requests aborted since the
        last step and those that got tokens in this one (finished ones included), without building
        outputs."""
        t0 = time.perf_counter()
        aborted, self._aborted = self._aborted, []
        compiles = self.num_compiles
        c = self._counters
        t_sched = t_exec = 0.0
        if self._fsm_waiting:
            self._admit_compiled()
        if self._inflight is None:
            self._land_loads()
            sched = self.scheduler.schedule()
            self._copy_blocks(sched)
            t_sched = time.perf_counter() - t0
            if sched.is_empty:
                self._busy_until = None
                if self._loads:  # only loads in flight: wait a little for one instead of spinning
                    self._loads[0][1].wait(0.005)
                elif self._fsm_waiting:  # only grammars compiling: likewise
                    concurrent.futures.wait([self._fsm_waiting[0].grammar_future], timeout=0.005)
                return aborted, []
            t = time.perf_counter()
            self._inflight = (sched, self._execute(sched, None))
            t_exec = time.perf_counter() - t
            self._note_idle(None)  # nothing was queued: the device idled from the last result to now
        sched, result = self._inflight
        self._inflight = None
        if self.async_scheduling:
            t = time.perf_counter()
            self._land_loads()
            nxt = self.scheduler.schedule()
            self._copy_blocks(nxt)
            t_mid = time.perf_counter()
            t_sched += t_mid - t
            if not nxt.is_empty:
                self._inflight = (nxt, self._execute(nxt, (sched, result)))
                t_exec += time.perf_counter() - t_mid
                self._note_idle(result)
        t_wait = time.perf_counter()
        tokens = np.asarray(result.tokens)  # the one blocking wait per step
        logits = None if result.logits is None else np.asarray(result.logits)
        logprobs = None
        if result.logprobs is not None:  # one [..., 1 + K] array of ids and one of logprobs for every row at once
            lp = {k: np.asarray(v) for k, v in result.logprobs.items()}
            top = "top_ids" in lp
            logprobs = (np.concatenate([tokens[..., None], lp["top_ids"]], -1) if top else tokens[..., None],
                        np.concatenate([lp["logprob"][..., None], lp["top_logprobs"]], -1) if top
                        else lp["logprob"][..., None], lp["rank"])
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(sched, {k: np.asarray(v) for k, v in result.prompt_logprobs.items()})
        t_back = time.perf_counter()
        self._busy_until = t_back  # the device was busy until this result came back
        if self.offloader is not None:
            self.offloader.poll()
        loop = sched.num_decode_steps
        # Python ints per row in one conversion (not one int() per token in the scheduler)
        sampled = tokens.T.tolist() if loop else tokens[:, None].tolist()
        lens_before = [req.num_output_tokens for req, _ in sched.scheduled]
        touched = self.scheduler.update_from_output(sched, sampled)
        if logprobs is not None:  # row-major views, [rows, steps, 1 + K] and [rows, steps]: one slice per request
            lp_ids, lp_vals, lp_ranks = ((a.swapaxes(0, 1) if loop else a[:, None]) for a in logprobs)
        generated = 0
        constrained = []                                   # (request, its new tokens): their grammars advance at once
        for r, (req, _) in enumerate(sched.scheduled):
            got = req.num_output_tokens - lens_before[r]
            generated += got
            if logits is not None and got:
                req.logits.extend(logits[:got, r] if loop else logits[r:r + 1])
            if logprobs is not None and got and req.logprobs is not None:  # views of the step's rows
                k = 1 + req.sampling_params.logprobs
                req.logprobs.add(lp_ids[r, :got, :k], lp_vals[r, :got, :k], lp_ranks[r, :got])
            if got and req.host_grammar:
                constrained.append((req, req.new_token_ids))
            elif got and req.grammar is not None and req.grammar.on_device:
                # the device masked and advanced it: the host follows (to start a slot over after a preemption)
                if not req.grammar.accept(req.output_token_ids[req.grammar.num_consumed:]) and not req.is_finished:
                    log.error("request %s: a token outside its grammar (%s): aborted", req.request_id,
                              req.grammar.rejected)
                    self.abort_request(req.request_id)
            elif req.grammar_in_step and req.grammar.rejected and not req.is_finished:
                # (not the matcher's own error: the step masks' worker may be advancing it right now)
                log.error("request %s: a token outside its grammar (%s): aborted", req.request_id,
                          req.grammar.rejected)
                self.abort_request(req.request_id)
        if constrained:
            for (req, toks), ok in zip(constrained, accept_tokens((req.grammar, toks) for req, toks in constrained)):
                if not ok:
                    log.error("request %s: token %s outside its grammar (%s): aborted", req.request_id, toks,
                              req.grammar.error)
                    self.abort_request(req.request_id)
        if self._held:
            self._release_held()
        c["steps"] += 1
        c["model_steps"] += max(1, loop)
        c["num_generated_tokens"] += generated
        if not loop:
            c["num_prompt_tokens_computed"] += sum(n for (_, n), k in zip(sched.scheduled, sched.samples)
                                                   if n > 1 or not k)
        for req in touched:
            if req.is_finished:
                self._requests.pop(req.request_id, None)
                self._release(req)
        if not self.has_unfinished_requests():
            self._busy_until = None  # no work left: idle time until the next request is not the host's
        t1 = time.perf_counter()
        if self._step_trace is not None:
            self._step_trace.append((t0, t1, loop, len(sched.scheduled), sum(n for _, n in sched.scheduled),
                                     generated, len(self.scheduler.running), len(self.scheduler.waiting),
                                     self._arrivals))
        c["step_s"] += t1 - t0
        c["device_wait_s"] += t_back - t_wait
        c["schedule_s"] += t_sched
        c["execute_s"] += t_exec
        c["update_s"] += t1 - t_back
        if loop and self.num_compiles == compiles:
            c["decode_s"] += t1 - t0
            c["decode_steps"] += loop
            c["decode_tokens"] += generated
        return aborted, touched

    @staticmethod
    def _record_prompt_logprobs(sched, lp: dict) -> None:
        """The prompt logprobs a mixed step computed, appended to each request in position order."""
        at = 0
        for req, first, count in getattr(sched, "plp_rows", ()):
            if req.prompt_logprobs is not None and len(req.prompt_logprobs) == first:
                k = req.sampling_params.prompt_logprobs
                sel = slice(at, at + count)
                targets = req.prompt_token_ids[first + 1:first + 1 + count]
                ids = lp["top_ids"][sel, :k].tolist() if k else [[]] * count
                lps = lp["top_logprobs"][sel, :k].tolist() if k else [[]] * count
                req.prompt_logprobs.extend(([tok, *i], [c, *v], rk) for tok, i, v, c, rk in zip(
                    targets, ids, lps, lp["logprob"][sel].tolist(), lp["rank"][sel].tolist()))
            at += count

    def _copy_blocks(self, sched) -> None:
        """Before a schedule's step (and after every step dispatched before it): its preempted requests give
        their penalty slots back (one re-admitted later starts its row over), then the host tier's copies it
        asked for: device to host first, then the loads it began (host to device beside the steps; see
        :mod:`jaxkv.core.host_kv_pool`)."""
        for req in sched.preempted:
            self.runner.release_slot(req)
        if sched.blocks_to_swap_out:
            self.offloader.swap_out(self.runner.kv_caches, sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self.runner.kv_caches = self.offloader.swap_in(self.runner.kv_caches, sched.blocks_to_swap_in)
        for req in sched.loads:
            req.kv_load = self.offloader.start_load(req.kv_load_pairs)
            self._loads.append((req, req.kv_load))

    def _land_loads(self) -> None:
        """Before a pass: scatter every load that is on the device into the caches (its request runs from
        this pass on); release the host blocks of every gathered one (cancelled ones included)."""
        if not self._loads:
            return
        keep = []
        for req, load in self._loads:
            if load.cancelled:  # the request ended: never scattered, its device blocks are free already
                if load.gathered:
                    self.host_pool.release(load.host_blocks)
                    continue
            elif load.ready:
                self.runner.kv_caches = self.offloader.finish_load(self.runner.kv_caches, load)
                self.host_pool.release(load.host_blocks)
                self.scheduler.finish_loading(req)
                continue
            keep.append((req, load))
        self._loads = keep

    def _note_idle(self, queued) -> None:
        """Right after a dispatch (input preparation included): if the device had nothing else to run
        (no ``queued`` result, or it is ready by now), it has been idle at most since the last moment it
        was known busy (a fetched result). Gaps between kernels inside one program are not counted."""
        if self._busy_until is not None and (queued is None or queued.tokens.is_ready()):
            self._counters["device_idle_s"] += time.perf_counter() - self._busy_until

    def _execute(self, sched, prev):
        src_rows = prev_tokens = None
        if prev is not None and any(sched.pending_input):
            prev_sched, prev_result = prev
            row_of = {id(req): r for r, (req, _) in enumerate(prev_sched.scheduled)}
            src_rows = [row_of[id(req)] if pending else -1
                        for (req, _), pending in zip(sched.scheduled, sched.pending_input)]
            prev_tokens = prev_result.last
        if sched.num_decode_steps:
            return self.runner.execute_decode(sched, src_rows, prev_tokens)
        return self.runner.execute_mixed(sched, src_rows, prev_tokens)

    def _output(self, reqs: list[Request]) -> RequestOutput:
        """The :class:`RequestOutput` of one request's completions ``reqs`` (one, or all ``n`` once finished)."""
        completions = []
        for req in reqs:
            finished = req.is_finished
            lp = None if req.logprobs is None else _dicts(_store_lists(req.logprobs))
            completions.append(CompletionOutput(
                index=req.index, token_ids=list(req.output_token_ids), new_token_ids=list(req.new_token_ids),
                finish_reason=RequestStatus.get_finished_reason(req.status), stop_reason=req.stop_reason,
                logprobs=lp, cumulative_logprob=None if lp is None else req.logprobs.cumulative(),
                logits=np.stack(req.logits) if finished and req.logits else None))
        first = next((r for r in reqs if r.prompt_logprobs is not None), None)
        if first is None and reqs[0].parent_id in self._children:
            first = self._children[reqs[0].parent_id][0]
        prompt_lp = None
        if first is not None and first.prompt_logprobs is not None:
            prompt_lp = [None, *_dicts(_lists(first.prompt_logprobs))] if first.prompt_logprobs else [None]
        req = reqs[0]
        return RequestOutput(request_id=req.parent_id, prompt_token_ids=req.prompt_token_ids, outputs=completions,
                             finished=all(r.is_finished for r in reqs), prompt_logprobs=prompt_lp,
                             num_cached_tokens=req.num_cached_prompt_tokens or 0)

    # -- convenience -----------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams], *, progress=None
                 ) -> list[RequestOutput]:
        """Add every prompt, step until all are done, return the final outputs in input order.

        Args:
            prompt_token_ids: the prompts.
            sampling_params: one for all, or one per prompt.
            progress: optional callable ``(finished_output) -> None`` called as each request ends.

        Raises:
            ValueError: what :meth:`add_request` raises (checked for every prompt before any is added)
                or a list of sampling params of the wrong length.
        """
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompt_token_ids))
        if len(params) != len(prompt_token_ids):
            raise ValueError(f"{len(params)} sampling_params for {len(prompt_token_ids)} prompts")
        base = f"gen-{self._arrivals}-"
        ids = [f"{base}{i}" for i in range(len(prompt_token_ids))]
        for i, p in enumerate(prompt_token_ids):  # validate all before adding any
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty")
        self.add_requests((rid, p, sp, True) for rid, p, sp in zip(ids, prompt_token_ids, params))
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            for out in self.step(final_only=True):
                if out.request_id in wanted:
                    final[out.request_id] = out
                    if progress is not None:
                        progress(out)
        return [final[i] for i in ids]
