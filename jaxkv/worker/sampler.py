"""Next-token sampling on device: greedy, temperature, top-k and nucleus (top-p); batch-wide or per row."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


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
    """One token per row, each row with its own temperature, top-p, top-k and PRNG key.

    vLLM: the V1 ``Sampler`` (min-tokens logits processor, top-k/top-p, greedy rows by argmax). A row's
    key is ``fold_in(key(seed), gen_idx)``, so the same request samples the same tokens in any batch.

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
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(logits.shape[0])[:, None]
    masked = (params.gen_idx < params.min_tokens)[:, None] & (params.stop_ids >= 0)
    logits = logits.at[rows, jnp.where(masked, params.stop_ids, logits.shape[-1])].set(
        -jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    if top_k_top_p is None:
        needs_filter = jnp.any(_rows_filter(params.temperature, params.top_p, params.top_k))
        scaled = jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda x, *_: x, scaled, params.top_k,
                              params.top_p)
    elif top_k_top_p:
        scaled = _filter_top_k_top_p(scaled, params.top_k, params.top_p)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(params.seeds, params.gen_idx)
    sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(params.temperature > 0, sampled, greedy)
