"""Time of one tensor-parallel all-reduce of a decode step's activations, as XLA runs it (issue 45 item 4).

    PYTHONPATH=. python scripts/dev/bench_allreduce.py [--rows 64,256,1024,8192] [--hidden 8192] [--iters 200]

``models.parallel.row_parallel`` sums each rank's partial ``[rows, hidden]`` bf16 output over the ``tp`` axis
(``shard_map`` + ``psum``). This times that psum alone on all local GPUs: ``--iters`` dependent psums inside one
jitted ``fori_loop`` (so the launch cost is amortised as in a step), best of 5 calls, per all-reduce: µs and the
algorithm bandwidth (bytes of one rank's buffer / time). Run it once per ``XLA_FLAGS`` to compare XLA's own
all-reduce kernel with NCCL's (``--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false``).

``--mode two-shot`` times the same sum as a reduce-scatter then an all-gather (``psum_scatter`` + ``all_gather``
over the rows; the rows must divide by the GPU count), which moves ``2 (n - 1) / n`` of the buffer a GPU where XLA's
one-shot kernel reads ``n - 1`` peers' whole buffers; ``--mode both`` runs both.
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

from jaxkv.parallel.mesh import TP
from models.parallel import _sum_over_tp  # what row_parallel runs inside its shard_map


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,1024,8192")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--mode", choices=("psum", "two-shot", "both"), default="psum")
    a = p.parse_args()
    devs = jax.devices()
    n = len(devs)
    mesh = Mesh(np.array(devs), (TP,))
    print(f"{n} x {devs[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

    def loop(x, mode):
        def body(_, y):  # each rank's partial sum in, the total out (scaled so values stay bounded)
            return _sum_over_tp(y, n, mode) * jnp.asarray(1.0 / n, y.dtype)
        return jax.lax.fori_loop(0, a.iters, body, x)

    for mode in ("psum", "two-shot") if a.mode == "both" else (a.mode,):
        f = jax.jit(jax.shard_map(lambda x: loop(x, mode), mesh=mesh, in_specs=P(TP), out_specs=P(TP),
                                  check_vma=False))
        for rows in (int(r) for r in a.rows.split(",")):
            if mode == "two-shot" and rows % n:  # _sum_over_tp would fall back to the psum
                raise SystemExit(f"--rows {rows} does not split over {n} devices for --mode two-shot")
            x = jax.device_put(jnp.ones((n * rows, a.hidden), jnp.bfloat16), NamedSharding(mesh, P("tp")))
            got = f(x)
            assert float(got[0, 0]) == 1.0, f"{mode}: the sum of {n} ones / {n} is {float(got[0, 0])}"
            best = min(_timed(f, x) for _ in range(5))
            us = best / a.iters * 1e6
            mb = rows * a.hidden * 2 / 1e6
            print(f"{mode:8s} rows {rows:5d}: {mb:7.2f} MB a rank, {us:8.1f} us an all-reduce, "
                  f"{mb / us:6.3f} TB/s algorithm bw")


def _timed(f, x) -> float:
    t = time.perf_counter()
    f(x).block_until_ready()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
