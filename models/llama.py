"""Llama-family decoder (SmolLM2, Llama 2/3) in Flax NNX, attending through jaxkv's paged cache.

Tokens travel in vLLM's flat layout: the new tokens of every sequence of the batch are concatenated
(``[num_tokens, ...]``), described by :class:`jaxkv.AttentionMetadata`. Each attention layer writes its
new K/V into its paged cache through the slot mapping and attends through ``jaxkv.paged_attention``.
:meth:`LlamaForCausalLM.forward_dense` is an independent cache-free forward (plain causal attention over
whole sequences), the reference the paged path is checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

import jaxkv
from jaxkv.parallel import gather_logits_rows, paged_attention_layer
from models.config import LlamaConfig


def rope_cos_sin(positions: Int[Array, "..."], head_size: int, theta: float
                 ) -> tuple[Float[Array, "... half"], Float[Array, "... half"]]:
    """f32 cos/sin of RoPE angles ``position * theta ** (-2i / head_size)``, ``i < head_size / 2``."""
    inv_freq = theta ** (-jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


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


def apply_rope(x: Float[Array, "... heads head_size"], cos: Float[Array, "... half"],
               sin: Float[Array, "... half"]) -> Float[Array, "... heads head_size"]:
    """Rotate channel pairs ``(i, i + head_size/2)`` (HF's ``rotate_half`` / NeoX convention)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """GQA self-attention: q/k/v projections, RoPE, paged cache write + paged attention, o projection."""

    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.config = c
        self.q_proj = nnx.Linear(c.hidden_size, c.num_heads * c.head_size, **linear)
        self.k_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_size, **linear)
        self.v_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_size, **linear)
        self.o_proj = nnx.Linear(c.num_heads * c.head_size, c.hidden_size, **linear)

    def _qkv(self, x, positions):
        c = self.config
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, c.num_heads, c.head_size)
        k = self.k_proj(x).reshape(*lead, c.num_kv_heads, c.head_size)
        v = self.v_proj(x).reshape(*lead, c.num_kv_heads, c.head_size)
        cos, sin = rope_cos_sin(positions, c.head_size, c.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x: Float[Array, "num_tokens hidden"], positions: Int[Array, "num_tokens"],
                 kv_cache: jax.Array, metadata: jaxkv.AttentionMetadata, *, attention_impl: str, mesh=None
                 ) -> tuple[Float[Array, "num_tokens hidden"], jax.Array]:
        c = self.config
        q, k, v = self._qkv(x, positions)
        # An fp8 cache (kv_cache_dtype "fp8*") is quantised on write and dequantised on read with
        # k_scale = v_scale = 1, vLLM's default when a checkpoint ships no calibrated scales.
        scales = {}
        if jnp.dtype(kv_cache.dtype) in jaxkv.FP8_DTYPES:
            scales = dict(k_scale=jnp.float32(1.0), v_scale=jnp.float32(1.0))
        # write + attend; on a mesh per shard (local heads, local rows and blocks: jaxkv.parallel)
        out, kv_cache = paged_attention_layer(q, k, v, kv_cache, metadata, scale=c.head_size ** -0.5,
                                              impl=attention_impl, mesh=mesh, **scales)
        return self.o_proj(out.reshape(x.shape[0], c.num_heads * c.head_size)), kv_cache

    def dense(self, x: Float[Array, "batch seq hidden"], valid: jax.Array) -> Float[Array, "batch seq hidden"]:
        """Cache-free causal attention over whole left-aligned sequences (``valid``: bool[batch, seq])."""
        c = self.config
        batch, seq, _ = x.shape
        q, k, v = self._qkv(x, jnp.broadcast_to(jnp.arange(seq), (batch, seq)))
        group = c.num_queries_per_kv
        q = q.reshape(batch, seq, c.num_kv_heads, group, c.head_size)
        out = dense_attention(q, k, v, valid, scale=c.head_size ** -0.5).astype(x.dtype)
        return self.o_proj(out.reshape(batch, seq, c.num_heads * c.head_size))


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **linear)
        self.up_proj = nnx.Linear(config.hidden_size, config.intermediate_size, **linear)
        self.down_proj = nnx.Linear(config.intermediate_size, config.hidden_size, **linear)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _rms_norm(config: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # Normalise in float32 (as HF's LlamaRMSNorm does); weights stay float32.
    return nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, dtype=jnp.float32,
                       param_dtype=jnp.float32, rngs=rngs)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = _rms_norm(config, rngs)
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(config, rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv_cache, metadata, *, attention_impl, mesh=None):
        h, kv_cache = self.self_attn(self.input_layernorm(x).astype(x.dtype), positions, kv_cache,
                                     metadata, attention_impl=attention_impl, mesh=mesh)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x).astype(x.dtype)), kv_cache

    def dense(self, x, valid):
        x = x + self.self_attn.dense(self.input_layernorm(x).astype(x.dtype), valid)
        return x + self.mlp(self.post_attention_layernorm(x).astype(x.dtype))


