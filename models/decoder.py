"""One decoder for every supported family (Llama 2/3, Mistral, Qwen 2/3, Gemma 3) in Flax NNX, attending
through jaxkv's paged cache.

The families differ only where :class:`models.decoder_config.ArchSwitches` says (q/k/v bias, q/k RMSNorm,
sandwich norms, GeGLU vs SwiGLU, scaled embeddings) and per layer (sliding window, RoPE base and scaling),
which :class:`models.decoder_config.DecoderConfig` answers. Parameter names are Hugging Face's
(``model.layers.{i}.self_attn.q_proj`` -> ``layers[i].self_attn.q_proj``).

Tokens travel in vLLM's flat layout: the new tokens of every sequence of the batch are concatenated
(``[num_tokens, ...]``), described by :class:`jaxkv.AttentionMetadata` (one per KV-cache group for hybrid
models). Each attention layer writes its new K/V into its paged cache through the slot mapping and attends
through ``jaxkv.paged_attention`` (on a ``(dp, tp)`` mesh, per shard: :func:`jaxkv.parallel.attention.paged_attention_layer`).
:meth:`DecoderForCausalLM.forward_dense` is an independent cache-free forward (plain masked attention over
whole sequences), the reference the paged path is checked against.

RMSNorms run in float32 with float32 weights (HF's ``LlamaRMSNorm`` / ``Gemma3RMSNorm`` upcast too); the
model holds final norm weights (a Gemma checkpoint's ``w - 1`` gets its 1 added by the loader).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxkv.attention.metadata import AttentionMetadata
from jaxkv.kv_cache.dtypes import FP8_DTYPES
from jaxkv.ops.activation import silu_and_mul_quant, swiglu_kernel_enabled
from jaxkv.parallel.attention import gather_logits_rows, paged_attention_layer
from models.decoder_config import DecoderConfig
from models.fused import split_fused
from models.parallel import row_parallel
from models.quantization import (
    Fp8Activation,
    Fp8Config,
    Fp8Linear,
    fp8_gemm_unscaled,
    make_linear,
    norm_quant_enabled,
    rms_norm_quantize_per_token,
)


def rope_cos_sin_from_inv_freq(positions: Int[Array, "..."], inv_freq: np.ndarray
                               ) -> tuple[Float[Array, "... half"], Float[Array, "... half"]]:
    """f32 cos/sin of RoPE angles ``position * inv_freq[i]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def rope_cos_sin(positions: Int[Array, "..."], head_size: int, theta: float
                 ) -> tuple[Float[Array, "... half"], Float[Array, "... half"]]:
    """f32 cos/sin of RoPE angles ``position * theta ** (-2i / head_size)``, ``i < head_size / 2``."""
    inv_freq = theta ** (-jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Float[Array, "... heads head_size"], cos: Float[Array, "... half"],
               sin: Float[Array, "... half"]) -> Float[Array, "... heads head_size"]:
    """Rotate channel pairs ``(i, i + head_size/2)`` (HF's ``rotate_half`` / NeoX convention)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dense_attention(q: Float[Array, "batch seq kv_heads group head_size"],
                    k: Float[Array, "batch seq kv_heads head_size"], v: Float[Array, "batch seq kv_heads head_size"],
                    valid: jax.Array, *, scale: float, sliding_window: int | None = None
                    ) -> Float[Array, "batch seq kv_heads group head_size"]:
    """Cache-free causal GQA attention in f32 over whole left-aligned sequences (``valid``:
    ``bool[batch, seq]``, keys that exist); with ``sliding_window`` a query sees only the last
    ``sliding_window`` keys, its own included. The dense references the paged models are tested against."""
    seq = q.shape[1]
    logits = jnp.einsum("bqkgd,btkd->bkgqt", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    qi, ti = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
    mask = ti <= qi
    if sliding_window is not None:
        mask &= qi - ti < sliding_window
    mask = mask[None] & valid[:, None, :]
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgqt,btkd->bqkgd", probs, v.astype(jnp.float32))


def _rms_norm(size: int, eps: float, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(size, epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)


def _norm_into(norm: nnx.RMSNorm, x: jax.Array, linears: Sequence[nnx.Module]):
    """``norm(x)`` in ``x``'s dtype for ``linears``, the Linears it feeds. When they are all fp8 with dynamic
    activation scales (and ``$JAXKV_FP8_NORM_QUANT`` is not ``0``), the norm quantizes for them in the same pass
    instead (:func:`models.quantization.rms_norm_quantize_per_token`: an
    :class:`~models.quantization.Fp8Activation`, which each of them takes as it is)."""
    if norm_quant_enabled() and all(isinstance(p, Fp8Linear) and p.input_scale is None for p in linears):
        return rms_norm_quantize_per_token(x, norm.scale[...], norm.epsilon)
    return norm(x).astype(x.dtype)


class Attention(nnx.Module):
    """q/k/v projections (+ bias), optional per-head q/k RMSNorm, RoPE, paged write + paged attention
    (sliding window on sliding layers), o projection. With ``quantization`` the projections are
    :class:`models.quantization.Fp8Linear` s (fp8 weights, dynamic or static fp8 activations)."""

    def __init__(self, config: DecoderConfig, layer: int, *, dtype, rngs: nnx.Rngs,
                 quantization: Fp8Config | None = None):
        c = config
        self.config = c
        self.sliding_window = c.layer_sliding_window(layer)
        self.inv_freq = tuple(float(f) for f in c.rope_inv_freq(layer))  # static: part of the graphdef
        bias = c.arch.qkv_bias
        if quantization is None:
            linear = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
            self.q_proj = nnx.Linear(c.hidden_size, c.num_heads * c.head_size, use_bias=bias, **linear)
            self.k_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_size, use_bias=bias, **linear)
            self.v_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_size, use_bias=bias, **linear)
            self.o_proj = nnx.Linear(c.num_heads * c.head_size, c.hidden_size, use_bias=False, **linear)
        else:
            linear = dict(dtype=dtype, rngs=rngs, quantization=quantization, layer=layer)
            q, kv = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
            self.q_proj = make_linear(c.hidden_size, q, use_bias=bias, name="q_proj", **linear)
            self.k_proj = make_linear(c.hidden_size, kv, use_bias=bias, name="k_proj", **linear)
            self.v_proj = make_linear(c.hidden_size, kv, use_bias=bias, name="v_proj", **linear)
            self.o_proj = make_linear(q, c.hidden_size, use_bias=False, name="o_proj", **linear)
        if c.arch.qk_norm:
            self.q_norm = _rms_norm(c.head_size, c.rms_norm_eps, rngs)
            self.k_norm = _rms_norm(c.head_size, c.rms_norm_eps, rngs)
        if quantization is not None and quantization.kv_cache_scales:  # the checkpoint's calibrated fp8 cache
            self.k_scale = nnx.Param(jnp.ones((), jnp.float32))
            self.v_scale = nnx.Param(jnp.ones((), jnp.float32))

    @property
    def scale(self) -> float:
        return self.config.softmax_scale

    def input_linears(self) -> list[nnx.Module]:
        """The Linears that take the layer's normed input (q/k/v, or their fused Linear)."""
        if getattr(self, "fused_qkv", None) is not None:
            return [self.qkv_proj]
        return [self.q_proj, self.k_proj, self.v_proj]

    def _qkv(self, x, positions):
        c = self.config
        lead = x.shape[:-1]
        fused = getattr(self, "fused_qkv", None)  # (tp, per-rank sizes): models.fused
        if fused is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = split_fused(self.qkv_proj(x), fused)
        q = q.reshape(*lead, c.num_heads, c.head_size)
        k = k.reshape(*lead, c.num_kv_heads, c.head_size)
        v = v.reshape(*lead, c.num_kv_heads, c.head_size)
        if c.arch.qk_norm:
            q = self.q_norm(q).astype(x.dtype)
            k = self.k_norm(k).astype(x.dtype)
        cos, sin = rope_cos_sin_from_inv_freq(positions, np.asarray(self.inv_freq, np.float32))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x: Float[Array, "num_tokens hidden"], positions: Int[Array, "num_tokens"],
                 kv_cache: jax.Array, metadata: AttentionMetadata, *, attention_impl: str, mesh=None
                 ) -> tuple[Float[Array, "num_tokens hidden"], jax.Array]:
        c = self.config
        q, k, v = self._qkv(x, positions)
        extras = {}
        # An fp8 cache (kv_cache_dtype "fp8*") is quantised on write and dequantised on read with the checkpoint's
        # calibrated k_scale / v_scale, or 1 (vLLM's default when a checkpoint ships none).
        if jnp.dtype(kv_cache.dtype) in FP8_DTYPES:
            if getattr(self, "k_scale", None) is not None:
                extras.update(k_scale=self.k_scale[...], v_scale=self.v_scale[...])
            else:
                extras.update(k_scale=jnp.float32(1.0), v_scale=jnp.float32(1.0))
        if self.sliding_window is not None:
            extras["sliding_window"] = self.sliding_window
        # write + attend; on a mesh per shard (local heads, local rows and blocks: jaxkv.parallel)
        out, kv_cache = paged_attention_layer(q, k, v, kv_cache, metadata, scale=self.scale,
                                              impl=attention_impl, mesh=mesh, **extras)
        return row_parallel(self.o_proj, out.reshape(x.shape[0], c.num_heads * c.head_size), mesh), kv_cache

    def dense(self, x: Float[Array, "batch seq hidden"], valid: jax.Array) -> Float[Array, "batch seq hidden"]:
        """Cache-free attention over whole left-aligned sequences (``valid``: bool[batch, seq]); causal, and
        on sliding-window layers only the last ``sliding_window`` keys (the query's own included)."""
        c = self.config
        batch, seq, _ = x.shape
        q, k, v = self._qkv(x, jnp.broadcast_to(jnp.arange(seq), (batch, seq)))
        q = q.reshape(batch, seq, c.num_kv_heads, c.num_queries_per_kv, c.head_size)
        out = dense_attention(q, k, v, valid, scale=self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.astype(x.dtype).reshape(batch, seq, c.num_heads * c.head_size))


