"""Where the Mosaic GPU decode kernel's time goes, per warpgroup (Hopper GPU only).

    python scripts/dev/profile_mgpu_decode.py [--shapes 64x1024,64x4096] [--dtypes bf16,fp8] [--out DIR]

Runs ``paged_attention_mgpu`` on bench_attention's decode shapes with Mosaic GPU's on-device profiler
(``paged_attention_mgpu.PROFILE``): every warpgroup of every CTA records the kernel's named scopes with the
SM clock. Prints, per warpgroup role (compute, memory, converter), the cycles per CTA spent in each scope
and outside them ("other"), and per CTA the cycles from its first event to the first ``qk`` (start-up)
and from the last ``pv`` to its last event (drain). The kernel time without the profiler (CUPTI) comes
first, so the profiler's own cost shows. Cycles are SM clock cycles; the traces (Chrome/Perfetto JSON) are
kept in ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import inspect
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

_SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # scripts/ (bench_attention)
sys.path[:0] = [os.path.dirname(_SCRIPTS), _SCRIPTS]
from bench_attention import HEAD_SIZE, _make_inputs, _timer  # noqa: E402

import pallas_kernels.paged_attention_mgpu as mgpu  # noqa: E402

ROLES = ("compute", "memory", "converter")


def summarize(trace_file: str, warpgroups: int) -> dict:
    """Per role: mean cycles per CTA in each scope; per CTA start-up and drain cycles; CTA start skew (ns)."""
    events = json.load(open(trace_file))["traceEvents"]
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    per_role = collections.defaultdict(lambda: collections.defaultdict(list))
    startup, drain, starts, spans = [], [], [], collections.defaultdict(list)
    for tid, evs in by_tid.items():
        role = ROLES[(tid - 1) % warpgroups]
        t0 = evs[0]["ts"] * 1e3                       # the first event is placed at the kernel's start (ns)
        cyc = [(e["name"], e["ph"], e["ts"] * 1e3 - t0) for e in evs]
        totals, stack = collections.Counter(), []
        for name, ph, t in cyc:
            if ph == "B":
                stack.append((name, t))
            else:
                n, tb = stack.pop()
                if not stack:                          # outermost scopes only
                    totals[n] += t - tb
        span = cyc[-1][2] - cyc[0][2]
        totals["other"] = span - sum(totals.values())
        for n, v in totals.items():
            per_role[role][n].append(v)
        spans[role].append(span)
        if role == "compute":
            starts.append(t0)
            first_qk = next((t for n, ph, t in cyc if n == "qk" and ph == "B"), None)
            last_pv = max((t for n, ph, t in cyc if n == "pv" and ph == "E"), default=None)
            if first_qk is not None:
                startup.append(first_qk)
                drain.append(span - last_pv)
    out = {role: {n: statistics.mean(v) for n, v in sorted(d.items())} for role, d in per_role.items()}
    out["span"] = {role: (statistics.mean(v), max(v)) for role, v in spans.items()}
    out["startup"] = (statistics.mean(startup), max(startup)) if startup else None
    out["drain"] = (statistics.mean(drain), max(drain)) if drain else None
    out["start_skew_ns"] = max(starts) - min(starts) if starts else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x1024,64x4096")
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--out", default="/tmp/mgpu-profile")
    p.add_argument("--space", type=int, default=320, help="profiled ranges per warpgroup (bounds-checked)")
    p.add_argument("--kwargs", default="{}", help="JSON kwargs for paged_attention_mgpu (e.g. ablations)")
    args = p.parse_args(argv)
    time_calls, how = _timer()
    rng = np.random.default_rng(0)
    extra = json.loads(args.kwargs)
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  {how}", flush=True)
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        inputs = _make_inputs(rng, batch, ctx, 3)
        for dt in args.dtypes.split(","):
            fp8 = dt == "fp8"
            ins = [(q, kv.astype(jnp.float8_e4m3fn), t, n) for q, kv, t, n in inputs] if fp8 else inputs
            kw = dict(scale=HEAD_SIZE ** -0.5, **extra, **(dict(k_scale=1.0, v_scale=1.0) if fp8 else {}))
            mgpu.PROFILE.clear()
            jax.clear_caches()
            fn = jax.jit(functools.partial(mgpu.paged_attention_mgpu, **kw))
            plain = statistics.median(time_calls(fn, ins, 20)) * 1e6
            out_dir = os.path.join(args.out, f"{shape}-{dt}")
            os.makedirs(out_dir, exist_ok=True)
            mgpu.PROFILE.update(profile_space=args.space, profile_dir=out_dir)
            if "profile_bounds_check" in {f.name for f in dataclasses.fields(plgpu.CompilerParams)}:
                mgpu.PROFILE["profile_bounds_check"] = True
            jax.clear_caches()
            fn = jax.jit(functools.partial(mgpu.paged_attention_mgpu, **kw))
            for _ in range(3):
                jax.block_until_ready(fn(*ins[0]))
            jax.effects_barrier()
            once = {"reps": 1} if "reps" in inspect.signature(time_calls).parameters else {}   # CUPTI timer
            profiled = statistics.median(time_calls(fn, ins, 5, **once)) * 1e6
            trace = sorted(glob.glob(os.path.join(out_dir, "*-trace.json")))[-1]
            converter = extra.get("producer_converts")   # resolved as the kernel resolves it (a third warpgroup)
            if converter is None:
                converter = mgpu.tuning.MGPU_DECODE_PRODUCER_CONVERTS
            warpgroups = 3 if fp8 and converter and extra.get("persistent", True) else 2
            s = summarize(trace, warpgroups)
            print(f"\n{shape} {dt}: {plain:.1f} us without the profiler, {profiled:.1f} us with it; trace {trace}")
            for role in ROLES[:warpgroups]:
                if role in s:
                    cols = " ".join(f"{n} {v:.0f}" for n, v in sorted(s[role].items(), key=lambda x: -x[1]))
                    print(f"  {role:9s} span {s['span'][role][0]:.0f} (max {s['span'][role][1]:.0f}) cycles: {cols}")
            if s["startup"]:
                print(f"  compute start-up to first qk: mean {s['startup'][0]:.0f} max {s['startup'][1]:.0f} cycles;"
                      f" last pv to end: mean {s['drain'][0]:.0f} max {s['drain'][1]:.0f}; CTA start skew"
                      f" {s['start_skew_ns']:.0f} ns", flush=True)
    mgpu.PROFILE.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
