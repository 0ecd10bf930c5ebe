"""Gemma 3 text decoder (Gemma-3-270M) in Flax NNX, attending through jaxkv's paged cache.

Architecture (Gemma 3 technical report; HF ``modeling_gemma3.py``; llama.cpp ``gemma3``):

* embedding scaled by ``sqrt(hidden_size)`` (in the model dtype), output head tied to the embedding;
* per layer: ``x + post_attention_norm(attn(input_norm(x)))`` then
  ``x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))`` (pre- and post-norms around both);
* attention: q/k/v projections, RMSNorm over ``head_size`` of every query and key head (q_norm / k_norm),
  RoPE (NeoX ``rotate_half`` pairs) with base 1e4 on sliding-window layers and 1e6 on global layers, softmax
  scale ``query_pre_attn_scalar ** -0.5``, MQA/GQA; five sliding-window layers (window 512, the current
  token included) then one global layer;
* MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
* RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` in float32, where ``w`` is the stored weight. HF stores ``w - 1``
  (``Gemma3RMSNorm`` multiplies by ``1 + weight``); llama.cpp's converter adds the 1 when it writes the
  GGUF, so GGUF norm weights are used as they are.

Paged path: each layer writes its K/V into the cache tensor it is bound to and attends with the metadata
of its KV-cache group (vLLM: one metadata per group, looked up by the layer). Sliding-window layers pass
``sliding_window`` to the attention op, so the kernels mask keys before the window and skip their blocks.
:meth:`Gemma3ForCausalLM.forward_dense` is an independent cache-free forward (plain masked attention over
whole sequences), the reference the paged path is checked against.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

import jaxkv
from models.gemma3_config import Gemma3Config
from models.llama import apply_rope, dense_attention, rope_cos_sin, set_weight


def _rms_norm(size: int, eps: float, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(size, epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)


class Gemma3Attention(nnx.Module):
    """q/k/v projections, per-head q/k RMSNorm, RoPE, paged write + paged attention, o projection."""

    def __init__(self, config: Gemma3Config, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.config = c
        self.sliding_window = c.sliding_window if c.is_sliding(layer) else None
        self.rope_base = c.rope_base(layer)
        self.q_proj = nnx.Linear(c.hidden_size, c.num_heads * c.head_size, **linear)
        self.k_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_size, **linear)
        self.v_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_size, **linear)
        self.o_proj = nnx.Linear(c.num_heads * c.head_size, c.hidden_size, **linear)
        self.q_norm = _rms_norm(c.head_size, c.rms_norm_eps, rngs)
        self.k_norm = _rms_norm(c.head_size, c.rms_norm_eps, rngs)

    @property
    def scale(self) -> float:
        return float(self.config.query_pre_attn_scalar) ** -0.5

    def _qkv(self, x, positions):
        c = self.config
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, c.num_heads, c.head_size)
        k = self.k_proj(x).reshape(*lead, c.num_kv_heads, c.head_size)
        v = self.v_proj(x).reshape(*lead, c.num_kv_heads, c.head_size)
        q = self.q_norm(q).astype(x.dtype)
        k = self.k_norm(k).astype(x.dtype)
        cos, sin = rope_cos_sin(positions, c.head_size, self.rope_base)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x: Float[Array, "num_tokens hidden"], positions: Int[Array, "num_tokens"],
                 kv_cache: jax.Array, metadata: jaxkv.AttentionMetadata, *, attention_impl: str
                 ) -> tuple[Float[Array, "num_tokens hidden"], jax.Array]:
        c = self.config
        q, k, v = self._qkv(x, positions)
        scales = {}
        if jnp.dtype(kv_cache.dtype) in jaxkv.FP8_DTYPES:
            scales = dict(k_scale=jnp.float32(1.0), v_scale=jnp.float32(1.0))
        kv_cache = jaxkv.write_to_paged_cache(kv_cache, k, v, metadata.slot_mapping, **scales)
        out = jaxkv.paged_attention(q, kv_cache, metadata, scale=self.scale, impl=attention_impl,
                                    sliding_window=self.sliding_window, **scales)
        return self.o_proj(out.reshape(x.shape[0], c.num_heads * c.head_size)), kv_cache

    def dense(self, x: Float[Array, "batch seq hidden"], valid: jax.Array) -> Float[Array, "batch seq hidden"]:
        """Cache-free attention over whole left-aligned sequences (``valid``: bool[batch, seq]); causal,
        and on sliding-window layers only the last ``sliding_window`` keys (the query's own included)."""
        c = self.config
        batch, seq, _ = x.shape
        q, k, v = self._qkv(x, jnp.broadcast_to(jnp.arange(seq), (batch, seq)))
        group = c.num_queries_per_kv
        q = q.reshape(batch, seq, c.num_kv_heads, group, c.head_size)
        out = dense_attention(q, k, v, valid, scale=self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.astype(x.dtype).reshape(batch, seq, c.num_heads * c.head_size))


class Gemma3MLP(nnx.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, config: Gemma3Config, *, dtype, rngs: nnx.Rngs):
        linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **linear)
        self.up_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **linear)
        self.down_proj = nnx.Linear(config.intermediate_size, config.hidden_size, **linear)

    def __call__(self, x):
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class Gemma3DecoderLayer(nnx.Module):
    """Sandwich-norm residual block (pre- and post-norms around attention and around the MLP)."""

    def __init__(self, config: Gemma3Config, layer: int, *, dtype, rngs: nnx.Rngs):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = _rms_norm(d, eps, rngs)
        self.self_attn = Gemma3Attention(config, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(d, eps, rngs)
        self.pre_feedforward_layernorm = _rms_norm(d, eps, rngs)
        self.mlp = Gemma3MLP(config, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = _rms_norm(d, eps, rngs)

    def _mlp_block(self, x):
        h = self.mlp(self.pre_feedforward_layernorm(x).astype(x.dtype))
        return x + self.post_feedforward_layernorm(h).astype(x.dtype)

    def __call__(self, x, positions, kv_cache, metadata, *, attention_impl):
        h, kv_cache = self.self_attn(self.input_layernorm(x).astype(x.dtype), positions, kv_cache,
                                     metadata, attention_impl=attention_impl)
        x = x + self.post_attention_layernorm(h).astype(x.dtype)
        return self._mlp_block(x), kv_cache

    def dense(self, x, valid):
        h = self.self_attn.dense(self.input_layernorm(x).astype(x.dtype), valid)
        x = x + self.post_attention_layernorm(h).astype(x.dtype)
        return self._mlp_block(x)


class Gemma3ForCausalLM(nnx.Module):
    """Scaled embedding, ``num_layers`` decoder layers, final norm, tied LM head."""

    def __init__(self, config: Gemma3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Gemma3DecoderLayer(config, i, dtype=dtype, rngs=rngs)
                                for i in range(config.num_layers)])
        self.norm = _rms_norm(config.hidden_size, config.rms_norm_eps, rngs)

    def _embed(self, input_ids):
        x = self.embed_tokens(input_ids)
        return x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)  # HF: normaliser in the model dtype

    def _logits(self, x):
        return self.embed_tokens.attend(self.norm(x).astype(self.dtype)).astype(jnp.float32)

    def __call__(self, input_ids: Int[Array, "num_tokens"], positions: Int[Array, "num_tokens"],
                 kv_caches: Sequence[jax.Array], metadata, logits_indices: Int[Array, "num_logits"], *,
                 attention_impl: str, cache_layout: Sequence[tuple[int, int]] | None = None
                 ) -> tuple[Float[Array, "num_logits vocab"], list[jax.Array]]:
        """One model step over the batch's new tokens (vLLM's flat layout).

        Args:
            input_ids: ``int32[num_tokens]`` new tokens of all sequences, concatenated.
            positions: ``int32[num_tokens]`` position of each token in its sequence.
            kv_caches: the cache tensors, ``[2, num_blocks, num_kv_heads, block_size, head_size]`` each
                (one per layer, or fewer, shared by the layers of different KV-cache groups).
            metadata: one :class:`jaxkv.AttentionMetadata` for every layer, or a sequence of them, one per
                KV-cache group.
            logits_indices: ``int32[num_logits]`` tokens whose next-token logits are wanted.
            attention_impl: see :func:`jaxkv.paged_attention`.
            cache_layout: per layer ``(kv_cache_group index, cache tensor index)`` (static); ``None``:
                layer ``i`` uses tensor ``i`` and the single ``metadata``.

        Returns:
            ``(f32[num_logits, vocab_size] logits, the updated cache tensors)``.

        Raises:
            ValueError: ``cache_layout`` or ``kv_caches`` that do not fit the layers.
        """
        c = self.config
        if cache_layout is None:
            cache_layout = [(0, i) for i in range(c.num_layers)]
        if len(cache_layout) != c.num_layers:
            raise ValueError(f"len(cache_layout)={len(cache_layout)} != num_layers={c.num_layers}")
        kv_caches = list(kv_caches)
        per_group = isinstance(metadata, (tuple, list))
        if max(t for _, t in cache_layout) >= len(kv_caches):
            raise ValueError(f"cache_layout names tensor {max(t for _, t in cache_layout)} but "
                             f"len(kv_caches)={len(kv_caches)}")
        x = self._embed(input_ids)
        for layer, (g, t) in zip(self.layers, cache_layout):
            md = metadata[g] if per_group else metadata
            x, kv_caches[t] = layer(x, positions, kv_caches[t], md, attention_impl=attention_impl)
        return self._logits(x[logits_indices]), kv_caches

    def forward_dense(self, input_ids: Int[Array, "batch seq"], valid: jax.Array, first_logit: int = 0
                      ) -> Float[Array, "batch seq_out vocab"]:
        """Cache-free forward over left-aligned sequences (``valid``: bool[batch, seq]); f32 logits of
        positions ``first_logit..seq-1`` (a static int: long prompts need only their last logits)."""
        x = self._embed(input_ids)
        for layer in self.layers:
            x = layer.dense(x, valid)
        return self._logits(x[:, first_logit:])


