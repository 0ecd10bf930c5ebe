"""fp8 weights (W8A8, e4m3): the quantizers, the scaled fp8 GEMM, the :class:`Fp8Linear` module and the
checkpoint's quantization config.

What runs is vLLM's FP8-Dynamic scheme (compressed-tensors ``CompressedTensorsW8A8Fp8`` with a ``channel``
weight strategy and dynamic ``token`` activations):

* weights ``f8e4m3[out, in]`` (PyTorch's orientation, the contraction dimension minor: the layout cuBLASLt's
  fp8 GEMM wants for its B operand, so XLA inserts no transpose) with a static per-output-channel scale
  ``s_w = amax(|w|, axis=in) / 448`` (``f32[out]``);
* activations quantized per token when the layer runs: ``s_x = amax(|x|, axis=-1) / 448``,
  ``x_q = e4m3(clip(x / s_x, -448, 448))``; or, for a checkpoint with a static ``input_scale``, one calibrated
  per-tensor scale. When the activations come from an RMSNorm, the norm quantizes them in the same pass
  (:func:`rms_norm_quantize_per_token`, vLLM's fused ``rms_norm_dynamic_per_token_quant``);
* ``y = (x_q @ w_q^T) * s_x[:, None] * s_w[None, :]``: an fp8 ``dot_general`` accumulated in f32 and written in
  the activation dtype (``preferred_element_type``; on Hopper XLA lowers it to cuBLASLt's
  ``__cublas$lt$matmul$f8``, on CPU it upcasts), the scales applied in f32 to that product, then the bias, then
  the activation dtype. vLLM's CUTLASS kernel applies the scales to the f32 accumulator; writing bf16 first is
  one more rounding (2^-9 relative) and half the bytes (``$JAXKV_FP8_GEMM_OUT=f32`` writes f32).

Scales are floored at ``1 / (448 * 512)`` (vLLM's ``min_scaling_factor`` of its per-token quant kernel), so an
all-zero row or channel quantizes to zeros instead of dividing by zero.

Which Linears: the decoder layers' q/k/v/o and gate/up/down projections; never the embedding, the LM head or
the norms (vLLM's ``ignore: ["lm_head"]``). Two sources:

* online (``quantization="fp8"``, vLLM ``--quantization fp8``): a bf16/f32 checkpoint (GGUF, HF, dummy)
  quantized at load time. vLLM's online fp8 uses one scale per weight tensor and per-token activation scales;
  jaxkv quantizes per output channel, the FP8-Dynamic checkpoints' scheme (never coarser than per tensor).
* a compressed-tensors fp8 checkpoint (``*-FP8-Dynamic`` / ``*-FP8``): ``weight`` stored ``F8_E4M3`` with
  ``weight_scale`` (``[out, 1]`` per channel, or a scalar per tensor) and, for static activations,
  ``input_scale``; ``config.json``'s ``quantization_config`` says which (:func:`fp8_config_from_hf`).

Where jaxkv differs from vLLM's kernels (same formula): q/k/v (and gate/up) are fused after loading
(:mod:`models.fused`) with each member's per-channel (or per-tensor, held per channel) weight scales stacked
beside its channels, so a fused layer is exact (vLLM requantizes a fused layer's per-tensor shards to one scale);
static-scale checkpoints keep their projections separate, each with its own ``input_scale`` (vLLM's fused
``QKVParallelLinear`` takes the largest of the three), and XLA computes one quantization of their shared input
(CSE). On a tensor-parallel mesh a row-parallel layer (o_proj,
down_proj) scales each rank's slice of the row on its own and all-reduces its partial sums in the model dtype, as
vLLM's ``RowParallelLinear`` does (:func:`models.parallel.row_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` magnitude."""
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""Smallest scale (vLLM's ``min_scaling_factor``): an all-zero row or channel gets it, and quantizes to zeros."""

WEIGHT_STRATEGIES = ("channel", "tensor")
ACTIVATION_SCHEMES = ("dynamic", "static")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """How a model's Linears are quantized to fp8 (hashable: part of the model's static structure).

    Attributes:
        weight_strategy: ``"channel"`` (one scale per output channel) or ``"tensor"`` (one per weight; held
            broadcast to ``f32[out]``, the same product).
        activation_scheme: ``"dynamic"`` (per-token scales computed when the layer runs) or ``"static"`` (the
            checkpoint's per-tensor ``input_scale``).
        checkpoint_fp8: the checkpoint stores the fp8 weights and their scales (compressed-tensors); otherwise
            float weights are quantized at load time (online).
        ignore: module names left unquantized besides the embedding, norms and LM head (compressed-tensors'
            ``ignore``: exact names such as ``"model.layers.0.mlp.down_proj"`` or ``"re:<regex>"``).
        kv_cache_scales: the checkpoint calibrated the KV cache (compressed-tensors' ``kv_cache_scheme``): each
            attention layer loads its ``self_attn.k_scale`` / ``v_scale`` (``f32[]``), which an fp8 cache
            (``kv_cache_dtype="fp8"``) quantizes and dequantizes with; other caches leave them unused, as vLLM
            does.

    Raises:
        ValueError: an unknown strategy or scheme, or a static scheme without a checkpoint (names the field).

    vLLM: ``Fp8Config`` (online) and ``CompressedTensorsConfig`` with ``CompressedTensorsW8A8Fp8``.
    """

    weight_strategy: str = "channel"
    activation_scheme: str = "dynamic"
    checkpoint_fp8: bool = False
    ignore: tuple[str, ...] = ()
    kv_cache_scales: bool = False

    def __post_init__(self):
        object.__setattr__(self, "ignore", tuple(self.ignore))
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"weight_strategy={self.weight_strategy!r} is not one of {WEIGHT_STRATEGIES}")
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation_scheme={self.activation_scheme!r} is not one of {ACTIVATION_SCHEMES}")
        if self.activation_scheme == "static" and not self.checkpoint_fp8:
            raise ValueError("activation_scheme='static' needs calibrated input scales from an fp8 checkpoint "
                             "(checkpoint_fp8=True)")

    @property
    def static_input_scale(self) -> bool:
        return self.activation_scheme == "static"

    def quantizes(self, layer: int, name: str) -> bool:
        """Whether Linear ``name`` (``"q_proj"``, ...) of decoder layer ``layer`` is fp8 (not in :attr:`ignore`)."""
        full = f"model.layers.{layer}.{_PARENT[name]}.{name}"
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], full):
                    return False
            elif pattern == full:
                return False
        return True


