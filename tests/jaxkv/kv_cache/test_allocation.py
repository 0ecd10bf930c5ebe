"""allocate_kv_cache_raw / reshape_kv_cache / init_kv_cache (seed 000) and bind_kv_cache.

Round trip per backend: a Python loop writes tokens into a flat NumPy buffer at addresses computed by
hand for that backend's memory layout; the buffer's bytes become the raw tensor; ``reshape_kv_cache``
must expose exactly those K/V through the backend's logical view (and its split view for the legacy
layout), bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kv_cache.allocation import (
    allocate_kv_cache,
    allocate_kv_cache_raw,
    bind_kv_cache,
    extract_layer_index,
    init_kv_cache,
    reshape_kv_cache,
)
from jaxkv.kv_cache.backends.pallas import PallasAttentionBackend
from jaxkv.kv_cache.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, get_kv_cache_config
from jaxkv.kv_cache.specs import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec
from jaxkv.vllm_parity.backends.flash_attn import FlashAttentionBackend, FlashAttentionHNDBackend
from jaxkv.vllm_parity.backends.flashinfer import FlashInferBackend, FlashInferHNDBackend
from jaxkv.vllm_parity.backends.mla import MLAAttentionBackend
from jaxkv.vllm_parity.backends.paged_attention_legacy import PagedAttentionLegacyBackend
from jaxkv.vllm_parity.kv_sharing import unique_kv_caches

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(np.float32)
E4M3 = np.dtype(jnp.float8_e4m3fn)


def bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def one_group_config(names, spec, num_blocks, *, shared=False):
    size = num_blocks * spec.page_size_bytes
    tensors = ((KVCacheTensor(size=size, shared_by=tuple(names)),) if shared else
               tuple(KVCacheTensor(size=size, shared_by=(n,)) for n in names))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=(KVCacheGroupSpec(layer_names=tuple(names), kv_cache_spec=spec),))


NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))

# ----------------------------------------------------------------------------------------------
# memory addresses and logical reads, by hand, per layout
# (kv: 0 = K, 1 = V; b: block; o: offset in block; h, d: int arrays of heads and channels)
# ----------------------------------------------------------------------------------------------


def address(name, kv, b, o, h, d, *, nb, bs, kvh, hs, itemsize):
    if name == "PALLAS" or name == "FLASH_ATTN_HND":  # [2, nb, kvh, bs, hs]
        return (((kv * nb + b) * kvh + h) * bs + o) * hs + d
    if name == "FLASH_ATTN":  # [2, nb, bs, kvh, hs]
        return (((kv * nb + b) * bs + o) * kvh + h) * hs + d
    if name == "FLASHINFER":  # [nb, 2, bs, kvh, hs]
        return (((b * 2 + kv) * bs + o) * kvh + h) * hs + d
    if name == "FLASHINFER_HND":  # [nb, 2, kvh, bs, hs]
        return (((b * 2 + kv) * kvh + h) * bs + o) * hs + d
    if name == "MLA":  # [nb, bs, hs], one latent per token
        assert kv == 0
        return (b * bs + o) * hs + d
    if name == "PAGED_ATTN":  # [2, nb, bs*kvh*hs], K packed by x = 16 bytes, V channel-major
        x = 16 // itemsize
        base = (kv * nb + b) * (bs * kvh * hs)
        if kv == 0:
            return base + ((h * (hs // x) + d // x) * bs + o) * x + d % x
        return base + (h * hs + d) * bs + o
    raise AssertionError(name)


def read_token(backend, cache, kv, b, o, *, kvh, hs):
    """``[kvh, hs]`` of token (b, o) read through the backend's logical (or split) view."""
    c = np.asarray(cache)
    name = backend.name
    if name == "PALLAS":
        return c[kv, b, :, o, :]
    if name.startswith("FLASH_ATTN"):
        return c[kv, b, o]
    if name.startswith("FLASHINFER"):
        return c[b, kv, o]
    if name == "MLA":
        return c[b, o][None]
    key, value = map(np.asarray, backend.split_kv_cache(cache, kvh, hs))
    return key[b, :, :, o, :].reshape(kvh, hs) if kv == 0 else value[b, :, :, o]


