"""``LLM``: vLLM's offline entry point: a model name or GGUF path in, completions out.

It lives in ``models/`` (not ``jaxkv/``) because it needs a concrete model, loader and tokenizer, and the
package direction is ``pallas_kernels <- jaxkv <- models``: the engine under it (:class:`jaxkv.LLMEngine`)
only sees ``model_fn``, params and caches. vLLM: ``vllm/entrypoints/llm.py`` (``LLM.generate``,
``LLM.chat``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Mapping, Sequence

from jaxkv.engine.core_client import DataParallelConfig, EngineDeadError, SyncMPClient
from jaxkv.engine.protocol import EngineCoreRequest
from jaxkv.outputs import CompletionOutput, RequestOutput
from jaxkv.sampling_params import SamplingParams
from models import registry
from models.entrypoints.engine_args import EngineArgs, EngineCoreFactory, build_engine, multiprocessing_enabled
from models.registry import resolve_model

log = logging.getLogger(__name__)

__all__ = ["LLM", "resolve_model"]


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

    def reset_prefix_cache(self) -> None:
        """Forget every cached block on every rank (vLLM ``LLM.reset_prefix_cache``)."""
        if self._client is None:
            self.engine.reset_prefix_cache()
        else:
            self._client.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        """Stop the engine-core processes now (otherwise when this object is collected or at exit)."""
        if self._client is not None:
            self._client.shutdown()

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
                 *, use_tqdm: bool = True, on_finished=None) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order, with ``text`` decoded.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict, or a list of
                these.
            sampling_params: one for every prompt or one per prompt (default
                :meth:`get_default_sampling_params`).
            use_tqdm: show a progress bar with the running tokens/s.
            on_finished: optional ``(RequestOutput) -> None`` called as each request ends; benchmarks time
                the run's phases with it.

        Raises:
            ValueError: bad prompts (empty, too long for ``max_model_len`` or the cache) or a list of
                sampling params of another length; nothing is left queued.
        """
        texts, token_ids = self._normalise(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(token_ids), desc="Processed prompts", dynamic_ncols=True)
        counts = {"in": 0, "out": 0}
        t0 = time.perf_counter()

        def progress(out: RequestOutput):
            counts["in"] += len(out.prompt_token_ids)
            counts["out"] += len(out.outputs[0].token_ids)
            if bar is not None:
                dt = time.perf_counter() - t0
                bar.set_postfix_str(f"est. speed input: {counts['in'] / dt:.2f} toks/s, "
                                    f"output: {counts['out'] / dt:.2f} toks/s", refresh=False)
                bar.update(1)
            if on_finished is not None:
                on_finished(out)

        try:
            if self._client is None:
                outputs = self.engine.generate(token_ids, sampling_params, progress=progress)
            else:
                outputs = self._generate_mp(token_ids, sampling_params, progress)
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
            if self._client is None:  # in-process engine (with engine-core processes: decoded as each finished)
                for c in out.outputs:
                    c.text = self.tokenizer.decode(c.token_ids)
        return outputs

    # requests a rank holds at once in LLM.generate, per max_num_seqs: the running batch and as many waiting
    # ($JAXKV_DISPATCH_WINDOW_PER_SEQ overrides it for A/B measurements; 0 sends every request at once)
    DISPATCH_WINDOW_PER_SEQ = 2

    def _generate_mp(self, token_ids: list[list[int]], sampling_params, progress) -> list[RequestOutput]:
        """``generate`` through the engine-core processes, with the requests dispatched as the cores take
        them: at most :attr:`DISPATCH_WINDOW_PER_SEQ` x ``max_num_seqs`` outstanding per rank, the rest sent
        as requests finish, each to the rank with about the fewest outstanding. A rank that steps faster so
        takes more of the batch, and every core starts stepping after adding its first window instead of
        the whole batch. (vLLM's offline data parallelism splits the prompts between ranks beforehand.)

        The first window is all or none (a rejected request raises before anything runs); a request a core
        rejects later aborts the others that are still running, then raises the same ``ValueError``.
        """
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(token_ids))
        if len(params) != len(token_ids):
            raise ValueError(f"{len(params)} sampling_params for {len(token_ids)} prompts")
        for i, p in enumerate(token_ids):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty")
        base = f"gen-{self._next_id}-"
        self._next_id += 1
        ids = [f"{base}{i}" for i in range(len(token_ids))]
        requests = [EngineCoreRequest(rid, p, sp, final_only=True) for rid, p, sp in zip(ids, token_ids, params)]
        per_seq = float(os.environ.get("JAXKV_DISPATCH_WINDOW_PER_SEQ", self.DISPATCH_WINDOW_PER_SEQ))
        window = (len(requests) if per_seq <= 0
                  else max(1, int(sum(per_seq * int(info["max_num_seqs"]) for info in self.engine_info))))
        chunk = max(1, window // 16)  # top-ups go in batches: one message per rank, not one per request
        self._client.add_requests(requests[:window])
        sent = min(window, len(requests))
        index = {rid: i for i, rid in enumerate(ids)}
        final: list[RequestOutput | None] = [None] * len(ids)
        left = len(ids)
        try:
            while left:
                for o in self._client.get_output().outputs:
                    i = index.get(o.request_id)
                    if i is None or not o.finished or final[i] is not None:
                        continue
                    if o.error is not None:
                        raise ValueError(o.error)
                    # decoded here, while the cores step on (session 18: decoding 4,256 ShareGPT outputs
                    # after the last step took ~0.3 s of the run's wall time)
                    completion = CompletionOutput(index=0, token_ids=list(o.new_token_ids),
                                                  new_token_ids=list(o.new_token_ids),
                                                  text=self.tokenizer.decode(o.new_token_ids),
                                                  finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                    final[i] = RequestOutput(request_id=o.request_id, prompt_token_ids=token_ids[i],
                                             outputs=[completion], finished=True,
                                             num_cached_tokens=o.num_cached_tokens)
                    left -= 1
                    if progress is not None:
                        progress(final[i])
                room = window - sum(self._client.outstanding)
                if sent < len(requests) and (room >= chunk or room >= len(requests) - sent):
                    more = requests[sent:sent + room]
                    self._client.add_requests(more, wait=False)
                    sent += len(more)
        except BaseException:
            self._client.abort([ids[i] for i in range(sent) if final[i] is None])
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
