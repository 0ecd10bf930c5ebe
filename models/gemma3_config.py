"""Hyper-parameters of a Gemma 3 text decoder (Gemma-3-270M and its larger siblings)."""

from __future__ import annotations

import dataclasses

from models.decoder_config import FULL_ATTENTION, GEMMA3, SLIDING_ATTENTION, ArchSwitches, DecoderConfig

__all__ = ["FULL_ATTENTION", "Gemma3Config", "SLIDING_ATTENTION"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config(DecoderConfig):
    """Static description of a Gemma 3 text decoder: a :class:`models.decoder_config.DecoderConfig` with
    Gemma 3's switches (q/k norms, sandwich norms, GeGLU, scaled embeddings, tied head) and defaults.
    Hashable (a ``jax.jit`` static argument).

    Field names follow Hugging Face's ``Gemma3TextConfig``; Gemma-3-270M values in parentheses:
    ``vocab_size`` (262144), ``hidden_size`` (640), ``intermediate_size`` (2048), ``num_layers`` (18),
    ``num_heads`` (4), ``num_kv_heads`` (1: MQA), ``head_size`` (256).

    Attributes:
        query_pre_attn_scalar: the softmax scale is ``query_pre_attn_scalar ** -0.5`` (256).
        sliding_window: window of the sliding-window layers in tokens, the current token included (512).
        sliding_window_pattern: every ``sliding_window_pattern``-th layer is global (6: five sliding-window
            layers then one full-attention layer); used when ``layer_types`` is not given.
        rope_theta: RoPE base of the global layers (1e6).
        rope_local_base_freq: RoPE base of the sliding-window layers (1e4).
        rms_norm_eps: epsilon of every RMSNorm (1e-6).
        max_position_embeddings: context length in tokens (32768).
        bos_token_id, eos_token_id: special token ids.
    """

    query_pre_attn_scalar: float | None = 256.0
    sliding_window: int | None = 512
    sliding_window_pattern: int = 6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float | None = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: int | None = 1
    arch: ArchSwitches = GEMMA3
    architecture: str = "Gemma3ForCausalLM"

    def __post_init__(self):
        p = self.sliding_window_pattern
        if isinstance(p, bool) or not isinstance(p, int) or p <= 0:
            raise ValueError(f"Gemma3Config.sliding_window_pattern={p!r} must be a positive int")
        if self.sliding_window is None:
            raise ValueError("Gemma3Config.sliding_window=None: Gemma 3 needs its window")
        if not self.tie_word_embeddings:
            raise ValueError("Gemma3Config.tie_word_embeddings=False: Gemma 3 ties the LM head to the embedding")
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", tuple(
                FULL_ATTENTION if (i + 1) % p == 0 else SLIDING_ATTENTION for i in range(self.num_layers)))
        super().__post_init__()