PHYSICAL_SHAPE = {  # (nb, bs, kvh, hs) -> memory shape, by hand
    "PALLAS": lambda nb, bs, kvh, hs: (2, nb, kvh, bs, hs),
    "FLASH_ATTN_HND": lambda nb, bs, kvh, hs: (2, nb, kvh, bs, hs),
    "FLASH_ATTN": lambda nb, bs, kvh, hs: (2, nb, bs, kvh, hs),
    "FLASHINFER": lambda nb, bs, kvh, hs: (nb, 2, bs, kvh, hs),
    "FLASHINFER_HND": lambda nb, bs, kvh, hs: (nb, 2, kvh, bs, hs),
    "MLA": lambda nb, bs, kvh, hs: (nb, bs, hs),
    "PAGED_ATTN": lambda nb, bs, kvh, hs: (2, nb, bs * kvh * hs),
}
LOGICAL_SHAPE = {
    "PALLAS": lambda nb, bs, kvh, hs: (2, nb, kvh, bs, hs),
    "FLASH_ATTN_HND": lambda nb, bs, kvh, hs: (2, nb, bs, kvh, hs),
    "FLASH_ATTN": lambda nb, bs, kvh, hs: (2, nb, bs, kvh, hs),
    "FLASHINFER": lambda nb, bs, kvh, hs: (nb, 2, bs, kvh, hs),
    "FLASHINFER_HND": lambda nb, bs, kvh, hs: (nb, 2, bs, kvh, hs),
    "MLA": lambda nb, bs, kvh, hs: (nb, bs, hs),
    "PAGED_ATTN": lambda nb, bs, kvh, hs: (2, nb, bs * kvh * hs),
}

# backend, block_size, num_kv_heads, head_size
LAYOUT_CASES = [
    (PallasAttentionBackend, 16, 2, 64),
    (PagedAttentionLegacyBackend, 16, 2, 64),
    (PagedAttentionLegacyBackend, 8, 3, 80),
    (FlashAttentionBackend, 16, 3, 64),
    (FlashAttentionHNDBackend, 16, 3, 64),
    (FlashAttentionHNDBackend, 32, 1, 40),
    (FlashInferBackend, 16, 2, 64),
    (FlashInferHNDBackend, 16, 2, 64),
    (MLAAttentionBackend, 16, 1, 576),
]


def write_tokens(rng, backend, dtype, *, nb, bs, kvh, hs, num_tokens=9):
    """Random tokens written by a Python loop at hand-computed addresses of a flat NumPy buffer."""
    num_halves = 1 if backend.name == "MLA" else 2
    flat = rng.standard_normal(num_halves * nb * bs * kvh * hs).astype(dtype)  # unowned slots: noise
    kv_data = rng.standard_normal((num_halves, num_tokens, kvh, hs)).astype(dtype)
    slots = rng.choice(nb * bs, num_tokens, replace=False)
    h, d = np.meshgrid(np.arange(kvh), np.arange(hs), indexing="ij")
    for t, slot in enumerate(slots):
        b, o = divmod(int(slot), bs)
        for kv in range(num_halves):
            flat[address(backend.name, kv, b, o, h, d, nb=nb, bs=bs, kvh=kvh, hs=hs,
                         itemsize=dtype.itemsize)] = kv_data[kv, t]
    return flat, kv_data, slots


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("backend,bs,kvh,hs", LAYOUT_CASES,
                         ids=lambda v: v.name if hasattr(v, "name") else str(v))
def test_round_trip_write_physical_read_logical(rng, backend, bs, kvh, hs, dtype):
    nb = 5
    spec_cls = MLAAttentionSpec if backend.name == "MLA" else FullAttentionSpec
    spec = spec_cls(block_size=bs, num_kv_heads=kvh, head_size=hs, dtype=dtype)
    flat, kv_data, slots = write_tokens(rng, backend, dtype, nb=nb, bs=bs, kvh=kvh, hs=hs)
    assert flat.nbytes == nb * spec.page_size_bytes
    cfg = one_group_config(NAMES[:1], spec, nb)
    raw = {NAMES[0]: jnp.asarray(flat.view(np.int8))}
    logical = reshape_kv_cache(cfg, raw, {NAMES[0]: backend})[NAMES[0]]
    assert logical.shape == LOGICAL_SHAPE[backend.name](nb, bs, kvh, hs)
    assert logical.dtype == dtype
    for t, slot in enumerate(slots):
        b, o = divmod(int(slot), bs)
        for kv in range(kv_data.shape[0]):
            np.testing.assert_array_equal(bits(read_token(backend, logical, kv, b, o, kvh=kvh, hs=hs)),
                                          bits(kv_data[kv, t]))
    physical = reshape_kv_cache(cfg, raw, {NAMES[0]: backend}, physical=True)[NAMES[0]]
    assert physical.shape == PHYSICAL_SHAPE[backend.name](nb, bs, kvh, hs)
    np.testing.assert_array_equal(bits(physical).ravel(), bits(flat))  # memory order, every byte


