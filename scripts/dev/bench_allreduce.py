"""Time of one tensor-parallel all-reduce of a decode step's activations, as XLA runs it (issue 45 item 4).

    python scripts/dev/bench_allreduce.py [--rows 64,256,1024,8192] [--hidden 8192] [--iters 200]

``models.parallel.row_parallel`` sums each rank's partial ``[rows, hidden]`` bf16 output over the ``tp`` axis
(``shard_map`` + ``psum``). This times that psum alone on all local GPUs: ``--iters`` dependent psums inside one
jitted ``fori_loop`` (so the launch cost is amortised as in a step), best of 5 calls, per all-reduce: µs and the
algorithm bandwidth (bytes of one rank's buffer / time). Run it once per ``XLA_FLAGS`` to compare XLA's own
all-reduce kernel with NCCL's (``--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false``).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,1024,8192")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args()
    devs = jax.devices()
    n = len(devs)
    mesh = Mesh(np.array(devs), ("tp",))
    print(f"{n} x {devs[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

    def loop(x):
        def body(_, y):  # each rank's partial sum in, the total out (scaled so values stay bounded)
            return jax.lax.psum(y, "tp") * jnp.asarray(1.0 / n, y.dtype)
        return jax.lax.fori_loop(0, a.iters, body, x)

    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    for rows in (int(r) for r in a.rows.split(",")):
        x = jax.device_put(jnp.ones((n * rows, a.hidden), jnp.bfloat16), NamedSharding(mesh, P("tp")))
        f(x).block_until_ready()
        best = min(_timed(f, x) for _ in range(5))
        us = best / a.iters * 1e6
        mb = rows * a.hidden * 2 / 1e6
        print(f"rows {rows:5d}: {mb:7.2f} MB a rank, {us:8.1f} us an all-reduce, {mb / us:6.3f} TB/s algorithm bw")


def _timed(f, x) -> float:
    t = time.perf_counter()
    f(x).block_until_ready()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
