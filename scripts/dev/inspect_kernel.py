"""Compile a jaxkv Pallas kernel for sm_90 on a CPU-only machine and print its PTX instruction mix.

    pip install triton==3.6.0          # any machine; only its compiler (and bundled ptxas) is used
    python scripts/dev/inspect_kernel.py prefill --block-q 32 --pages 8 --warps 8 --stages 3
    python scripts/dev/inspect_kernel.py decode --batch 64 --ctx 1024 --splits 2 --pages 4

Lowers the kernel through Pallas' Triton lowering on CPU (JAX is told it targets compute capability 9.0),
writes the Triton IR, then compiles it with the pip ``triton`` package for sm_90 and counts the PTX
instructions that tell whether the kernel is built as intended: ``cp.async`` / ``ld.global.v4`` (16-byte
vector loads) vs ``ld.global.b16`` (one element per load), ``wgmma`` vs ``mma.sync``, ``ex2.approx``,
and the shared memory a program needs. The GPU build goes through XLA's own Triton, so this is a proxy
for it, not the same binary. Uses private JAX modules (``jax._src.pallas.triton``); a debugging aid,
not part of the library.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import types


def lower_to_ttir(kind: str, args) -> list[str]:
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration

    registration.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    original = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def capture(*a, **k):
        result = original(*a, **k)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result
    registration.lowering.lower_jaxpr_to_triton_module = capture

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
    from bench_attention import BLOCK_SIZE as block  # the benchmarks' shapes
    from bench_attention import HEAD_SIZE as head_size
    from bench_attention import NUM_HEADS as heads
    from bench_attention import NUM_KV_HEADS as kv_heads

    S = jax.ShapeDtypeStruct
    if kind == "prefill":
        from pallas_kernels.paged_prefill_attention import paged_prefill_attention
        n, pages = args.tokens, args.tokens // block
        shapes = (S((n, heads, head_size), jnp.bfloat16),
                  S((2, pages, kv_heads, block, head_size), jnp.bfloat16),
                  S((1, pages), jnp.int32), S((1,), jnp.int32), S((2,), jnp.int32))
        fn = lambda q, kv, bt, sl, qsl: paged_prefill_attention(  # noqa: E731
            q, kv, bt, sl, qsl, scale=head_size ** -0.5, max_query_len=n, block_q=args.block_q,
            pages_per_compute_block=args.pages, num_warps=args.warps, num_stages=args.stages)
    else:
        from pallas_kernels.paged_attention import paged_attention
        pages = args.ctx // block
        shapes = (S((args.batch, heads, head_size), jnp.bfloat16),
                  S((2, args.batch * pages, kv_heads, block, head_size), jnp.bfloat16),
                  S((args.batch, pages), jnp.int32), S((args.batch,), jnp.int32))
        fn = lambda q, kv, bt, sl: paged_attention(  # noqa: E731
            q, kv, bt, sl, scale=head_size ** -0.5, num_splits=args.splits,
            pages_per_compute_block=args.pages, num_warps=args.warps, num_stages=args.stages)
    try:  # exporting stops at the custom call's compatibility check, after the kernel was lowered
        export.export(jax.jit(fn), platforms=("cuda",))(*shapes)
    except ValueError as e:
        if "custom call" not in str(e):
            raise
    return modules


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("prefill", "decode"))
    p.add_argument("--tokens", type=int, default=2048, help="prefill: prompt length")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--splits", type=int, default=1)
    p.add_argument("--block-q", type=int, default=32)
    p.add_argument("--pages", type=int, default=None, help="pages_per_compute_block (default 8 / 4)")
    p.add_argument("--warps", type=int, default=None, help="default 8 (prefill) / 4 (decode)")
    p.add_argument("--stages", type=int, default=None, help="default 3 (prefill) / 2 (decode)")
    p.add_argument("--keep", default=None, help="directory to keep the .ttir/.ttgir/.ptx files in")
    args = p.parse_args(argv)
    prefill = args.kind == "prefill"
    args.pages = args.pages or (8 if prefill else 4)
    args.warps = args.warps or (8 if prefill else 4)
    args.stages = args.stages or (3 if prefill else 2)
    import triton
    from triton.backends.compiler import GPUTarget

    out_dir = args.keep or tempfile.mkdtemp()
    for i, ttir in enumerate(lower_to_ttir(args.kind, args)):
        path = os.path.join(out_dir, f"{args.kind}{i}.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=args.warps, num_stages=args.stages))
        for key in ("ttgir", "ptx"):
            with open(f"{path}.{key}", "w") as f:
                f.write(compiled.asm[key])
        counts = collections.Counter(re.findall(r"^\s*(?:@!?%\w+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)",
                                                compiled.asm["ptx"], re.M))
        print(f"{path}: shared memory {compiled.metadata.shared} B, "
              f"{compiled.asm['ttgir'].count('ttg.convert_layout')} layout conversions in TTGIR")
        watch = ("ld.global", "cp.async.cg", "wgmma.mma", "mma.sync", "ex2.approx", "ld.shared", "st.shared",
                 "st.global")
        for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            if name.startswith(watch):
                print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