ONLINE_FP8 = Fp8Config()
"""``quantization="fp8"`` on a float checkpoint: per-channel weights, per-token activations."""


# -- quantizers ---------------------------------------------------------------------------------------------
def _scale(amax: jax.Array) -> jax.Array:
    return jnp.maximum(amax / FP8_MAX, FP8_MIN_SCALE)


def _to_fp8(x32: jax.Array, scale: jax.Array) -> jax.Array:
    # clip before the cast: XLA's convert to e4m3fn makes NaN of anything past 448 (the type has no inf)
    return jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_weight(w: Float[Array, "out in"], strategy: str = "channel"
                    ) -> tuple[jax.Array, Float[Array, "out"]]:
    """``w`` (any float dtype, ``[out, in]``) -> ``(f8e4m3[out, in], f32[out])``: per output channel
    (``strategy="channel"``) ``s = max(amax(|w|, axis=1) / 448, 1/(448*512))`` and ``w_q = e4m3(clip(w / s,
    ±448))`` (round to nearest even); ``strategy="tensor"``: one amax over the whole weight, repeated per channel.

    Raises:
        ValueError: ``w`` not 2-D, or an unknown ``strategy``.

    vLLM: ``ops.scaled_fp8_quant(weight)`` (per tensor) / llm-compressor's channel-wise observer.
    """
    if w.ndim != 2:
        raise ValueError(f"weight must be [out, in], got shape {tuple(w.shape)}")
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {WEIGHT_STRATEGIES}")
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=1)
    if strategy == "tensor":
        amax = jnp.broadcast_to(jnp.max(amax), amax.shape)
    scale = _scale(amax)
    return _to_fp8(w32, scale[:, None]), scale


