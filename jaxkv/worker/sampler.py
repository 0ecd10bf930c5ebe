"""Next-token sampling on device, per row: vLLM V1's ``Sampler`` (``vllm/v1/sample/sampler.py``).

Order, as vLLM's: the raw logprobs (``logprobs_mode="raw_logprobs"``: the model's own distribution) are taken
first; then ``allowed_token_ids``, bad words, ``min_tokens`` (stop tokens masked) and ``logit_bias``; then the
repetition, frequency and presence penalties; the greedy rows take the argmax of that; the others divide by
their temperature, drop tokens under ``min_p`` times the most likely one's probability, apply top-k then top-p,
and draw with their own key (``fold_in(key(seed), gen_idx)``: a request's tokens do not depend on its batch), a
chunk then a token within it (:func:`categorical_by_chunks`, the same distribution with ~1/170 of the random draws
at a 128k vocabulary).

Every extra (the ``min_tokens`` mask, ``min_p``, penalties, bias, allow list, bad words, logprobs) is a static
:class:`SamplerFeatures`
flag of the step: a batch without one compiles and runs none of its code.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def sample_tokens(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float) -> jax.Array:
    """Pick one token per row.

    Args:
        logits: ``f32[num_seqs, vocab_size]``.
        key: a PRNG key (unused when greedy).
        temperature: 0 → greedy (argmax); > 0 divides the logits (static).
        top_p: keep the smallest set of tokens whose probability mass reaches ``top_p`` (static,
            in ``(0, 1]``; 1 keeps all).

    Returns:
        ``int32[num_seqs]``.

    Raises:
        ValueError: ``temperature < 0`` or ``top_p`` outside ``(0, 1]``.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1:
        # Work on sorted positions, not values, so ties at the boundary do not widen the nucleus.
        order = jnp.argsort(-logits, axis=-1, stable=True)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p  # mass before this token < top_p
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1,
                                  inplace=False)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["temperature", "top_p", "top_k", "seeds", "gen_idx", "min_tokens",
                                "stop_ids"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters of a batched step (pytree; ``R`` = padded request count).

    Attributes:
        temperature: ``f32[R]``, 0 = greedy.
        top_p: ``f32[R]``, 1 = off.
        top_k: ``int32[R]``, ``<= 0`` = off.
        seeds: ``uint32[R]`` each request's seed.
        gen_idx: ``int32[R]`` index of the token being sampled among the request's outputs; with the
            seed it makes the row's PRNG key, so a request's samples do not depend on its batch.
        min_tokens: ``int32[R]``: while ``gen_idx < min_tokens`` the row's ``stop_ids`` are masked.
        stop_ids: ``int32[R, S]`` tokens that would stop the row (EOS and stop tokens), ``-1`` padded.
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seeds: jax.Array
    gen_idx: jax.Array
    min_tokens: jax.Array
    stop_ids: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplerFeatures:
    """What one step's sampler does beyond temperature (static: each combination is its own program).

    Attributes:
        min_tokens: some row is still under its ``min_tokens`` (``SamplingArrays.min_tokens`` > its ``gen_idx``
            when the step is dispatched): its stop ids are masked while ``gen_idx < min_tokens``. Without it the
            step has no mask at all: at a 128k vocabulary and batch 256 the mask cost 39.5 us a step on an H200 as
            a comparison (written out as a bool mask) and 47 us as a scatter into the logits (their f32 copy then
            written out), against 72 us for the draw's two passes over the logits (docs/perf-notes.md, session 33).
        top_k_top_p: some row filters by top-k or top-p.
        min_p: some row has ``min_p > 0``; ``extras["min_p"]`` ``f32[R]``.
        penalties: some row has a penalty; ``extras``: ``presence``, ``frequency``, ``repetition`` ``f32[R]``,
            ``output_ids`` ``int32[R, L]`` (the row's generated tokens so far, ``-1`` padded) and
            ``prompt_ids`` ``int32[R, P]`` (its prompt, ``-1`` padded).
        logit_bias: ``extras``: ``bias_ids`` ``int32[R, B]`` (``-1`` padded), ``bias_values`` ``f32[R, B]``.
        allowed: ``extras``: ``allowed_ids`` ``int32[R, A]`` (``-1`` padded) and ``has_allowed`` ``int32[R]``
            (1: only the row's ids may be sampled).
        bad_words: ``extras["bad_ids"]`` ``int32[R, W]``: tokens the row may not sample now (``-1`` padded).
        bitmask: structured outputs: ``extras["bitmask"]`` ``int32[R, ceil(vocab / 32)]``, bit ``t % 32`` of word
            ``t // 32`` set where token ``t`` is allowed (all ones for an unconstrained row).
        bitmask_in_step: the model runner computes ``extras["bitmask"]`` inside the step (host callbacks per
            step, :meth:`jaxkv.worker.model_runner.ModelRunner.use_step_masks`) from ``extras["grammar_id"]``;
            the sampler itself reads only ``bitmask``.
        grammar_dfa: some row's grammar is an automaton on the device (:mod:`jaxkv.core.grammar_dfa`): the model
            runner computes its ``bitmask`` rows inside the step from the row's state (``extras["slots"]``,
            ``extras["dfa_offset"]``) and advances the state by the sampled token.
        num_logprobs: ``-1``: no row wants logprobs; else the top this many are returned per row (with the
            sampled token's logprob and rank).
    """

    min_tokens: bool = False
    top_k_top_p: bool = False
    min_p: bool = False
    penalties: bool = False
    logit_bias: bool = False
    allowed: bool = False
    bad_words: bool = False
    bitmask: bool = False
    bitmask_in_step: bool = False
    grammar_dfa: bool = False
    num_logprobs: int = -1


def _set_at(logits: jax.Array, ids: jax.Array, value) -> jax.Array:
    """``logits[r, ids[r, j]] = value`` for every ``ids >= 0``."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(ids >= 0, ids, logits.shape[-1])].set(value, mode="drop")


def _mask_ids(logits: jax.Array, ids: jax.Array, value) -> jax.Array:
    """``logits[r, ids[r, j]] = value`` for every ``ids >= 0`` (``ids`` ``int32[R, S]``, S small) as an elementwise
    comparison with each of the ``S`` ids, which XLA fuses into the logits' consumers (or writes out as a bool mask);
    :func:`_set_at`'s scatter would need the f32 logits written out first."""
    token = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :]
    hit = functools.reduce(jnp.logical_or, [token == ids[:, j:j + 1] for j in range(ids.shape[1])],
                           jnp.zeros(logits.shape, bool))
    return jnp.where(hit, value, logits)


