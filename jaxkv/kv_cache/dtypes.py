"""KV-cache dtypes: ``kv_cache_dtype`` strings, fp8 quantisation on write and dequantisation on read.

vLLM: ``--kv-cache-dtype`` (``CacheConfig.cache_dtype``), ``STR_DTYPE_TO_TORCH_DTYPE``, and the
``kv_cache_dtype`` / ``k_scale`` / ``v_scale`` arguments of ``reshape_and_cache`` and
``paged_attention_v1/v2`` (``fp8::scaled_convert``).

Conventions (shared by the write op, the reference attention and the Pallas kernels):

* An fp8 cache is a JAX array whose dtype *is* the fp8 type (``jnp.float8_e4m3fn`` or
  ``jnp.float8_e5m2``), same shape as a model-dtype cache. (vLLM stores ``torch.uint8`` and reinterprets
  the bytes in its kernels; ``ml_dtypes`` gives JAX real fp8 arrays, so there is no bit-casting.)
* ``"fp8"`` means ``"fp8_e4m3"``, which is the OCP/NVIDIA ``float8_e4m3fn`` (finite max 448, no inf,
  one NaN encoding). The ROCm ``e4m3fnuz`` variant is not supported.
* One scale per tensor: ``k_scale`` for keys, ``v_scale`` for values, each a ``float32`` scalar
  (shape ``()``; ``(1,)`` is accepted), finite and ``> 0``. The meaning of a scale is
  ``real_value ≈ stored_value * scale``:

  - write (quantise): ``stored = cast_fp8(clip(x.astype(f32) * inv_scale, -fp8_max, +fp8_max))``
    with ``inv_scale = f32(1) / scale`` (one float32 division), rounding to nearest even; values
    beyond the fp8 range saturate to ``±fp8_max`` (never ``inf`` or NaN); NaN inputs stay NaN. The
    division is written as a multiplication by the reciprocal on purpose: XLA rewrites
    ``x / broadcast(scale)`` into exactly that in vectorised code, so spelling it out makes every
    backend and every array size round identically (a true ``x / scale`` differs by at most one
    float32 ulp, which only matters for values on an fp8 rounding tie).
  - read (dequantise): ``x = stored.astype(f32) * scale`` then cast to the compute dtype. A kernel may
    equivalently fold ``k_scale`` into the softmax scale (``q·k * sm_scale * k_scale``) and multiply
    the attention output by ``v_scale`` (``sum_j p_j * v_j * v_scale``).

* ``"auto"`` (the cache has the model dtype): scales are not used, values are plainly cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import KV_CACHE_DTYPES
from pallas_kernels.paged_attention import FP8_DTYPES as _kernel_fp8_dtypes

__all__ = ["FP8_DTYPES", "KV_CACHE_DTYPES", "dequantize_from_cache", "quantize_to_cache", "resolve_kv_cache_dtype"]


FP8_DTYPES = _kernel_fp8_dtypes
"""The cache dtypes that are quantised with a scale (the ones the Pallas kernels dequantise)."""

_STR_TO_DTYPE = {
    "fp8": FP8_DTYPES[0],
    "fp8_e4m3": FP8_DTYPES[0],
    "fp8_e5m2": FP8_DTYPES[1],
}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The dtype of the cache arrays for a ``kv_cache_dtype`` string.

    vLLM: ``STR_DTYPE_TO_TORCH_DTYPE[cache_config.cache_dtype]`` (``"auto"`` → ``model_config.dtype``).

    Args:
        kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`: ``"auto"`` → ``model_dtype``;
            ``"fp8"`` and ``"fp8_e4m3"`` → ``float8_e4m3fn``; ``"fp8_e5m2"`` → ``float8_e5m2``.
        model_dtype: the model's activation dtype (anything ``jnp.dtype`` accepts), used for ``"auto"``.

    Returns:
        The cache dtype as a ``jnp.dtype``.

    Raises:
        ValueError: ``kv_cache_dtype`` is not one of :data:`KV_CACHE_DTYPES` (names the value), or
            ``"auto"`` with a ``model_dtype`` that is not a floating dtype.
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype != "auto":
        return _STR_TO_DTYPE[kv_cache_dtype]
    try:
        dtype = jnp.dtype(model_dtype)
    except TypeError as e:
        raise ValueError(f"model_dtype={model_dtype!r} is not a dtype") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"model_dtype={dtype} must be a floating dtype for kv_cache_dtype='auto'")
    return dtype


def is_fp8_dtype(dtype) -> bool:
    """Whether ``dtype`` is one of the quantised cache dtypes (:data:`FP8_DTYPES`)."""
    try:
        return jnp.dtype(dtype) in FP8_DTYPES
    except TypeError:
        return False


def fp8_max(dtype) -> float:
    """Largest finite value of an fp8 cache dtype: 448.0 (e4m3fn) or 57344.0 (e5m2).

    Raises:
        ValueError: ``dtype`` is not in :data:`FP8_DTYPES`.
    """
    if not is_fp8_dtype(dtype):
        raise ValueError(f"dtype={dtype!r} is not an fp8 cache dtype {FP8_DTYPES}")
    return float(jnp.finfo(dtype).max)


def check_scale(scale, name: str = "scale") -> jax.Array:
    """Validate a per-tensor scale and return it as a ``float32`` scalar (shape ``()``).

    Args:
        scale: Python number or array of one element (shape ``()`` or ``(1,)``), floating or integer.
        name: the argument's name for error messages (``"k_scale"``, ``"v_scale"``).

    Returns:
        ``f32[]``. Traced under ``jit`` (then only its shape and dtype are checked).

    Raises:
        ValueError: ``scale`` is ``None``, not numeric, not of one element, or (when concrete) not
            finite or ``<= 0`` (names the value).
    """
    if scale is None:
        raise ValueError(f"{name}=None: a scale is required for an fp8 cache")
    try:
        dtype = jnp.result_type(scale)
    except TypeError as e:
        raise ValueError(f"{name}={scale!r} is not a number or array") from e
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError(f"{name}.dtype={dtype} must be floating")
    shape = np.shape(scale)
    if shape not in ((), (1,)):
        raise ValueError(f"{name}.shape={shape} must be () or (1,)")
    try:
        value = float(np.asarray(scale, np.float64).reshape(()))
    except jax.errors.TracerArrayConversionError:
        value = None
    if value is not None and not (np.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value} must be finite and > 0")
    return jnp.asarray(scale, jnp.float32).reshape(())


def _target_dtype(cache_dtype, x_dtype) -> jnp.dtype:
    if isinstance(cache_dtype, str):
        return resolve_kv_cache_dtype(cache_dtype, x_dtype)
    try:
        return jnp.dtype(cache_dtype)
    except TypeError as e:
        raise ValueError(f"cache_dtype={cache_dtype!r} is not a dtype or kv_cache_dtype string") from e


def quantize_to_cache(x: jax.Array, scale, cache_dtype) -> jax.Array:
    """Convert new K or V values to the cache dtype (quantise for fp8).

    vLLM: ``fp8::scaled_convert<cache_t, scalar_t, kv_dt>(x, scale)`` inside ``reshape_and_cache``.

    Args:
        x: ``[...]`` floating values (e.g. ``bf16[num_tokens, num_kv_heads, head_size]``).
        scale: ``f32[]`` per-tensor scale (see :func:`check_scale`); required for an fp8
            ``cache_dtype``, ignored otherwise (may be ``None``).
        cache_dtype: the cache's dtype, or a :data:`KV_CACHE_DTYPES` string (``"auto"`` resolves to
            ``x.dtype``).

    Returns:
        ``cache_dtype[...]``, same shape as ``x``: for fp8, ``x.astype(f32) * (f32(1) / scale)``
        clipped to ``±fp8_max(cache_dtype)`` and rounded to nearest even (out-of-range values
        saturate; NaN stays NaN); otherwise ``x.astype(cache_dtype)``.

    Raises:
        ValueError: unknown ``cache_dtype`` string; fp8 with a missing or invalid ``scale``.
    """
    dtype = _target_dtype(cache_dtype, jnp.result_type(x))
    if not is_fp8_dtype(dtype):
        return jnp.asarray(x).astype(dtype)
    scale = check_scale(scale)
    limit = fp8_max(dtype)
    inv_scale = jnp.float32(1) / scale  # see the module docstring: multiply, never x / scale
    scaled = jnp.asarray(x).astype(jnp.float32) * inv_scale
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def dequantize_from_cache(x: jax.Array, scale, out_dtype) -> jax.Array:
    """Convert cached K or V values back to a compute dtype (dequantise for fp8).

    vLLM: ``fp8::scaled_convert<scalar_t, cache_t, kv_dt>(x, scale)`` in the attention kernels.

    Args:
        x: ``cache_dtype[...]`` values read from the cache.
        scale: ``f32[]`` per-tensor scale; required when ``x`` is fp8, ignored otherwise.
        out_dtype: dtype of the result (e.g. the query dtype).

    Returns:
        ``out_dtype[...]``: ``(x.astype(f32) * scale).astype(out_dtype)`` for fp8 ``x``,
        ``x.astype(out_dtype)`` otherwise.

    Raises:
        ValueError: ``x`` is fp8 and ``scale`` is missing or invalid.
    """
    x = jnp.asarray(x)
    if not is_fp8_dtype(x.dtype):
        return x.astype(out_dtype)
    scale = check_scale(scale)
    return (x.astype(jnp.float32) * scale).astype(out_dtype)
