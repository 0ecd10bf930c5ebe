"""Gemma 3 text decoder (Gemma-3-270M and larger) in Flax NNX: :class:`models.decoder.DecoderForCausalLM` with
Gemma 3's switches (:data:`models.decoder_config.GEMMA3`).

Architecture (Gemma 3 technical report; HF ``modeling_gemma3.py``; llama.cpp ``gemma3``):

* embedding scaled by ``sqrt(hidden_size)`` (in the model dtype), output head tied to the embedding;
* per layer: ``x + post_attention_norm(attn(input_norm(x)))`` then
  ``x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))`` (pre- and post-norms around both);
* attention: q/k/v projections, RMSNorm over ``head_size`` of every query and key head (q_norm / k_norm),
  RoPE (NeoX ``rotate_half`` pairs) with base 1e4 on sliding-window layers and 1e6 on global layers, softmax
  scale ``query_pre_attn_scalar ** -0.5``, MQA/GQA; five sliding-window layers (window 512, the current
  token included) then one global layer;
* MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
* RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` in float32, where ``w`` is the held weight. HF stores ``w - 1``
  (``Gemma3RMSNorm`` multiplies by ``1 + weight``; :mod:`models.hf_loader` adds the 1); llama.cpp's converter
  adds the 1 when it writes the GGUF, so GGUF norm weights are used as they are.

Paged path: each layer writes its K/V into the cache tensor it is bound to and attends with the metadata of
its KV-cache group (vLLM: one metadata per group, looked up by the layer). Sliding-window layers pass
``sliding_window`` to the attention op, so the kernels mask keys before the window and skip their blocks.
"""

from __future__ import annotations

import jax.numpy as jnp

from models.decoder import DecoderForCausalLM
from models.decoder import from_weights as _from_weights
from models.decoder import random_weights as _random_weights
from models.gemma3_config import Gemma3Config

__all__ = ["Gemma3ForCausalLM", "from_weights", "random_weights"]


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Scaled embedding, ``num_layers`` sandwich-norm decoder layers, final norm, tied LM head."""


def from_weights(config: Gemma3Config, weights: dict, *, dtype=jnp.float32, quantization=None
                 ) -> DecoderForCausalLM:
    """Build the model from a weight dict (names of :func:`models.gemma3_loader.load_gemma3_gguf`).

    Raises:
        ValueError: a weight missing or with the wrong shape (names the weight and both shapes).
    """
    return _from_weights(config, weights, dtype=dtype, cls=Gemma3ForCausalLM, quantization=quantization)


def random_weights(config: Gemma3Config, *, seed: int = 0, dtype=jnp.float32) -> DecoderForCausalLM:
    """A randomly initialised model (tests): norm weights drawn around 1 so they are not the identity."""
    return _random_weights(config, seed=seed, dtype=dtype, cls=Gemma3ForCausalLM)