def from_weights(config: Gemma3Config, weights: dict, *, dtype=jnp.float32) -> Gemma3ForCausalLM:
    """Build the model from a weight dict (names of :func:`models.gemma3_loader.load_gemma3_gguf`).

    Raises:
        ValueError: a weight missing or with the wrong shape (names the weight and both shapes).
    """
    model = nnx.eval_shape(lambda: Gemma3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))

    def put(param, name, cast=dtype):
        set_weight(param, weights, name, cast)

    put(model.embed_tokens.embedding, "embed_tokens")
    put(model.norm.scale, "norm", jnp.float32)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            put(getattr(layer, norm).scale, p + norm, jnp.float32)
        put(layer.self_attn.q_norm.scale, p + "q_norm", jnp.float32)
        put(layer.self_attn.k_norm.scale, p + "k_norm", jnp.float32)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(getattr(layer.self_attn, name).kernel, p + name)
        for name in ("gate_proj", "up_proj", "down_proj"):
            put(getattr(layer.mlp, name).kernel, p + name)
    return model


def random_weights(config: Gemma3Config, *, seed: int = 0, dtype=jnp.float32) -> Gemma3ForCausalLM:
    """A randomly initialised model (tests): norm weights drawn around 1 so they are not the identity."""
    model = Gemma3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and path and path[-1] == "scale":
            key, sub = jax.random.split(key)
            param.set_value(1.0 + 0.2 * jax.random.normal(sub, param.get_value().shape, jnp.float32))
    return model
