"""A minimal batch generation engine: block allocation, metadata, one jitted step with the cache donated.

The engine is model-agnostic: it drives any ``model_fn(params, input_ids, positions, kv_caches, metadata,
logits_indices) -> (logits, kv_caches)``. One call of :meth:`Engine.generate` prefills all prompts in one
step, then decodes them together; finished sequences free their blocks and become padding rows, so the
decode step keeps one padded shape and compiles once (vLLM's CUDA-graph padding: ``PAD_SLOT_ID`` slots,
length-1 dummy sequences, fixed block-table width).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.block_allocator import BlockAllocator
from jaxkv.metadata import AttentionMetadata, build_attn_metadata
from jaxkv.sampling import sample_tokens

ModelFn = Callable[..., tuple[jax.Array, list[jax.Array]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick and when to stop. vLLM: ``SamplingParams`` (the subset used here).

    Attributes:
        max_new_tokens: most tokens generated per prompt.
        temperature: 0 = greedy.
        top_p: nucleus mass in ``(0, 1]``.
        stop_token_ids: generation of a sequence ends at any of these (not included in the output).
        seed: PRNG seed for sampling.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@dataclasses.dataclass
class Completion:
    """One prompt's result: generated token ids and why generation stopped ("stop" or "length")."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None = None