def quantize_per_token(x: Float[Array, "... k"]) -> tuple[jax.Array, Float[Array, "..."]]:
    """Dynamic per-token activation quantization: ``x`` (any float dtype) -> ``(f8e4m3[..., k], f32[...])`` with
    ``s = max(amax(|x|, axis=-1) / 448, 1/(448*512))`` per row (a zero row gets the floor and zeros) and
    ``x_q = e4m3(clip(x / s, ±448))``. vLLM: ``scaled_fp8_quant(x, use_per_token_if_dynamic=True)``."""
    x32 = x.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(x32), axis=-1))
    return _to_fp8(x32, scale[..., None]), scale


NORM_QUANT_ENV = "JAXKV_FP8_NORM_QUANT"
"""``0`` in the environment quantizes a norm's output for its fp8 Linears as its own pass (a maintainer's A/B;
the fused :func:`rms_norm_quantize_per_token` is the default)."""


def norm_quant_enabled() -> bool:
    """Whether an RMSNorm feeding dynamic fp8 Linears quantizes its output itself (``JAXKV_FP8_NORM_QUANT``
    unset or not ``0``)."""
    return os.environ.get(NORM_QUANT_ENV, "1") != "0"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Activation:
    """Activations already quantized per token, for :class:`Fp8Linear` s with dynamic activation scales.

    ``q`` ``f8e4m3[..., k]``, ``scale`` ``f32[...]`` (one per token, :func:`quantize_per_token`'s), ``dtype``
    (static) the activations' own dtype, which the Linear returns. ``shape`` / ``ndim`` are ``q``'s, so layer code
    that reads only those takes it where it took the array. vLLM: the fp8 output of its fused
    ``rms_norm_dynamic_per_token_quant`` kernel, which the next ``scaled_mm`` takes with its scales.
    """

    q: jax.Array
    scale: jax.Array
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim


def rms_norm_quantize_per_token(x: Float[Array, "... k"], weight: Float[Array, "k"], eps: float
                                ) -> Fp8Activation:
    """``quantize_per_token(rms_norm(x))`` in one pass over ``x``, without the normed activations in between.

    ``rms_norm(x) = x * (r * weight)`` with ``r = rsqrt(mean(x², axis=-1) + eps)`` in f32 (``nnx.RMSNorm``'s
    formula). Since ``r > 0``, the row's absmax is ``r * max(|x * weight|)``. Both reductions read ``x`` alone, so
    XLA may compute them in one multi-output fusion with the residual add before them (8B on an H200: one kernel
    fewer a layer than quantizing the norm's output on its own). Then one elementwise pass writes the e4m3 values.
    The result equals :func:`quantize_per_token` of the f32 norm up to f32 rounding (a scale's last bit, and so an
    e4m3 value on a rounding tie). The normed activations are not rounded to ``x``'s
    dtype on the way, where the separate path rounds them.

    Args:
        x: ``[..., k]`` activations, any float dtype (the residual stream).
        weight: ``[k]`` the norm's scale.
        eps: the norm's epsilon.

    Returns:
        :class:`Fp8Activation` with ``x``'s dtype.

    vLLM: ``rms_norm_dynamic_per_token_quant`` (the kernel its compile pass fuses RMSNorm + per-token fp8
    quantization into).
    """
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    w32 = weight.astype(jnp.float32)
    amax = r[..., 0] * jnp.max(jnp.abs(x32 * w32), axis=-1)
    scale = _scale(amax)
    return Fp8Activation(_to_fp8(x32 * (r * w32), scale[..., None]), scale, jnp.dtype(x.dtype))


