"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen 2/3): :class:`models.decoder.DecoderForCausalLM`
with a :class:`models.decoder_config.LlamaConfig`.

Kept as its own name for the GGUF path and its callers; the layers are :mod:`models.decoder`'s, shared
with Gemma 3. :meth:`LlamaForCausalLM.forward_dense` is the independent cache-free forward the paged path is
checked against.
"""

from __future__ import annotations

import jax.numpy as jnp

from models.decoder import (
    MLP,
    Attention,
    DecoderForCausalLM,
    DecoderLayer,
    apply_rope,
    dense_attention,
    rope_cos_sin,
    set_weight,
)
from models.decoder import from_weights as _from_weights
from models.decoder_config import LlamaConfig

__all__ = ["Attention", "DecoderLayer", "LlamaForCausalLM", "MLP", "apply_rope", "dense_attention", "from_weights",
           "rope_cos_sin", "set_weight"]


class LlamaForCausalLM(DecoderForCausalLM):
    """Embedding, ``num_layers`` pre-norm decoder layers, final norm and LM head (tied by default)."""


def from_weights(config: LlamaConfig, weights: dict, *, dtype=jnp.float32, quantization=None
                 ) -> DecoderForCausalLM:
    """Build the model from a weight dict (names of :func:`models.gguf_loader.load_llama_gguf`).

    Raises:
        ValueError: a weight missing or with the wrong shape (names the weight and both shapes).
    """
    return _from_weights(config, weights, dtype=dtype, cls=LlamaForCausalLM, quantization=quantization)
