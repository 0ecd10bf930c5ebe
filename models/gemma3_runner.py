"""Glue between Gemma 3 and jaxkv: per-layer specs, the hybrid KV-cache config, caches and the step.

The 18 layers of Gemma-3-270M are 15 sliding-window layers (window 512) and 3 full-attention layers.
vLLM's rules (:func:`jaxkv.get_kv_cache_config`, ``_get_kv_cache_config_uniform_page_size``) cut them into
groups of ``min(layers per type) = 3``: five sliding-window groups and one full-attention group over one
block pool, and 3 cache tensors, tensor ``i`` shared by layer ``i`` of every group. Each layer writes and
reads its tensor through its group's block table. With ``hybrid=False`` (vLLM
``disable_hybrid_kv_cache_manager``) every layer is a full-attention layer for the cache (one group, one
tensor per layer) and sliding-window layers only limit their compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxkv
from models.gemma3 import Gemma3ForCausalLM
from models.gemma3_config import Gemma3Config


def layer_names(config: Gemma3Config) -> list[str]:
    """vLLM-style attention layer names, ``model.layers.{i}.self_attn.attn``."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(config.num_layers)]


def kv_cache_specs(config: Gemma3Config, *, block_size: int, dtype, hybrid: bool = True
                   ) -> dict[str, jaxkv.KVCacheSpec]:
    """Layer name -> spec: :class:`jaxkv.SlidingWindowSpec` for sliding-window layers (``hybrid``), else
    :class:`jaxkv.FullAttentionSpec` (recording the window when ``hybrid`` is off)."""
    common = dict(block_size=block_size, num_kv_heads=config.num_kv_heads, head_size=config.head_size,
                  dtype=dtype)
    specs = {}
    for i, name in enumerate(layer_names(config)):
        if config.is_sliding(i) and hybrid:
            specs[name] = jaxkv.SlidingWindowSpec(sliding_window=config.sliding_window, **common)
        elif config.is_sliding(i):
            specs[name] = jaxkv.FullAttentionSpec(sliding_window=config.sliding_window, **common)
        else:
            specs[name] = jaxkv.FullAttentionSpec(**common)
    return specs


def get_kv_cache_config(config: Gemma3Config, *, block_size: int, dtype, num_blocks: int,
                        hybrid: bool = True) -> jaxkv.KVCacheConfig:
    """The model's :class:`jaxkv.KVCacheConfig` with ``num_blocks`` blocks (vLLM's grouping rules)."""
    specs = kv_cache_specs(config, block_size=block_size, dtype=dtype, hybrid=hybrid)
    page = next(iter(specs.values())).page_size_bytes
    return jaxkv.get_kv_cache_config(specs, num_blocks * page * config.num_layers, num_blocks=num_blocks)


def cache_layout(config: Gemma3Config, kv_config: jaxkv.KVCacheConfig) -> tuple[tuple[int, int], ...]:
    """Per layer ``(kv_cache_group index, tensor index)`` (static, for :class:`Gemma3ForCausalLM`).

    Raises:
        ValueError: a layer in no group or no tensor.
    """
    group_of = {n: g for g, grp in enumerate(kv_config.kv_cache_groups) for n in grp.layer_names}
    tensor_of = {n: t for t, tensor in enumerate(kv_config.kv_cache_tensors) for n in tensor.shared_by}
    layout = []
    for name in layer_names(config):
        if name not in group_of or name not in tensor_of:
            raise ValueError(f"layer {name!r} is in no kv_cache_group or no kv_cache_tensor")
        layout.append((group_of[name], tensor_of[name]))
    return tuple(layout)


def init_kv_caches(config: Gemma3Config, *, block_size: int, dtype, num_blocks: int, hybrid: bool = True
                   ) -> tuple[jaxkv.KVCacheConfig, list[jax.Array]]:
    """The config and its zero-filled tensors (Pallas layout ``[2, num_blocks, num_kv_heads, block_size,
    head_size]`` each), in ``kv_cache_tensors`` order."""
    kv_config = get_kv_cache_config(config, block_size=block_size, dtype=dtype, num_blocks=num_blocks,
                                    hybrid=hybrid)
    by_layer = jaxkv.allocate_kv_cache(kv_config, jaxkv.PallasAttentionBackend)
    return kv_config, [by_layer[t.shared_by[0]] for t in kv_config.kv_cache_tensors]


def make_model_fn(model: Gemma3ForCausalLM, kv_config: jaxkv.KVCacheConfig, *, attention_impl: str):
    """``(params, fn)``: the pure step :class:`jaxkv.LLMEngine` drives (``kv_caches`` = the config's
    tensors; ``metadata`` = one per group, or one for all when there is one group)."""
    jaxkv.attention.check_attention_impl(attention_impl)
    layout = cache_layout(model.config, kv_config)
    graphdef, state = nnx.split(model)

    def fn(state, input_ids, positions, kv_caches, metadata, logits_indices):
        return nnx.merge(graphdef, state)(input_ids, positions, kv_caches, metadata, logits_indices,
                                          attention_impl=attention_impl, cache_layout=layout)

    return state, fn


def make_engine(model: Gemma3ForCausalLM, *, attention_impl: str, block_size: int, num_blocks: int,
                max_model_len: int, cache_dtype=None, hybrid: bool = True, **engine_options
                ) -> jaxkv.LLMEngine:
    """The model with freshly allocated (hybrid) caches behind a :class:`jaxkv.LLMEngine`."""
    kv_config, caches = init_kv_caches(model.config, block_size=block_size, num_blocks=num_blocks,
                                       dtype=model.dtype if cache_dtype is None else cache_dtype,
                                       hybrid=hybrid)
    params, fn = make_model_fn(model, kv_config, attention_impl=attention_impl)
    return jaxkv.LLMEngine(fn, params, caches, block_size=block_size, max_model_len=max_model_len,
                           kv_cache_groups=kv_config.kv_cache_groups, **engine_options)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _dense_logits(graphdef, state, input_ids, valid, first_logit):
    return nnx.merge(graphdef, state).forward_dense(input_ids, valid, first_logit)


def dense_logits(model: Gemma3ForCausalLM, input_ids, valid=None, *, first_logit: int = 0) -> np.ndarray:
    """Jitted cache-free forward: ``f32[batch, seq - first_logit, vocab]`` logits (NumPy)."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    valid = jnp.ones(input_ids.shape, bool) if valid is None else jnp.asarray(valid, bool)
    graphdef, state = nnx.split(model)
    return np.asarray(_dense_logits(graphdef, state, input_ids, valid, first_logit))
