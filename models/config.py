"""Hyper-parameters of a Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen 2/3 share it)."""

from __future__ import annotations

import dataclasses

from models.decoder_config import DecoderConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """A :class:`models.decoder_config.DecoderConfig` with Llama's defaults (pre-norm blocks, SwiGLU, no
    bias, one RoPE base). Qwen 2/3 and Mistral are Llama configs with other :attr:`arch` switches or a
    ``sliding_window``.

    Hashable, so it can be a static argument of ``jax.jit``. SmolLM2-135M: ``hidden_size=576``,
    ``intermediate_size=1536``, ``num_layers=30``, ``num_heads=9``, ``num_kv_heads=3``, ``head_size=64``.
    """
