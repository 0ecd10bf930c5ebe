"""Hyper-parameters of every decoder family jaxkv runs, and the switches where the families differ.

One decoder implementation (:mod:`models.decoder`) serves Llama 2/3 (SmolLM2, Llama 3.x), Mistral, Qwen 2/2.5,
Qwen 3 and Gemma 3. What differs between them is a handful of switches (:class:`ArchSwitches`) and per-layer
facts (sliding window, RoPE base and scaling) that :class:`DecoderConfig` answers per layer. vLLM keeps one
model file per family (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``gemma3.py``); the differences it spells out
there are the switches here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchSwitches:
    """Where the families' decoder layers differ (everything else is shared).

    Attributes:
        qkv_bias: q/k/v projections carry a bias (Qwen 2: ``attention_bias``; vLLM ``QKVParallelLinear(bias=True)``).
        qk_norm: an RMSNorm over ``head_size`` of every query and key head before RoPE (Qwen 3, Gemma 3).
        sandwich_norm: norms after attention and around the MLP as well (Gemma 3:
            ``post_attention_layernorm`` on the attention output, ``pre_feedforward_layernorm`` /
            ``post_feedforward_layernorm`` around the MLP); otherwise Llama's pre-norm block, where
            ``post_attention_layernorm`` is the MLP's input norm.
        hidden_act: the gated MLP's activation, ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU).
        scale_embeddings: embeddings times ``sqrt(hidden_size)`` in the model dtype (Gemma).
        rms_norm_unit_offset: the checkpoint stores RMSNorm weights as ``w - 1`` (HF Gemma's
            ``x * (1 + w)``). A loader concern only: the model always holds the final ``w``.
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    hidden_act: str = "silu"
    scale_embeddings: bool = False
    rms_norm_unit_offset: bool = False

    def __post_init__(self):
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {HIDDEN_ACTS}")


LLAMA = ArchSwitches()
QWEN2 = ArchSwitches(qkv_bias=True)
QWEN3 = ArchSwitches(qk_norm=True)
GEMMA3 = ArchSwitches(qk_norm=True, sandwich_norm=True, hidden_act="gelu_pytorch_tanh", scale_embeddings=True,
                      rms_norm_unit_offset=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """HF ``rope_scaling`` (``rope_type`` ``"linear"``: positions divided by ``factor``; ``"llama3"``: Llama
    3.1's frequency-dependent rescaling with ``low_freq_factor`` / ``high_freq_factor`` around
    ``original_max_position_embeddings``). vLLM: ``rotary_embedding.get_rope``."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r} is not supported (known: {ROPE_TYPES})")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be > 0")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor={self.high_freq_factor} must be > "
                             f"low_freq_factor={self.low_freq_factor}")


def rope_inv_freq(head_size: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """``f32[head_size / 2]`` RoPE inverse frequencies ``theta ** (-2i / head_size)``, rescaled by ``scaling``
    (computed in float64 on the host: a constant of the compiled step)."""
    inv = theta ** (-np.arange(0, head_size, 2, dtype=np.float64) / head_size)
    if scaling is None or scaling.rope_type == "default":
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    # llama3: long wavelengths divided by factor, short ones kept, a smooth blend in between
    old = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / scaling.factor, np.where(wavelen < high_wavelen, inv, blended))
    return out.astype(np.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Static description of a decoder of any supported family. Hashable (a ``jax.jit`` static argument).

    Field names are jaxkv's (HF's in parentheses where they differ).

    Attributes:
        vocab_size: tokens in the vocabulary.
        hidden_size: model width.
        intermediate_size: gated MLP inner width.
        num_layers: decoder layers (``num_hidden_layers``).
        num_heads: query heads (``num_attention_heads``).
        num_kv_heads: key/value heads (``num_key_value_heads``).
        head_size: channels per head (``head_dim``).
        rope_theta: RoPE base (of the full-attention layers when ``rope_local_base_freq`` is set).
        rope_scaling: :class:`RopeScaling` of the full-attention layers, or ``None``.
        rope_local_base_freq: RoPE base of the sliding-window layers (Gemma 3), ``None``: ``rope_theta``.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: longest sequence the model supports, in tokens.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        bos_token_id, eos_token_id: special token ids (``None`` when absent; ``eos_token_id`` the first EOS).
        query_pre_attn_scalar: softmax scale is ``query_pre_attn_scalar ** -0.5`` (``None``: ``head_size``).
        sliding_window: window of the sliding-window layers in tokens, the current token included (``None``:
            no layer slides).
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"`` (HF's ``layer_types``);
            ``None``: every layer slides when ``sliding_window`` is set (Mistral), else none does.
        arch: the family switches (:class:`ArchSwitches`).
        architecture: vLLM's architecture name (``LlamaForCausalLM``, ...), for messages and the registry.

    Raises:
        ValueError: a size that is not a positive int, heads that do not group, an odd head size, a
            ``layer_types`` of the wrong length or with an unknown entry.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_local_base_freq: float | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    arch: ArchSwitches = LLAMA
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        cls = type(self).__name__
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{cls}.{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{cls}.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"{cls}.head_size={self.head_size} must be even (RoPE)")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or
                                                not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"{cls}.sliding_window={self.sliding_window!r} must be a positive int or None")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"{cls}.query_pre_attn_scalar={self.query_pre_attn_scalar} must be > 0")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"{cls}.layer_types has {len(self.layer_types)} entries, num_layers="
                                 f"{self.num_layers}")
            bad = sorted(set(self.layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION})
            if bad:
                raise ValueError(f"{cls}.layer_types holds {bad}; known: {SLIDING_ATTENTION!r}, {FULL_ATTENTION!r}")

    # -- per layer --------------------------------------------------------------------------------------
    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def layer_type(self, layer: int) -> str:
        if self.sliding_window is None:
            return FULL_ATTENTION
        if self.layer_types is None:
            return SLIDING_ATTENTION
        return self.layer_types[layer]

    def is_sliding(self, layer: int) -> bool:
        return self.layer_type(layer) == SLIDING_ATTENTION

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer ``layer`` in tokens, or ``None`` (full attention)."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.is_sliding(i) for i in range(self.num_layers))

    def rope_base(self, layer: int) -> float:
        if self.rope_local_base_freq is not None and self.is_sliding(layer):
            return self.rope_local_base_freq
        return self.rope_theta

    def rope_inv_freq(self, layer: int) -> np.ndarray:
        """``f32[head_size / 2]`` inverse frequencies of layer ``layer`` (Gemma 3: the sliding-window layers
        use the local base and no scaling)."""
        local = self.rope_local_base_freq is not None and self.is_sliding(layer)
        return rope_inv_freq(self.head_size, self.rope_base(layer), None if local else self.rope_scaling)

    @property
    def softmax_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_size) ** -0.5

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """A :class:`models.decoder_config.DecoderConfig` with Llama's defaults (pre-norm blocks, SwiGLU, no
    bias, one RoPE base). Qwen 2/3 and Mistral are Llama configs with other :attr:`arch` switches or a
    ``sliding_window``.

    Hashable, so it can be a static argument of ``jax.jit``. SmolLM2-135M: ``hidden_size=576``,
    ``intermediate_size=1536``, ``num_layers=30``, ``num_heads=9``, ``num_kv_heads=3``, ``head_size=64``.
    """