SAMPLE_CHUNK = 256
"""Tokens per chunk of :func:`categorical_by_chunks` (~sqrt of a 128k vocabulary: ~500 chunk draws + 256 token
draws a row)."""


def categorical_by_chunks(keys: jax.Array, logits: jax.Array, chunk: int = SAMPLE_CHUNK) -> jax.Array:
    """One token per row from ``softmax(logits[r])`` with row ``r``'s key: ``jax.random.categorical``'s
    distribution, drawn with ``ceil(vocab / chunk) + chunk`` Gumbel numbers a row instead of ``vocab``.

    Gumbel-max twice: a chunk ``c`` of ``chunk`` consecutive tokens is picked by ``argmax(lse_c + g_c)``, where
    ``lse_c`` is the logsumexp of its logits (so ``P(c)`` is the chunk's total probability), then a token ``i``
    within it by ``argmax(logits_i + g_i)`` (``P(i | c) = p_i / P(c)``): ``P(i) = p_i`` exactly, up to float32
    rounding. A fully masked chunk (all ``-inf``) has ``lse = -inf`` and is never picked. The draws for a 128k
    vocabulary fall from 128,256 to 757 a row: the one-pass ``jax.random.categorical`` of a batch-256 decode
    step took 185 us on an H200, its threefry hashes bound by integer work (docs/perf-notes.md, session 33).
    vLLM samples with one exponential draw per vocabulary entry (``probs / q``), as ``jax.random.categorical``
    does with Gumbel noise.

    Args:
        keys: ``key[R]`` typed PRNG keys, one a row (two streams are split from each).
        logits: ``f32[R, vocab]`` (``-inf`` = masked).
        chunk: tokens per chunk (static); a vocabulary of at most ``2 * chunk`` tokens is drawn in one pass.

    Returns:
        ``int32[R]`` token ids.
    """
    rows, vocab = logits.shape
    if vocab <= 2 * chunk:
        return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
    num_chunks = -(-vocab // chunk)
    pad = num_chunks * chunk - vocab
    blocks = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(rows, num_chunks, chunk)
    top = jnp.max(blocks, axis=-1)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(blocks - safe[..., None]), axis=-1)) + safe  # -inf for an all-masked chunk
    pair = jax.vmap(lambda k: jax.random.split(k))(keys)
    g_chunk = jax.vmap(lambda k: jax.random.gumbel(k, (num_chunks,)))(pair[:, 0])
    c = jnp.argmax(lse + g_chunk, axis=-1).astype(jnp.int32)
    token = c[:, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    within = jnp.take_along_axis(logits, jnp.minimum(token, vocab - 1), axis=-1)
    within = jnp.where(token < vocab, within, -jnp.inf)
    g_token = jax.vmap(lambda k: jax.random.gumbel(k, (chunk,)))(pair[:, 1])
    return c * chunk + jnp.argmax(within + g_token, axis=-1).astype(jnp.int32)


def token_counts(ids: jax.Array, vocab_size: int) -> jax.Array:
    """``int32[R, vocab_size]``: how often each token occurs in each row of ``ids`` (``-1`` ignored).
    vLLM ``get_token_bin_counts_and_mask``."""
    rows = jnp.arange(ids.shape[0])[:, None]
    counts = jnp.zeros((ids.shape[0], vocab_size), jnp.int32)
    return counts.at[rows, jnp.where(ids >= 0, ids, vocab_size)].add(1, mode="drop")


def apply_penalties(logits: jax.Array, output_counts: jax.Array, prompt_mask: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's ``apply_penalties``: a token seen in the prompt or the output has its logit divided by
    ``repetition`` when positive and multiplied by it otherwise; then ``frequency * count`` and
    ``presence * (count > 0)`` of the output are subtracted.

    Args:
        logits: ``f32[R, V]``. output_counts: ``int32[R, V]``. prompt_mask: ``bool[R, V]``.
        presence, frequency, repetition: ``f32[R]``.
    """
    seen = output_counts > 0
    rep = jnp.where(prompt_mask | seen, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency[:, None] * output_counts - presence[:, None] * seen


def raw_logprobs(logits: jax.Array, sampled: jax.Array, k: int) -> dict[str, jax.Array]:
    """Log-probabilities of ``logits``' distribution: the ``sampled`` token's (``f32[R]``) and its rank
    (``int32[R]``, 1 = most likely; ties share the better rank), and the ``k`` most likely tokens' ids and
    logprobs (``int32[R, k]``, ``f32[R, k]``). vLLM ``Sampler.compute_logprobs`` / ``gather_logprobs``."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(sampled, 0)[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1).astype(jnp.int32)
    out = dict(logprob=chosen, rank=rank)
    if k > 0:
        top_lps, top_ids = lax.top_k(lp, k)
        out.update(top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lps)
    return out


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to ``-inf``) what top-k then top-p (over the renormalised top-k) drop, per row."""
    vocab = logits.shape[-1]
    vals = -jnp.sort(-logits, axis=-1)                                   # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    rank = jnp.arange(vocab)[None, :]
    vals = jnp.where(rank < k[:, None], vals, -jnp.inf)
    probs = jax.nn.softmax(vals, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) & (rank < k[:, None])
    cutoff = jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1)           # smallest kept logit
    return jnp.where(logits >= cutoff[:, None], logits, -jnp.inf)


def _rows_filter(temperature, top_p, top_k):
    """Per row (NumPy or JAX arrays): sampled (``temperature > 0``) and filtered by top-p or top-k."""
    return (temperature > 0) & ((top_p < 1) | (top_k > 0))


def needs_top_k_top_p(temperature, top_p, top_k) -> bool:
    """Host (NumPy) check: does any sampled row filter by top-p or top-k? The engine passes the answer
    to :func:`sample_tokens_per_row` as a static flag."""
    return bool(np.any(_rows_filter(np.asarray(temperature), np.asarray(top_p), np.asarray(top_k))))


def sample_tokens_per_row(logits: jax.Array, params: SamplingArrays, *,
                          top_k_top_p: bool | None = None) -> jax.Array:
    """One token per row, each row with its own temperature, top-p, top-k, ``min_tokens`` and PRNG key (no extras:
    :func:`sample_with_features` with the ``min_tokens`` mask and ``top_k_top_p``).

    Args:
        logits: ``f32[R, vocab]``.
        params: :class:`SamplingArrays` with ``R`` rows.
        top_k_top_p: static: whether any row filters by top-k/top-p (:func:`needs_top_k_top_p`);
            ``False`` skips the filter's full-vocabulary sort, ``True`` applies it (rows with
            ``top_p == 1`` and ``top_k <= 0`` keep every token). ``None``: decided on the device with a
            ``lax.cond``, which on GPU makes the call wait on the host for the predicate (the engine
            never uses it).

    Returns:
        ``int32[R]``.
    """
    if top_k_top_p is None:
        needs_filter = jnp.any(_rows_filter(params.temperature, params.top_p, params.top_k))
        filtered, plain = SamplerFeatures(min_tokens=True, top_k_top_p=True), SamplerFeatures(min_tokens=True)
        return lax.cond(needs_filter,
                        lambda x: sample_with_features(x, params, {}, filtered)[0],
                        lambda x: sample_with_features(x, params, {}, plain)[0], logits)
    return sample_with_features(logits, params, {}, SamplerFeatures(min_tokens=True, top_k_top_p=top_k_top_p))[0]


def process_logits(logits: jax.Array, params: SamplingArrays, extras: dict, features: SamplerFeatures, *,
                   output_counts: jax.Array | None = None, prompt_mask: jax.Array | None = None) -> jax.Array:
    """The logits a row samples from before its temperature: the structured-output bitmask, ``allowed_token_ids``,
    bad words, the ``min_tokens`` mask, ``logit_bias``, then the penalties (vLLM V1's order; masked tokens are
    ``-inf``); the ``min_tokens`` mask only with ``features.min_tokens``.

    Args:
        logits: ``[R, vocab]`` raw logits (any float dtype).
        params, extras, features: as :func:`sample_with_features`.
        output_counts, prompt_mask: with ``features.penalties`` (required): ``int32[R, vocab]`` /
            ``bool[R, vocab]`` (:func:`token_counts` of the rows' output and prompt tokens).

    Raises:
        ValueError: ``features.penalties`` without ``output_counts`` and ``prompt_mask``.

    Returns:
        ``f32[R, vocab]``.
    """
    logits = jnp.asarray(logits).astype(jnp.float32)
    vocab = logits.shape[-1]
    if features.bitmask:
        token = jnp.arange(vocab)
        words = extras["bitmask"][:, token // 32]
        allowed = (jnp.right_shift(words, (token % 32).astype(jnp.int32)[None, :]) & 1) != 0
        logits = jnp.where(allowed, logits, -jnp.inf)
    if features.allowed:
        allowed = _set_at(jnp.zeros_like(logits, dtype=bool), extras["allowed_ids"], True)
        logits = jnp.where((extras["has_allowed"][:, None] > 0) & ~allowed, -jnp.inf, logits)
    if features.bad_words:
        logits = _set_at(logits, extras["bad_ids"], -jnp.inf)
    if features.min_tokens:
        masked = (params.gen_idx < params.min_tokens)[:, None] & (params.stop_ids >= 0)
        logits = _mask_ids(logits, jnp.where(masked, params.stop_ids, -1), -jnp.inf)
    if features.logit_bias:
        rows = jnp.arange(logits.shape[0])[:, None]
        ids = extras["bias_ids"]
        logits = logits.at[rows, jnp.where(ids >= 0, ids, vocab)].add(extras["bias_values"], mode="drop")
    if features.penalties:
        if output_counts is None or prompt_mask is None:
            raise ValueError("features.penalties needs output_counts and prompt_mask (token_counts of the rows' "
                             "output and prompt tokens)")
        logits = apply_penalties(logits, output_counts, prompt_mask, extras["presence"], extras["frequency"],
                                 extras["repetition"])
    return logits


def apply_min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """vLLM's min-p: tokens whose probability (of the temperature-scaled ``f32[R, vocab]`` logits) is below
    ``min_p[r]`` (``f32[R]``) times the row's largest are set to ``-inf``."""
    probs = jax.nn.softmax(scaled, axis=-1)
    floor = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < floor, -jnp.inf, scaled)