@pytest.mark.parametrize("backend", [FlashAttentionHNDBackend, PagedAttentionLegacyBackend,
                                     FlashInferBackend], ids=lambda b: b.name)
def test_round_trip_fp8(rng, backend):
    nb, bs, kvh, hs = 3, 16, 2, 64
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=kvh, head_size=hs, dtype=E4M3)
    flat, kv_data, slots = write_tokens(rng, backend, E4M3, nb=nb, bs=bs, kvh=kvh, hs=hs)
    cfg = one_group_config(NAMES[:1], spec, nb)
    logical = reshape_kv_cache(cfg, {NAMES[0]: jnp.asarray(flat.view(np.uint8))},
                               {NAMES[0]: backend})[NAMES[0]]
    for t, slot in enumerate(slots):
        b, o = divmod(int(slot), bs)
        for kv in range(2):
            np.testing.assert_array_equal(bits(read_token(backend, logical, kv, b, o, kvh=kvh, hs=hs)),
                                          bits(kv_data[kv, t]))


# ----------------------------------------------------------------------------------------------
# allocate_kv_cache_raw
# ----------------------------------------------------------------------------------------------

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)


def test_raw_one_buffer_per_tensor_shared_by_its_layers():
    names = NAMES + ("model.layers.3.self_attn.attn",)
    cfg = KVCacheConfig(num_blocks=4, kv_cache_tensors=(
        KVCacheTensor(size=4 * SPEC.page_size_bytes, shared_by=(names[0], names[2])),
        KVCacheTensor(size=4 * SPEC.page_size_bytes, shared_by=(names[1], names[3]))),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=names[:2], kv_cache_spec=SPEC),
                         KVCacheGroupSpec(layer_names=names[2:], kv_cache_spec=SPEC)))
    raw = allocate_kv_cache_raw(cfg)
    assert set(raw) == set(names)
    assert raw[names[0]] is raw[names[2]] and raw[names[1]] is raw[names[3]]
    assert raw[names[0]] is not raw[names[1]]
    for buf in raw.values():
        assert buf.shape == (4 * SPEC.page_size_bytes,) and buf.dtype == jnp.int8
        assert not np.asarray(buf).any()


def test_raw_missing_and_extra_layers_raise():
    size = 2 * SPEC.page_size_bytes
    group = KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=SPEC)
    missing = KVCacheConfig(num_blocks=2, kv_cache_groups=(group,), kv_cache_tensors=(
        KVCacheTensor(size=size, shared_by=(NAMES[1],)),))
    with pytest.raises(ValueError, match=r"layers\.0.*layers\.2"):
        allocate_kv_cache_raw(missing)
    extra = KVCacheConfig(num_blocks=2, kv_cache_groups=(group,), kv_cache_tensors=tuple(
        KVCacheTensor(size=size, shared_by=(n,)) for n in NAMES + ("model.layers.9.attn",)))
    with pytest.raises(ValueError, match=r"layers\.9"):
        allocate_kv_cache_raw(extra)
    twice = KVCacheConfig(num_blocks=2, kv_cache_groups=(group,), kv_cache_tensors=(
        KVCacheTensor(size=size, shared_by=NAMES), KVCacheTensor(size=size, shared_by=(NAMES[1],))))
    with pytest.raises(ValueError, match=r"layers\.1.*two|kv_cache_tensors\[1\]"):
        allocate_kv_cache_raw(twice)