class LlamaForCausalLM(nnx.Module):
    """Embedding, ``num_layers`` decoder layers, final norm and LM head (tied by default)."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_layers)])
        self.norm = _rms_norm(config, rngs)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                      dtype=dtype, param_dtype=dtype, rngs=rngs)

    def _logits(self, x):
        x = self.norm(x).astype(self.dtype)
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def __call__(self, input_ids: Int[Array, "num_tokens"], positions: Int[Array, "num_tokens"],
                 kv_caches: list[jax.Array], metadata: jaxkv.AttentionMetadata,
                 logits_indices: Int[Array, "num_logits"], *, attention_impl: str, mesh=None
                 ) -> tuple[Float[Array, "num_logits vocab"], list[jax.Array]]:
        """One model step over the batch's new tokens.

        Args:
            input_ids: ``int32[num_tokens]`` new tokens of all sequences, concatenated.
            positions: ``int32[num_tokens]`` position of each token in its sequence.
            kv_caches: one ``[2, num_blocks, num_kv_heads, block_size, head_size]`` array per layer.
            metadata: slot mapping, block tables, seq lens of the batch.
            logits_indices: ``int32[num_logits]`` tokens whose next-token logits are wanted
                (each sequence's last new token).
            attention_impl: see :func:`jaxkv.paged_attention`.
            mesh: the ``(dp, tp)`` mesh the parameters and caches are sharded over (``None``: one
                device); see :func:`models.parallel.shard_llama_params`.

        Returns:
            ``(f32[num_logits, vocab_size] logits, the updated caches)``.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"len(kv_caches)={len(kv_caches)} != num_layers={self.config.num_layers}")
        x = self.embed_tokens(input_ids)
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, kv_cache = layer(x, positions, kv_cache, metadata, attention_impl=attention_impl, mesh=mesh)
            new_caches.append(kv_cache)
        return self._logits(gather_logits_rows(x, logits_indices, mesh)), new_caches

    def forward_dense(self, input_ids: Int[Array, "batch seq"], valid: jax.Array
                      ) -> Float[Array, "batch seq vocab"]:
        """Cache-free forward over left-aligned sequences (``valid``: bool[batch, seq]); f32 logits."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer.dense(x, valid)
        return self._logits(x)


def set_weight(param, weights: dict, name: str, dtype) -> None:
    """``param``'s value becomes ``weights[name]`` cast to ``dtype`` (``ValueError`` naming the weight when
    it is missing or its shape differs from the parameter's)."""
    if name not in weights:
        raise ValueError(f"weight {name!r} missing")
    value, expected = weights[name], tuple(param.get_value().shape)
    if tuple(value.shape) != expected:
        raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, expected {expected}")
    param.set_value(jnp.asarray(value, dtype))


def from_weights(config: LlamaConfig, weights: dict, *, dtype=jnp.float32) -> LlamaForCausalLM:
    """Build the model from a weight dict (names of :func:`models.gguf_loader.load_llama_gguf`).

    Raises:
        ValueError: a weight missing or with the wrong shape (names the weight and both shapes).
    """
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))

    def put(param, name, cast=dtype):
        set_weight(param, weights, name, cast)

    put(model.embed_tokens.embedding, "embed_tokens")
    put(model.norm.scale, "norm", jnp.float32)
    if not config.tie_word_embeddings:
        put(model.lm_head.kernel, "lm_head")
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        put(layer.input_layernorm.scale, p + "input_layernorm", jnp.float32)
        put(layer.post_attention_layernorm.scale, p + "post_attention_layernorm", jnp.float32)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(getattr(layer.self_attn, name).kernel, p + name)
        for name in ("gate_proj", "up_proj", "down_proj"):
            put(getattr(layer.mlp, name).kernel, p + name)
    return model