class MLP(nnx.Module):
    """Gated feed-forward ``down(act(gate(x)) * up(x))``: SwiGLU (``silu``) or GeGLU (``gelu_pytorch_tanh``);
    fp8 projections with ``quantization``."""

    def __init__(self, config: DecoderConfig, *, dtype, rngs: nnx.Rngs, quantization: Fp8Config | None = None,
                 layer: int = 0):
        self.gelu = config.arch.hidden_act == "gelu_pytorch_tanh"
        d, f = config.hidden_size, config.intermediate_size
        if quantization is None:
            linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
            self.gate_proj = nnx.Linear(d, f, **linear)
            self.up_proj = nnx.Linear(d, f, **linear)
            self.down_proj = nnx.Linear(f, d, **linear)
        else:
            linear = dict(use_bias=False, dtype=dtype, rngs=rngs, quantization=quantization, layer=layer)
            self.gate_proj = make_linear(d, f, name="gate_proj", **linear)
            self.up_proj = make_linear(d, f, name="up_proj", **linear)
            self.down_proj = make_linear(f, d, name="down_proj", **linear)

    def input_linears(self) -> list[nnx.Module]:
        """The Linears that take the MLP's input (gate/up, or their fused Linear)."""
        if getattr(self, "fused_gate_up", None) is not None:
            return [self.gate_up_proj]
        return [self.gate_proj, self.up_proj]

    def _swiglu_quantizes(self, mesh) -> bool:
        """Whether the SwiGLU and ``down_proj``'s activation quantization run as one op
        (:func:`jaxkv.ops.activation.silu_and_mul_quant`): fused gate/up and ``down_proj`` both dynamic fp8 without
        bias, one device, SiLU, ``$JAXKV_FP8_SWIGLU_KERNEL=1``."""
        dynamic = lambda p: isinstance(p, Fp8Linear) and p.input_scale is None and p.bias is None  # noqa: E731
        return (mesh is None and not self.gelu and getattr(self, "fused_gate_up", None) is not None
                and dynamic(self.gate_up_proj) and dynamic(self.down_proj) and swiglu_kernel_enabled())

    def __call__(self, x, *, mesh=None):
        fused = getattr(self, "fused_gate_up", None)  # (tp, per-rank sizes): models.fused
        if self._swiglu_quantizes(mesh):
            product, s_x = fp8_gemm_unscaled(self.gate_up_proj, x)
            lead = product.shape[:-1]
            q, scale = silu_and_mul_quant(product.reshape(-1, product.shape[-1]), s_x.reshape(-1),
                                          self.gate_up_proj.weight_scale[...])
            return self.down_proj(Fp8Activation(q.reshape(*lead, -1), scale.reshape(lead), x.dtype))
        if fused is None:
            g, u = self.gate_proj(x), self.up_proj(x)
        else:
            g, u = split_fused(self.gate_up_proj(x), fused)
        g = jax.nn.gelu(g, approximate=True) if self.gelu else jax.nn.silu(g)
        return row_parallel(self.down_proj, g * u, mesh)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block ``x + attn(norm(x))``, ``x + mlp(norm(x))``; with ``sandwich_norm`` (Gemma 3)
    the attention and MLP outputs are normed too (``post_attention_layernorm``, ``post_feedforward_layernorm``)
    and the MLP's input norm is ``pre_feedforward_layernorm``."""

    def __init__(self, config: DecoderConfig, layer: int, *, dtype, rngs: nnx.Rngs,
                 quantization: Fp8Config | None = None):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.sandwich = config.arch.sandwich_norm
        self.input_layernorm = _rms_norm(d, eps, rngs)
        quant = {} if quantization is None else dict(quantization=quantization)
        self.self_attn = Attention(config, layer, dtype=dtype, rngs=rngs, **quant)
        self.post_attention_layernorm = _rms_norm(d, eps, rngs)
        if self.sandwich:
            self.pre_feedforward_layernorm = _rms_norm(d, eps, rngs)
            self.post_feedforward_layernorm = _rms_norm(d, eps, rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs, **quant, **({"layer": layer} if quant else {}))

    def _after_attention(self, x, h, mesh=None):
        mlp_in = self.mlp.input_linears()
        if not self.sandwich:
            x = x + h
            return x + self.mlp(_norm_into(self.post_attention_layernorm, x, mlp_in), mesh=mesh)
        x = x + self.post_attention_layernorm(h).astype(x.dtype)
        h = self.mlp(_norm_into(self.pre_feedforward_layernorm, x, mlp_in), mesh=mesh)
        return x + self.post_feedforward_layernorm(h).astype(x.dtype)

    def __call__(self, x, positions, kv_cache, metadata, *, attention_impl, mesh=None):
        h, kv_cache = self.self_attn(_norm_into(self.input_layernorm, x, self.self_attn.input_linears()),
                                     positions, kv_cache, metadata, attention_impl=attention_impl, mesh=mesh)
        return self._after_attention(x, h, mesh), kv_cache

    def dense(self, x, valid):
        h = self.self_attn.dense(_norm_into(self.input_layernorm, x, self.self_attn.input_linears()), valid)
        return self._after_attention(x, h)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("attention_impl", "mesh"))
