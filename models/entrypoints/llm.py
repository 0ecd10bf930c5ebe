"""``LLM``: vLLM's offline entry point: a model name or GGUF path in, completions out.

It lives in ``models/`` (not ``jaxkv/``) because it needs a concrete model, loader and tokenizer, and the
package direction is ``pallas_kernels <- jaxkv <- models``: the engine under it (:class:`jaxkv.LLMEngine`)
only sees ``model_fn``, params and caches. vLLM: ``vllm/entrypoints/llm.py`` (``LLM.generate``,
``LLM.chat``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from typing import Any, Mapping, Sequence

from jaxkv.engine.core_client import DataParallelConfig, EngineDeadError, SyncMPClient
from jaxkv.engine.protocol import EngineCoreRequest, child_request_id
from jaxkv.outputs import CompletionOutput, Logprob, RequestOutput
from jaxkv.sampling_params import BeamSearchParams, SamplingParams
from models import registry
from models.entrypoints.engine_args import EngineArgs, EngineCoreFactory, build_engine, multiprocessing_enabled
from models.entrypoints.output_processor import CompletionState, logprob_dicts, truncate_prompt
from models.registry import resolve_model

log = logging.getLogger(__name__)

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchSequence", "resolve_model"]


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam (vLLM ``BeamSearchSequence``): ``tokens`` (prompt + generated), per generated token its
    ``{token_id: Logprob}``, the cumulative logprob, the generated text, why it ended."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's beams, best first (vLLM ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]


class _Request:
    """One offline request's completions in the front end (the shared output processor's states)."""

    def __init__(self, prompt_token_ids: list[int], completions: list[CompletionState], params: SamplingParams):
        self.prompt_token_ids = prompt_token_ids
        self.completions = completions
        self.texts = [""] * len(completions)
        self.reasons: list[tuple] = [(None, None)] * len(completions)
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def add(self, out) -> bool:
        """Fold one core output in; True when a stop string just ended its completion."""
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None and out.index == 0:
            self.prompt_logprobs.extend(logprob_dicts(out.new_prompt_logprobs, self.completions[0].texts))
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        c = self.completions[out.index]
        if c.finished:
            return False
        text, finished, finish_reason, stop_reason = c.add(out)
        self.texts[out.index] = text
        self.reasons[out.index] = (finish_reason, stop_reason) if finished else (None, None)
        return finished and out.finish_reason is None

    def output(self, request_id: str) -> RequestOutput:
        outs = [CompletionOutput(index=c.index, token_ids=list(c.detok.token_ids), text=self.texts[c.index],
                                 finish_reason=self.reasons[c.index][0], stop_reason=self.reasons[c.index][1],
                                 logprobs=c.logprobs, cumulative_logprob=c.cumulative)
                for c in self.completions]
        return RequestOutput(request_id=request_id, prompt_token_ids=self.prompt_token_ids, outputs=outs,
                             finished=True, prompt_logprobs=self.prompt_logprobs,
                             num_cached_tokens=self.num_cached_tokens)


class LLM:
    """Load a model, size its paged KV cache, and generate with continuous batching.

    By default the engine runs in engine-core processes of its own (one per data-parallel rank, vLLM V1's
    ``EngineCoreProc``), reached through :class:`jaxkv.engine.core_client.SyncMPClient`; this object keeps
    the tokenizer and turns token ids into :class:`RequestOutput` s. ``enable_multiprocessing=False`` (or
    ``JAXKV_ENABLE_MULTIPROCESSING=0``; vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) builds the engine in
    this process instead (tests, debugging): same engine, same greedy outputs, and ``llm.engine`` /
    ``llm.model`` are then the live objects.

    Args:
        model: ``"smollm2-135m"``, ``"gemma3-270m"``, a GGUF path (architecture ``llama`` or ``gemma3``), an HF
            checkpoint directory (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
            ``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``; docs/models.md), or with ``load_format="dummy"`` a
            ``config.json`` or a built-in name (``llama-3.1-8b``, ``qwen2.5-7b``, ``qwen3-8b``, ``mistral-7b``,
            ``gemma-3-4b``; random weights made on the device(s), a byte-level placeholder tokenizer for a
            built-in name; give ``tokenizer`` for a real one). Models with sliding-window layers (Gemma 3,
            Mistral) run with hybrid KV-cache groups: sliding-window layers keep only their window's blocks.
        tokenizer, dtype, kv_cache_dtype, block_size, max_model_len, max_num_seqs, max_num_batched_tokens,
            gpu_memory_utilization, num_gpu_blocks, enable_prefix_caching, long_prefill_token_threshold,
            num_scheduler_steps, max_admission_delay_steps, async_scheduling, attention_impl, seed,
            return_logits, tensor_parallel_size, load_format, compile_ahead, compilation_cache_dir,
            kv_offloading_size, preemption_mode: see
            :class:`models.entrypoints.engine_args.EngineArgs` (the defaults are shared with ``serve.py``
            and ``bench_throughput.py``). ``max_num_seqs``, ``max_num_batched_tokens`` and ``num_gpu_blocks``
            are per data-parallel rank (vLLM's semantics). ``return_logits`` needs the in-process engine.
        data_parallel_size: independent engine replicas, each in its own process on its own
            ``tensor_parallel_size`` devices, with its own scheduler and block pool; each request runs on
            a rank with about the fewest outstanding requests (:mod:`jaxkv.engine.load_balancer`; vLLM
            ``data_parallel_size``).
        data_parallel_size_local, data_parallel_address, data_parallel_rpc_port: ranks on several hosts
            (vLLM's names, :class:`jaxkv.engine.core_client.DataParallelConfig`): this process starts
            ``data_parallel_size_local`` ranks and waits for the others to connect to the TCP endpoints
            at ``data_parallel_address:data_parallel_rpc_port`` (``scripts/serve.py --headless``).
        enable_multiprocessing: see above (``None``: the environment variable, default on).

    Raises:
        ValueError: unknown model, bad sizes or dtypes, a memory budget that holds no block, too few
            devices, head counts that do not split over ``tensor_parallel_size`` (the message lists the
            valid sizes).
        EngineDeadError: an engine-core process failed while starting for another reason.
    """

    def __init__(self, model: str | os.PathLike = "smollm2-135m", *, data_parallel_size: int = 1,
                 data_parallel_size_local: int | None = None, data_parallel_address: str | None = None,
                 data_parallel_rpc_port: int = 13345, enable_multiprocessing: bool | None = None,
                 **engine_kwargs):
        self.engine_args = EngineArgs(model=str(model), **engine_kwargs)
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
        self.data_parallel_size = data_parallel_size
        self.multiprocessing = multiprocessing_enabled(enable_multiprocessing) and not self.engine_args.return_logits
        self.engine = None  # the in-process engine (multiprocessing off)
        self.model = None
        self._client = None
        self._next_id = 0
        self.last_summary: dict[str, float] = {}
        if not self.multiprocessing:
            if data_parallel_size > 1:
                raise ValueError(f"data_parallel_size={data_parallel_size} needs the engine-core processes "
                                 "(enable_multiprocessing=True): each rank is its own engine")
            built = build_engine(self.engine_args)
            self.engine, self.model, self.config = built.engine, built.model, built.config
            self.tokenizer, self.kv_cache_config, self.mesh = built.tokenizer, built.kv_cache_config, built.mesh
            self.engine_info = [built.info]
        else:
            path = resolve_model(self.engine_args.model)  # a bad name fails here, before any process starts
            self._client = SyncMPClient(
                EngineCoreFactory(self.engine_args),
                DataParallelConfig(data_parallel_size=data_parallel_size,
                                   data_parallel_size_local=data_parallel_size_local,
                                   data_parallel_address=data_parallel_address,
                                   data_parallel_rpc_port=data_parallel_rpc_port,
                                   devices_per_rank=self.engine_args.tensor_parallel_size))
            # the client's reader thread keeps the client alive: this LLM's collection (or exit) stops it
            weakref.finalize(self, self._client.shutdown)
            try:
                # while the cores start, this process reads what it needs itself (in parallel with them)
                self.config = registry.load_config(path)
                self.tokenizer = registry.load_model_tokenizer(path, self.engine_args.tokenizer, self.config)
                self.engine_info = self._client.wait_ready()
            except EngineDeadError as e:
                self._client.shutdown()
                if e.error_type in ("ValueError", "FileNotFoundError"):
                    raise (ValueError if e.error_type == "ValueError" else FileNotFoundError)(e.message) from None
                raise
        info = self.engine_info[0]
        self.num_gpu_blocks = info["num_gpu_blocks"]
        self.max_model_len = info["max_model_len"]
        self.attention_impl = info["attention_impl"]
        self.dtype = info["dtype"]
        log.info("LLM: %s, %s, kv_cache_dtype=%s, %d blocks of %d tokens per rank, attention=%s, tp=%d, dp=%d, %s",
                 info["model"], self.dtype, info["kv_cache_dtype"], self.num_gpu_blocks,
                 info["block_size"], self.attention_impl, info["tensor_parallel_size"], data_parallel_size,
                 "engine-core processes" if self.multiprocessing else "in-process engine")

    @property
    def llm_engine(self):
        """The in-process :class:`jaxkv.LLMEngine` (``None`` with engine-core processes). vLLM: ``llm_engine``."""
        return self.engine

    @property
    def engine_pids(self) -> list[int]:
        """The engine-core processes' ids (empty in-process)."""
        return [] if self._client is None else self._client.pids

    def get_engine_stats(self) -> list[dict]:
        """Every rank's engine counters (:class:`jaxkv.engine.llm_engine.EngineStats` fields as a dict), by rank."""
        if self._client is None:
            from jaxkv.engine.core import engine_stats
            return [engine_stats(self.engine)]
        return self._client.call_utility("stats")

    # -- RL rollouts: new weights from a JAX trainer, the device lent to it between generations ----------
    def get_params(self):
        """The engine's model parameters (an ``nnx.State`` of the decoder; the engine's own device arrays):
        the structure :meth:`update_weights` takes. In-process engine only.

        Raises:
            ValueError: with engine-core processes.
        """
        self._need_in_process("get_params")
        return self.engine.get_params()

    def update_weights(self, params) -> None:
        """Generate with new weights (vLLM's weight-sync hook, in JAX form): ``params`` is a pytree of the
        model's structure (:meth:`get_params`, or a decoder of the same config or its ``nnx.state``, whose separate
        q/k/v and gate/up weights are fused here as the engine's are: :func:`models.fused.fused_params`), e.g. a
        JAX trainer's arrays in this process; they are used where they are (moved device to device onto the
        engine's shardings if needed), nothing is traced or compiled again, and the prefix cache is reset.
        In-process engine only (``enable_multiprocessing=False``): arrays of this process cannot reach an
        engine-core process without a trip through the host.

        Raises:
            ValueError: engine-core processes, requests still running, or another structure, shape or dtype.
        """
        self._need_in_process("update_weights")
        from models.fused import fused_params
        self.engine.update_weights(fused_params(params, self.model))

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache's device memory (level 1 also moves the weights to host memory; level 2 discards
        them: give new ones with :meth:`update_weights` before :meth:`wake_up`), e.g. while a trainer runs. On
        every rank with engine-core processes. vLLM ``LLM.sleep``.

        Raises:
            ValueError: requests are unfinished, already asleep, a bad level, or a host KV tier.
        """
        if self._client is None:
            self.engine.sleep(level)
        else:
            self._client.call_utility("sleep", level)

    def wake_up(self) -> None:
        """Undo :meth:`sleep` (a zeroed KV cache; the weights back). vLLM ``LLM.wake_up``."""
        if self._client is None:
            self.engine.wake_up()
        else:
            self._client.call_utility("wake_up")

    def _need_in_process(self, what: str) -> None:
        if self._client is not None:
            raise ValueError(f"{what} needs the in-process engine (LLM(..., enable_multiprocessing=False)): "
                             "a JAX trainer's arrays cannot reach an engine-core process without the host")

    # -- beam search --------------------------------------------------------------------------------------
    def beam_search(self, prompts, params: BeamSearchParams, *, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM ``LLM.beam_search``): each step extends every live beam by one token with the
        ``2 * beam_width`` most likely next tokens (their logprobs from the engine), keeps the ``beam_width``
        best by cumulative logprob, and moves beams that end with EOS to the finished ones; at the end the
        ``beam_width`` best finished or live beams by ``cumulative_logprob / len ** length_penalty``. Beams share
        their common prefix's KV blocks through the prefix cache (each step computes only the new tokens of
        each beam's last, partial block).

        Args:
            prompts: as :meth:`generate`'s (strings, token ids or ``{"prompt_token_ids"}`` dicts).
            params: :class:`BeamSearchParams`.

        Returns:
            One :class:`BeamSearchOutput` per prompt, its ``sequences`` best first.

        Raises:
            ValueError: bad prompts, or ``2 * beam_width`` above the engine's ``max_logprobs``.
        """
        texts, token_ids = self._normalise(prompts)
        width = params.beam_width
        eos = set(getattr(self.tokenizer, "stop_token_ids", None) or ())
        step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * width,
                                     ignore_eos=True, detokenize=False)
        live = [[BeamSearchSequence(tokens=list(p), logprobs=[], cum_logprob=0.0)] for p in token_ids]
        done: list[list[BeamSearchSequence]] = [[] for _ in token_ids]
        plen = [len(p) for p in token_ids]
        for _ in range(params.max_tokens):
            flat = [(i, b) for i, beams in enumerate(live) for b in beams
                    if len(b.tokens) < self.max_model_len]
            if not flat:
                break
            outs = self.generate([{"prompt_token_ids": b.tokens} for _, b in flat], step_params, use_tqdm=use_tqdm)
            candidates: list[list[BeamSearchSequence]] = [[] for _ in token_ids]
            for (i, beam), out in zip(flat, outs):
                for token, lp in out.outputs[0].logprobs[0].items():
                    seq = BeamSearchSequence(tokens=beam.tokens + [token], logprobs=beam.logprobs + [{token: lp}],
                                             cum_logprob=beam.cum_logprob + lp.logprob)
                    if token in eos and not params.ignore_eos:
                        seq.finish_reason = "stop"
                        done[i].append(seq)
                    else:
                        candidates[i].append(seq)
            live = [sorted(c, key=lambda s: s.cum_logprob, reverse=True)[:width] for c in candidates]

        def score(seq: BeamSearchSequence, i: int) -> float:
            return seq.cum_logprob / max(1, len(seq.tokens) - plen[i]) ** params.length_penalty

        results = []
        for i in range(len(token_ids)):
            for s in live[i]:
                s.finish_reason = s.finish_reason or "length"
            best = sorted(done[i] + live[i], key=lambda s: score(s, i), reverse=True)[:width]
            for s in best:
                out_ids = s.tokens[plen[i]:]
                if s.finish_reason == "stop" and not params.include_stop_str_in_output:
                    out_ids = out_ids[:-1]
                s.text = self.tokenizer.decode(out_ids)
            results.append(BeamSearchOutput(sequences=best))
        return results

    def reset_prefix_cache(self) -> None:
        """Forget every cached block on every rank (vLLM ``LLM.reset_prefix_cache``)."""
        if self._client is None:
            self.engine.reset_prefix_cache()
        else:
            self._client.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        """Stop the engine-core processes now (otherwise when this object is collected or at exit); an
        in-process engine writes its step trace (``$JAXKV_STEP_TRACE``) here."""
        if self._client is not None:
            self._client.shutdown()
        elif self.engine is not None:
            self.engine.write_step_trace()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's ``generation_config.json`` sampling defaults (``temperature``, ``top_p``,
        ``top_k``), what :meth:`generate` uses when given none; ``SamplingParams()`` without one. vLLM:
        ``LLM.get_default_sampling_params`` (``--generation-config auto``)."""
        gen = getattr(self.tokenizer, "generation_config", None) or {}
        known = {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
        if known.get("top_k") == 0:
            known["top_k"] = -1
        return SamplingParams(**known)

    # -- generation --------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, on_finished=None, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order, with ``text`` decoded. vLLM: ``LLM.generate``.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict, or a list of
                these.
            sampling_params: one for every prompt or one per prompt (default
                :meth:`get_default_sampling_params`). ``n`` completions per prompt share its KV blocks;
                stop strings, ``include_stop_str_in_output``, ``truncate_prompt_tokens``, ``bad_words`` and
                the detokenization options are applied here (vLLM's front end), the rest in the engine.
            use_tqdm: show a progress bar with the running tokens/s.
            on_finished: optional ``(RequestOutput) -> None`` called as each request ends; benchmarks time
                the run's phases with it.
            priority: one int per prompt with ``scheduling_policy="priority"`` (vLLM's: smaller is admitted
                first, ties by order; the requests reach the engine in windows of
                :attr:`DISPATCH_WINDOW_PER_SEQ` x ``max_num_seqs``, in the order given).

        Raises:
            ValueError: bad prompts (empty, too long for ``max_model_len`` or the cache), bad sampling
                parameters, a list of sampling params or priorities of another length, or ``priority`` with
                the ``"fcfs"`` policy; nothing is left queued.
        """
        texts, token_ids = self._normalise(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(token_ids))
        if len(params) != len(token_ids):
            raise ValueError(f"{len(params)} sampling_params for {len(token_ids)} prompts")
        if priority is not None:
            priority = [int(x) for x in priority]
            if len(priority) != len(token_ids):
                raise ValueError(f"{len(priority)} priorities for {len(token_ids)} prompts")
            if self.engine_args.scheduling_policy != "priority" and any(priority):
                raise ValueError(f"priority needs scheduling_policy='priority' (this LLM's is "
                                 f"{self.engine_args.scheduling_policy!r})")
        for i, (p, sp) in enumerate(zip(token_ids, params)):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty")
            if not sp.spaces_between_special_tokens:
                raise ValueError("spaces_between_special_tokens=False is not supported")
        params = [sp.with_bad_words_tokenized(self.tokenizer) for sp in params]
        token_ids = [truncate_prompt(p, sp.truncate_prompt_tokens, self.max_model_len)
                     for p, sp in zip(token_ids, params)]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(token_ids), desc="Processed prompts", dynamic_ncols=True)
        counts = {"in": 0, "out": 0}
        t0 = time.perf_counter()

        def progress(out: RequestOutput):
            counts["in"] += len(out.prompt_token_ids)
            counts["out"] += sum(len(c.token_ids) for c in out.outputs)
            if bar is not None:
                dt = time.perf_counter() - t0
                bar.set_postfix_str(f"est. speed input: {counts['in'] / dt:.2f} toks/s, "
                                    f"output: {counts['out'] / dt:.2f} toks/s", refresh=False)
                bar.update(1)
            if on_finished is not None:
                on_finished(out)

        try:
            if self.engine is not None and self.engine_args.return_logits:
                if priority is not None and any(priority):
                    raise ValueError("priority is not supported with return_logits")
                outputs = self.engine.generate(token_ids, params, progress=progress)  # logits: tests only
                for out in outputs:
                    for c in out.outputs:
                        c.text = self.tokenizer.decode(c.token_ids)
            else:
                outputs = self._generate_core(token_ids, params, progress, priority)
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
        self.last_summary = dict(num_prompts=len(outputs), prompt_tokens=counts["in"],
                                 output_tokens=counts["out"], elapsed_s=wall,
                                 input_tokens_per_s=counts["in"] / wall, output_tokens_per_s=counts["out"] / wall)
        log.info("Processed %d prompts in %.2f s: input %.1f tok/s, output %.1f tok/s", len(outputs), wall,
                 counts["in"] / wall, counts["out"] / wall)
        for text, out in zip(texts, outputs):
            out.prompt = text
        return outputs

    # requests a rank holds at once in LLM.generate, per max_num_seqs: the running batch and as many waiting
    # ($JAXKV_DISPATCH_WINDOW_PER_SEQ overrides it for A/B measurements; 0 sends every request at once)
    DISPATCH_WINDOW_PER_SEQ = 2

    def _generate_core(self, token_ids: list[list[int]], params: list[SamplingParams], progress,
                       priority: list[int] | None = None) -> list[RequestOutput]:
        """``generate`` over the engine's core outputs (:class:`EngineCoreOutput`, in process or from the
        engine-core processes), each folded into its completion by the shared output processor.

        A request without stop strings is reported once, when it finishes (vLLM ``FINAL_ONLY``); one with
        stop strings every step, so it ends at the token that completes one. Through the engine-core
        processes the requests are dispatched as the cores take them: at most
        :attr:`DISPATCH_WINDOW_PER_SEQ` x ``max_num_seqs`` outstanding per rank, the rest sent as requests
        finish, each to the rank with about the fewest outstanding (a rank that steps faster so takes more
        of the batch, and every core starts stepping after its first window). The first window is all or
        none (a rejected request raises before anything runs); a request a core rejects later aborts the
        others that are still running, then raises the same ``ValueError``.
        """
        base = f"gen-{self._next_id}-"
        self._next_id += 1
        ids = [f"{base}{i}" for i in range(len(token_ids))]
        priority = priority or [0] * len(ids)
        requests = [EngineCoreRequest(rid, p, sp, final_only=not sp.stop, priority=prio)
                    for rid, p, sp, prio in zip(ids, token_ids, params, priority)]
        states = {rid: _Request(p, [CompletionState(i, self.tokenizer, sp) for i in range(sp.n)], sp)
                  for rid, p, sp in zip(ids, token_ids, params)}
        index = {rid: i for i, rid in enumerate(ids)}
        final: list[RequestOutput | None] = [None] * len(ids)
        left = len(ids)
        if self._client is None:
            window = chunk = len(requests)
            self.engine.add_requests((r.request_id, r.prompt_token_ids, r.sampling_params, r.final_only, r.priority)
                                     for r in requests)
            next_outputs = self.engine.step_core_outputs
            abort = self.engine.abort_request
        else:
            per_seq = float(os.environ.get("JAXKV_DISPATCH_WINDOW_PER_SEQ", self.DISPATCH_WINDOW_PER_SEQ))
            window = (len(requests) if per_seq <= 0
                      else max(1, int(sum(per_seq * int(info["max_num_seqs"]) for info in self.engine_info))))
            chunk = max(1, window // 16)  # top-ups go in batches: one message per rank, not one per request
            self._client.add_requests(requests[:window])
            next_outputs = lambda: self._client.get_output().outputs  # noqa: E731
            abort = self._client.abort
        sent = min(window, len(requests))
        try:
            while left:
                for o in next_outputs():
                    i = index.get(o.request_id)
                    if i is None or final[i] is not None:
                        continue
                    if o.error is not None:
                        raise ValueError(o.error)
                    state = states[o.request_id]
                    if state.add(o):  # a stop string: the engine runs on for this completion
                        abort([o.request_id if len(state.completions) == 1
                               else child_request_id(o.request_id, o.index)])
                    if state.finished:
                        final[i] = state.output(o.request_id)
                        left -= 1
                        if progress is not None:
                            progress(final[i])
                if self._client is not None:
                    room = window - sum(self._client.outstanding)
                    if sent < len(requests) and (room >= chunk or room >= len(requests) - sent):
                        more = requests[sent:sent + room]
                        self._client.add_requests(more, wait=False)
                        sent += len(more)
        except BaseException:
            abort([ids[i] for i in range(sent) if final[i] is None])
            if self._client is None:  # the aborted requests' final outputs come with the next step
                while self.engine.has_unfinished_requests():
                    self.engine.step_core_outputs()
            raise
        return final

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to a list of
        conversations, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        # the template writes the BOS token itself (Gemma's does): no second one from the tokenizer
        prompts = []
        for c in conversations:
            text = self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _normalise(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        texts, ids = [], []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts.append(p)
                ids.append(self.tokenizer.encode(p, add_special_tokens=True))  # BOS where the GGUF asks
            elif isinstance(p, Mapping) and "prompt_token_ids" in p:
                texts.append(p.get("prompt"))
                ids.append([int(t) for t in p["prompt_token_ids"]])
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                texts.append(None)
                ids.append([int(t) for t in p])
            else:
                raise ValueError(f"prompts[{i}]={p!r} is not a string, token ids or "
                                 "{'prompt_token_ids': [...]}")
        return texts, ids
