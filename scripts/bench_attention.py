"""Paged decode attention benchmark on a GPU: our Pallas kernels (Triton; Mosaic GPU, Hopper only) vs JAX's
Pallas paged_attention; ``--mode prefill``: our prefill kernels (Triton; Mosaic GPU) vs cuDNN, then chunked
prefill (512 new tokens over a cached context of 4k / 16k).

    python scripts/bench_attention.py --mode decode [--quick]
    python scripts/bench_attention.py --mode prefill [--quick]

Shape (issue 4's grid): 32 query heads, 8 KV heads, head_size 128, bf16, block_size 16, random block
tables, all sequences the same length. GB/s = K+V bytes read (2 * sum(seq_lens) * num_kv_heads *
head_size * itemsize) / median per-call device time. Device time is the sum of every GPU kernel the call
launches (read with torch.profiler / CUPTI when torch is importable; otherwise wall-clock per call,
dispatch included, and the table says so). K/V sets rotate so they are not served from L2. Every output
is checked against the float32 reference before timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu
from pallas_kernels.tuning import decode_num_splits

GRID = [(1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 1024), (64, 4096), (256, 1024), (256, 4096)]
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, jnp.bfloat16
L2_BYTES = 50 * 2**20


def _timer():
    """Returns ``time_calls(fn, inputs, iters) -> list[seconds per call]`` and its description."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        torch = None
    if torch is None:
        def wall(fn, inputs, iters):
            times = []
            for i in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*inputs[i % len(inputs)]))
                times.append(time.perf_counter() - t0)
            return times
        return wall, "wall-clock per call (dispatch included)"

    def cupti(fn, inputs, iters, reps=5):
        per_call = []
        for _ in range(reps):
            jax.block_until_ready(fn(*inputs[0]))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                outs = [fn(*inputs[i % len(inputs)]) for i in range(iters)]
                jax.block_until_ready(outs[-1])  # one stream: the last call ends after the others
            total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
            if total_us == 0:
                raise RuntimeError("CUPTI recorded no kernel: rerun without torch for wall-clock timing")
            per_call.append(total_us * 1e-6 / iters)
        return per_call
    return cupti, "CUPTI device time per call (all kernels of the call)"


