"""Probe (GPU): cross-CTA merge through a global semaphore: CTAs 1..N-1 write a tile by TMA and signal;
CTA 0 waits for N-1 signals, reads every tile back by TMA and writes their sum. Run twice (the semaphore
must be back at 0 after a call)."""
import jax, jax.numpy as jnp, numpy as np, sys
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

N, R, D = 16, 8, 128

def kern(x_ref, part_ref, out_ref, smem, all_smem, bar):
    i = jax.lax.axis_index("i")
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    plgpu.copy_gmem_to_smem(x_ref.at[i], smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    smem[...] = smem[...] * 2.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, part_ref.at[i])
    plgpu.wait_smem_to_gmem(0)

    @pl.when(i > 0)
    def _():
        pl.semaphore_signal(sem, 1)

    @pl.when(i == 0)
    def _():
        pl.semaphore_wait(sem, N - 1)
        plgpu.copy_gmem_to_smem(part_ref, all_smem, bar.at[1])
        plgpu.barrier_wait(bar.at[1])
        acc = all_smem[0]
        for j in range(1, N):
            acc = acc + all_smem[j]
        smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_ref)
        plgpu.wait_smem_to_gmem(0)

def main(interpret):
    x = jax.random.normal(jax.random.key(0), (N, R, D), jnp.float32)
    f = plgpu.kernel(lambda x_ref, p_ref, o_ref: pl.run_scoped(
                         lambda *s: kern(x_ref, p_ref, o_ref, *s),
                         plgpu.SMEM((R, D), jnp.float32), plgpu.SMEM((N, R, D), jnp.float32),
                         plgpu.Barrier(num_barriers=2)),
                     out_type=(jax.ShapeDtypeStruct((N, R, D), jnp.float32), jax.ShapeDtypeStruct((R, D), jnp.float32)),
                     grid=(N,), grid_names=("i",), interpret=plgpu.InterpretGPUParams() if interpret else None)
    f = jax.jit(f)
    for it in range(3):
        _, out = f(x * (it + 1))
        err = float(jnp.max(jnp.abs(out - 2 * (it + 1) * x.sum(0))))
        print("call", it, "max err", err, flush=True)

if __name__ == "__main__":
    try:
        main(sys.argv[1] == "interp")
    except Exception as e:
        print("FAILED", type(e).__name__, str(e)[:1500])

def export_only():
    from jax import export
    x = jnp.zeros((N, R, D), jnp.float32)
    f = plgpu.kernel(lambda x_ref, p_ref, o_ref: pl.run_scoped(
                         lambda *s: kern(x_ref, p_ref, o_ref, *s),
                         plgpu.SMEM((R, D), jnp.float32), plgpu.SMEM((N, R, D), jnp.float32),
                         plgpu.Barrier(num_barriers=2)),
                     out_type=(jax.ShapeDtypeStruct((N, R, D), jnp.float32), jax.ShapeDtypeStruct((R, D), jnp.float32)),
                     grid=(N,), grid_names=("i",))
    print("lowered", "mosaic_gpu" in export.export(jax.jit(f), platforms=("cuda",))(x).mlir_module())