def _layer_step(graphdef, state, x, positions, kv_cache, metadata, *, attention_impl, mesh):
    """One decoder layer (``graphdef`` + ``state`` from ``nnx.split``) as a jitted function of its own.

    Inside the model's jitted step this is a call, not a copy: JAX traces and lowers the layer once per
    distinct layer structure (the graphdef: a dense model has one, Gemma 3 two) and input shapes, where the
    plain loop traced it once per layer, and XLA inlines the calls before it optimises. A warm start (JAX's
    persistent cache skips only XLA's compile) spent most of its time tracing and lowering the step
    programs: 16.8 s of 19.1 s for SmolLM2's 19 buckets under cProfile on an H200 (session 17).
    """
    return nnx.merge(graphdef, state)(x, positions, kv_cache, metadata, attention_impl=attention_impl, mesh=mesh)


class DecoderForCausalLM(nnx.Module):
    """Embedding (scaled by ``sqrt(hidden_size)`` for Gemma), ``num_layers`` decoder layers, final norm and
    LM head (tied to the embedding unless ``tie_word_embeddings`` is off). vLLM: ``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma3ForCausalLM``.

    ``quantization``: a :class:`models.quantization.Fp8Config` makes the decoder layers' q/k/v/o and
    gate/up/down projections fp8 (:class:`models.quantization.Fp8Linear`); the embedding, norms and LM head stay
    in ``dtype``. ``None`` (the default) builds exactly the unquantized model."""

    def __init__(self, config: DecoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 quantization: Fp8Config | None = None):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        if quantization is not None:
            self.quantization = quantization  # static (the graphdef); absent on unquantized models
        quant = {} if quantization is None else dict(quantization=quantization)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, rngs=rngs, **quant)
                                for i in range(config.num_layers)])
        self.norm = _rms_norm(config.hidden_size, config.rms_norm_eps, rngs)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)

    def _embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        if self.config.arch.scale_embeddings:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)  # HF: the normaliser in the model dtype
        return x

    def _logits(self, x):
        x = self.norm(x).astype(self.dtype)
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def __call__(self, input_ids: Int[Array, "num_tokens"], positions: Int[Array, "num_tokens"],
                 kv_caches: Sequence[jax.Array], metadata, logits_indices: Int[Array, "num_logits"], *,
                 attention_impl: str, mesh=None, cache_layout: Sequence[tuple[int, int]] | None = None
                 ) -> tuple[Float[Array, "num_logits vocab"], list[jax.Array]]:
        """One model step over the batch's new tokens (vLLM's flat layout).

        Args:
            input_ids: ``int32[num_tokens]`` new tokens of all sequences, concatenated.
            positions: ``int32[num_tokens]`` position of each token in its sequence.
            kv_caches: the cache tensors, ``[2, num_blocks, num_kv_heads, block_size, head_size]`` each (one
                per layer, or fewer, shared by the layers of different KV-cache groups).
            metadata: one :class:`jaxkv.AttentionMetadata` for every layer, or a sequence of them, one per
                KV-cache group.
            logits_indices: ``int32[num_logits]`` tokens whose next-token logits are wanted (each sequence's
                last new token).
            attention_impl: see :func:`jaxkv.paged_attention`.
            mesh: the ``(dp, tp)`` mesh the parameters and caches are sharded over (``None``: one device);
                see :func:`models.parallel.shard_params`.
            cache_layout: per layer ``(kv_cache_group index, cache tensor index)`` (static); ``None``: layer
                ``i`` uses tensor ``i`` and the single ``metadata``.

        Returns:
            ``(f32[num_logits, vocab_size] logits, the updated cache tensors)``.

        Raises:
            ValueError: ``cache_layout`` or ``kv_caches`` that do not fit the layers.
        """
        c = self.config
        kv_caches = list(kv_caches)
        if cache_layout is None:
            if len(kv_caches) != c.num_layers:
                raise ValueError(f"len(kv_caches)={len(kv_caches)} != num_layers={c.num_layers}")
            cache_layout = [(0, i) for i in range(c.num_layers)]
        if len(cache_layout) != c.num_layers:
            raise ValueError(f"len(cache_layout)={len(cache_layout)} != num_layers={c.num_layers}")
        if max(t for _, t in cache_layout) >= len(kv_caches):
            raise ValueError(f"cache_layout names tensor {max(t for _, t in cache_layout)} but "
                             f"len(kv_caches)={len(kv_caches)}")
        per_group = isinstance(metadata, (tuple, list))
        x = self._embed(input_ids)
        for layer, (g, t) in zip(self.layers, cache_layout):
            md = metadata[g] if per_group else metadata
            x, kv_caches[t] = _layer_step(*nnx.split(layer), x, positions, kv_caches[t], md,
                                          attention_impl=attention_impl, mesh=mesh)
        return self._logits(gather_logits_rows(x, logits_indices, mesh)), kv_caches

    def forward_dense(self, input_ids: Int[Array, "batch seq"], valid: jax.Array, first_logit: int = 0
                      ) -> Float[Array, "batch seq_out vocab"]:
        """Cache-free forward over left-aligned sequences (``valid``: bool[batch, seq]); f32 logits of
        positions ``first_logit..seq-1`` (a static int: long prompts need only their last logits)."""
        x = self._embed(input_ids)
        for layer in self.layers:
            x = layer.dense(x, valid)
        return self._logits(x[:, first_logit:])


