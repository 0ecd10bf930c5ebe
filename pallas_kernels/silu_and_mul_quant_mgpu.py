"""SwiGLU and its per-token fp8 quantization in one pass, on Pallas Mosaic GPU (Hopper: TMA pipeline).

The input of an fp8 ``down_proj``: ``a = silu(g) * u`` from the fused gate/up fp8 GEMM's output, then per token
``s = max(amax(|a|) / 448, 1 / (448 * 512))`` and ``q = e4m3(clip(a / s, ±448))``. XLA runs this as three kernels at
decode sizes (the product written as bf16, its absmax, the conversion: ~18 us a layer for Llama-3.1-8B at batch 256
on an H200, ~40 MB moved; docs/perf-notes.md, session 33); this kernel reads the GEMM's output once and writes e4m3.
The GEMM's scales are applied here too (``g = raw_g * row_scale * col_scale_g``), so XLA never writes the scaled
product. vLLM: ``silu_and_mul`` followed by ``scaled_fp8_quant(..., use_per_token_if_dynamic=True)``, which its
compile passes fuse.

One CUDA block per token row (grid ``(rows,)``, one warpgroup). A row's gate and up halves, viewed as
``[F / 128, 128]`` tiles, and their column scales stream through shared memory in chunks of ``chunk_rows x 128``
(``plgpu.emit_pipeline``, two stages). Each chunk's product goes to a bf16 row buffer in shared memory (rounded to
bf16, as XLA's form rounds it) and into a running elementwise absmax; then the row's scale, one pass over the buffer
writing e4m3, and one TMA copy of the row out. The scale goes out as a ``[rows, 128]`` f32 row of copies (one TMA
box; the caller reads column 0). Shared memory a block: two pipeline stages of the four chunks (gate and up in
bf16, their column scales in f32), the bf16 row and the e4m3 row (~94 KB at F = 14,336 with 16-row chunks: two blocks
an SM).

Tested in the Mosaic GPU interpreter on CPU and lowered for sm_90 on CPU; the compiled kernel runs only on a
Hopper GPU. Not measured compiled yet: :mod:`jaxkv.ops.activation` uses it only when asked
(``JAXKV_FP8_SWIGLU_KERNEL=1``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

E4M3_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)   # models.quantization's floor: a zero row quantizes to zeros
COLS = 128                           # a row is viewed as [F / COLS, COLS] tiles (TMA boxes are <= 256 a side)
CHUNK_ROWS = (16, 8)                 # tile rows a pipeline step moves, the first that divides F / COLS
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def silu_and_mul_quant_reference(gate_up: jax.Array, row_scale: jax.Array, col_scale: jax.Array
                                 ) -> tuple[jax.Array, jax.Array]:
    """The kernel's result in plain ``jnp`` (f32 math; the product rounded to ``gate_up``'s dtype before its
    quantization, as the kernel rounds it to bf16): see :func:`silu_and_mul_quant` for the arguments."""
    f = gate_up.shape[-1] // 2
    y = gate_up.astype(jnp.float32) * row_scale.astype(jnp.float32)[:, None] * col_scale.astype(jnp.float32)
    g = y[:, :f]
    a = g / (1.0 + jnp.exp(-g)) * y[:, f:]  # silu as the kernel computes it
    scale = jnp.maximum(jnp.max(jnp.abs(a), axis=-1) * (1.0 / E4M3_MAX), MIN_SCALE)
    a = a.astype(gate_up.dtype).astype(jnp.float32)
    return jnp.clip(a * (1.0 / scale)[:, None], -E4M3_MAX, E4M3_MAX).astype(FP8), scale


def unsupported_reason(gate_up: jax.Array) -> str | None:
    """Why the kernel does not take ``gate_up``, or ``None``."""
    if gate_up.ndim != 2 or gate_up.shape[-1] % 2:
        return f"gate_up.shape={gate_up.shape} is not [rows, 2 * F]"
    if gate_up.dtype != jnp.bfloat16:
        return f"gate_up.dtype={gate_up.dtype} is not bfloat16"
    f = gate_up.shape[-1] // 2
    if f % COLS or _chunk_rows(f // COLS) is None or f // COLS > 256:
        return f"F={f} is not a multiple of {COLS} x one of {CHUNK_ROWS} up to {256 * COLS}"
    return None


def _chunk_rows(tiles: int) -> int | None:
    return next((c for c in CHUNK_ROWS if tiles % c == 0), None)


def silu_and_mul_quant(gate_up: jax.Array, row_scale: jax.Array, col_scale: jax.Array, *,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``silu(g) * u`` quantized to e4m3 per row, from the raw output of a fused gate/up fp8 GEMM.

    Args:
        gate_up: ``bf16[rows, 2 * F]``, the GEMM's output before its scales: gate in columns ``[0, F)``, up in
            ``[F, 2 * F)``.
        row_scale: ``f32[rows]``, the activations' per-token scales (``g = gate_up * row_scale * col_scale``).
        col_scale: ``f32[2 * F]``, the weight's per-output-channel scales.
        interpret: run in the Mosaic GPU interpreter (CPU).

    Returns:
        ``(q f8e4m3[rows, F], scale f32[rows])`` with ``q * scale ≈ silu(g) * u``: the scale is
        ``max(amax / 448, 1 / (448 * 512))`` of the row's f32 product, ``q`` that product rounded to bf16, divided by
        the scale and saturated to ±448 (round to nearest even).

    Raises:
        ValueError: a shape or dtype the kernel does not take (:func:`unsupported_reason`).
    """
    reason = unsupported_reason(gate_up)
    if reason:
        raise ValueError(reason)
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale = _call(rows, f, interpret)(gate_up.reshape(rows, 2, f // COLS, COLS),
                                         col_scale.astype(jnp.float32).reshape(2, f // COLS, COLS),
                                         row_scale.astype(jnp.float32))
    return q.reshape(rows, f), scale[:, 0]


@functools.lru_cache(maxsize=None)
def _call(rows: int, f: int, interpret: bool):
    tiles = f // COLS
    chunk = _chunk_rows(tiles)
    steps = tiles // chunk

    def kernel(gu_gmem, sw_gmem, sx_gmem, q_gmem, s_gmem, a_smem, q_smem, s_tile):
        r = jax.lax.axis_index("r")
        x = sx_gmem[r]

        def step(idx, g_ref, u_ref, sg_ref, su_ref, amax):
            (k,) = idx
            g = g_ref[...].astype(jnp.float32) * (sg_ref[...] * x)
            u = u_ref[...].astype(jnp.float32) * (su_ref[...] * x)
            a = g / (1.0 + jnp.exp(-g)) * u
            a_smem[pl.ds(k * chunk, chunk)] = a.astype(a_smem.dtype)
            return jnp.maximum(amax, jnp.abs(a))

        spec = pl.BlockSpec((chunk, COLS), lambda k: (k, 0))
        amax = plgpu.emit_pipeline(step, grid=(steps,), in_specs=[spec] * 4, max_concurrent_steps=2,
                                   init_carry=jnp.zeros((chunk, COLS), jnp.float32))(
            gu_gmem.at[r, 0], gu_gmem.at[r, 1], sw_gmem.at[0], sw_gmem.at[1])
        scale = jnp.maximum(jnp.max(amax) * (1.0 / E4M3_MAX), MIN_SCALE)
        inverse = 1.0 / scale

        @pl.loop(0, steps)
        def _(j):
            part = pl.ds(j * chunk, chunk)
            q_smem[part] = jnp.clip(a_smem[part].astype(jnp.float32) * inverse, -E4M3_MAX, E4M3_MAX).astype(FP8)

        s_tile[...] = jnp.full((COLS,), scale, jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[r])
        plgpu.copy_smem_to_gmem(s_tile, s_gmem.at[r])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((rows, tiles, COLS), FP8), jax.ShapeDtypeStruct((rows, COLS), jnp.float32)),
        scratch_types=[plgpu.SMEM((tiles, COLS), jnp.bfloat16), plgpu.SMEM((tiles, COLS), FP8),
                       plgpu.SMEM((COLS,), jnp.float32)],
        grid=(rows,), grid_names=("r",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
