"""A Llama-3.1-8B layer stack's GEMMs alone, with separate q/k/v and gate/up weights against fused ones
(vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``), at the row counts an engine step runs.

Each of ``--layers`` layers has its own weights (so nothing stays in L2 between layers), and each layer is
``x + o(q) + down(silu(gate) * up)`` with k and v folded into the residual, so that XLA keeps every
projection. No attention, no norms: the difference between the two variants is the GEMMs alone. Prints
milliseconds per stack and the weight-read bound (all weights once over ``--bandwidth-tb-s``).

    python scripts/dev/bench_fused_gemm.py --rows 2,16,64,128,256,512,8192 [--impl torch] [--shared-weights]

``--impl torch`` runs the same stack in PyTorch (cuBLAS through ``torch.matmul``, replayed as one CUDA graph
per row count, as vLLM runs its decode steps): the GEMMs a vLLM-like engine would get on the same GPU.
``--shared-weights`` gives every layer layer 0's weights (the projections that fit stay in L2 across layers),
to see how much of the stack's time is the weights' trip from HBM.

Caveat (session 22, H100): in this JAX stack XLA's dot merger merges the separate gate and up projections (they
share ``x``) and concatenates their weights on every call (155.5 us a layer at 256 rows, against two 46.8 us cuBLAS
GEMMs in PyTorch); the engine's step keeps them apart. For the engine's GEMM cost read its kernel table
(``bench_mesh_step.py --top-kernels``), not this bench's JAX column.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def make_weights(normal, layers, d, q, kv, f, fused, shared=False):
    """Per layer weights from ``normal(layer, index, shape)`` (LeCun-scaled bf16 in JAX or PyTorch; ``index`` names
    the projection: 0 q or qkv, 1 k, 2 v, 3 o, 4 gate or gate_up, 5 up, 6 down); ``shared``: every layer is layer 0
    (same arrays)."""
    out = []
    for i in range(layers):
        if shared and i:
            out.append(out[0])
            continue
        o, down = normal(i, 3, (q, d)), normal(i, 6, (f, d))
        if fused:
            out.append(dict(qkv=normal(i, 0, (d, q + 2 * kv)), o=o, gate_up=normal(i, 4, (d, 2 * f)), down=down))
        else:
            out.append(dict(q=normal(i, 0, (d, q)), k=normal(i, 1, (d, kv)), v=normal(i, 2, (d, kv)), o=o,
                            gate=normal(i, 4, (d, f)), up=normal(i, 5, (d, f)), down=down))
    return out


def stack(weights, x, q, kv, f, fused, silu=jax.nn.silu, tile=jnp.tile):
    for lw in weights:
        if fused:
            qkv = x @ lw["qkv"]
            qq, k, v = qkv[:, :q], qkv[:, q:q + kv], qkv[:, q + kv:]
            gu = x @ lw["gate_up"]
            g, u = gu[:, :f], gu[:, f:]
        else:
            qq, k, v = x @ lw["q"], x @ lw["k"], x @ lw["v"]
            g, u = x @ lw["gate"], x @ lw["up"]
        kv_sum = tile(k + v, q // kv)
        h = (qq + kv_sum) @ lw["o"]
        x = x + h + (silu(g) * u) @ lw["down"]
    return x


def print_kernels(run, sync, calls: int, top: int, label: str) -> None:
    """CUPTI (``torch.profiler``) table of the ``top`` kernels of ``calls`` calls of ``run``: us and launches per
    call (GPU only; without torch a line says so)."""
    if jax.default_backend() != "gpu":
        return
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print(f"   kernels, {label}: torch is not installed, no CUPTI table")
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        sync()
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / calls
    print(f"   kernels, {label}: {total:9.1f} us of device time per stack")
    for e in events[:top]:
        print(f"   {e.device_time_total / calls:9.1f} us {e.count / calls:5.1f} x "
              f"{e.device_time_total / e.count:7.1f} us  {e.key[:90]}")


def jax_timer(a, fused):
    """``rows -> ms`` of the stack in JAX (best of 3 rounds of ``a.repeats`` calls)."""
    d, q, kv, f = a.hidden, a.q, a.kv, a.ffn
    key = jax.random.key(0)

    def normal(layer, index, shape):
        k = jax.random.split(jax.random.fold_in(key, layer), 7)[index]
        return (jax.random.normal(k, shape, jnp.float32) / shape[0] ** 0.5).astype(jnp.bfloat16)
    weights = make_weights(normal, a.layers, d, q, kv, f, fused, shared=a.shared_weights)
    fn = jax.jit(lambda w, x: stack(w, x, q, kv, f, fused))

    def time_rows(rows):
        x = jax.random.normal(jax.random.key(rows), (rows, d), jnp.float32).astype(jnp.bfloat16) * 0.01
        jax.block_until_ready(fn(weights, x))
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(a.repeats):
                out = fn(weights, x)
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - t0) / a.repeats * 1e3)
        if rows in a.kernel_rows:
            out = []
            print_kernels(lambda: out.append(fn(weights, x)), lambda: jax.block_until_ready(out), 5, a.top_kernels,
                          f"jax {'fused' if fused else 'separate'}, {rows} rows")
        return best
    return time_rows


def torch_timer(a, fused):
    """``rows -> ms`` of the same stack in PyTorch, one CUDA graph per row count, timed by CUDA events."""
    import torch
    d, q, kv, f = a.hidden, a.q, a.kv, a.ffn
    g = torch.Generator(device="cuda").manual_seed(0)

    def normal(layer, index, shape):
        return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) / shape[0] ** 0.5).to(torch.bfloat16)
    weights = make_weights(normal, a.layers, d, q, kv, f, fused, shared=a.shared_weights)

    def run(x):
        return stack(weights, x, q, kv, f, fused, silu=torch.nn.functional.silu, tile=lambda t, n: t.repeat(1, n))

    @torch.inference_mode()
    def time_rows(rows):
        x = torch.randn((rows, d), generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16) * 0.01
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(x)  # warm-up (cuBLAS handles, heuristics) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(x)
        graph.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.repeats):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / a.repeats)
        if rows in a.kernel_rows:  # eager (no graph) so that CUPTI names every kernel
            print_kernels(lambda: run(x), torch.cuda.synchronize, 5, a.top_kernels,
                          f"torch {'fused' if fused else 'separate'}, {rows} rows")
        del graph
        return best
    return time_rows


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
    p.add_argument("--impl", choices=("jax", "torch"), default="jax")
    p.add_argument("--shared-weights", action="store_true", help="every layer uses layer 0's weights")
    p.add_argument("--variants", default="separate,fused", help="which weight layouts to time")
    p.add_argument("--kernel-rows", default="", help="row counts whose kernels to list (CUPTI through torch)")
    p.add_argument("--top-kernels", type=int, default=12)
    a = p.parse_args()
    a.kernel_rows = {int(r) for r in a.kernel_rows.split(",") if r}
    d, q, kv, f = a.hidden, a.q, a.kv, a.ffn
    weight_bytes = a.layers * 2 * (d * (q + 2 * kv) + q * d + 2 * d * f + f * d)
    if a.impl == "torch":
        import torch
        device = torch.cuda.get_device_name()
    else:
        device = jax.devices()[0].device_kind
    print(f"device {device}; impl {a.impl}; {a.layers} layers{' (shared weights)' if a.shared_weights else ''}, "
          f"{weight_bytes / 1e9:.2f} GB of weights; read bound {weight_bytes / a.bandwidth_tb_s / 1e9:.3f} ms at "
          f"{a.bandwidth_tb_s} TB/s")
    row_counts = [int(r) for r in a.rows.split(",")]
    variants = [v.strip() for v in a.variants.split(",")]
    results = {}
    for variant in variants:
        timer = (torch_timer if a.impl == "torch" else jax_timer)(a, variant == "fused")
        for rows in row_counts:
            results[(variant, rows)] = timer(rows)
        del timer
    flop_per_row = weight_bytes  # 2 FLOP per weight (bf16: 2 bytes per weight)
    print(f"{'rows':>6} " + " ".join(f"{v + ' ms':>12} {v[:5] + ' TFLOP/s':>14}" for v in variants)
          + (f" {'fused/sep':>10}" if len(variants) == 2 else ""))
    for rows in row_counts:
        cells = " ".join(f"{results[(v, rows)]:>12.3f} {flop_per_row * rows / results[(v, rows)] / 1e9:>14.1f}"
                         for v in variants)
        ratio = f" {results[(variants[1], rows)] / results[(variants[0], rows)]:>10.3f}" if len(variants) == 2 else ""
        print(f"{rows:>6} {cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
