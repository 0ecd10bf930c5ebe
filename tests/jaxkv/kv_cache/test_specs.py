"""KV-cache specs (vLLM kv_cache_interface): page sizes, type_id, max memory, merge, get_kv_cache_spec."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.kv_cache.layer_specs import AttentionLayerDescription, get_kv_cache_spec, get_shared_kv_cache_layers
from jaxkv.kv_cache.specs import AttentionSpec, FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec

# bytes per element, written out
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


def full(**kw):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
    args.update(kw)
    return FullAttentionSpec(**args)


def sliding(window=128, **kw):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16, sliding_window=window)
    args.update(kw)
    return SlidingWindowSpec(**args)


# ----------------------------------------------------------------------------------------------------
# page_size_bytes, dtypes
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype_name", list(ITEMSIZE))
@pytest.mark.parametrize("block_size,num_kv_heads,head_size", [(16, 8, 128), (32, 3, 80), (1, 1, 256)])
def test_page_size_bytes_full_and_sliding(dtype_name, block_size, num_kv_heads, head_size):
    want = 2 * block_size * num_kv_heads * head_size * ITEMSIZE[dtype_name]  # K and V
    f = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                          dtype=dtype_name)
    s = SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                          dtype=getattr(jnp, dtype_name), sliding_window=7)
    assert f.page_size_bytes == want
    assert s.page_size_bytes == want
    assert f.dtype == np.dtype(dtype_name) and isinstance(f.dtype, np.dtype)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, ml_dtypes.float8_e5m2, "float8_e4m3fn", np.float16])
def test_dtype_forms_are_normalised(dtype):
    spec = full(dtype=dtype)
    again = full(dtype=np.dtype(dtype))
    assert spec == again and hash(spec) == hash(again)
    assert isinstance(spec.dtype, np.dtype)


def test_mla_page_size_has_no_factor_two():
    # DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 channels, one latent per token
    spec = MLAAttentionSpec.from_mla_dims(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                          dtype=jnp.bfloat16)
    assert spec.head_size == 576 and spec.num_kv_heads == 1
    assert spec.page_size_bytes == 16 * 576 * 2 == 18432
    fp8 = MLAAttentionSpec(block_size=64, head_size=576, dtype=jnp.float8_e4m3fn)
    assert fp8.page_size_bytes == 64 * 576
    # MLA is full attention for the KV-cache manager (vLLM: MLAAttentionSpec(FullAttentionSpec))
    assert isinstance(spec, FullAttentionSpec)
    assert spec.type_id == "full_attention_16_18432"
    assert spec.max_memory_usage_bytes(100) == 7 * 18432  # ceil(100 / 16) = 7


@pytest.mark.parametrize("kw,needle", [(dict(num_kv_heads=2), "num_kv_heads=2"),
                                       (dict(sliding_window=64), "sliding_window=64"),
                                       (dict(head_size=0), "head_size=0")])
def test_mla_rejects(kw, needle):
    args = dict(block_size=16, head_size=576, dtype=jnp.bfloat16)
    args.update(kw)
    with pytest.raises(ValueError, match=needle):
        MLAAttentionSpec(**args)


@pytest.mark.parametrize("kw,needle", [(dict(kv_lora_rank=0), "kv_lora_rank=0"),
                                       (dict(qk_rope_head_dim=-64), "qk_rope_head_dim=-64")])
def test_mla_from_dims_rejects(kw, needle):
    args = dict(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=jnp.bfloat16)
    args.update(kw)
    with pytest.raises(ValueError, match=needle):
        MLAAttentionSpec.from_mla_dims(**args)


# ----------------------------------------------------------------------------------------------------
# validation, immutability, hashing
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,field,value", [
    (FullAttentionSpec, "block_size", True), (FullAttentionSpec, "block_size", 16.0),
    (FullAttentionSpec, "num_kv_heads", -2), (FullAttentionSpec, "sliding_window", 0),
    (SlidingWindowSpec, "sliding_window", 0), (SlidingWindowSpec, "sliding_window", None),
    (SlidingWindowSpec, "sliding_window", 4.5), (SlidingWindowSpec, "head_size", "64"),
])
def test_bad_fields_name_field_and_value(cls, field, value):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.float32)
    if cls is SlidingWindowSpec:
        args["sliding_window"] = 32
    args[field] = value
    with pytest.raises(ValueError, match=f"{field}={value!r}".replace("(", r"\(").replace(")", r"\)")):
        cls(**args)


def test_dtype_none_or_garbage_rejected():
    with pytest.raises(ValueError, match="dtype=None"):
        full(dtype=None)
    with pytest.raises(ValueError, match="dtype='fp9'"):
        full(dtype="fp9")


def test_numpy_int_sizes_become_python_ints():
    spec = full(block_size=np.int64(32), head_size=np.int32(128))
    assert type(spec.block_size) is int and type(spec.head_size) is int
    assert spec == full(block_size=32, head_size=128)


def test_missing_sliding_window_is_a_type_error():
    with pytest.raises(TypeError):
        SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.float32)


def test_frozen_hashable_and_equal_by_class():
    a, b = sliding(64), sliding(64)
    assert a == b and hash(a) == hash(b) and len({a, b, sliding(32)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.sliding_window = 8  # type: ignore[misc]
    # same fields, different classes: not equal (vLLM's dataclass equality)
    assert MLAAttentionSpec(block_size=16, head_size=64, dtype=jnp.bfloat16) != \
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=jnp.bfloat16)
    assert full() != full(sliding_window=128)


def test_replace_and_copy_with_new_block_size():
    spec = full(sliding_window=256)
    half = spec.copy_with_new_block_size(8)
    assert half.block_size == 8 and half.sliding_window == 256
    assert half.page_size_bytes == 2 * 8 * 2 * 64 * 2
    assert spec.block_size == 16
    with pytest.raises(ValueError, match="block_size=0"):
        spec.copy_with_new_block_size(0)
    with pytest.raises(ValueError, match="sliding_window=-1"):
        sliding().replace(sliding_window=-1)


def test_spec_as_static_jit_argument_compiles_once_per_distinct_spec():
    traces = []

    def f(x, spec):
        traces.append(spec)
        return x * spec.page_size_bytes

    g = jax.jit(f, static_argnames="spec")
    x = jnp.ones(2, jnp.float32)
    assert float(g(x, spec=full())[0]) == 8192.0  # 2 * 16 * 2 * 64 * 2
    g(x, spec=FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16"))
    assert len(traces) == 1  # an equal spec hits the cache
    assert float(g(x, spec=full(num_kv_heads=1))[0]) == 4096.0
    assert len(traces) == 2


def test_base_classes_are_abstract():
    base = KVCacheSpec(block_size=16)
    with pytest.raises(NotImplementedError):
        base.page_size_bytes
    with pytest.raises(NotImplementedError):
        base.type_id
    with pytest.raises(NotImplementedError):
        base.max_memory_usage_bytes(10)
    attn = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.float32)
    assert attn.page_size_bytes == 2 * 16 * 2 * 64 * 4
    with pytest.raises(NotImplementedError):
        attn.type_id


# ----------------------------------------------------------------------------------------------------
# type_id
# ----------------------------------------------------------------------------------------------------

def test_type_id_hand_values():
    assert full().type_id == "full_attention_16_8192"
    assert full(sliding_window=512).type_id == "full_attention_16_8192"  # window not part of it (vLLM)
    assert sliding(128).type_id == "sliding_window_128_16_8192"
    assert full(block_size=32, num_kv_heads=1).type_id == "full_attention_32_8192"


def test_type_id_differs_when_tokens_or_bytes_differ():
    base = full()
    # bytes per token differ
    assert full(dtype=jnp.float32).type_id != base.type_id
    assert full(head_size=128).type_id != base.type_id
    # tokens per block differ, same page bytes
    same_bytes = full(block_size=32, num_kv_heads=1)
    assert same_bytes.page_size_bytes == base.page_size_bytes and same_bytes.type_id != base.type_id
    # tokens kept differ: full vs window, window vs window
    assert sliding(128).type_id != base.type_id
    assert sliding(128).type_id != sliding(256).type_id
    # same page and tokens, different head split: same type (they are then merged, and fail to merge)
    assert full(num_kv_heads=4, head_size=32).type_id == base.type_id


# ----------------------------------------------------------------------------------------------------
# max_memory_usage_bytes
# ----------------------------------------------------------------------------------------------------

def blocks_by_counting(num_tokens, block_size):
    """Whole blocks for num_tokens tokens, counted one token at a time."""
    blocks, filled = 0, block_size
    for _ in range(num_tokens):
        if filled == block_size:
            blocks, filled = blocks + 1, 0
        filled += 1
    return blocks


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("max_model_len", [1, 7, 8, 9, 16, 17, 100, 4096])
def test_full_max_memory_counts_whole_blocks(block_size, max_model_len):
    spec = full(block_size=block_size)
    want = blocks_by_counting(max_model_len, block_size) * spec.page_size_bytes
    assert spec.max_memory_usage_bytes(max_model_len) == want
    assert spec.max_memory_usage_bytes(max_model_len, 32) == want  # batch size does not matter


def test_sliding_max_memory_hand_values():
    s = sliding(128)  # block 16, page 8192
    # min(127 + 64, 1000) = 191 tokens -> 12 blocks, + 1 for a window starting inside a block
    assert s.max_memory_usage_bytes(1000, 64) == 13 * 8192
    # capped by max_model_len: min(191, 100) = 100 -> 7 + 1
    assert s.max_memory_usage_bytes(100, 64) == 8 * 8192
    # no max_num_batched_tokens: a whole request at once -> min(127 + 100, 100) = 100
    assert s.max_memory_usage_bytes(100) == 8 * 8192
    # vLLM's comment: block 4, window 4 over [XXCD][EF] needs two blocks
    tiny = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=jnp.int8, sliding_window=4)
    assert tiny.max_memory_usage_bytes(4, 1) == 2 * tiny.page_size_bytes


def max_blocks_spanned(num_tokens, block_size):
    """Most blocks any run of num_tokens consecutive tokens touches, over every start offset."""
    return max(len({(start + i) // block_size for i in range(num_tokens)}) for start in range(block_size))


@pytest.mark.parametrize("window,block_size,max_model_len,batched", [
    (4, 4, 64, 1), (5, 4, 64, 3), (128, 16, 4096, 64), (128, 16, 100, 64), (1, 8, 50, 8), (33, 16, 40, 40)])
def test_sliding_max_memory_formula_and_bound(window, block_size, max_model_len, batched):
    s = sliding(window, block_size=block_size)
    num_tokens = min(window - 1 + batched, max_model_len)
    want_blocks = -(-num_tokens // block_size) + 1
    got = s.max_memory_usage_bytes(max_model_len, batched)
    assert got == want_blocks * s.page_size_bytes
    # never under-estimates: the window plus a step's tokens, at the worst alignment, fits
    assert got >= max_blocks_spanned(num_tokens, block_size) * s.page_size_bytes
    # and never more than full attention would need plus one block
    assert got <= full(block_size=block_size).max_memory_usage_bytes(max_model_len) + s.page_size_bytes


@pytest.mark.parametrize("args,needle", [((0,), "max_model_len=0"), ((10, 0), "max_num_batched_tokens=0"),
                                         ((10.5,), "max_model_len=10.5")])
def test_max_memory_bad_lengths(args, needle):
    for spec in (full(), sliding()):
        with pytest.raises(ValueError, match=needle):
            spec.max_memory_usage_bytes(*args)


# ----------------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------------

def test_base_merge_equal_and_unequal():
    s = sliding(64)
    assert SlidingWindowSpec.merge([s, sliding(64), s]) == s
    with pytest.raises(ValueError,
                       match=r"specs\[2\]\.sliding_window=32 differs from specs\[0\]\.sliding_window=64"):
        SlidingWindowSpec.merge([s, s, sliding(32)])
    with pytest.raises(ValueError, match=r"specs\[1\]\.dtype=dtype\('float32'\)"):
        SlidingWindowSpec.merge([s, sliding(64, dtype=jnp.float32)])
    with pytest.raises(ValueError, match="empty"):
        SlidingWindowSpec.merge([])


def test_merge_rejects_other_classes():
    with pytest.raises(ValueError, match=r"specs\[1\] is a FullAttentionSpec"):
        SlidingWindowSpec.merge([sliding(), full()])
    with pytest.raises(ValueError, match=r"specs\[0\] is a SlidingWindowSpec"):
        FullAttentionSpec.merge([sliding(), sliding()])
    with pytest.raises(ValueError, match="MLAAttentionSpec.merge"):
        FullAttentionSpec.merge([full(num_kv_heads=1), MLAAttentionSpec(block_size=16, head_size=64,
                                                                       dtype=jnp.bfloat16)])


def test_full_merge_keeps_agreeing_window():
    merged = FullAttentionSpec.merge([full(), full(sliding_window=512), full(sliding_window=512)])
    assert merged == full(sliding_window=512)
    assert FullAttentionSpec.merge([full(), full()]) == full()
    assert FullAttentionSpec.merge([full(sliding_window=8)]).sliding_window == 8


def test_full_merge_rejects_different_windows_and_fields():
    with pytest.raises(ValueError, match=r"sliding_window=\[256, 512\]"):
        FullAttentionSpec.merge([full(sliding_window=512), full(), full(sliding_window=256)])
    # the first differing field is named (num_kv_heads comes before head_size)
    with pytest.raises(ValueError,
                       match=r"specs\[1\]\.num_kv_heads=4 differs from specs\[0\]\.num_kv_heads=2"):
        FullAttentionSpec.merge([full(), full(num_kv_heads=4, head_size=32)])
    with pytest.raises(ValueError, match=r"specs\[2\]\.head_size=32 differs from specs\[0\]\.head_size=64"):
        FullAttentionSpec.merge([full(), full(), full(head_size=32)])
    with pytest.raises(ValueError, match=r"specs\[1\]\.block_size=32"):
        FullAttentionSpec.merge([full(), full(block_size=32)])


def test_mla_merge():
    m = MLAAttentionSpec(block_size=16, head_size=576, dtype=jnp.bfloat16)
    assert MLAAttentionSpec.merge([m, m]) == m
    with pytest.raises(ValueError, match=r"specs\[1\]\.head_size=512"):
        MLAAttentionSpec.merge([m, m.replace(head_size=512)])
    with pytest.raises(ValueError, match=r"specs\[1\] is a FullAttentionSpec"):
        MLAAttentionSpec.merge([m, full(num_kv_heads=1, head_size=576)])


# ----------------------------------------------------------------------------------------------------
# get_kv_cache_spec / get_shared_kv_cache_layers
# ----------------------------------------------------------------------------------------------------

def name(i):
    return f"model.layers.{i}.self_attn.attn"


def test_get_kv_cache_spec_builds_each_kind():
    layers = [
        AttentionLayerDescription(name=name(0), num_kv_heads=4, head_size=128),
        AttentionLayerDescription(name=name(1), num_kv_heads=4, head_size=128, sliding_window=1024),
        AttentionLayerDescription(name=name(2), num_kv_heads=1, head_size=576, use_mla=True),
        AttentionLayerDescription(name=name(3), num_kv_heads=4, head_size=128,
                                  kv_sharing_target_layer_name=name(1)),
        AttentionLayerDescription(name=name(4), num_kv_heads=4, head_size=128,
                                  kv_sharing_target_layer_name=name(0)),
    ]
    specs = get_kv_cache_spec(layers, block_size=32, dtype=jnp.float8_e4m3fn)
    assert list(specs) == [name(0), name(1), name(2)]  # sharing layers get no spec (vLLM)
    assert specs[name(0)] == FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=128,
                                               dtype=jnp.float8_e4m3fn)
    assert specs[name(1)] == SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=128,
                                               dtype=jnp.float8_e4m3fn, sliding_window=1024)
    assert specs[name(2)] == MLAAttentionSpec(block_size=32, head_size=576, dtype=jnp.float8_e4m3fn)
    assert get_shared_kv_cache_layers(layers) == {name(3): name(1), name(4): name(0)}
    assert get_shared_kv_cache_layers(layers[:3]) == {}


def desc(i, **kw):
    args = dict(name=name(i), num_kv_heads=2, head_size=64)
    args.update(kw)
    return AttentionLayerDescription(**args)


@pytest.mark.parametrize("layers,needle", [
    ([desc(0), desc(0)], "appears twice"),
    ([desc(0), desc(1, kv_sharing_target_layer_name="model.layers.9.self_attn.attn")], "is not a layer"),
    ([desc(0, kv_sharing_target_layer_name=name(1)), desc(1)], "comes after it"),
    ([desc(0), desc(1, kv_sharing_target_layer_name=name(0)), desc(2, kv_sharing_target_layer_name=name(1))],
     "itself shares"),
    ([desc(0), desc(1, num_kv_heads=4, kv_sharing_target_layer_name=name(0))], "num_kv_heads=4"),
    ([desc(0), "model.layers.1"], r"layers\[1\]"),
])
def test_get_kv_cache_spec_rejects(layers, needle):
    with pytest.raises(ValueError, match=needle):
        get_kv_cache_spec(layers, block_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=needle):
        get_shared_kv_cache_layers(layers)


@pytest.mark.parametrize("kw,needle", [
    (dict(kv_sharing_target_layer_name=name(0)), "cannot be the layer itself"),
    (dict(use_mla=True, num_kv_heads=1, sliding_window=128), "sliding_window=128"),
    (dict(use_mla=True), "num_kv_heads=2"),
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(head_size=-64), "head_size=-64"),
    (dict(name=""), "name=''"),
    (dict(use_mla=1), "use_mla=1"),
])
def test_layer_description_rejects(kw, needle):
    with pytest.raises(ValueError, match=needle):
        desc(0, **kw)


def test_get_kv_cache_spec_bad_block_size_or_dtype():
    with pytest.raises(ValueError, match="block_size=0"):
        get_kv_cache_spec([desc(0)], block_size=0, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        get_kv_cache_spec([desc(0)], block_size=16, dtype="nope")