def quantize_static(x: Float[Array, "... k"], input_scale: Float[Array, ""]) -> jax.Array:
    """Static per-tensor activation quantization: ``f8e4m3[..., k] = e4m3(clip(x / input_scale, ±448))``
    (``input_scale``: the checkpoint's calibrated ``f32[]``). vLLM: ``scaled_fp8_quant(x, input_scale)``."""
    return _to_fp8(x.astype(jnp.float32), input_scale.astype(jnp.float32))


def dequantize(q: jax.Array, scale: jax.Array) -> Float[Array, "..."]:
    """``f32`` values of ``q`` (``f8e4m3``) times their scales: a weight's ``f32[out]`` over ``[out, in]``, a
    per-token ``f32[...]`` over ``[..., k]`` (a scale per leading index), or a scalar."""
    s = jnp.asarray(scale, jnp.float32)
    return q.astype(jnp.float32) * (s[..., None] if s.ndim else s)


# -- the scaled fp8 GEMM ------------------------------------------------------------------------------------
GEMM_OUT_ENV = "JAXKV_FP8_GEMM_OUT"
"""``f32`` in the environment makes the fp8 GEMM write f32, the scales then applied to the f32 product; by default
(``out``) it writes the Linear's output dtype: bf16 is half the bytes, and one more rounding before the scales.
8B on an H200, fp8 weights + fp8 KV: 1.032x the f32 output's tok/s in one call (docs/perf-notes.md, session 32)."""


def gemm_out_dtype(out_dtype) -> jnp.dtype:
    """The dtype the fp8 GEMM of a Linear returning ``out_dtype`` writes: ``out_dtype`` itself, or f32 when
    ``$JAXKV_FP8_GEMM_OUT`` is ``f32``."""
    return jnp.dtype(jnp.float32 if os.environ.get(GEMM_OUT_ENV, "out") == "f32" else out_dtype)


