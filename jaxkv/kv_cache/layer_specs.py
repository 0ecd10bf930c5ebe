"""Per-layer KV-cache specs from a description of a model's attention layers.

vLLM: ``get_kv_cache_spec`` (``vllm/v1/worker/gpu/attn_utils.py`` / ``GPUModelRunner.get_kv_cache_spec``),
which reads the ``Attention`` modules of the model; here the model lists its layers as
:class:`AttentionLayerDescription` values. :func:`get_shared_kv_cache_layers` gives the cross-layer KV
sharing pairs (vLLM: ``GPUModelRunner.shared_kv_cache_layers``) for :mod:`jaxkv.vllm_parity.kv_sharing`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv.kv_cache.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    _check_positive_int,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionLayerDescription:
    """What :func:`get_kv_cache_spec` needs to know of one decoder attention layer.

    The analogue of the fields vLLM reads from an ``Attention`` module.

    Attributes:
        name: layer name, e.g. ``"model.layers.3.self_attn.attn"``.
        num_kv_heads: key/value heads.
        head_size: channels per head (for MLA: ``kv_lora_rank + qk_rope_head_dim``).
        sliding_window: window in tokens, ``None`` for full attention.
        use_mla: the layer caches one MLA latent per token.
        kv_sharing_target_layer_name: the earlier layer whose KV cache this layer reads (cross-layer KV
            sharing); such a layer allocates no cache of its own.
    """

    name: str
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None
    use_mla: bool = False
    kv_sharing_target_layer_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty str")
        for name in ("num_kv_heads", "head_size"):
            object.__setattr__(self, name, _check_positive_int(name, getattr(self, name)))
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window",
                               _check_positive_int("sliding_window", self.sliding_window))
        if not isinstance(self.use_mla, bool):
            raise ValueError(f"use_mla={self.use_mla!r} must be a bool")
        if self.use_mla and self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} is not supported with use_mla=True "
                             f"(layer {self.name})")
        if self.use_mla and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must be 1 with use_mla=True "
                             f"(layer {self.name})")
        target = self.kv_sharing_target_layer_name
        if target is not None and (not isinstance(target, str) or not target):
            raise ValueError(f"kv_sharing_target_layer_name={target!r} must be a non-empty str or None")
        if target == self.name:
            raise ValueError(f"kv_sharing_target_layer_name={target!r} cannot be the layer itself")


def _validate_layers(layers: Sequence[AttentionLayerDescription]) -> dict[str, AttentionLayerDescription]:
    by_name: dict[str, AttentionLayerDescription] = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, AttentionLayerDescription):
            raise ValueError(f"layers[{i}]={layer!r} is not an AttentionLayerDescription")
        if layer.name in by_name:
            raise ValueError(f"layers[{i}].name={layer.name!r} appears twice")
        target_name = layer.kv_sharing_target_layer_name
        if target_name is not None:
            # vLLM (validate_kv_sharing_target): the target must be an attention layer that comes before.
            target = by_name.get(target_name)
            if target is None:
                where = "comes after it" if any(l.name == target_name for l in layers) else "is not a layer"
                raise ValueError(f"kv_sharing_target_layer_name={target_name!r} of layer {layer.name!r} "
                                 f"{where}; the target must be an earlier attention layer")
            if target.kv_sharing_target_layer_name is not None:
                raise ValueError(f"kv_sharing_target_layer_name={target_name!r} of layer {layer.name!r} "
                                 f"itself shares the KV cache of {target.kv_sharing_target_layer_name!r}; "
                                 "point at the layer that owns the cache")
            for field in ("num_kv_heads", "head_size", "use_mla"):
                if getattr(layer, field) != getattr(target, field):
                    raise ValueError(f"layer {layer.name!r} has {field}={getattr(layer, field)!r} but its KV "
                                     f"sharing target {target_name!r} has {field}={getattr(target, field)!r}")
        by_name[layer.name] = layer
    return by_name


def get_kv_cache_spec(layers: Sequence[AttentionLayerDescription], *, block_size: int,
                      dtype) -> dict[str, KVCacheSpec]:
    """Per-layer KV-cache specs of a decoder model. vLLM: ``get_kv_cache_spec`` (gpu/attn_utils.py).

    A layer with ``sliding_window`` gets a :class:`SlidingWindowSpec`, an MLA layer an
    :class:`MLAAttentionSpec`, any other a :class:`FullAttentionSpec`. As in vLLM, a layer with a
    ``kv_sharing_target_layer_name`` gets **no** spec (it allocates nothing; it reads its target's cache):
    get those pairs from :func:`get_shared_kv_cache_layers`.

    Args:
        layers: the model's attention layers in model order.
        block_size: tokens per block (vLLM ``cache_config.block_size``).
        dtype: the cache dtype (vLLM ``kv_cache_dtype``), any JAX/NumPy dtype.

    Returns:
        ``{layer_name: spec}`` in model order, without the KV-sharing layers.

    Raises:
        ValueError: a bad descriptor, duplicate names, a KV-sharing target that is missing, comes later,
            shares itself, or has another ``num_kv_heads``/``head_size``/``use_mla``; bad ``block_size`` or
            ``dtype``.
    """
    _validate_layers(layers)
    specs: dict[str, KVCacheSpec] = {}
    for layer in layers:
        if layer.kv_sharing_target_layer_name is not None:
            continue
        common = dict(block_size=block_size, head_size=layer.head_size, dtype=dtype)
        if layer.use_mla:
            specs[layer.name] = MLAAttentionSpec(**common)
        elif layer.sliding_window is not None:
            specs[layer.name] = SlidingWindowSpec(num_kv_heads=layer.num_kv_heads,
                                                  sliding_window=layer.sliding_window, **common)
        else:
            specs[layer.name] = FullAttentionSpec(num_kv_heads=layer.num_kv_heads, **common)
    return specs


def get_shared_kv_cache_layers(layers: Sequence[AttentionLayerDescription]) -> dict[str, str]:
    """``{layer_name: target_layer_name}`` for the layers that reuse another layer's KV cache.

    vLLM: ``GPUModelRunner.shared_kv_cache_layers`` (filled while building the KV-cache spec), the input of
    ``add_kv_sharing_layers_to_kv_cache_groups``.

    Raises:
        ValueError: as :func:`get_kv_cache_spec` for the layer descriptions.
    """
    _validate_layers(layers)
    return {l.name: l.kv_sharing_target_layer_name for l in layers if l.kv_sharing_target_layer_name}