def test_raw_runner_only_layers_get_no_buffer():
    cfg = one_group_config(NAMES[:2], SPEC, 2)
    cfg = dataclasses.replace(cfg, kv_cache_groups=(KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=SPEC),))
    with pytest.raises(ValueError, match=r"layers\.2"):
        allocate_kv_cache_raw(cfg)
    raw = allocate_kv_cache_raw(cfg, runner_only_attn_layers={NAMES[2]})
    assert set(raw) == set(NAMES[:2])


# ----------------------------------------------------------------------------------------------
# reshape_kv_cache: sharing, num_blocks from bytes, errors
# ----------------------------------------------------------------------------------------------

def test_reshape_num_blocks_from_raw_size_and_shared_objects():
    # tensor holds 6 blocks although config says 4: vLLM takes numel // page_size_bytes
    cfg = KVCacheConfig(num_blocks=4, kv_cache_tensors=(
        KVCacheTensor(size=6 * SPEC.page_size_bytes, shared_by=NAMES[:2]),
        KVCacheTensor(size=6 * SPEC.page_size_bytes, shared_by=NAMES[2:])),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=SPEC),))
    raw = allocate_kv_cache_raw(cfg)
    backends = {n: FlashAttentionHNDBackend for n in NAMES}
    caches = reshape_kv_cache(cfg, raw, backends)
    assert all(c.shape == (2, 6, 16, 2, 64) for c in caches.values())
    assert caches[NAMES[0]] is caches[NAMES[1]]  # one tensor, one layout → one array
    assert caches[NAMES[0]] is not caches[NAMES[2]]


def test_reshape_one_tensor_two_dtypes(rng):
    """A tensor shared by layers of two groups with different specs of equal page size: each view is
    the same bytes reinterpreted (checked against NumPy's ``.view``)."""
    spec_a = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.float32)
    spec_b = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=jnp.bfloat16)
    assert spec_a.page_size_bytes == spec_b.page_size_bytes
    nb = 3
    cfg = KVCacheConfig(num_blocks=nb, kv_cache_tensors=(
        KVCacheTensor(size=nb * spec_a.page_size_bytes, shared_by=(NAMES[0], NAMES[1])),),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=(NAMES[0],), kv_cache_spec=spec_a),
                         KVCacheGroupSpec(layer_names=(NAMES[1],), kv_cache_spec=spec_b)))
    data = rng.integers(0, 256, nb * spec_a.page_size_bytes, dtype=np.uint8)
    data[3::4] &= 0x3F  # keep f32 exponents small: no NaN bit patterns to compare
    raw = jnp.asarray(data.view(np.int8))
    caches = reshape_kv_cache(cfg, {NAMES[0]: raw, NAMES[1]: raw},
                              {NAMES[0]: PallasAttentionBackend, NAMES[1]: FlashAttentionHNDBackend})
    np.testing.assert_array_equal(bits(caches[NAMES[0]]), data.view(np.uint32).reshape(2, nb, 2, 16, 64))
    np.testing.assert_array_equal(bits(caches[NAMES[1]]),
                                  data.view(np.uint16).reshape(2, nb, 4, 16, 64).transpose(0, 1, 3, 2, 4))


