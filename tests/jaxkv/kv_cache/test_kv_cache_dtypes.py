"""kv_cache_dtype strings and fp8 quantise / dequantise (vLLM ``fp8::scaled_convert``).

Accuracy is measured against float64: e4m3 has 3 mantissa bits (relative rounding error <= 2^-4 for
normal values), e5m2 has 2 (<= 2^-3). The NumPy references cast with ``ml_dtypes``, not XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.kv_cache.dtypes import (
    FP8_DTYPES,
    KV_CACHE_DTYPES,
    check_scale,
    dequantize_from_cache,
    fp8_max,
    is_fp8_dtype,
    quantize_to_cache,
    resolve_kv_cache_dtype,
)

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(jnp.bfloat16)
# (dtype, largest finite, smallest normal, relative error bound of round-to-nearest)
FORMATS = [(E4M3, 448.0, 2.0**-6, 2.0**-4), (E5M2, 57344.0, 2.0**-14, 2.0**-3)]


def ref_quantize(x, scale: float, dtype) -> np.ndarray:
    top = float(ml_dtypes.finfo(dtype).max)
    inv = np.float32(1) / np.float32(scale)  # the documented convention: x * (1 / scale) in float32
    return np.clip(np.asarray(x, np.float32) * inv, -top, top).astype(dtype)


def in_range_values(rng, n, lo, hi) -> np.ndarray:
    """Log-uniform magnitudes in [lo, hi] with random signs, float64."""
    return rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(np.log2(lo), np.log2(hi), n))


# ----------------------------------------------------------------------------------------------
# resolve_kv_cache_dtype
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,model_dtype,want", [
    ("auto", jnp.bfloat16, BF16), ("auto", "float16", np.dtype(np.float16)),
    ("auto", np.float32, np.dtype(np.float32)), ("fp8", jnp.bfloat16, E4M3),
    ("fp8_e4m3", np.float32, E4M3), ("fp8_e5m2", jnp.bfloat16, E5M2),
])
def test_resolve_kv_cache_dtype(name, model_dtype, want):
    got = resolve_kv_cache_dtype(name, model_dtype)
    assert got == want
    assert is_fp8_dtype(got) == name.startswith("fp8")
    assert name in KV_CACHE_DTYPES


@pytest.mark.parametrize("bad", ["fp16", "FP8", "fp8_e4m3fnuz", "int8", "", None, 8])
def test_resolve_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype={bad!r} must be one of"):
        resolve_kv_cache_dtype(bad, jnp.bfloat16)


def test_resolve_auto_rejects_non_float_model_dtype():
    with pytest.raises(ValueError, match=r"model_dtype=int32 must be a floating dtype"):
        resolve_kv_cache_dtype("auto", np.int32)
    with pytest.raises(ValueError, match=r"model_dtype='nope'"):
        resolve_kv_cache_dtype("auto", "nope")


def test_fp8_max_and_is_fp8():
    assert fp8_max(E4M3) == 448.0 and fp8_max(jnp.float8_e5m2) == 57344.0
    assert set(FP8_DTYPES) == {E4M3, E5M2}
    assert not is_fp8_dtype(jnp.bfloat16) and not is_fp8_dtype("not a dtype")
    with pytest.raises(ValueError, match=r"dtype=.*bfloat16.* is not an fp8 cache dtype"):
        fp8_max(jnp.bfloat16)


# ----------------------------------------------------------------------------------------------
# quantize / dequantize
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,top,tiny,bound", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0, 24.5])
def test_round_trip_error_bound_vs_float64(rng, dtype, top, tiny, bound, scale):
    x64 = in_range_values(rng, 4096, tiny * scale, top * scale)
    x64 = np.concatenate([x64, [top * scale, -tiny * scale]])  # both ends of the normal range
    x = x64.astype(np.float32)
    q = quantize_to_cache(jnp.asarray(x), jnp.float32(scale), dtype)
    assert q.dtype == dtype and q.shape == x.shape
    back = np.asarray(dequantize_from_cache(q, jnp.float32(scale), jnp.float32), np.float64)
    rel = np.abs(back - x64) / np.abs(x64)
    # bound, plus the float32 rounding of x and of x / scale and back * scale
    assert rel.max() <= bound * (1 + 1e-6) + 4 * 2.0**-24
    assert rel.max() > bound / 4  # the values really went through fp8
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8),
                                  ref_quantize(x, scale, dtype).view(np.uint8))


@pytest.mark.parametrize("dtype,top,tiny,bound", FORMATS)
def test_out_of_range_saturates(dtype, top, tiny, bound):
    scale = 0.5
    x = np.array([1e30, -1e30, 3e38, top * scale * 1.2, -top * scale * 1.0001, np.inf, -np.inf],
                 np.float32)
    q = np.asarray(quantize_to_cache(jnp.asarray(x), scale, dtype)).astype(np.float64)
    np.testing.assert_array_equal(q, np.sign(x) * top)
    back = np.asarray(dequantize_from_cache(jnp.asarray(q.astype(dtype)), scale, jnp.float32))
    np.testing.assert_array_equal(back, np.sign(x) * top * scale)
    assert np.isfinite(back).all()
    # a plain cast would not saturate: e4m3fn overflows to NaN, e5m2 to inf
    assert not np.isfinite(np.float32(top * 1.2).astype(dtype).astype(np.float32))
    # NaN is not a range problem: it stays NaN
    assert np.isnan(np.asarray(quantize_to_cache(jnp.array([np.nan]), 1.0, dtype), np.float32)).all()


def test_bf16_input_and_dequantize_formula(rng):
    x = (rng.standard_normal((5, 2, 16)) * 50).astype(BF16)
    q = quantize_to_cache(jnp.asarray(x), jnp.array([3.0], jnp.float32), "fp8")  # (1,) scale
    assert q.dtype == E4M3
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), ref_quantize(x, 3.0, E4M3).view(np.uint8))
    out = dequantize_from_cache(q, jnp.float32(3.0), jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    want = (np.asarray(q).astype(np.float32) * np.float32(3.0)).astype(BF16)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), want.view(np.uint16))


def test_non_fp8_dtypes_are_a_plain_cast(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    for cache_dtype in (jnp.bfloat16, "auto"):
        got = quantize_to_cache(jnp.asarray(x), None, cache_dtype)  # scale ignored, may be None
        want = x.astype(BF16) if cache_dtype != "auto" else x
        np.testing.assert_array_equal(np.asarray(got), want)
    y = x.astype(BF16)
    np.testing.assert_array_equal(np.asarray(dequantize_from_cache(jnp.asarray(y), None, np.float32)),
                                  y.astype(np.float32))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp4'"):
        quantize_to_cache(jnp.asarray(x), 1.0, "fp4")


@pytest.mark.parametrize("scale,match", [
    (None, r"scale=None: a scale is required"), (0.0, r"scale=0.0 must be finite and > 0"),
    (-2.0, r"scale=-2.0"), (np.inf, r"scale=inf"), (np.nan, r"scale=nan"),
    (np.ones(2, np.float32), r"scale.shape=\(2,\)"), ("one", r"scale='one'"),
])
def test_bad_scale_rejected(scale, match):
    with pytest.raises(ValueError, match=match):
        quantize_to_cache(jnp.ones(3), scale, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=match.replace("scale", "k_scale", 1)):
        check_scale(scale, "k_scale")
    with pytest.raises(ValueError, match=match):
        dequantize_from_cache(jnp.ones(3, jnp.float8_e5m2), scale, jnp.float32)


def test_traced_scale_under_jit(rng):
    x = rng.standard_normal(64).astype(np.float32) * 100
    f = jax.jit(lambda x, s: quantize_to_cache(x, s, jnp.float8_e5m2))
    for s in (0.5, 7.0):  # same compiled program, scale is data
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x), jnp.float32(s))).view(np.uint8),
                                      ref_quantize(x, s, E5M2).view(np.uint8))


def test_rounding_does_not_depend_on_array_size():
    """bf16 inputs / 1.75 often land on an fp8 rounding tie; a scalar and a vectorised loop must round
    alike (XLA turns ``x / broadcast(s)`` into ``x * (1 / s)`` only in the vectorised case)."""
    x = np.array([0.79296875, 5.46875, -0.396484375], BF16)  # x / 1.75 is exactly an e4m3 tie
    want = ref_quantize(x, 1.75, E4M3).view(np.uint8)
    one_by_one = [np.asarray(quantize_to_cache(jnp.asarray(v[None]), 1.75, E4M3)).view(np.uint8)[0]
                  for v in x]
    many = np.asarray(quantize_to_cache(jnp.asarray(np.tile(x, 100)), 1.75, E4M3)).view(np.uint8)
    np.testing.assert_array_equal(one_by_one, want)
    np.testing.assert_array_equal(many, np.tile(want, 100))