# -- weights from a name -> array dict (the GGUF loaders' names) ------------------------------------------
def set_weight(param, weights: dict, name: str, dtype) -> None:
    """``param``'s value becomes ``weights[name]`` cast to ``dtype`` (``ValueError`` naming the weight when
    it is missing or its shape differs from the parameter's)."""
    if name not in weights:
        raise ValueError(f"weight {name!r} missing")
    value, expected = weights[name], tuple(param.get_value().shape)
    if tuple(value.shape) != expected:
        raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, expected {expected}")
    param.set_value(jnp.asarray(value, dtype))


def param_names(config: DecoderConfig) -> dict[str, tuple]:
    """Flat weight name (the GGUF loaders' ``layers.{i}.q_proj`` style) -> attribute path of the parameter
    in :class:`DecoderForCausalLM` (``("layers", i, "self_attn", "q_proj", "kernel")``)."""
    names = {"embed_tokens": ("embed_tokens", "embedding"), "norm": ("norm", "scale")}
    if not config.tie_word_embeddings:
        names["lm_head"] = ("lm_head", "kernel")
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.arch.sandwich_norm:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for n in norms:
            names[p + n] = ("layers", i, n, "scale")
        if config.arch.qk_norm:
            for n in ("q_norm", "k_norm"):
                names[p + n] = ("layers", i, "self_attn", n, "scale")
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[p + n] = ("layers", i, "self_attn", n, "kernel")
        if config.arch.qkv_bias:
            for n in ("q_proj", "k_proj", "v_proj"):
                names[p + n + ".bias"] = ("layers", i, "self_attn", n, "bias")
        for n in ("gate_proj", "up_proj", "down_proj"):
            names[p + n] = ("layers", i, "mlp", n, "kernel")
    return names


