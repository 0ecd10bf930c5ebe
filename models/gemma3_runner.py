"""Gemma 3's names for the generic glue of :mod:`models.runner` (per-layer specs, the hybrid KV-cache config,
caches, the step, the dense reference).

The 18 layers of Gemma-3-270M are 15 sliding-window layers (window 512) and 3 full-attention layers.
vLLM's rules (:func:`jaxkv.get_kv_cache_config`, ``_get_kv_cache_config_uniform_page_size``) cut them into
groups of ``min(layers per type) = 3``: five sliding-window groups and one full-attention group over one
block pool, and 3 cache tensors, tensor ``i`` shared by layer ``i`` of every group. Each layer writes and
reads its tensor through its group's block table. With ``hybrid=False`` (vLLM
``disable_hybrid_kv_cache_manager``) every layer is a full-attention layer for the cache (one group, one
tensor per layer) and sliding-window layers only limit their compute.
"""

from __future__ import annotations

import numpy as np

from jaxkv.engine.llm_engine import LLMEngine
from jaxkv.kv_cache.config import KVCacheConfig
from models import runner
from models.gemma3_config import Gemma3Config
from models.runner import cache_layout, kv_cache_specs, layer_names

__all__ = ["cache_layout", "dense_logits", "get_kv_cache_config", "init_kv_caches", "kv_cache_specs",
           "layer_names", "make_engine", "make_model_fn"]


def get_kv_cache_config(config: Gemma3Config, *, block_size: int, dtype, num_blocks: int,
                        hybrid: bool = True) -> KVCacheConfig:
    """The model's :class:`jaxkv.KVCacheConfig` with ``num_blocks`` blocks (vLLM's grouping rules)."""
    return runner.get_kv_cache_config(config, block_size=block_size, dtype=dtype, num_blocks=num_blocks,
                                      hybrid=hybrid)


def init_kv_caches(config: Gemma3Config, *, block_size: int, dtype, num_blocks: int, hybrid: bool = True,
                   mesh=None) -> tuple[KVCacheConfig, list]:
    """The config and its zero-filled tensors, in ``kv_cache_tensors`` order (see :func:`models.runner.init_kv_caches`)."""
    return runner.init_kv_caches(config, block_size=block_size, dtype=dtype, num_blocks=num_blocks, hybrid=hybrid,
                                 mesh=mesh)


def make_model_fn(model, kv_config: KVCacheConfig, *, attention_impl: str, mesh=None):
    """``(params, fn)``: the pure step :class:`jaxkv.LLMEngine` drives (see :func:`models.runner.make_model_fn`)."""
    return runner.make_model_fn(model, kv_config, attention_impl=attention_impl, mesh=mesh)


def make_engine(model, *, attention_impl: str, block_size: int, num_blocks: int, max_model_len: int,
                cache_dtype=None, hybrid: bool = True, **engine_options) -> LLMEngine:
    """The model with freshly allocated (hybrid) caches behind a :class:`jaxkv.LLMEngine`."""
    return runner.make_engine(model, attention_impl=attention_impl, block_size=block_size, num_blocks=num_blocks,
                              max_model_len=max_model_len, cache_dtype=cache_dtype, hybrid=hybrid,
                              **engine_options)


def dense_logits(model, input_ids, valid=None, *, first_logit: int = 0) -> np.ndarray:
    """Jitted cache-free forward: ``f32[batch, seq - first_logit, vocab]`` logits (NumPy)."""
    return np.asarray(runner.dense_logits(model, input_ids, valid, first_logit=first_logit))
