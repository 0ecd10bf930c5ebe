"""``silu(g) * u`` and its per-token fp8 quantization for an fp8 ``down_proj``, in one op: the Mosaic GPU kernel
(:mod:`pallas_kernels.silu_and_mul_quant_mgpu`) or its ``jnp`` form.

The model uses it only when ``$JAXKV_FP8_SWIGLU_KERNEL`` is ``1`` (:func:`swiglu_kernel_enabled`): the kernel is
tested in the interpreter and lowered for sm_90, not yet measured compiled (docs/perf-notes.md, session 33).
"""

from __future__ import annotations

import os

import jax

from pallas_kernels import silu_and_mul_quant_mgpu as _kernel

SWIGLU_KERNEL_ENV = "JAXKV_FP8_SWIGLU_KERNEL"
"""``1`` in the environment: an fp8 MLP (fused gate/up, dynamic fp8 ``down_proj``, one device) runs its SwiGLU and
``down_proj``'s activation quantization as :func:`silu_and_mul_quant` (read when a step is traced)."""

IMPLS = ("pallas_mosaic", "reference")


def swiglu_kernel_enabled() -> bool:
    """Whether ``$JAXKV_FP8_SWIGLU_KERNEL`` is ``1``."""
    return os.environ.get(SWIGLU_KERNEL_ENV, "0") == "1"


def silu_and_mul_quant(gate_up: jax.Array, row_scale: jax.Array, col_scale: jax.Array, *,
                       impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``silu(g) * u`` of a fused gate/up fp8 GEMM's raw output, quantized to e4m3 per row.

    Args:
        gate_up: ``[rows, 2 * F]`` the GEMM's output before its scales (gate columns first).
        row_scale: ``f32[rows]`` the GEMM input's per-token scales.
        col_scale: ``f32[2 * F]`` the weight's per-channel scales.
        impl: ``"pallas_mosaic"`` (the kernel; Hopper GPU), ``"reference"`` (``jnp``), or ``None``: the kernel on
            a GPU when it takes the shape (:func:`pallas_kernels.silu_and_mul_quant_mgpu.unsupported_reason`), else
            the reference.

    Returns:
        ``(q f8e4m3[rows, F], scale f32[rows])``; ``q * scale`` ≈ ``silu(g) * u``.

    Raises:
        ValueError: an unknown ``impl``, or ``"pallas_mosaic"`` for a shape the kernel does not take.

    vLLM: ``silu_and_mul`` + ``scaled_fp8_quant(use_per_token_if_dynamic=True)``.
    """
    if impl is None:
        impl = ("pallas_mosaic" if jax.default_backend() == "gpu" and _kernel.unsupported_reason(gate_up) is None
                else "reference")
    if impl == "reference":
        return _kernel.silu_and_mul_quant_reference(gate_up, row_scale, col_scale)
    if impl == "pallas_mosaic":
        return _kernel.silu_and_mul_quant(gate_up, row_scale, col_scale)
    raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
