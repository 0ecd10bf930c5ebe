"""The fused SwiGLU + per-token e4m3 kernel (:mod:`pallas_kernels.silu_and_mul_quant_mgpu`): its ``jnp`` reference
against float64 NumPy, the kernel against the reference (in the Mosaic GPU interpreter on CPU, compiled on a GPU),
and its lowering for sm_90 on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import silu_and_mul_quant_mgpu as k

ON_GPU = jax.default_backend() == "gpu"


def _inputs(rows: int, f: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    gate_up = jnp.asarray(rng.standard_normal((rows, 2 * f)) * 4, jnp.bfloat16)
    gate_up = gate_up.at[rows - 1].set(0)  # an all-zero row: the scale floor, zeros out
    row_scale = jnp.asarray(rng.uniform(0.5, 2.0, rows), jnp.float32)
    col_scale = jnp.asarray(rng.uniform(0.005, 0.05, 2 * f), jnp.float32)
    return gate_up, row_scale, col_scale


def _e4m3_step(x: np.ndarray) -> np.ndarray:
    """The spacing of e4m3 values at ``|x|`` (3 mantissa bits; subnormals below 2**-6 step by 2**-9)."""
    exp = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -6)))
    return 2.0 ** (exp - 3)


def test_reference_against_float64():
    """The reference's scale is float64's ``max(amax / 448, 1 / (448 * 512))`` (f32 rounding), and each value is
    within half an e4m3 step (plus the bf16 rounding of the product) of float64's ``silu(g) * u / scale``."""
    gate_up, row_scale, col_scale = _inputs(5, 256)
    q, scale = jax.jit(k.silu_and_mul_quant_reference)(gate_up, row_scale, col_scale)
    y = np.asarray(gate_up, np.float64) * np.asarray(row_scale, np.float64)[:, None] * np.asarray(col_scale,
                                                                                                   np.float64)
    g, u = y[:, :256], y[:, 256:]
    a = g / (1 + np.exp(-g)) * u
    want_scale = np.maximum(np.abs(a).max(1) / 448, 1 / (448 * 512))
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-6)
    want = a / want_scale[:, None]
    got = np.asarray(q.astype(jnp.float32), np.float64)
    assert np.all(np.abs(got - want) <= 0.5 * _e4m3_step(want) + np.abs(want) * 2.0 ** -8 + 1e-12)
    assert np.all(got[-1] == 0) and np.abs(got).max() <= 448


@pytest.mark.parametrize("rows,f", [(3, 1024), (2, 4096)], ids=["one-step", "two-steps"])
def test_kernel_matches_reference(rows, f):
    """One pipeline step (8 tile rows) and two (16-row chunks). Interpreted on CPU: bit for bit. Compiled (its
    ``exp`` approximate): scales within 1e-5, each value within one e4m3 step, at most 1 % of them off."""
    gate_up, row_scale, col_scale = _inputs(rows, f, seed=f)
    q, scale = jax.jit(lambda *a: k.silu_and_mul_quant(*a, interpret=not ON_GPU))(gate_up, row_scale, col_scale)
    q_ref, scale_ref = jax.jit(k.silu_and_mul_quant_reference)(gate_up, row_scale, col_scale)
    got, want = np.asarray(q.astype(jnp.float32)), np.asarray(q_ref.astype(jnp.float32))
    assert q.shape == (rows, f) and q.dtype == k.FP8 and scale.shape == (rows,)
    if not ON_GPU:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(scale), np.asarray(scale_ref))
        return
    np.testing.assert_allclose(np.asarray(scale), np.asarray(scale_ref), rtol=1e-5)
    off = got != want
    assert off.mean() <= 0.01 and np.all(np.abs(got - want) <= _e4m3_step(want) + 1e-12)


def test_unsupported_shapes_are_named():
    """Shapes the kernel does not take raise a ValueError naming them; the op falls back to the reference."""
    for shape, dtype, needle in (((4, 1000), jnp.bfloat16, "F=500"), ((4, 2048), jnp.float32, "dtype"),
                                 ((4, 3), jnp.bfloat16, "shape")):
        with pytest.raises(ValueError, match=needle):
            k.silu_and_mul_quant(jnp.zeros(shape, dtype), jnp.ones(4), jnp.ones(shape[1]))


@pytest.mark.skipif(ON_GPU, reason="CPU lowering check (sm_90); the GPU compiles the kernel")
def test_lowers_for_sm90():
    """Llama-3.1-8B's MLP width (F = 14,336: 112 tile rows, seven 16-row steps) and 70B's at tp=4 (7,168: 8-row
    steps) lower through Mosaic GPU for CUDA on CPU (unsupported ops, casts and layouts fail here)."""
    from jax import export
    for rows, f in ((256, 14336), (8, 7168)):
        args = (jax.ShapeDtypeStruct((rows, 2 * f), jnp.bfloat16), jax.ShapeDtypeStruct((rows,), jnp.float32),
                jax.ShapeDtypeStruct((2 * f,), jnp.float32))
        exported = export.export(jax.jit(k.silu_and_mul_quant), platforms=("cuda",))(*args)
        assert "mosaic_gpu" in exported.mlir_module()
