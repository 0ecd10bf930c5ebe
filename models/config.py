"""Hyper-parameters of a Llama-family decoder (SmolLM2, Llama 2/3 style)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Static description of a Llama-family decoder.

    Hashable, so it can be a static argument of ``jax.jit``.

    Attributes:
        vocab_size: tokens in the vocabulary.
        hidden_size: model width (SmolLM2-135M: 576).
        intermediate_size: SwiGLU inner width (SmolLM2-135M: 1536).
        num_layers: decoder layers (SmolLM2-135M: 30).
        num_heads: query heads per layer (SmolLM2-135M: 9).
        num_kv_heads: key/value heads per layer (SmolLM2-135M: 3).
        head_size: channels per head (SmolLM2-135M: 64).
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: longest sequence the model supports, in tokens.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        bos_token_id, eos_token_id: special token ids (``None`` when absent).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}")

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads
