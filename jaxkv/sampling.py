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
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # the threshold is the smallest logit kept: tokens whose preceding mass is still < top_p
        kept = mass_before < top_p
        threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
