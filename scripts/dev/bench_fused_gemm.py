"""A Llama-3.1-8B layer stack's GEMMs alone, with separate q/k/v and gate/up weights against fused ones
(vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``), at the row counts an engine step runs.

Each of ``--layers`` layers has its own weights (so nothing stays in L2 between layers), and each layer is
``x + o(q) + down(silu(gate) * up)`` with k and v folded into the residual, so that XLA keeps every
projection. No attention, no norms: the difference between the two variants is the GEMMs alone. Prints
milliseconds per stack and the weight-read bound (all weights once over ``--bandwidth-tb-s``).

    python scripts/dev/bench_fused_gemm.py --rows 2,16,64,128,256,512,8192
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def make_weights(key, layers, d, q, kv, f, fused, dtype=jnp.bfloat16):
    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / shape[0] ** 0.5).astype(dtype)
    out = []
    for i in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, i), 7)
        o, down = w(ks[3], (q, d)), w(ks[6], (f, d))
        if fused:
            out.append(dict(qkv=w(ks[0], (d, q + 2 * kv)), o=o, gate_up=w(ks[4], (d, 2 * f)), down=down))
        else:
            out.append(dict(q=w(ks[0], (d, q)), k=w(ks[1], (d, kv)), v=w(ks[2], (d, kv)), o=o,
                            gate=w(ks[4], (d, f)), up=w(ks[5], (d, f)), down=down))
    return out


def stack(weights, x, q, kv, f, fused):
    for lw in weights:
        if fused:
            qkv = x @ lw["qkv"]
            qq, k, v = qkv[:, :q], qkv[:, q:q + kv], qkv[:, q + kv:]
            gu = x @ lw["gate_up"]
            g, u = gu[:, :f], gu[:, f:]
        else:
            qq, k, v = x @ lw["q"], x @ lw["k"], x @ lw["v"]
            g, u = x @ lw["gate"], x @ lw["up"]
        kv_sum = jnp.tile(k + v, q // kv)
        h = (qq + kv_sum) @ lw["o"]
        x = x + h + (jax.nn.silu(g) * u) @ lw["down"]
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="2,16,64,128,256,512,8192")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--q", type=int, default=4096)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bandwidth-tb-s", type=float, default=4.3)
    a = p.parse_args()
    d, q, kv, f = a.hidden, a.q, a.kv, a.ffn
    weight_bytes = a.layers * 2 * (d * (q + 2 * kv) + q * d + 2 * d * f + f * d)
    print(f"device {jax.devices()[0].device_kind}; {a.layers} layers, {weight_bytes / 1e9:.2f} GB of weights; "
          f"read bound {weight_bytes / a.bandwidth_tb_s / 1e9:.3f} ms at {a.bandwidth_tb_s} TB/s")
    print(f"{'rows':>6} {'separate ms':>12} {'fused ms':>10} {'fused/sep':>10} {'sep TFLOP/s':>12} {'fused TFLOP/s':>14}")
    key = jax.random.key(0)
    results = {}
    for fused in (False, True):
        weights = make_weights(key, a.layers, d, q, kv, f, fused)
        fn = jax.jit(lambda w, x, fused=fused: stack(w, x, q, kv, f, fused))
        for rows in (int(r) for r in a.rows.split(",")):
            x = jax.random.normal(jax.random.key(rows), (rows, d), jnp.float32).astype(jnp.bfloat16) * 0.01
            jax.block_until_ready(fn(weights, x))
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(a.repeats):
                    out = fn(weights, x)
                jax.block_until_ready(out)
                best = min(best, (time.perf_counter() - t0) / a.repeats * 1e3)
            results[(fused, rows)] = best
        del weights
    flop_per_row = weight_bytes  # 2 FLOP per weight (bf16: 2 bytes per weight)
    for rows in (int(r) for r in a.rows.split(",")):
        s, fu = results[(False, rows)], results[(True, rows)]
        print(f"{rows:>6} {s:>12.3f} {fu:>10.3f} {fu / s:>10.3f} {flop_per_row * rows / s / 1e9:>12.1f} "
              f"{flop_per_row * rows / fu / 1e9:>14.1f}")


if __name__ == "__main__":
    main()