def get_param(model: nnx.Module, path: tuple):
    """The ``nnx.Param`` at attribute ``path`` of ``model``."""
    obj = model
    for key in path:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    return obj


def from_weights(config: DecoderConfig, weights: dict, *, dtype=jnp.float32, cls=DecoderForCausalLM,
                 quantization: Fp8Config | None = None) -> DecoderForCausalLM:
    """Build the model (a ``cls``) from a flat weight dict (names of :func:`param_names`; ``x @ W``
    orientation, final norm weights). With ``quantization`` (an online
    :class:`models.quantization.Fp8Config`) the projections' float weights are quantized to fp8 here
    (per output channel, on the device).

    Raises:
        ValueError: a weight missing or with the wrong shape (names the weight and both shapes).
    """
    quant = {} if quantization is None else dict(quantization=quantization)
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0), **quant))
    for name, path in param_names(config).items():
        if path[-1] == "kernel" and isinstance(get_param(model, path[:-1]), Fp8Linear):
            _set_fp8_weight(get_param(model, path[:-1]), weights, name, quantization)
            continue
        cast = jnp.float32 if path[-1] == "scale" else dtype
        set_weight(get_param(model, path), weights, name, cast)
    return model


def _set_fp8_weight(layer: Fp8Linear, weights: dict, name: str, quantization: Fp8Config) -> None:
    """``layer`` gets ``weights[name]`` (float ``[in, out]``, the ``x @ W`` orientation) quantized to fp8."""
    if name not in weights:
        raise ValueError(f"weight {name!r} missing")
    value = weights[name]
    expected = (layer.in_features, layer.out_features)
    if tuple(value.shape) != expected:
        raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, expected {expected}")
    layer.set_from_float(jnp.asarray(value).T, quantization.weight_strategy)


def random_weights(config: DecoderConfig, *, seed: int = 0, dtype=jnp.float32, cls=DecoderForCausalLM
                   ) -> DecoderForCausalLM:
    """A randomly initialised model (tests): the modules' initialisers, norm weights drawn around 1 and
    biases around 0 so that neither is the identity."""
    model = cls(config, dtype=dtype, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and path and path[-1] in ("scale", "bias"):
            key, sub = jax.random.split(key)
            noise = 0.2 * jax.random.normal(sub, param.get_value().shape, jnp.float32)
            param.set_value((1.0 + noise if path[-1] == "scale" else noise).astype(param.get_value().dtype))
    return model