def kernel_breakdown(fn, args, iters=10):
    """``[(kernel name, µs per call)]`` of one jitted call, longest first (CUPTI through torch's profiler):
    where a call's device time goes (the kernel itself vs the XLA ops around it). Empty without torch."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return []
    jax.block_until_ready(fn(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs[-1])
    rows = [(e.key, e.device_time_total / iters) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def print_breakdown(label, fn, args):
    rows = kernel_breakdown(fn, args)
    if rows:
        total = sum(t for _, t in rows)
        print(f"      {label} kernels ({total:.1f} µs per call): "
              + "; ".join(f"{name[:48]} {t:.1f}" for name, t in rows[:6]), flush=True)


def _make_inputs(rng, batch, ctx, num_sets):
    pages_per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * pages_per_seq
    sets = []
    for _ in range(num_sets):
        key = jax.random.key(int(rng.integers(2**31)))
        kv = jax.random.normal(key, (2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE), DTYPE)
        q = jax.random.normal(jax.random.fold_in(key, 1), (batch, NUM_HEADS, HEAD_SIZE), DTYPE)
        tables = jnp.asarray(rng.permutation(num_blocks).reshape(batch, pages_per_seq).astype(np.int32))
        sets.append((q, kv, tables, jnp.full((batch,), ctx, jnp.int32)))
    return sets


def _variant_kwargs(name: str, named: dict | None = None) -> dict:
    """Kernel kwargs of a variant named by tokens joined with '+': a name of ``named`` (the fp8 variants), ids /
    noids (``page_ids_first`` on / off), pf (``prefetch_item``), nobal (``balance=False``), bkv64 (``block_kv=64``),
    stN (``num_stages=N``)."""
    kw = {}
    for tok in name.split("+"):
        if named and tok in named:
            kw.update(named[tok])
        elif tok in ("ids", "noids"):
            kw["page_ids_first"] = tok == "ids"
        elif tok == "pf":
            kw["prefetch_item"] = True
        elif tok == "nobal":
            kw["balance"] = False
        elif tok == "bkv64":
            kw["block_kv"] = 64
        elif tok.startswith("st") and tok[2:].isdigit():
            kw["num_stages"] = int(tok[2:])
        else:
            raise SystemExit(f"unknown variant token {tok!r} in {name!r}")
    return kw


def _to_jax_layout(q, kv, tables, lens):
    # jax.experimental.pallas.ops.gpu.paged_attention: k/v [num_kv_heads, total_pages, page_size, D]
    return q, kv[0].transpose(1, 0, 2, 3), kv[1].transpose(1, 0, 2, 3), tables, lens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("decode", "write", "prefill"), default="decode")
    p.add_argument("--quick", action="store_true", help="fewer variants")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the GB/s table here (for plots)")
    p.add_argument("--breakdown", action="store_true",
                   help="also print each kernel's device time per call (the kernel vs the XLA ops around "
                        "it): prefill for cuDNN, Triton and the Mosaic variants; decode for ours, Mosaic "
                        "(bf16, fp8) and JAX's kernel")
    p.add_argument("--fp8-variants", default="auto,convert,qk8,conv",
                   help="decode: comma-separated Mosaic fp8 variants (auto, convert, qk8, qk8t, nobal, conv, prod, "
                        "prod64, conv64, st4, ahead, inorder; convert/qk8/qk8t: fp8_route (the converter warpgroup "
                        "converts K and V / q·kᵀ in fp8 on 64 query rows, V converted / Kqᵀ in fp8 with the keys as "
                        "the wgmma rows, V converted); nobal: the default without the longest-first deal; 64: 64-key "
                        "steps; st4: a 4-stage ring; conv/prod: the compute/a converter warpgroup converts fp8 to 16 "
                        "bits, K and V (auto: the tuned default, tuning.MGPU_DECODE_FP8_ROUTE); ahead/inorder: the "
                        "compute warpgroup converts each tile beside the other wgmma / in step order)")
    p.add_argument("--bf16-variants", default="",
                   help="decode: extra Mosaic bf16 variants, comma-separated, each tokens joined by '+' (ids/noids: "
                        "page ids loaded first or not, pf: the next item prefetched, nobal: no longest-first deal, "
                        "bkv64: 64-key steps, stN: N ring stages); the "
                        "fp8 variants take the same tokens beside their names (e.g. qk8t+ids+bkv64+st6)")
    p.add_argument("--mosaic-only", action="store_true",
                   help="decode: only the Mosaic kernels (no Triton or JAX peers, no Triton fp8)")
    p.add_argument("--balance-ab", action="store_true",
                   help="decode: also the Mosaic bf16 kernel without the longest-first deal (balance=False)")
    p.add_argument("--shapes", default=None,
                   help="decode: comma-separated BATCHxCTX shapes instead of the grid (e.g. 64x1024,256x4096)")
    p.add_argument("--prefill-fp8", action="store_true",
                   help="prefill: also an fp8 e4m3 cache (scales 1): the Triton kernel and the Mosaic kernel (its fp8 "
                        "path), each TF/s, the Mosaic result checked against Triton's on the same fp8 cache")
    p.add_argument("--prefill-fp8-routes", default=",".join(MOSAIC_PREFILL_FP8_QUICK),
                   help="prefill --prefill-fp8: the Mosaic fp8 routes to time, comma-separated names of "
                        f"MOSAIC_PREFILL_FP8 ({', '.join(MOSAIC_PREFILL_FP8)}; default: the quick set)")
    p.add_argument("--prefill-variants", default=None,
                   help="prefill: the Mosaic bf16 variants to time, comma-separated names of MOSAIC_PREFILL_VARIANTS "
                        "(default: MOSAIC_PREFILL_QUICK with --quick, all without; 'mosaic' is the fp8 ratios' base)")
    p.add_argument("--no-mosaic", action="store_true",
                   help="leave out the Mosaic GPU kernels (pallas_kernels.paged_attention_mgpu, "
                        "paged_prefill_attention_mgpu)")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_attention needs a GPU", file=sys.stderr)
        return 2
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    time_calls, how = _timer()
    rng = np.random.default_rng(0)
    scale = HEAD_SIZE ** -0.5
    # copy ceiling: read + write of a 2 GiB buffer
    x = jax.random.normal(jax.random.key(0), (2**30,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + 1)
    t = statistics.median(time_calls(copy, [(x,)], 10))
    copy_gbs = 2 * x.nbytes / t / 1e9
    del x
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  timing: {how}")
    print(f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s")

    if args.mode == "write":
        return bench_write(time_calls, copy_gbs)
    if args.mode == "prefill":
        unknown = [r for r in args.prefill_fp8_routes.split(",") if r not in MOSAIC_PREFILL_FP8]
        unknown += [v for v in (args.prefill_variants or "").split(",") if v and v not in MOSAIC_PREFILL_VARIANTS]
        if unknown:
            p.error(f"unknown prefill route / variant: {', '.join(unknown)}")
        return bench_prefill(time_calls, args.iters, sweep=not args.quick, mosaic=not args.no_mosaic,
                             breakdown=args.breakdown, fp8=args.prefill_fp8,
                             fp8_routes=args.prefill_fp8_routes.split(","),
                             variant_names=args.prefill_variants.split(",") if args.prefill_variants else None)

    ours = {} if args.mosaic_only else {"ours auto": dict(), "ours v1 (s=1)": dict(num_splits=1)}
    if not args.quick and not args.mosaic_only:  # around the tuned rule: half / double its split count, 8 pages per step, 3 stages
        ours.update({"ours s/2": dict(splits_factor=0.5), "ours s*2": dict(splits_factor=2),
                     "ours p8": dict(pages_per_compute_block=8), "ours st3": dict(num_stages=3)})
    # "mosaic 2/SM": 64-key steps and twice as many persistent CTAs as SMs (two share an SM, each with
    # half its shared memory: one CTA's softmax and conversions overlap the other's waits);
    # "mosaic p-smem": P through shared memory (the interpreter's path, the compiled default before
    # session 12); "mosaic per-item": one CTA per (sequence, KV head, split) item, not persistent
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    mosaic = {} if args.no_mosaic else {"mosaic auto": dict(), "mosaic bkv64": dict(block_kv=64)}
    if mosaic and args.mosaic_only:
        mosaic.pop("mosaic bkv64")
    if mosaic and args.balance_ab:
        mosaic["mosaic nobal"] = dict(balance=False)
    if mosaic:
        mosaic.update({f"mosaic {v}": _variant_kwargs(v) for v in args.bf16_variants.split(",") if v})
    if mosaic and not args.quick:
        mosaic.update({"mosaic p-smem": dict(pv_from_smem=True), "mosaic 2/SM": dict(block_kv=64, num_programs=2 * sms),
                       "mosaic s=1": dict(num_splits=1), "mosaic per-item": dict(persistent=False),
                       "mosaic s*2": dict(splits_factor=2)})
    # fp8 e4m3 cache (scales 1) on the Mosaic kernel, bandwidth in fp8 bytes. "conv": the fp8 pages
    # converted to 16 bits by the compute warpgroup (producer_converts=False), "prod": by a converter warpgroup
    fp8_all = {"auto": dict(), "conv": dict(producer_converts=False), "prod": dict(producer_converts=True),
               "prod64": dict(producer_converts=True, block_kv=64),
               "conv64": dict(producer_converts=False, block_kv=64),
               "st4": dict(num_stages=4), "ahead": dict(producer_converts=False, convert_ahead=True),
               "inorder": dict(producer_converts=False, convert_ahead=False),
               "convert": dict(fp8_route="convert"), "qk8": dict(fp8_route="qk8"), "qk8t": dict(fp8_route="qk8t"),
               "nobal": dict(balance=False)}
    mosaic_fp8 = {} if args.no_mosaic else {f"mosaic {k} fp8 (fp8 bytes)": fp8_all.get(k) or _variant_kwargs(k, fp8_all)
                                            for k in args.fp8_variants.split(",") if k}
    peers = {} if args.mosaic_only else {"jax default": dict()}
    if not args.quick and not args.mosaic_only:
        peers.update({f"jax k={k} p={pp}": dict(k_splits=k, pages_per_compute_block=pp)
                      for k in (1, 4, 16) for pp in (4, 16)})

    rows = []
    grid = GRID if not args.shapes else [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
    for batch, ctx in grid:
        kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2
        num_sets = max(2, min(4, -(-3 * L2_BYTES // kv_bytes)))
        inputs = _make_inputs(rng, batch, ctx, num_sets)
        ref = paged_attention_reference(*(a.astype(jnp.float32) if a.dtype == DTYPE else a
                                          for a in inputs[0]), scale=scale) if batch * ctx <= 2**18 else None
        results = {}
        variants = []
        # Every op jitted, as a model step calls it: an eager call adds the public op's host-side metadata
        # check and a host-to-device copy of each Python-number argument (the fp8 scales), not kernel time.
        for n, kw in ours.items():
            kw = dict(kw)
            if "splits_factor" in kw:
                auto = decode_num_splits(batch, NUM_KV_HEADS, ctx // BLOCK_SIZE)
                kw["num_splits"] = max(1, int(kw.pop("splits_factor") * auto))
            variants.append((n, jax.jit(functools.partial(paged_attention, scale=scale, **kw)), inputs))
        for n, kw in mosaic.items():
            kw = dict(kw)
            if "splits_factor" in kw:
                auto = decode_num_splits(batch, NUM_KV_HEADS, ctx // BLOCK_SIZE, 128 // BLOCK_SIZE)
                kw["num_splits"] = max(1, int(kw.pop("splits_factor") * auto))
            variants.append((n, jax.jit(functools.partial(paged_attention_mgpu, scale=scale, **kw)), inputs))
        jax_inputs = [_to_jax_layout(*s) for s in inputs]
        # JAX's kernel applies no softmax scale: the caller scales q (one tiny fused op, timed too)
        variants += [(n, jax.jit(lambda q, *rest, kw=kw: jax_pa.paged_attention(q * scale, *rest, **kw)),
                      jax_inputs) for n, kw in peers.items()]
        for name, fn, ins in variants:
            try:
                out = fn(*ins[0])
            except Exception as e:  # a peer's parameter combination may not apply to this shape
                results[name] = None
                print(f"  {batch=} {ctx=} {name}: skipped ({type(e).__name__}: {str(e)[:80]})")
                continue
            if ref is not None:
                err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
                if not err < 2e-2:
                    if name.startswith("mosaic"):  # the new kernel: report, keep the other numbers
                        print(f"  {batch=} {ctx=} {name}: WRONG, rel err {err:.2e} > 2e-2")
                        results[name] = None
                        continue
                    raise SystemExit(f"{name} {batch=} {ctx=}: rel err {err:.2e} > 2e-2")
            t = statistics.median(time_calls(fn, ins, args.iters))
            results[name] = kv_bytes / t / 1e9
        # fp8 (e4m3) cache, scales 1: bandwidth counted in fp8 bytes (half of bf16's)
        fp8_inputs = [(q, kv.astype(jnp.float8_e4m3fn), t, l) for q, kv, t, l in inputs]
        fp8_fn = jax.jit(functools.partial(paged_attention, scale=scale, k_scale=1.0, v_scale=1.0))
        if ref is not None:
            q, kv8, t, l = fp8_inputs[0]
            ref8 = paged_attention_reference(q.astype(jnp.float32), kv8.astype(jnp.float32), t, l, scale=scale)
            if not args.mosaic_only:
                err = float(jnp.abs(fp8_fn(*fp8_inputs[0]).astype(jnp.float32) - ref8).max() / jnp.abs(ref8).max())
                if not err < 2e-2:
                    raise SystemExit(f"ours fp8 {batch=} {ctx=}: rel err {err:.2e} > 2e-2")
        if not args.mosaic_only:
            t8 = statistics.median(time_calls(fp8_fn, fp8_inputs, args.iters))
            results["ours fp8 (fp8 bytes)"] = kv_bytes / 2 / t8 / 1e9
        m8_fns = {}
        for name, kw in mosaic_fp8.items():
            results[name] = None
            fn8 = m8_fns[name] = jax.jit(functools.partial(paged_attention_mgpu, scale=scale, k_scale=1.0,
                                                           v_scale=1.0, **kw))
            try:
                out8 = fn8(*fp8_inputs[0]).astype(jnp.float32)
                err = 0.0 if ref is None else float(jnp.abs(out8 - ref8).max() / jnp.abs(ref8).max())
                # fp8_route="qk8" rounds the query to e4m3: tests/pallas_kernels/fuzz.py FP8_Q_TOLERANCE
                if err < (1e-1 if kw.get("fp8_route") == "qk8" else 2e-2):
                    t8 = statistics.median(time_calls(fn8, fp8_inputs, args.iters))
                    results[name] = kv_bytes / 2 / t8 / 1e9
                else:
                    print(f"  {batch=} {ctx=} {name}: WRONG, rel err {err:.2e} > 2e-2")
            except Exception as e:
                print(f"  {batch=} {ctx=} {name}: failed ({type(e).__name__}: {str(e)[:200]})")
        if args.breakdown:
            for name, fn, ins in variants:
                if name in ("ours auto", "mosaic auto", "jax default") and results.get(name):
                    print_breakdown(name, fn, ins[0])
            for name, fn8 in m8_fns.items():
                if results.get(name):
                    print_breakdown(name.removesuffix(" (fp8 bytes)"), fn8, fp8_inputs[0])
        rows.append((batch, ctx, results))
        best_ours = max((v for k, v in results.items() if k.startswith("ours") and "fp8" not in k and v),
                        default=0)
        best_jax = max((v for k, v in results.items() if k.startswith("jax") and v), default=0)
        if args.mosaic_only:
            print(f"batch {batch:>3} ctx {ctx:>5}: (% of copy bandwidth)", flush=True)
        else:
            print(f"batch {batch:>3} ctx {ctx:>5}: fp8 {100 * results['ours fp8 (fp8 bytes)'] / copy_gbs:5.1f}% | ours auto {100 * results['ours auto'] / copy_gbs:5.1f}% "
                  f"best {100 * best_ours / copy_gbs:5.1f}% | jax default {100 * (results['jax default'] or 0) / copy_gbs:5.1f}% "
                  f"best {100 * best_jax / copy_gbs:5.1f}%  (% of copy bandwidth)", flush=True)
        if mosaic:
            pct = {k: f"{100 * v / copy_gbs:5.1f}%" if v else "  -  " for k, v in results.items()
                   if k.startswith("mosaic")}
            print("                    mosaic: " + " | ".join(f"{k} {v}" for k, v in pct.items()), flush=True)
            # fp8 speed-up = mosaic auto's bf16 time / the fp8 variant's time (= 2 x fp8-byte GB/s / bf16 GB/s)
            ups = {k.removesuffix(" (fp8 bytes)"): 2 * results[k] / results["mosaic auto"] for k in mosaic_fp8
                   if results.get("mosaic auto") and results.get(k)}
            if ups:
                print("                    fp8 speed-up vs mosaic auto bf16 (bf16 time / fp8 time): "
                      + " | ".join(f"{k} {v:.2f}x" for k, v in ups.items()), flush=True)
            if results.get("mosaic nobal"):   # the same against the bf16 kernel without the longest-first deal
                ups = {k.removesuffix(" (fp8 bytes)"): 2 * results[k] / results["mosaic nobal"] for k in mosaic_fp8
                       if results.get(k)}
                print("                    fp8 speed-up vs mosaic nobal bf16: "
                      + " | ".join(f"{k} {v:.2f}x" for k, v in ups.items()), flush=True)

        if args.json:  # after every shape: a run cut short still leaves its finished rows
            with open(args.json, "w") as f:
                json.dump({"copy_gbs": copy_gbs, "device": jax.devices()[0].device_kind,
                           "rows": [{"batch": b, "ctx": c, "gbs": r} for b, c, r in rows]}, f, indent=1)

    names = list(ours) + ([] if args.mosaic_only else ["ours fp8 (fp8 bytes)"]) + list(mosaic) + list(mosaic_fp8) \
        + list(peers)
    print("\nGB/s per kernel variant (rows: batch, ctx)")
    for name in names:
        print(f"{name:>22} " + " ".join(f"{res[name]:>6.0f}" if res.get(name) else f"{'-':>6}"
                                       for _, _, res in rows))
    return 0


def bench_write(time_calls, copy_gbs) -> int:
    """The write path (XLA scatter, cache donated): time per call must not grow with num_blocks."""
    from jaxkv.kv_cache.write import write_to_paged_cache
    print("write_to_paged_cache (XLA scatter under donation), SmolLM2-like layer: 3 KV heads, D 64, bf16")
    print(f"{'tokens':>6} {'num_blocks':>10} {'cache MB':>9} {'us/call':>8} {'written GB/s':>12}")
    step = jax.jit(write_to_paged_cache, donate_argnums=0)
    for num_tokens in (64, 4096):
        for num_blocks in (4096, 16384, 65536):
            kv = jnp.zeros((2, num_blocks, 3, BLOCK_SIZE, 64), jnp.bfloat16)
            key = jax.random.normal(jax.random.key(1), (num_tokens, 3, 64), jnp.bfloat16)
            slots = jnp.asarray(np.random.default_rng(0).permutation(num_blocks * BLOCK_SIZE)[:num_tokens]
                                .astype(np.int32))
            state = {"kv": kv}

            def call(k, v, s):
                state["kv"] = step(state["kv"], k, v, s)
                return state["kv"]
            t = statistics.median(time_calls(call, [(key, key, slots)], 20))
            written = 2 * num_tokens * 3 * 64 * 2
            print(f"{num_tokens:>6} {num_blocks:>10} {kv.nbytes / 1e6:>9.0f} {t * 1e6:>8.1f} "
                  f"{written / t / 1e9:>12.1f}", flush=True)
            del kv
            state.clear()
    return 0


# (block_q, pages_per_compute_block, num_warps, num_stages); 32 q tokens x 4 heads = 128 dot rows,
# 4 or 8 pages of 16 = 64 or 128 keys per step.
PREFILL_SWEEP = [dict(block_q=bq, pages_per_compute_block=pp, num_warps=w, num_stages=st)
                 for bq, pp, w, st in ((32, 4, 8, 3), (32, 8, 8, 2), (32, 8, 8, 4), (32, 4, 4, 3),
                                       (16, 8, 4, 3), (64, 4, 8, 3), (64, 8, 8, 3))]


# "block_size" is not a kernel argument: that variant runs on its own copy of the cache in pages of 64
# tokens (one TMA copy per 64 keys instead of four; the page size is each backend's to choose).
MOSAIC_PREFILL_VARIANTS = {"mosaic": dict(), "mosaic p64": dict(block_size=64),
                           "mosaic per-item": dict(persistent=False),
                           "mosaic p64 per-item": dict(block_size=64, persistent=False),
                           "mosaic nopp": dict(pingpong=False), "mosaic c1": dict(num_consumers=1),
                           "mosaic bkv64": dict(block_kv=64)}
MOSAIC_PREFILL_QUICK = ("mosaic", "mosaic p64", "mosaic per-item", "mosaic p64 per-item")


def _mosaic_prefill_try(name, fn, args, want_fn, iters, time_calls, flops, max_diff=5e-2):
    """TF/s of a Mosaic prefill variant, or None (printed why) when it fails or is wrong (``want_fn``'s max abs
    diff not below ``max_diff``): the new kernel must not stop the run."""
    try:
        out = fn(*args)
        err = float(want_fn(out))
    except Exception as e:  # a compile / launch failure of the new kernel
        print(f"      {name}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
        return None
    if not err < max_diff:
        print(f"      {name}: WRONG, max abs diff {err:.2e}", flush=True)
        return None
    return flops / statistics.median(time_calls(fn, [args], iters)) / 1e12


def _pages(rng, k, v, block_size):
    """Dense ``[batch, length, kv_heads, D]`` K/V scattered into shuffled pages of ``block_size`` tokens:
    ``(kv_cache, block_tables)``."""
    batch, length = k.shape[:2]
    pages = length // block_size
    tables = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32)
    # scatter the dense K/V into pages: token t of sequence b → block tables[b, t // block_size]
    kv = jnp.zeros((2, batch * pages, NUM_KV_HEADS, block_size, HEAD_SIZE), DTYPE)
    dense = jnp.stack([k, v]).reshape(2, batch, pages, block_size, NUM_KV_HEADS, HEAD_SIZE)
    kv = kv.at[:, tables.reshape(-1)].set(
        dense.transpose(0, 1, 2, 4, 3, 5).reshape(2, batch * pages, NUM_KV_HEADS, block_size, HEAD_SIZE))
    return kv, jnp.asarray(tables)


def _paged_dense(rng, batch, length, key):
    """Dense [batch, length, heads, D] q/k/v and the same K/V in shuffled pages of ``BLOCK_SIZE`` tokens."""
    q = jax.random.normal(key, (batch, length, NUM_HEADS, HEAD_SIZE), DTYPE)
    k = jax.random.normal(jax.random.fold_in(key, 1), (batch, length, NUM_KV_HEADS, HEAD_SIZE), DTYPE)
    v = jax.random.normal(jax.random.fold_in(key, 2), (batch, length, NUM_KV_HEADS, HEAD_SIZE), DTYPE)
    return (q, k, v, *_pages(rng, k, v, BLOCK_SIZE))


# fp8 prefill on the Mosaic kernel: "default" (the kernel's defaults), and its routes (``fp8_route``), who converts V
# (``v_converter``) and step sizes pinned, so a name means what it meant when a doc quoted it (sessions 28-29: the
# routes' names with the consumers converting V and 64-key steps; "-vmem": the memory warpgroup converting it)
_CONSUMERS64, _MEMORY64 = dict(v_converter="consumers", block_kv=64), dict(v_converter="memory", block_kv=64)
MOSAIC_PREFILL_FP8 = {"default": dict(),
                      "convert": dict(fp8_route="convert", **_CONSUMERS64),
                      "qk8": dict(fp8_route="qk8", **_CONSUMERS64),
                      "qk8lo": dict(fp8_route="qk8lo", **_CONSUMERS64),
                      "qk8lo-bkv128": dict(fp8_route="qk8lo", v_converter="consumers", block_kv=128),
                      "qk8-bkv128": dict(fp8_route="qk8", v_converter="consumers", block_kv=128),
                      "qk8lo-vmem": dict(fp8_route="qk8lo", **_MEMORY64),
                      "qk8lo-vmem-r48": dict(fp8_route="qk8lo", memory_registers=48, **_MEMORY64),
                      "qk8lo-vmem-r72": dict(fp8_route="qk8lo", memory_registers=72, **_MEMORY64),
                      "qk8-vmem": dict(fp8_route="qk8", **_MEMORY64),
                      "convert-vmem": dict(fp8_route="convert", **_MEMORY64),
                      "qk8lo-vmem-bkv128": dict(fp8_route="qk8lo", v_converter="memory", block_kv=128)}
MOSAIC_PREFILL_FP8_QUICK = ("default", "qk8lo", "qk8", "convert")  # --prefill-fp8-routes' default
# "qk8"'s max abs diff against the Triton kernel on the same fp8 cache (it rounds the query to e4m3: FA3's accuracy;
# the routes that keep q's precision are held to _mosaic_prefill_try's 5e-2)
FP8_Q_DIFF = 1.5e-1


def _fp8_prefill_line(args, kw, iters, time_calls, flops, bf16_tfs, mosaic_bf16_tfs=None, routes=None) -> str:
    """An fp8 cache (the same K/V in e4m3, scales 1): Triton's and the Mosaic kernel's TF/s (each route of
    ``MOSAIC_PREFILL_FP8``), the Mosaic outputs checked against Triton's on that cache; ``bf16_tfs``: the Triton
    kernel's bf16 TF/s, ``mosaic_bf16_tfs``: the Mosaic kernel's (default variant) bf16 TF/s, for the ratios;
    ``routes``: names of ``MOSAIC_PREFILL_FP8`` (``None``: all)."""
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention
    from pallas_kernels.paged_prefill_attention_mgpu import paged_prefill_attention_mgpu
    q, kv, *meta = args
    args8 = (q, kv.astype(jnp.float8_e4m3fn), *meta)
    kw = dict(kw, k_scale=1.0, v_scale=1.0)
    triton = jax.jit(functools.partial(paged_prefill_attention, **kw))
    want = triton(*args8).astype(jnp.float32)
    t_tfs = flops / statistics.median(time_calls(triton, [args8], iters)) / 1e12
    line = f"      fp8 cache: Triton {t_tfs:.1f} TF/s ({t_tfs / bf16_tfs:.2f}x its bf16)"
    for name, rkw in MOSAIC_PREFILL_FP8.items():
        if routes is not None and name not in routes:
            continue
        mosaic = jax.jit(functools.partial(paged_prefill_attention_mgpu, **kw, **rkw))
        diff = lambda out: jnp.abs(out.astype(jnp.float32) - want).max()
        m_tfs = _mosaic_prefill_try(f"mosaic fp8 {name}", mosaic, args8, diff, iters, time_calls, flops,
                                    max_diff=FP8_Q_DIFF if rkw.get("fp8_route") == "qk8" else 5e-2)
        if m_tfs:
            vs = f", {m_tfs / mosaic_bf16_tfs:.2f}x Mosaic bf16" if mosaic_bf16_tfs else ""
            line += f"\n        Mosaic {name}: {m_tfs:.1f} TF/s ({m_tfs / t_tfs:.2f}x Triton fp8{vs})"
    return line


def bench_prefill(time_calls, iters, sweep=False, mosaic=True, breakdown=False, fp8=False, fp8_routes=None,
                  variant_names=None) -> int:
    """Paged prefill kernels (Triton; Mosaic GPU) vs cuDNN dense causal attention on the same Q/K/V
    (TFLOP/s, causal FLOPs), then chunked prefill (a 512-token chunk over a cached context). ``fp8``: each row
    also with an fp8 cache (``fp8_routes``: the Mosaic routes, names of ``MOSAIC_PREFILL_FP8``);
    ``variant_names``: the Mosaic bf16 variants (``None``: quick or all, by ``sweep``)."""
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention
    from pallas_kernels.paged_prefill_attention_mgpu import paged_prefill_attention_mgpu
    names = variant_names or (list(MOSAIC_PREFILL_VARIANTS) if sweep else MOSAIC_PREFILL_QUICK)
    variants = {} if not mosaic else {n: MOSAIC_PREFILL_VARIANTS[n] for n in names}
    print("paged prefill (context 0, whole prompts) vs jax.nn.dot_product_attention(implementation='cudnn'),")
    print(f"{NUM_HEADS}q/{NUM_KV_HEADS}kv heads, D {HEAD_SIZE}, bf16, block {BLOCK_SIZE}; "
          "FLOPs = 4 * D * heads * L(L+1)/2 per sequence (unmasked pairs only)")
    print(f"{'batch':>5} {'len':>5} {'ours TF/s':>10} {'cudnn TF/s':>11} {'ratio':>6}"
          + "".join(f" {n + ' TF/s':>16} {'ratio':>6}" for n in variants))
    scale = HEAD_SIZE ** -0.5
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        for length in (512, 2048, 8192):
            key = jax.random.key(batch * 100000 + length)
            q, k, v, kv, tables = _paged_dense(rng, batch, length, key)
            qs = q.reshape(batch * length, NUM_HEADS, HEAD_SIZE)
            qsl = jnp.arange(batch + 1, dtype=jnp.int32) * length
            lens = jnp.full((batch,), length, jnp.int32)
            args = (qs, kv, tables, lens, qsl)
            # jitted: the public op checks concrete metadata on the host, which a timing must not include
            ours = jax.jit(functools.partial(paged_prefill_attention, scale=scale, max_query_len=length))
            cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, scale=scale,
                                              implementation="cudnn"))
            want = cudnn(q, k, v)

            def diff(out):
                out = out.reshape(batch, length, NUM_HEADS, HEAD_SIZE).astype(jnp.float32)
                return jnp.abs(out - want.astype(jnp.float32)).max()
            err = float(diff(ours(*args)))
            if not err < 5e-2:
                raise SystemExit(f"prefill {batch=} {length=}: max abs diff vs cudnn {err:.2e}")
            flops = 4 * HEAD_SIZE * NUM_HEADS * batch * length * (length + 1) / 2
            t_ours = statistics.median(time_calls(ours, [args], iters))
            t_cudnn = statistics.median(time_calls(cudnn, [(q, k, v)], iters))
            cudnn_tfs = flops / t_cudnn / 1e12
            row = f"{batch:>5} {length:>5} {flops / t_ours / 1e12:>10.1f} {cudnn_tfs:>11.1f} {t_cudnn / t_ours:>6.2f}"
            breakdowns = []
            mosaic_bf16 = None
            for name, kw in variants.items():
                kw, vargs = dict(kw), args
                if "block_size" in kw:  # the same K/V in larger pages
                    vargs = (qs, *_pages(rng, k, v, kw.pop("block_size")), lens, qsl)
                fn = jax.jit(functools.partial(paged_prefill_attention_mgpu, scale=scale, max_query_len=length,
                                               **kw))
                tfs = _mosaic_prefill_try(name, fn, vargs, diff, iters, time_calls, flops)
                row += f" {tfs:>16.1f} {tfs / cudnn_tfs:>6.2f}" if tfs else f" {'-':>16} {'-':>6}"
                if name == "mosaic":
                    mosaic_bf16 = tfs
                if breakdown and tfs:
                    breakdowns.append((name, fn, vargs))
            print(row, flush=True)
            if fp8:
                print(_fp8_prefill_line(args, dict(scale=scale, max_query_len=length), iters, time_calls, flops,
                                        flops / t_ours / 1e12, mosaic_bf16,
                                        fp8_routes), flush=True)
            if breakdown:
                print_breakdown("cudnn", cudnn, (q, k, v))
                print_breakdown("ours (Triton)", ours, args)
                for bd in breakdowns:
                    print_breakdown(*bd)
            if sweep and (batch, length) in ((1, 8192), (8, 2048)):
                for kw in PREFILL_SWEEP:
                    fn = jax.jit(functools.partial(paged_prefill_attention, scale=scale, max_query_len=length,
                                                   **kw))
                    try:
                        t = statistics.median(time_calls(fn, [args], iters))
                    except Exception as e:  # e.g. a tile set over the shared-memory limit
                        print(f"      sweep {kw}: skipped ({type(e).__name__})")
                        continue
                    print(f"      sweep {kw}: {flops / t / 1e12:6.1f} TF/s", flush=True)

    # Chunked prefill: batch 1, a chunk of 512 new tokens over a cached context; checked against the
    # float32 reference op, FLOPs = 4 * D * heads * (512 * ctx + 512 * 513 / 2).
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention_reference
    chunk = 512
    print(f"\nchunked prefill: batch 1, {chunk} new tokens over a cached context (TF/s)")
    print(f"{'ctx':>6} {'ours TF/s':>10}" + "".join(f" {n + ' TF/s':>16} {'vs ours':>7}" for n in variants))
    for ctx in (4096, 16384):
        total = ctx + chunk
        q, k, v, kv, tables = _paged_dense(rng, 1, total, jax.random.key(ctx))
        qs = q[0, ctx:]
        args = (qs, kv, tables, jnp.asarray([total], jnp.int32), jnp.asarray([0, chunk], jnp.int32))
        kw = dict(scale=scale, max_query_len=chunk)
        want = paged_prefill_attention_reference(qs.astype(jnp.float32), kv.astype(jnp.float32), *args[2:], **kw)

        def diff(out):
            return jnp.abs(out.astype(jnp.float32) - want).max()
        ours = jax.jit(functools.partial(paged_prefill_attention, **kw))
        err = float(diff(ours(*args)))
        if not err < 5e-2:
            raise SystemExit(f"chunked prefill {ctx=}: max abs diff vs reference {err:.2e}")
        flops = 4 * HEAD_SIZE * NUM_HEADS * (chunk * ctx + chunk * (chunk + 1) / 2)
        ours_tfs = flops / statistics.median(time_calls(ours, [args], iters)) / 1e12
        row = f"{ctx:>6} {ours_tfs:>10.1f}"
        mosaic_bf16 = None
        for name, vkw in variants.items():
            vkw, vargs = dict(vkw), args
            if "block_size" in vkw:  # the same K/V in larger pages
                vargs = (qs, *_pages(rng, k, v, vkw.pop("block_size")), *args[3:])
            fn = jax.jit(functools.partial(paged_prefill_attention_mgpu, **kw, **vkw))
            tfs = _mosaic_prefill_try(name, fn, vargs, diff, iters, time_calls, flops)
            row += f" {tfs:>16.1f} {tfs / ours_tfs:>7.2f}" if tfs else f" {'-':>16} {'-':>7}"
            if name == "mosaic":
                mosaic_bf16 = tfs
        print(row, flush=True)
        if fp8:
            print(_fp8_prefill_line(args, kw, iters, time_calls, flops, ours_tfs, mosaic_bf16, fp8_routes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