@dataclasses.dataclass
class GenerationStats:
    """Counts and wall-clock seconds of one :meth:`Engine.generate` call (device work synchronised).

    ``decode_s`` and ``decode_tokens`` exclude the first decode step, which includes compilation when
    the step shape is new.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    first_decode_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    step_logits: list = dataclasses.field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def _next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


class Engine:
    """Generates from a batch of prompts through a paged KV cache.

    Args:
        model_fn: ``(params, input_ids, positions, kv_caches, metadata, logits_indices) ->
            (f32[num_logits, vocab] logits, kv_caches)``, traceable by ``jax.jit``.
        params: pytree passed to ``model_fn`` (not donated).
        kv_caches: one cache array per layer, ``[2, num_blocks, num_kv_heads, block_size, head_size]``;
            the engine owns them from now on (they are donated to each step).
        block_size: tokens per block.
        max_model_len: longest sequence (prompt + generated), in tokens; fixes the block-table width.

    Raises:
        ValueError: caches of different shapes, or non-positive sizes.
    """

    def __init__(self, model_fn: ModelFn, params, kv_caches: list[jax.Array], *, block_size: int,
                 max_model_len: int):
        shapes = {c.shape for c in kv_caches}
        if len(shapes) != 1:
            raise ValueError(f"kv_caches have different shapes: {sorted(shapes)}")
        (shape,) = shapes
        if shape[3] != block_size:
            raise ValueError(f"block_size={block_size} != cache block size {shape[3]}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len} must be >= 1")
        self.params = params
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_blocks_per_seq = -(-max_model_len // block_size)
        self.allocator = BlockAllocator(shape[1])
        self.num_compiles = 0

        def step(params, kv_caches, input_ids, positions, metadata, logits_indices, key, *,
                 temperature, top_p, return_logits):
            self.num_compiles += 1  # runs only while tracing
            logits, kv_caches = model_fn(params, input_ids, positions, kv_caches, metadata,
                                         logits_indices)
            tokens = sample_tokens(logits, key, temperature=temperature, top_p=top_p)
            return tokens, (logits if return_logits else None), kv_caches

        self._step = jax.jit(step, donate_argnums=(1,),
                             static_argnames=("temperature", "top_p", "return_logits"))

    # -- admission -------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]], sampling: SamplingParams) -> list[int]:
        if not prompts:
            raise ValueError("prompts=[] holds no prompt")
        need = []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty")
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens; max_model_len={self.max_model_len} "
                                 "leaves no room to generate")
            final_len = min(len(p) + sampling.max_new_tokens, self.max_model_len)
            need.append(-(-final_len // self.block_size))
        if sum(need) > self.allocator.num_free_blocks:
            raise ValueError(f"the batch needs {sum(need)} blocks (prompt + max_new_tokens), the cache has "
                             f"{self.allocator.num_free_blocks} free of {self.allocator.num_blocks}")
        return need

    # -- one step --------------------------------------------------------------------------------
    def _run(self, input_ids, positions, metadata: AttentionMetadata, logits_indices, key,
             sampling: SamplingParams, return_logits: bool):
        tokens, logits, self.kv_caches = self._step(
            self.params, self.kv_caches, jnp.asarray(input_ids, jnp.int32),
            jnp.asarray(positions, jnp.int32), metadata, jnp.asarray(logits_indices, jnp.int32), key,
            temperature=float(sampling.temperature), top_p=float(sampling.top_p),
            return_logits=return_logits)
        return np.asarray(tokens), logits

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, *,
                 return_logits: bool = False) -> tuple[list[Completion], GenerationStats]:
        """Generate a completion for every prompt.

        Raises:
            ValueError: empty prompt list or prompt, a prompt of ``>= max_model_len`` tokens, or a batch
                the cache cannot hold to its end; raised before any work, nothing is allocated.
        """
        self._check_prompts(prompts, sampling)
        num_seqs = len(prompts)
        batch = _next_pow2(num_seqs)
        width = self.max_num_blocks_per_seq
        bs = self.block_size
        key = jax.random.key(sampling.seed)
        stats = GenerationStats(prompt_tokens=sum(map(len, prompts)))
        done = [Completion(list(p), []) for p in prompts]
        tokens = [list(p) for p in prompts]
        blocks = [self.allocator.allocate(-(-len(p) // bs)) for p in prompts]

        def table(rows):
            t = np.zeros((len(rows), width), np.int32)
            for r, b in enumerate(rows):
                t[r, :len(b)] = b
            return t

        # ---- prefill: every prompt in one step ----
        lens = np.array([len(p) for p in prompts])
        num_tokens = int(lens.sum())
        md = build_attn_metadata(table(blocks), np.zeros(num_seqs), lens, bs,
                                 num_seqs_padded=batch, num_tokens_padded=_next_pow2(num_tokens, 16),
                                 max_query_len=_next_pow2(int(lens.max())))
        ids = np.zeros(md.slot_mapping.shape[0], np.int32)
        ids[:num_tokens] = np.concatenate(prompts)
        pos = np.zeros_like(ids)
        pos[:num_tokens] = np.concatenate([np.arange(n) for n in lens])
        last = np.zeros(batch, np.int32)
        last[:num_seqs] = np.cumsum(lens) - 1
        key, sub = jax.random.split(key)
        t0 = time.perf_counter()
        new, logits = self._run(ids, pos, md, last, sub, sampling, return_logits)
        stats.prefill_s = time.perf_counter() - t0
        if return_logits:
            stats.step_logits.append(np.asarray(logits)[:num_seqs])

        active = list(range(num_seqs))

        def accept(s, token):
            if token in sampling.stop_token_ids:
                done[s].finish_reason = "stop"
            else:
                tokens[s].append(int(token))
                done[s].token_ids.append(int(token))
                if len(done[s].token_ids) >= sampling.max_new_tokens or len(tokens[s]) >= self.max_model_len:
                    done[s].finish_reason = "length"
            if done[s].finish_reason is not None:
                self.allocator.free(blocks[s])
                blocks[s] = []
                return False
            return True

        active = [s for s in active if accept(s, new[s])]

        # ---- decode: one new token per active sequence per step ----
        while active:
            ctx = np.array([len(tokens[s]) - 1 for s in active])
            for s in active:  # a block for the incoming token's position when the last one is full
                if len(tokens[s]) > len(blocks[s]) * bs:
                    blocks[s] += self.allocator.allocate(1)
            md = build_attn_metadata(table([blocks[s] for s in active]), ctx, np.ones(len(active)), bs,
                                     num_seqs_padded=batch, num_tokens_padded=batch, max_query_len=1)
            ids = np.zeros(batch, np.int32)
            ids[:len(active)] = [tokens[s][-1] for s in active]
            pos = np.zeros(batch, np.int32)
            pos[:len(active)] = ctx
            key, sub = jax.random.split(key)
            t0 = time.perf_counter()
            new, logits = self._run(ids, pos, md, np.arange(batch), sub, sampling, return_logits)
            dt = time.perf_counter() - t0
            if stats.decode_steps == 0:
                stats.first_decode_s = dt
            else:
                stats.decode_s += dt
                stats.decode_tokens += len(active)
            stats.decode_steps += 1
            if return_logits:
                full = np.full((num_seqs, logits.shape[-1]), np.nan, np.float32)
                full[active] = np.asarray(logits)[:len(active)]
                stats.step_logits.append(full)
            active = [s for r, s in enumerate(active) if accept(s, new[r])]

        stats.generated_tokens = sum(len(c.token_ids) for c in done)
        return done, stats
