"""JAX's Mosaic GPU Hopper matmul (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``) against XLA's GEMM on
the projections of a Llama-3.1-8B decode step at the row counts where XLA reaches 425 TFLOP/s (256 rows, session 21):
is a warp-specialized wgmma kernel with small tiles (more CTAs than XLA's 64 for a 256 x 4096 output) the lever?

    python scripts/dev/bench_mgpu_matmul.py --rows 256
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

SHAPES = {"qkv (fused)": (4096, 6144), "o / q": (4096, 4096), "gate_up (fused)": (4096, 28672),
          "gate / up": (4096, 14336), "down": (14336, 4096)}


def timed(fn, *args) -> tuple[jax.Array, float]:
    out, runtimes = profiler.measure(fn, iterations=10)(*args)
    return out, statistics.median(runtimes) * 1e3  # us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="256")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    configs = list(itertools.product((64, 128), (64, 128), (hm.MatmulDimension.M, hm.MatmulDimension.N),
                                     (hm.MatmulDimension.M, hm.MatmulDimension.N), (1, 8)))
    for m in (int(r) for r in a.rows.split(",")):
        for name in a.shapes.split(","):
            k, n = SHAPES[name]
            x = (jax.random.normal(jax.random.key(0), (m, k), jnp.float32) / 8).astype(jnp.bfloat16)
            w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
            ref, xla_us = timed(jax.jit(lambda x, w: x @ w), x, w)
            flops = 2 * m * n * k
            best = (float("inf"), None)
            for tile_m, tile_n, wg, minor, width in configs:
                cfg = hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                                      epi_tile_m=64, epi_tile_n=64, grid_minor_dim=minor, grid_tile_width=width,
                                      wg_dimension=wg)
                try:
                    out, us = timed(jax.jit(functools.partial(hm.matmul, config=cfg)), x, w, None)
                except Exception as e:  # tile shapes that do not divide, shared memory overflows
                    continue
                err = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))))
                if err > 0.05:
                    print(f"   {cfg}: max error {err:.3g}, skipped")
                    continue
                if us < best[0]:
                    best = (us, cfg)
            us, cfg = best
            print(f"M={m:4d} {name:16s} K={k:5d} N={n:5d}: XLA {xla_us:7.1f} us ({flops / xla_us / 1e6:5.0f} TFLOP/s); "
                  f"Mosaic best {us:7.1f} us ({flops / us / 1e6:5.0f} TFLOP/s) = {xla_us / us:.2f}x"
                  + (f" tile_m={cfg.tile_m} tile_n={cfg.tile_n} wg={cfg.wg_dimension} minor={cfg.grid_minor_dim} "
                     f"width={cfg.grid_tile_width}" if cfg else ""), flush=True)


if __name__ == "__main__":
    main()