def test_reshape_rejects_bad_input():
    cfg = one_group_config(NAMES[:2], SPEC, 3)
    raw = allocate_kv_cache_raw(cfg)
    backends = {n: PallasAttentionBackend for n in NAMES[:2]}
    with pytest.raises(ValueError, match=r"layers\.1.*backends"):
        reshape_kv_cache(cfg, raw, {NAMES[0]: PallasAttentionBackend})
    with pytest.raises(ValueError, match=r"layers\.1.*raw tensor"):
        reshape_kv_cache(cfg, {NAMES[0]: raw[NAMES[0]]}, backends)
    short = dict(raw, **{NAMES[1]: jnp.zeros(3 * SPEC.page_size_bytes - 2, jnp.int8)})
    with pytest.raises(ValueError, match="page_size_bytes"):
        reshape_kv_cache(cfg, short, backends)
    with pytest.raises(ValueError, match="int8/uint8"):
        reshape_kv_cache(cfg, dict(raw, **{NAMES[1]: jnp.zeros(3 * SPEC.page_size_bytes, jnp.float32)}),
                         backends)
    with pytest.raises(ValueError, match="int8/uint8"):
        reshape_kv_cache(cfg, dict(raw, **{NAMES[1]: raw[NAMES[1]].reshape(2, -1)}), backends)
    with pytest.raises(ValueError, match="block_size=8 not supported"):
        reshape_kv_cache(one_group_config(NAMES[:1], SPEC.replace(block_size=8), 4),
                         allocate_kv_cache_raw(one_group_config(NAMES[:1], SPEC.replace(block_size=8), 4)),
                         {NAMES[0]: FlashAttentionBackend})
    # MLA layout holds half the bytes of a K/V spec's page: rejected, not silently truncated
    kv_spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=jnp.bfloat16)
    mla_cfg = one_group_config(NAMES[:1], kv_spec, 2)
    with pytest.raises(ValueError, match="disagrees with the layout"):
        reshape_kv_cache(mla_cfg, allocate_kv_cache_raw(mla_cfg), {NAMES[0]: MLAAttentionBackend})
    not_attention = KVCacheSpec(block_size=16)  # no heads, no dtype
    group = KVCacheGroupSpec(layer_names=NAMES[:1], kv_cache_spec=not_attention)
    bad = KVCacheConfig(num_blocks=1, kv_cache_tensors=(KVCacheTensor(size=64, shared_by=NAMES[:1]),),
                        kv_cache_groups=(group,))
    with pytest.raises(ValueError, match="attention spec"):
        reshape_kv_cache(bad, {NAMES[0]: jnp.zeros(64, jnp.int8)}, {NAMES[0]: PallasAttentionBackend})


# ----------------------------------------------------------------------------------------------
# init_kv_cache and allocate_kv_cache
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("physical", [False, True])
def test_init_equals_reshape_of_raw(physical):
    names = NAMES
    cfg = KVCacheConfig(num_blocks=3, kv_cache_tensors=(
        KVCacheTensor(size=3 * SPEC.page_size_bytes, shared_by=names[:2]),
        KVCacheTensor(size=3 * SPEC.page_size_bytes, shared_by=names[2:])),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=names, kv_cache_spec=SPEC),))
    backends = {names[0]: FlashAttentionHNDBackend, names[1]: FlashAttentionHNDBackend,
                names[2]: FlashInferHNDBackend}
    got = init_kv_cache(cfg, backends, physical=physical)
    want = reshape_kv_cache(cfg, allocate_kv_cache_raw(cfg), backends, physical=physical)
    assert list(got) == list(want) == list(names)
    expected_shapes = ({names[0]: (2, 3, 2, 16, 64), names[2]: (3, 2, 2, 16, 64)} if physical else
                       {names[0]: (2, 3, 16, 2, 64), names[2]: (3, 2, 16, 2, 64)})
    for n in names:
        assert got[n].shape == want[n].shape == expected_shapes.get(n, expected_shapes[names[0]])
        assert got[n].dtype == want[n].dtype == jnp.bfloat16
        assert not np.asarray(got[n]).any()
    assert got[names[0]] is got[names[1]]


def test_init_rejects_like_allocate_and_reshape():
    cfg = one_group_config(NAMES[:2], SPEC, 3)
    cfg = dataclasses.replace(cfg, kv_cache_tensors=cfg.kv_cache_tensors[:1])
    with pytest.raises(ValueError, match=r"layers\.1"):
        init_kv_cache(cfg, {n: PallasAttentionBackend for n in NAMES[:2]})
    with pytest.raises(ValueError, match="head_size=64"):
        init_kv_cache(one_group_config(NAMES[:1], SPEC, 3), {NAMES[0]: MLAAttentionBackend})


def test_allocate_kv_cache_physical_and_shared_tensor():
    cfg = one_group_config(NAMES[:2], SPEC, 3, shared=True)
    cfg = dataclasses.replace(cfg, kv_cache_tensors=(
        KVCacheTensor(size=3 * SPEC.page_size_bytes, shared_by=NAMES[:2]),))
    logical = allocate_kv_cache(cfg, FlashAttentionHNDBackend)
    physical = allocate_kv_cache(cfg, FlashAttentionHNDBackend, physical=True)
    assert logical[NAMES[0]].shape == (2, 3, 16, 2, 64)
    assert physical[NAMES[0]].shape == (2, 3, 2, 16, 64)
    assert logical[NAMES[0]] is logical[NAMES[1]]
    pallas = allocate_kv_cache(one_group_config(NAMES[:2], SPEC, 3), PallasAttentionBackend)
    assert pallas[NAMES[0]] is not pallas[NAMES[1]]