def fp8_matmul(x_q: jax.Array, w_q: jax.Array, out_dtype=jnp.float32) -> Float[Array, "... out"]:
    """``[..., out] = x_q @ w_q^T`` for ``x_q: f8e4m3[..., in]`` and ``w_q: f8e4m3[out, in]``: one fp8
    ``dot_general`` contracting both operands' minor dimension, accumulated in f32 and written as ``out_dtype``
    (default f32; cuBLASLt's fp8 GEMM on Hopper: ``__cublas$lt$matmul$f8``; an upcast f32 GEMM on CPU)."""
    return jax.lax.dot_general(x_q, w_q, (((x_q.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def fp8_linear(x: Float[Array, "... in"], weight: jax.Array, weight_scale: Float[Array, "out"], *,
               input_scale: jax.Array | None = None, bias: jax.Array | None = None, out_dtype=None
               ) -> Float[Array, "... out"]:
    """vLLM's W8A8 fp8 Linear: ``y = (x_q @ w_q^T) * s_x[:, None] * s_w[None, :] + bias``.

    Args:
        x: activations, ``[..., in]`` (bf16/f16/f32), or an :class:`Fp8Activation` already quantized per token
            (dynamic scheme only).
        weight: ``f8e4m3[out, in]``.
        weight_scale: ``f32[out]`` per output channel.
        input_scale: ``f32[]`` static per-tensor activation scale, or ``None``: dynamic per-token scales
            (:func:`quantize_per_token`).
        bias: ``[out]`` or ``None`` (added in f32 after the scales).
        out_dtype: result dtype (default ``x.dtype``).

    Returns:
        ``[..., out]`` in ``out_dtype``.

    Raises:
        ValueError: an :class:`Fp8Activation` with a static ``input_scale``.

    vLLM: ``Fp8LinearOp.apply`` (``cutlass_scaled_mm`` / ``torch._scaled_mm`` with row-wise scales).
    """
    if isinstance(x, Fp8Activation) and input_scale is not None:
        raise ValueError("an Fp8Activation (dynamic per-token scales) fed a Linear with a static input_scale")
    if input_scale is None:
        x_q, s_x = _per_token(x)
        s_x = s_x[..., None]
    else:
        x_q, s_x = quantize_static(x, input_scale), input_scale.astype(jnp.float32)
    out_dtype = out_dtype or x.dtype
    y = fp8_matmul(x_q, weight, gemm_out_dtype(out_dtype)).astype(jnp.float32) * s_x * weight_scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _per_token(x) -> tuple[jax.Array, jax.Array]:
    """``(x_q, s_x[...])``: an :class:`Fp8Activation` as it is, float activations through :func:`quantize_per_token`."""
    return (x.q, x.scale) if isinstance(x, Fp8Activation) else quantize_per_token(x)


def fp8_gemm_unscaled(linear: "Fp8Linear", x) -> tuple[jax.Array, jax.Array]:
    """A dynamic-scale :class:`Fp8Linear`'s GEMM without its scales: ``(x_q @ w_q^T, s_x)`` with the product in
    :func:`gemm_out_dtype` and ``s_x`` ``f32[...]`` the activations' per-token scales (``x`` an
    :class:`Fp8Activation` or float activations, quantized here). The Linear's output is ``product * s_x[..., None] *
    linear.weight_scale``: the caller applies the scales itself (:func:`jaxkv.ops.activation.silu_and_mul_quant`).

    Raises:
        ValueError: a static ``input_scale`` or a bias.
    """
    if linear.input_scale is not None or linear.bias is not None:
        raise ValueError("fp8_gemm_unscaled takes an Fp8Linear with dynamic scales and no bias")
    x_q, s_x = _per_token(x)
    return fp8_matmul(x_q, linear.weight[...], gemm_out_dtype(x.dtype)), s_x


def fp8_linear_reference(x, weight, weight_scale, *, input_scale=None, bias=None, out_dtype=None):
    """The same product computed the plain way (tests): activations quantized as :func:`fp8_linear` does, then
    both operands dequantized to f32 and multiplied at ``Precision.HIGHEST``."""
    if input_scale is None:
        x_deq = dequantize(*quantize_per_token(x))
    else:
        x_deq = dequantize(quantize_static(x, input_scale), input_scale)
    w_deq = dequantize(weight, weight_scale)
    y = jnp.matmul(x_deq, w_deq.T, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


class Fp8Linear(nnx.Module):
    """A Linear with fp8 weights (vLLM: a ``LinearBase`` whose ``quant_method`` is ``Fp8LinearMethod`` /
    ``CompressedTensorsLinearMethod``).

    Parameters: ``weight`` ``f8e4m3[out, in]``, ``weight_scale`` ``f32[out]``, ``input_scale`` ``f32[]`` (static
    activation scheme only), ``bias`` ``[out]`` in the model dtype (``use_bias``). Called on ``[..., in]``
    activations it returns ``[..., out]`` in their dtype (:func:`fp8_linear`).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False, dtype=jnp.float32,
                 static_input_scale: bool = False, rngs: nnx.Rngs | None = None):
        del rngs  # the values come from a checkpoint, a quantizer or models.dummy
        self.in_features, self.out_features = in_features, out_features
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), FP8_DTYPE))
        self.weight_scale = nnx.Param(jnp.ones((out_features,), jnp.float32))
        self.input_scale = nnx.Param(jnp.ones((), jnp.float32)) if static_input_scale else None
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        return fp8_linear(x, self.weight[...], self.weight_scale[...],
                          input_scale=None if self.input_scale is None else self.input_scale[...],
                          bias=None if self.bias is None else self.bias[...])

    def set_from_float(self, w: Float[Array, "out in"], strategy: str = "channel") -> None:
        """Quantize float weights ``w`` (``[out, in]``) into this layer (:func:`quantize_weight`)."""
        q, s = quantize_weight_jit(jnp.asarray(w), strategy)
        self.weight.set_value(q)
        self.weight_scale.set_value(s)


quantize_weight_jit = jax.jit(quantize_weight, static_argnums=1)


@functools.lru_cache(maxsize=64)
def quantize_weight_to(weight_sharding, scale_sharding, strategy: str = "channel"):
    """:func:`quantize_weight` jitted with its outputs placed in ``(weight_sharding, scale_sharding)``."""
    return jax.jit(functools.partial(quantize_weight, strategy=strategy),
                   out_shardings=(weight_sharding, scale_sharding))


def make_linear(in_features: int, out_features: int, *, use_bias: bool, dtype, rngs: nnx.Rngs,
                quantization: Fp8Config | None, layer: int, name: str) -> nnx.Module:
    """``nnx.Linear`` (``quantization=None`` or a Linear the config ignores) or :class:`Fp8Linear`."""
    if quantization is None or not quantization.quantizes(layer, name):
        return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
    return Fp8Linear(in_features, out_features, use_bias=use_bias, dtype=dtype,
                     static_input_scale=quantization.static_input_scale)


# -- what a checkpoint or the command line asks for -----------------------------------------------------------
def resolve_quantization(quantization, checkpoint: Fp8Config | None = None) -> Fp8Config | None:
    """The :class:`Fp8Config` a model is built with, from ``quantization`` (``None``, ``"fp8"`` or an
    :class:`Fp8Config`; vLLM's ``quantization`` argument) and the checkpoint's own (``config.json``'s
    ``quantization_config``, :func:`fp8_config_from_hf`): the checkpoint's wins when it has one (``None`` and
    ``"fp8"`` both take it, as vLLM detects the method from the checkpoint), else ``"fp8"`` is
    :data:`ONLINE_FP8`.

    Raises:
        ValueError: ``quantization`` not one of ``(None, "fp8")`` nor an :class:`Fp8Config`.
    """
    from jaxkv.config import QUANTIZATIONS
    if isinstance(quantization, Fp8Config):
        return checkpoint or quantization
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one of {QUANTIZATIONS}")
    if checkpoint is not None:
        return checkpoint
    return ONLINE_FP8 if quantization == "fp8" else None


def _need(obj: dict, key: str, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{where}.{key} is missing")
    return obj[key]


def _check(value, allowed, field: str):
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not supported (supported: {list(allowed)})")


def fp8_config_from_hf(qc: dict, *, source: str = "config.json") -> Fp8Config:
    """The :class:`Fp8Config` of an HF ``config.json``'s ``quantization_config`` object.

    Accepted: ``quant_method: "compressed-tensors"`` with one config group targeting ``Linear``, its
    ``weights`` ``{type: float, num_bits: 8, strategy: channel|tensor, symmetric: true, dynamic: false}`` and
    ``input_activations`` ``{type: float, num_bits: 8}`` either ``dynamic: true`` (strategy ``token``) or
    static (``dynamic: false``, strategy ``tensor``); ``ignore`` (``["lm_head"]``); ``kv_cache_scheme`` null or
    static per-tensor fp8 scales (:attr:`Fp8Config.kv_cache_scales`).
    Also ``quant_method: "fp8"`` (AutoFP8 / vLLM's serialized ``Fp8Config``: per-tensor weights,
    ``activation_scheme`` dynamic or static, no ``weight_block_size``).

    Raises:
        ValueError: anything else, naming ``source``, the field (``quantization_config.config_groups.group_0.
            weights.strategy``, ...) and its value.
    """
    where = "quantization_config"
    try:
        method = _need(qc, "quant_method", where)
        if method == "fp8":
            _check(qc.get("weight_block_size"), (None,), f"{where}.weight_block_size")
            scheme = qc.get("activation_scheme", "dynamic")
            _check(scheme, ACTIVATION_SCHEMES, f"{where}.activation_scheme")
            return Fp8Config(weight_strategy="tensor", activation_scheme=scheme, checkpoint_fp8=True,
                             ignore=_ignore(qc.get("ignored_layers") or (), f"{where}.ignored_layers"))
        _check(method, ("compressed-tensors", "fp8"), f"{where}.quant_method")
        _check(qc.get("format", "float-quantized"), ("float-quantized", "naive-quantized"), f"{where}.format")
        kv_scales = _kv_cache_scheme(qc.get("kv_cache_scheme"), f"{where}.kv_cache_scheme")
        groups = _need(qc, "config_groups", where)
        if not isinstance(groups, dict) or len(groups) != 1:
            raise ValueError(f"{where}.config_groups has {len(groups) if isinstance(groups, dict) else groups!r} "
                             "groups; one group of fp8 Linears is supported")
        (gname, group), = groups.items()
        g = f"{where}.config_groups.{gname}"
        targets = _need(group, "targets", g)
        if "Linear" not in targets:
            raise ValueError(f"{g}.targets={targets!r} is not supported (supported: a list holding 'Linear')")
        w = _need(group, "weights", g)
        if not isinstance(w, dict):
            raise ValueError(f"{g}.weights={w!r} is not supported (an fp8 weight scheme is needed)")
        _check(w.get("type"), ("float",), f"{g}.weights.type")
        _check(w.get("num_bits"), (8,), f"{g}.weights.num_bits")
        _check(w.get("strategy"), WEIGHT_STRATEGIES, f"{g}.weights.strategy")
        _check(w.get("symmetric", True), (True,), f"{g}.weights.symmetric")
        _check(w.get("dynamic", False), (False,), f"{g}.weights.dynamic")
        _check(w.get("block_structure"), (None,), f"{g}.weights.block_structure")
        a = group.get("input_activations")
        if not isinstance(a, dict):
            raise ValueError(f"{g}.input_activations={a!r} is not supported (weight-only fp8, W8A16, is not; "
                             "supported: fp8 activations, dynamic per token or static per tensor)")
        _check(a.get("type"), ("float",), f"{g}.input_activations.type")
        _check(a.get("num_bits"), (8,), f"{g}.input_activations.num_bits")
        _check(a.get("dynamic"), (True, False), f"{g}.input_activations.dynamic")
        if a["dynamic"]:
            _check(a.get("strategy", "token"), ("token",), f"{g}.input_activations.strategy")
        else:
            _check(a.get("strategy", "tensor"), ("tensor",), f"{g}.input_activations.strategy")
        return Fp8Config(weight_strategy=w["strategy"], activation_scheme="dynamic" if a["dynamic"] else "static",
                         checkpoint_fp8=True, ignore=_ignore(qc.get("ignore") or (), f"{where}.ignore"),
                         kv_cache_scales=kv_scales)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _kv_cache_scheme(scheme, field: str) -> bool:
    """Whether a compressed-tensors ``kv_cache_scheme`` calibrated the KV cache: ``None`` (no) or static per-tensor
    fp8 scales (``{type: float, num_bits: 8, strategy: tensor, dynamic: false, symmetric: true}``, vLLM's
    ``CompressedTensorsKVCacheMethod``); anything else raises ``ValueError`` naming the field and the value."""
    if scheme is None:
        return False
    if not isinstance(scheme, dict):
        raise ValueError(f"{field}={scheme!r} is not supported (supported: null or an fp8 per-tensor scheme)")
    _check(scheme.get("type"), ("float",), f"{field}.type")
    _check(scheme.get("num_bits"), (8,), f"{field}.num_bits")
    _check(scheme.get("strategy", "tensor"), ("tensor",), f"{field}.strategy")
    _check(scheme.get("dynamic", False), (False,), f"{field}.dynamic")
    _check(scheme.get("symmetric", True), (True,), f"{field}.symmetric")
    return True


def _ignore(names, field: str) -> tuple[str, ...]:
    """Entries of an ignore list that name decoder Linears (the LM head and embedding are never quantized)."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{field}={names!r} must be a list of module names")
    return tuple(n for n in names if n not in ("lm_head", "model.embed_tokens"))


def hf_quantization(hf: dict, *, source: str = "config.json") -> Fp8Config | None:
    """:func:`fp8_config_from_hf` of ``hf["quantization_config"]``, or ``None`` when the checkpoint has none.

    Raises:
        ValueError: a quantization config jaxkv does not run (naming the field, its value and ``source``).
    """
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config={qc!r} is not an object")
    return fp8_config_from_hf(qc, source=source)
