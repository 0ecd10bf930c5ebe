"""A minimal batch generation engine: block allocation, metadata, jitted steps with the cache donated.

The engine is model-agnostic: it drives any ``model_fn(params, input_ids, positions, kv_caches, metadata,
logits_indices) -> (logits, kv_caches)``. One call of :meth:`Engine.generate` prefills all prompts in one
step, then decodes them together in a device loop of ``steps_per_sync`` steps per host round trip
(``lax.scan``: slot mapping, sequence lengths, sampling and stop checks all stay on the device).
Finished sequences become padding rows (``PAD_SLOT_ID`` slot, length-1 dummy sequence, as vLLM pads CUDA
graphs), so the decode loop keeps one shape and compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.block_allocator import BlockAllocator
from jaxkv.metadata import AttentionMetadata, build_attn_metadata
from jaxkv.prefix_cache import PrefixCache, block_hashes
from jaxkv.sampling import sample_tokens
from jaxkv.slot_mapping import slot_mapping_from_positions

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

    ``decode_s`` / ``decode_steps`` / ``decode_tokens`` exclude the first decode chunk, which includes
    compilation when its shape is new (``first_decode_s``). ``step_logits`` (with ``return_logits``) has
    one ``f32[num_prompts, vocab]`` array per step, NaN rows for finished sequences.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
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

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "positions", "remaining", "active", "stopped", "key"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-row decode state carried on the device between steps (``B`` = padded batch).

    Attributes:
        tokens: ``int32[B]`` last token of each row (the next step's input).
        positions: ``int32[B]`` position of that token (= tokens already in the cache).
        remaining: ``int32[B]`` tokens each row may still generate.
        active: ``bool[B]`` rows still generating (dummy and finished rows are padding).
        stopped: ``bool[B]`` rows that ended on a stop token.
        key: PRNG key for sampling.
    """

    tokens: jax.Array
    positions: jax.Array
    remaining: jax.Array
    active: jax.Array
    stopped: jax.Array
    key: jax.Array


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
        steps_per_sync: decode steps run on the device between two host round trips (a sequence may
            run up to ``steps_per_sync - 1`` padding steps after it finished).
        prefill_chunk_size: chunked prefill: at most this many prompt tokens per sequence per step, each
            chunk attending to the chunks already in the cache (vLLM's chunked prefill); ``None`` = the
            whole prompt in one step.
        enable_prefix_caching: keep the full prompt blocks of finished sequences in the cache and reuse
            them for later prompts with the same prefix (only the remaining tokens are computed);
            :class:`jaxkv.prefix_cache.PrefixCache`.

    Raises:
        ValueError: caches of different shapes, or non-positive sizes.
    """

    def __init__(self, model_fn: ModelFn, params, kv_caches: list[jax.Array], *, block_size: int,
                 max_model_len: int, steps_per_sync: int = 1, prefill_chunk_size: int | None = None,
                 enable_prefix_caching: bool = False):
        shapes = {c.shape for c in kv_caches}
        if len(shapes) != 1:
            raise ValueError(f"kv_caches have different shapes: {sorted(shapes)}")
        (shape,) = shapes
        if shape[3] != block_size:
            raise ValueError(f"block_size={block_size} != cache block size {shape[3]}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len} must be >= 1")
        if steps_per_sync < 1:
            raise ValueError(f"steps_per_sync={steps_per_sync} must be >= 1")
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size={prefill_chunk_size} must be >= 1 or None")
        self.prefill_chunk_size = prefill_chunk_size
        self.model_fn = model_fn
        self.params = params
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.steps_per_sync = steps_per_sync
        self.max_num_blocks_per_seq = -(-max_model_len // block_size)
        self.allocator = BlockAllocator(shape[1])
        self.prefix_cache = PrefixCache(self.allocator) if enable_prefix_caching else None
        self.num_compiles = 0
        self._prefill = jax.jit(self._prefill_step, donate_argnums=(1,),
                                static_argnames=("temperature", "top_p", "return_logits"))
        self._decode = jax.jit(self._decode_loop, donate_argnums=(1,),
                               static_argnames=("num_steps", "temperature", "top_p", "return_logits"))

    # -- device functions --------------------------------------------------------------------------
    def _prefill_step(self, params, kv_caches, input_ids, positions, metadata, logits_indices, key, *,
                      temperature, top_p, return_logits):
        self.num_compiles += 1  # runs only while tracing
        logits, kv_caches = self.model_fn(params, input_ids, positions, kv_caches, metadata,
                                          logits_indices)
        tokens = sample_tokens(logits, key, temperature=temperature, top_p=top_p)
        return tokens, (logits if return_logits else None), kv_caches

    def _decode_loop(self, params, kv_caches, state: DecodeState, block_tables, stop_token_ids, *,
                     num_steps, temperature, top_p, return_logits):
        """``num_steps`` decode steps on the device. Returns per-step tokens (-1 where a row emitted
        nothing), per-step ``was_active``, optional logits, the new state and caches."""
        self.num_compiles += 1
        batch = state.tokens.shape[0]
        rows = jnp.arange(batch, dtype=jnp.int32)

        def step(carry, i):
            s, caches = carry
            fed = jnp.where(s.active, s.positions, -1)  # -1 → PAD slot: padding rows write nothing
            metadata = AttentionMetadata(
                slot_mapping=slot_mapping_from_positions(block_tables, rows, fed, self.block_size),
                seq_lens=jnp.where(s.active, s.positions + 1, 1).astype(jnp.int32),
                block_tables=block_tables,
                query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
                max_query_len=1,
                max_seq_len=block_tables.shape[1] * self.block_size)
            logits, caches = self.model_fn(params, s.tokens, jnp.maximum(fed, 0), caches, metadata, rows)
            new = sample_tokens(logits, jax.random.fold_in(s.key, i), temperature=temperature,
                                top_p=top_p)
            is_stop = jnp.isin(new, stop_token_ids)
            emit = s.active & ~is_stop
            positions = s.positions + emit
            remaining = s.remaining - emit
            s_next = DecodeState(
                tokens=jnp.where(emit, new, s.tokens), positions=positions, remaining=remaining,
                active=emit & (remaining > 0) & (positions + 1 < self.max_model_len),
                stopped=s.stopped | (s.active & is_stop), key=s.key)
            outputs = (jnp.where(emit, new, -1), s.active, logits if return_logits else None)
            return (s_next, caches), outputs

        (state, kv_caches), (out_tokens, out_active, out_logits) = lax.scan(
            step, (state, kv_caches), jnp.arange(num_steps))
        state = dataclasses.replace(state, key=jax.random.fold_in(state.key, num_steps))
        return out_tokens, out_active, out_logits, state, kv_caches

    # -- admission -------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]], sampling: SamplingParams,
                       reused: list[list[int]]) -> list[int]:
        """Validate the batch; return the new blocks each prompt needs (beyond its reused prefix)."""
        if not prompts:
            raise ValueError("prompts=[] holds no prompt")
        need = []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty")
            if len(p) >= self.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens; max_model_len={self.max_model_len} "
                                 "leaves no room to generate")
            need.append(-(-self._final_len(len(p), sampling) // self.block_size) - len(reused[i]))
        available = self.allocator.num_free_blocks
        if self.prefix_cache is not None:
            available += self.prefix_cache.num_evictable_blocks_without({b for r in reused for b in r})
        if sum(need) > available:
            raise ValueError(f"the batch needs {sum(need)} blocks (prompt + max_new_tokens), the cache has "
                             f"{available} free of {self.allocator.num_blocks}")
        return need

    def _final_len(self, prompt_len: int, sampling: SamplingParams) -> int:
        return min(prompt_len + sampling.max_new_tokens, self.max_model_len)

    def _table(self, rows: list[list[int]], batch: int) -> np.ndarray:
        t = np.zeros((batch, self.max_num_blocks_per_seq), np.int32)
        for r, b in enumerate(rows):
            t[r, :len(b)] = b
        return t

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, *,
                 return_logits: bool = False) -> tuple[list[Completion], GenerationStats]:
        """Generate a completion for every prompt.

        Every sequence's blocks for its whole generation (prompt + ``max_new_tokens``, capped at
        ``max_model_len``) are reserved at admission, so a batch that is admitted cannot run out of
        blocks; they are freed when the call returns.

        Raises:
            ValueError: empty prompt list or prompt, a prompt of ``>= max_model_len`` tokens, or a batch
                the cache cannot hold to its end; raised before any work, nothing is allocated.
        """
        hashes = [self._prompt_hashes(p) for p in prompts]
        reused = [self.prefix_cache.match(h) if self.prefix_cache else [] for h in hashes]
        need = self._check_prompts(prompts, sampling, reused)
        num_seqs = len(prompts)
        batch = _next_pow2(num_seqs)
        stats = GenerationStats(prompt_tokens=sum(map(len, prompts)),
                                cached_prompt_tokens=self.block_size * sum(map(len, reused)))
        if self.prefix_cache is None:
            blocks = [self.allocator.allocate(n) for n in need]
        else:
            for r in reused:
                self.prefix_cache.acquire(r)
            blocks = [r + self.prefix_cache.allocate(n) for r, n in zip(reused, need)]
        try:
            result = self._generate(prompts, sampling, return_logits, batch, blocks, stats,
                                    [len(r) * self.block_size for r in reused])
        except BaseException:
            self._release(blocks, hashes, reused, computed=False)
            raise
        self._release(blocks, hashes, reused, computed=True)
        return result

    def _prompt_hashes(self, prompt: list[int]) -> list[int]:
        # full blocks of the prompt minus its last token: the last token is always computed, so the
        # prefill step has a logit to sample the first new token from (as vLLM recomputes it)
        return block_hashes(prompt[:-1], self.block_size) if self.prefix_cache else []

    def _release(self, blocks, hashes, reused, *, computed: bool) -> None:
        """Give every block back; with prefix caching, keep the prompt's full blocks cached (only when
        the call completed, so that no block is cached before its K/V was written)."""
        for b, h, r in zip(blocks, hashes, reused):
            if self.prefix_cache is None:
                self.allocator.free(b)
                continue
            self.prefix_cache.release(r)
            fresh_full = b[len(r):len(h)] if computed else []  # this prompt's full blocks, computed now
            rejected = self.prefix_cache.register(h[len(r):], fresh_full)
            kept = [x for x in fresh_full if x not in rejected]
            self.prefix_cache.release(kept)
            self.allocator.free(rejected + b[len(r) + len(fresh_full):])

    def _generate(self, prompts, sampling, return_logits, batch, blocks, stats, cached_lens):
        num_seqs = len(prompts)
        done = [Completion(list(p), []) for p in prompts]
        key = jax.random.key(sampling.seed)
        flags = dict(temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                     return_logits=return_logits)
        table = self._table(blocks, batch)

        # ---- prefill: every prompt, in chunks of at most prefill_chunk_size tokens per step ----
        lens = np.array([len(p) for p in prompts])
        chunk = self.prefill_chunk_size or int(lens.max())
        computed = np.array(cached_lens, np.int64)  # num_computed_tokens: prompt tokens already cached
        first = np.zeros(batch, np.int32)
        first_logits = [None] * num_seqs
        max_q = _next_pow2(min(chunk, int(lens.max())))  # static across chunks: one compile
        t0 = time.perf_counter()
        while (computed < lens).any():
            rows = np.flatnonzero(computed < lens)
            q_lens = np.minimum(lens[rows] - computed[rows], chunk)
            num_tokens = int(q_lens.sum())
            # a chunk of one token per sequence is a decode-shaped batch: one token per (padded) row
            md = build_attn_metadata(table[rows], computed[rows], q_lens, self.block_size,
                                     num_seqs_padded=batch, max_query_len=max_q,
                                     num_tokens_padded=batch if max_q == 1 else _next_pow2(num_tokens, 16))
            ids = np.zeros(md.slot_mapping.shape[0], np.int32)
            ids[:num_tokens] = np.concatenate([prompts[s][computed[s]:computed[s] + n]
                                               for s, n in zip(rows, q_lens)])
            pos = np.zeros_like(ids)
            pos[:num_tokens] = np.concatenate([np.arange(computed[s], computed[s] + n)
                                               for s, n in zip(rows, q_lens)])
            last = np.zeros(batch, np.int32)
            last[:len(rows)] = np.cumsum(q_lens) - 1
            key, sub = jax.random.split(key)
            tokens, logits, self.kv_caches = self._prefill(
                self.params, self.kv_caches, jnp.asarray(ids), jnp.asarray(pos), md, jnp.asarray(last),
                sub, **flags)
            tokens = np.asarray(tokens)
            computed[rows] += q_lens
            for r, s in enumerate(rows):
                if computed[s] == lens[s]:  # this chunk ended the prompt: its last logits give token 1
                    first[s] = tokens[r]
                    if return_logits:
                        first_logits[s] = np.asarray(logits[r])
        stats.prefill_s = time.perf_counter() - t0
        if return_logits:
            stats.step_logits.append(np.stack(first_logits))

        # the first token is sampled by the prefill; the device loop takes it from there
        stop = np.array(sorted(sampling.stop_token_ids) or [-1], np.int32)
        first_stops = np.isin(first[:num_seqs], stop)
        for s in range(num_seqs):
            if first_stops[s]:
                done[s].finish_reason = "stop"
            else:
                done[s].token_ids.append(int(first[s]))
        remaining = np.zeros(batch, np.int32)
        remaining[:num_seqs] = sampling.max_new_tokens - 1
        positions = np.zeros(batch, np.int32)
        positions[:num_seqs] = lens
        active = np.zeros(batch, bool)
        active[:num_seqs] = ~first_stops & (remaining[:num_seqs] > 0) & (lens + 1 < self.max_model_len)
        state = DecodeState(tokens=jnp.asarray(first), positions=jnp.asarray(positions), remaining=jnp.asarray(remaining),
                            active=jnp.asarray(active), stopped=jnp.asarray(np.zeros(batch, bool)),
                            key=key)
        tables, stop = jnp.asarray(table), jnp.asarray(stop)

        # ---- decode: steps_per_sync steps per host round trip ----
        num_chunks = 0
        while active.any():
            t0 = time.perf_counter()
            out_tokens, was_active, logits, state, self.kv_caches = self._decode(
                self.params, self.kv_caches, state, tables, stop, num_steps=self.steps_per_sync, **flags)
            out_tokens, was_active = np.asarray(out_tokens), np.asarray(was_active)
            active = np.asarray(state.active)
            dt = time.perf_counter() - t0
            emitted = int((out_tokens[:, :num_seqs] >= 0).sum())
            if num_chunks == 0:
                stats.first_decode_s = dt
            else:
                stats.decode_s += dt
                stats.decode_steps += self.steps_per_sync
                stats.decode_tokens += emitted
            num_chunks += 1
            for s in range(num_seqs):
                done[s].token_ids.extend(int(t) for t in out_tokens[:, s] if t >= 0)
            if return_logits:
                logits = np.asarray(logits)
                for i in range(self.steps_per_sync):
                    if was_active[i, :num_seqs].any():
                        stats.step_logits.append(
                            np.where(was_active[i, :num_seqs, None], logits[i, :num_seqs], np.nan))

        stopped = np.asarray(state.stopped)
        for s in range(num_seqs):
            if done[s].finish_reason is None:
                done[s].finish_reason = "stop" if stopped[s] else "length"
        stats.generated_tokens = sum(len(c.token_ids) for c in done)
        return done, stats