def test_init_hybrid_config_shares_arrays_across_groups():
    """2 full + 4 sliding-window layers (get_kv_cache_config: 3 groups of 2, tensor i shared by full i,
    sliding i, sliding 2 + i): layers of one tensor get one array, so donation needs unique_kv_caches."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16)
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=jnp.bfloat16,
                                sliding_window=128)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    kinds = [full, sliding, sliding, full, sliding, sliding]
    cfg = get_kv_cache_config(dict(zip(names, kinds)), 10**9, num_blocks=4)
    assert len(cfg.kv_cache_tensors) == 2
    caches = init_kv_cache(cfg, {n: FlashAttentionHNDBackend for n in names}, physical=True)
    for tensor in cfg.kv_cache_tensors:
        first = caches[tensor.shared_by[0]]
        assert first.shape == (2, 4, 2, 16, 64)
        assert all(caches[n] is first for n in tensor.shared_by)
    bound = bind_kv_cache(caches)
    buffers, index = unique_kv_caches(bound)
    assert len(buffers) == 2
    owner = {n: i for i, t in enumerate(cfg.kv_cache_tensors) for n in t.shared_by}
    for pos, name in enumerate(names):  # positions of one tensor map to one buffer, others to another
        for pos2, name2 in enumerate(names):
            assert (index[pos] == index[pos2]) == (owner[name] == owner[name2])
        assert bound[pos] is buffers[index[pos]]


# ----------------------------------------------------------------------------------------------
# extract_layer_index (several modules per layer) / bind_kv_cache (several modules per index)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,num_attn_module,index", [
    ("model.layers.3.self_attn.1.attn", 2, 7), ("model.layers.3.self_attn.0.attn", 2, 6),
    ("model.layers.3.self_attn.attn", 2, 6), ("model.layers.3.mlp.1", 2, 3),
    ("model.layers.5.attn.2", 3, 17), ("model.layers.5.attn.2", 1, 5)])
def test_extract_layer_index_num_attn_module(name, num_attn_module, index):
    assert extract_layer_index(name, num_attn_module) == index


@pytest.mark.parametrize("name,num_attn_module,needle", [
    ("model.layers.3.self_attn.2.attn", 2, "module 2"),
    ("model.layers.3.self_attn.0.attn.1", 2, "more than one"),
    ("model.layers.3.attn", 0, "num_attn_module=0"),
    ("model.head.attn", 2, "layers")])
def test_extract_layer_index_num_attn_module_errors(name, num_attn_module, needle):
    with pytest.raises(ValueError, match=needle):
        extract_layer_index(name, num_attn_module)


ENC_DEC = {  # encoder-decoder decoder layers: self- and cross-attention share a layer index
    "model.decoder.layers.1.encoder_attn.attn": "x1",
    "model.decoder.layers.0.self_attn.attn": "s0",
    "model.decoder.layers.0.encoder_attn.attn": "x0",
    "model.decoder.layers.1.self_attn.attn": "s1",
}


def test_bind_several_modules_per_index():
    with pytest.raises(ValueError, match="encoder_attn|self_attn"):
        bind_kv_cache(ENC_DEC)
    assert bind_kv_cache(ENC_DEC, multiple_per_index="first") == ["s0", "x1"]  # first in dict order
    assert bind_kv_cache(ENC_DEC, multiple_per_index="all") == ["s0", "x0", "x1", "s1"]
    with pytest.raises(ValueError, match="multiple_per_index='both'"):
        bind_kv_cache(ENC_DEC, multiple_per_index="both")
    gap = {k.replace("layers.1", "layers.2"): v for k, v in ENC_DEC.items()}
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        bind_kv_cache(gap, multiple_per_index="all")


def test_bind_num_attn_module():
    caches = {f"model.layers.{i}.self_attn.{j}.attn": (i, j) for i in (1, 0) for j in (1, 0)}
    assert bind_kv_cache(caches, num_attn_module=2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="share layer index"):
        bind_kv_cache(caches)
