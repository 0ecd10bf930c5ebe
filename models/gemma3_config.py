"""Hyper-parameters of a Gemma 3 text decoder (Gemma-3-270M and its larger siblings)."""

from __future__ import annotations

import dataclasses

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config:
    """Static description of a Gemma 3 text decoder. Hashable (a ``jax.jit`` static argument).

    Field names follow Hugging Face's ``Gemma3TextConfig``; Gemma-3-270M values in parentheses.

    Attributes:
        vocab_size: tokens in the vocabulary (262144).
        hidden_size: model width (640).
        intermediate_size: GELU-tanh gated MLP inner width (2048).
        num_layers: decoder layers (18).
        num_heads: query heads (4).
        num_kv_heads: key/value heads (1: MQA).
        head_size: channels per head (256).
        query_pre_attn_scalar: the softmax scale is ``query_pre_attn_scalar ** -0.5`` (256).
        sliding_window: window of the sliding-window layers in tokens, the current token included (512).
        sliding_window_pattern: every ``sliding_window_pattern``-th layer is global (6: five sliding-window
            layers then one full-attention layer).
        rope_theta: RoPE base of the global layers (1e6).
        rope_local_base_freq: RoPE base of the sliding-window layers (1e4).
        rms_norm_eps: epsilon of every RMSNorm (1e-6).
        max_position_embeddings: context length in tokens (32768).
        bos_token_id, eos_token_id: special token ids.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 2
    eos_token_id: int | None = 1

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_size", "sliding_window", "sliding_window_pattern",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Gemma3Config.{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"Gemma3Config.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"Gemma3Config.head_size={self.head_size} must be even (RoPE)")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"Gemma3Config.query_pre_attn_scalar={self.query_pre_attn_scalar} must be > 0")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return True

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Per layer: ``"sliding_attention"`` or ``"full_attention"`` (HF's ``layer_types``; llama.cpp's
        ``swa_pattern``): layer ``i`` is global when ``(i + 1) % sliding_window_pattern == 0``."""
        p = self.sliding_window_pattern
        return tuple(FULL_ATTENTION if (i + 1) % p == 0 else SLIDING_ATTENTION
                     for i in range(self.num_layers))

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION

    def rope_base(self, layer: int) -> float:
        return self.rope_local_base_freq if self.is_sliding(layer) else self.rope_theta
