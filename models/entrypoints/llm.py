"""``LLM``: vLLM's offline entry point: a model name, GGUF path or HF checkpoint directory in, completions out.

It lives in ``models/`` (not ``jaxkv/``) because it needs a concrete model, loader and tokenizer, and the
package direction is ``pallas_kernels <- jaxkv <- models``: the engine under it (:class:`jaxkv.LLMEngine`)
only sees ``model_fn``, params and caches. vLLM: ``vllm/entrypoints/llm.py`` (``LLM.generate``,
``LLM.chat``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import jaxkv
import jaxkv.parallel
from jaxkv import RequestOutput, SamplingParams
from models import registry
from models.parallel import check_model_tensor_parallel
from models.registry import resolve_model
from models.runner import kv_cache_spec

log = logging.getLogger(__name__)

__all__ = ["LLM", "resolve_model"]


class LLM:
    """Load a model, size its paged KV cache, and generate with continuous batching.

    Args:
        model: ``"smollm2-135m"``, ``"gemma3-270m"``, a GGUF path (architecture ``llama`` or ``gemma3``), an HF
            checkpoint directory (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
            ``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``; docs/models.md), or with ``load_format="dummy"`` a
            ``config.json`` or a built-in name (``llama-3.1-8b``, ``qwen2.5-7b``, ``qwen3-8b``, ``mistral-7b``,
            ``gemma-3-4b``). Models with sliding-window layers (Gemma 3, Mistral) run with hybrid KV-cache
            groups: sliding-window layers keep only their window's blocks.
        dtype: ``"auto"`` (bfloat16 on GPU, float32 elsewhere), ``"float32"``, ``"bfloat16"``,
            ``"float16"``.
        kv_cache_dtype: ``"auto"`` (= dtype), ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``.
        block_size: tokens per block.
        max_model_len: longest sequence (default: the model's ``max_position_embeddings``, at most 4096).
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching, long_prefill_token_threshold,
            num_scheduler_steps, max_admission_delay_steps, async_scheduling, seed: see :class:`jaxkv.LLMEngine` (``max_num_batched_tokens`` defaults
            to ``max(2048, max_num_seqs)``; ``max_admission_delay_steps`` defaults to 8 here, 0 in
            the engine: a waiting request may wait up to 8 decode steps so the device runs whole
            decode loops; on an H200, 4000 ShareGPT requests, that gave 1.81x the output tokens/s
            of 0, docs/benchmarks.md; 0 admits at once, as vLLM).
        gpu_memory_utilization: fraction of device memory for weights + cache (used when
            ``num_gpu_blocks`` is not given, on a device that reports its memory).
        num_gpu_blocks: cache size in blocks (vLLM ``num_gpu_blocks_override``); on a device without
            memory statistics (CPU) the default is enough blocks for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens, at most 1024 blocks.
        attention_impl: ``"pallas"`` / ``"pallas_interpret"`` / ``"reference"`` (default per device).
        return_logits: keep the logits of every sampled token (tests).
        tensor_parallel_size: devices each model replica is split over (heads and MLP, Megatron-style;
            vLLM ``tensor_parallel_size``).
        data_parallel_size: model replicas, each with its own KV block pool; every request runs on one
            (vLLM ``data_parallel_size``). With either above 1 the model runs on a ``(dp, tp)``
            :func:`jaxkv.parallel.make_mesh` mesh of ``dp * tp`` devices; ``num_gpu_blocks`` is then per
            ``dp`` rank, while ``max_num_seqs`` / ``max_num_batched_tokens`` stay engine-wide (all ranks;
            vLLM sets them per rank).
        load_format: ``"auto"`` (the checkpoint's weights) or ``"dummy"`` (vLLM's ``--load-format dummy``:
            config and tokenizer only, random weights from ``seed`` made on the device(s); for speed
            measurements: a header-only GGUF from ``scripts/make_header_gguf.py``, a ``config.json`` or a
            built-in name; a built-in name has a byte-level placeholder tokenizer,
            :class:`models.hf_tokenizer.PlaceholderTokenizer`).

    Raises:
        ValueError: unknown model, bad sizes or dtypes, a memory budget that holds no block, too few
            devices for the mesh, head counts that do not split over ``tensor_parallel_size`` (the
            message lists the valid sizes).
    """

    def __init__(self, model: str | os.PathLike = "smollm2-135m", *, dtype: str = "auto",
                 kv_cache_dtype: str = "auto", block_size: int = 16, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 gpu_memory_utilization: float = 0.9, num_gpu_blocks: int | None = None,
                 enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
                 num_scheduler_steps: int = 8, max_admission_delay_steps: int = 8,
                 async_scheduling: bool = False, attention_impl: str | None = None, seed: int = 0,
                 return_logits: bool = False, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 load_format: str = "auto"):
        path = resolve_model(model)
        self.mesh = jaxkv.parallel.make_mesh(tensor_parallel_size, data_parallel_size)
        if tensor_parallel_size * data_parallel_size == 1:
            self.mesh = None  # one device: no mesh, exactly the single-device program
        on_gpu = jax.default_backend() == "gpu"
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu else "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={dtype!r} not one of auto, float32, bfloat16, float16")
        self.dtype = jnp.dtype(dtype)
        self.attention_impl = jaxkv.attention.check_attention_impl(
            attention_impl or jaxkv.default_attention_impl())
        snapshot = None
        if num_gpu_blocks is None and _has_memory_stats():
            snapshot = jaxkv.memory_snapshot()  # before the weights, as vLLM profiles at start-up
        self.config, weights, self.tokenizer = registry.load_checkpoint(path, progress=False,
                                                                        load_format=load_format)
        if self.mesh is not None:
            check_model_tensor_parallel(self.config, tensor_parallel_size)
        self.model = registry.build_model(self.config, weights, dtype=self.dtype, seed=seed, mesh=self.mesh)
        del weights
        self.max_model_len = max_model_len or min(self.config.max_position_embeddings, 4096)
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} > the model's max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        max_num_batched_tokens = max_num_batched_tokens or max(2048, max_num_seqs)
        cache_dtype = jaxkv.resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        if num_gpu_blocks is None:
            num_gpu_blocks = self._blocks_from_memory(snapshot, gpu_memory_utilization, block_size,
                                                      cache_dtype, max_num_seqs, max_num_batched_tokens)
        self.num_gpu_blocks = num_gpu_blocks
        parts = registry.make_engine_caches(self.model, block_size=block_size, num_blocks=num_gpu_blocks,
                                            dtype=cache_dtype, attention_impl=self.attention_impl,
                                            mesh=self.mesh)
        if self.mesh is not None:
            nnx.update(self.model, parts.params)  # the sharded weights replace the single-device copy
        self.kv_cache_config = parts.kv_cache_config
        self.engine = jaxkv.LLMEngine(
            parts.model_fn, parts.params, parts.kv_caches, kv_cache_groups=parts.kv_cache_groups,
            block_size=block_size, max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, eos_token_id=self.tokenizer.stop_token_ids,
            long_prefill_token_threshold=long_prefill_token_threshold,
            num_scheduler_steps=num_scheduler_steps, max_admission_delay_steps=max_admission_delay_steps,
            async_scheduling=async_scheduling,
            seed=seed, return_logits=return_logits, mesh=self.mesh)
        self.last_summary: dict[str, float] = {}
        log.info("LLM: %s, %s, kv_cache_dtype=%s, %d blocks of %d tokens%s, attention=%s, mesh=%s",
                 registry.model_name(path), self.dtype, cache_dtype, num_gpu_blocks, block_size,
                 " per dp rank" if self.mesh is not None else "", self.attention_impl,
                 None if self.mesh is None else dict(self.mesh.shape))

    def _blocks_from_memory(self, snapshot, utilization, block_size, cache_dtype, max_num_seqs,
                            max_num_batched_tokens) -> int:
        spec = kv_cache_spec(self.config, block_size=block_size, dtype=cache_dtype)
        dp, _ = jaxkv.parallel.mesh_sizes(self.mesh)
        if snapshot is None:  # no memory statistics (CPU): enough for max_num_seqs full sequences
            per_seq = registry.blocks_per_sequence(self.config, self.max_model_len, block_size=block_size,
                                                   max_num_batched_tokens=max_num_batched_tokens,
                                                   hybrid=registry.use_hybrid(self.mesh))
            return min(max(1024, per_seq), -(-max_num_seqs // dp) * per_seq)
        devices = [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)
        in_use = max(int(d.memory_stats().get("bytes_in_use", 0)) for d in devices)
        # weights (in use now) + activations of the widest step (logits of every row, f32, x4 margin)
        activations = max(1 << 30, 4 * 4 * max(max_num_seqs, 256) * self.config.vocab_size
                          + 64 * max_num_batched_tokens * self.config.hidden_size * 4)
        return jaxkv.num_blocks_from_device_memory(
            spec, num_layers=registry.num_cache_tensors(self.config, hybrid=registry.use_hybrid(self.mesh)),
            gpu_memory_utilization=utilization,
            reserved_bytes=in_use + activations, total_bytes=snapshot.total_bytes,
            free_bytes=snapshot.free_bytes, mesh=self.mesh)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's default sampling (``generation_config.json``'s ``temperature``, ``top_p``,
        ``top_k``), what :meth:`generate` uses when given none; ``SamplingParams()`` without one. vLLM:
        ``LLM.get_default_sampling_params`` (``--generation-config auto``)."""
        gen = getattr(self.tokenizer, "generation_config", None) or {}
        known = {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
        if known.get("top_k") == 0:
            known["top_k"] = -1
        return SamplingParams(**known)

    # -- generation --------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order, with ``text`` decoded.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict, or a list of
                these.
            sampling_params: one for every prompt or one per prompt (default
                :meth:`get_default_sampling_params`).
            use_tqdm: show a progress bar with the running tokens/s.

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

        try:
            outputs = self.engine.generate(token_ids, sampling_params, progress=progress)
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
            for c in out.outputs:
                c.text = self.tokenizer.decode(c.token_ids)
        return outputs

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


def _has_memory_stats() -> bool:
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    return bool(stats) and "bytes_limit" in stats