def sample_with_features(logits: jax.Array, params: SamplingArrays, extras: dict, features: SamplerFeatures, *,
                         output_counts: jax.Array | None = None, prompt_mask: jax.Array | None = None
                         ) -> tuple[jax.Array, dict | None]:
    """One token per row (vLLM V1 ``Sampler.forward``; the order is the module docstring's).

    Args:
        logits: ``[R, vocab]`` raw logits, any float dtype (the model's bf16 output as it is).
        params: :class:`SamplingArrays` with ``R`` rows.
        extras: the per-row arrays ``features`` names (:class:`SamplerFeatures`).
        features: static.
        output_counts, prompt_mask: with ``features.penalties``, ``int32[R, vocab]`` counts of each row's
            generated tokens and ``bool[R, vocab]`` its prompt's tokens (the runner keeps them per slot on
            the device, and a decode loop up to date across its steps).

    Returns:
        ``(tokens int32[R], logprobs)``: ``logprobs`` is :func:`raw_logprobs`' dict when
        ``features.num_logprobs >= 0``, else ``None``.
    """
    raw = logits.astype(jnp.float32)  # read only for logprobs: the model's own distribution
    logits = process_logits(logits, params, extras, features, output_counts=output_counts, prompt_mask=prompt_mask)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    if features.min_p:
        scaled = apply_min_p(scaled, extras["min_p"])
    if features.top_k_top_p:
        scaled = _filter_top_k_top_p(scaled, params.top_k, params.top_p)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(params.seeds, params.gen_idx)
    sampled = categorical_by_chunks(keys, scaled)
    tokens = jnp.where(params.temperature > 0, sampled, greedy)
    logprobs = raw_logprobs(raw, tokens, features.num_logprobs) if features.num_logprobs >= 0 else None
    return tokens, logprobs
