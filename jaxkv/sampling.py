"""Next-token sampling on device: greedy, temperature and nucleus (top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
