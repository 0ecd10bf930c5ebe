"""fp8 weights on the GPU (issue 45 item 2): does XLA run :func:`models.quantization.fp8_linear` as cuBLASLt's fp8
GEMM, how accurate is it there, and what does a Llama-3.1-8B layer stack's GEMMs cost in fp8 against bf16.

    python scripts/dev/bench_fp8_gemm.py [--hlo-dir DIR] [--rows 1,16,64,256,1024,4096,8192] [--layers 8]
        [--variants bf16,fp8] [--kernel-rows 16,1024] [--skip-timing]

1. **HLO**: the optimized HLO of one fp8 Linear at 8B shapes (gate_proj, ``x: bf16[M, 4096]``, ``w: f8e4m3[14336,
   4096]``, per-channel scales, per-token activation quantization) for M = 1, 256 and 8192, written to ``--hlo-dir``;
   per M it prints the custom-call targets (``__cublas$lt$matmul$f8`` is the fp8 GEMM; ``__cublas$gemm`` /
   ``__cublas$lt$matmul`` with a wide convert of the weight would be an upcast), transposes of the weight, and
   converts of the f8 weight to a wide type. Then the same count over a 2-layer 8B-shaped fp8 model's dense forward
   (7 fp8 Linears a layer: 4 to 7 fp8 GEMMs, XLA's dot merger joining q/k/v and gate/up).
2. **Accuracy on the device**: the fp8 Linear against the dequantize-then-f32-matmul reference
   (``fp8_linear_reference``, ``Precision.HIGHEST``) at M = 256: max and mean relative error (the fp8 GEMM's own
   accumulation; XLA's default precision may use Hopper's fast fp8 accumulation, as vLLM's CUTLASS kernels do);
   also ``Precision.HIGHEST`` on the fp8 dot, and the quantization error against the bf16 GEMM of the float weights.
3. **Timing** (unless ``--skip-timing``): ``--layers`` layers of the 8B projections with their own weights
   (q/k/v/o, gate/up/down; ``x + o(q + k + v) + down(silu(gate) * up)`` so that XLA keeps every projection, as
   ``bench_fused_gemm.py`` does) at each row count, bf16 (``x @ W``, what ``nnx.Linear`` runs) against fp8 (the
   model's ``fp8_linear``: per-token quantization of x + fp8 GEMM + scales; ``fp8-bf16out``: the same with the GEMM
   writing bf16 instead of f32, a candidate for the model): milliseconds per stack (best of 3 rounds
   of ``--repeats`` calls), weight-read bound, and for ``--kernel-rows`` the CUPTI kernel table through
   ``torch.profiler`` (skipped when torch is missing), which splits the fp8 GEMMs from the quantization kernels.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_fused_gemm import print_kernels  # this folder: on sys.path when run as a script

from models.quantization import FP8_DTYPE, fp8_linear, fp8_linear_reference, quantize_weight

HIDDEN, Q, KV, FFN = 4096, 4096, 1024, 14336
SHAPES = dict(q=(Q, HIDDEN), k=(KV, HIDDEN), v=(KV, HIDDEN), o=(HIDDEN, Q), gate=(FFN, HIDDEN), up=(FFN, HIDDEN),
              down=(HIDDEN, FFN))  # [out, in]
FP8_GEMM = "__cublas$lt$matmul$f8"


def hlo_summary(text: str) -> dict:
    """Custom-call targets, weight transposes and f8 -> wide converts of an optimized HLO module's text."""
    targets = re.findall(r'custom_call_target="([^"]+)"', text)
    types = dict(re.findall(r"(%[\w.\-]+) = \(?(\w+)\[", text))  # instruction name -> element type (names are unique)
    converts = [m.group(0)[:160] for m in re.finditer(
        r"(%[\w.\-]+) = (bf16|f16|f32)\[[^\]]*\]\S* convert\((%[\w.\-]+)\)", text)
        if types.get(m.group(3)) == "f8e4m3fn"]
    transposes = [line.strip()[:160] for line in text.splitlines() if "f8e4m3fn" in line and " transpose(" in line]
    return dict(targets=targets, fp8_gemms=targets.count(FP8_GEMM), f8_converts=converts, f8_transposes=transposes)


def check_hlo(hlo_dir: pathlib.Path | None) -> bool:
    ok = True
    key = jax.random.key(0)
    out, inp = SHAPES["gate"]
    w = jax.random.normal(key, (out, inp), jnp.float32) / inp ** 0.5
    wq, ws = quantize_weight(w)
    fn = jax.jit(fp8_linear)
    for rows in (1, 256, 8192):
        x = jax.random.normal(jax.random.fold_in(key, rows), (rows, inp), jnp.bfloat16)
        text = fn.lower(x, wq, ws).compile().as_text()
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            (hlo_dir / f"fp8-linear-gate-m{rows}.txt").write_text(text)
        s = hlo_summary(text)
        good = s["fp8_gemms"] == 1 and not s["f8_converts"]
        ok &= good
        print(f"HLO fp8 Linear gate_proj M={rows}: custom calls {s['targets']}; {FP8_GEMM}: {s['fp8_gemms']}; "
              f"f8->wide converts: {len(s['f8_converts'])}; f8 transposes: {len(s['f8_transposes'])} -> "
              f"{'fp8 GEMM' if good else 'NOT an fp8 GEMM'}")
        for line in s["f8_converts"][:3] + s["f8_transposes"][:3]:
            print(f"    {line}")
    # a 2-layer 8B-shaped model's dense forward
    from flax import nnx

    from models.dummy import dummy_model
    from models.engine_setup import _dense_logits
    from models.hf_config import builtin_config
    from models.quantization import ONLINE_FP8
    config = builtin_config("llama-3.1-8b").replace(num_layers=2)
    model = dummy_model(config, dtype=jnp.bfloat16, quantization=ONLINE_FP8)
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 64), jnp.int32)
    text = _dense_logits.lower(graphdef, state, ids, jnp.ones(ids.shape, bool), 63).compile().as_text()
    if hlo_dir is not None:
        (hlo_dir / "fp8-llama8b-2layers-dense.txt").write_text(text)
    s = hlo_summary(text)
    # 14 Linears; XLA's dot merger joins GEMMs that share their input (q/k/v, gate/up): 8 to 14 GEMMs, all fp8
    ok &= 8 <= s["fp8_gemms"] <= 14 and not s["f8_converts"]
    print(f"HLO 2-layer 8B fp8 model, dense forward of 64 tokens: {FP8_GEMM} x {s['fp8_gemms']} (8 to 14 expected: "
          "14 Linears, q/k/v and gate/up may be merged), "
          f"other custom calls {sorted(set(t for t in s['targets'] if t != FP8_GEMM))}, f8->wide converts "
          f"{len(s['f8_converts'])}, f8 transposes {len(s['f8_transposes'])}")
    del model, state
    return ok


def check_accuracy() -> None:
    key = jax.random.key(1)
    out, inp = SHAPES["gate"]
    w = jax.random.normal(key, (out, inp), jnp.float32) / inp ** 0.5
    wq, ws = quantize_weight(w)
    x = jax.random.normal(jax.random.fold_in(key, 2), (256, inp), jnp.float32).astype(jnp.bfloat16)
    ref = fp8_linear_reference(x, wq, ws, out_dtype=jnp.float32)

    def rel(y):
        d = np.abs(np.asarray(y, np.float64) - np.asarray(ref, np.float64))
        scale = np.abs(np.asarray(ref, np.float64)).max()
        return d.max() / scale, d.mean() / scale

    default = jax.jit(lambda x, w, s: fp8_linear(x, w, s, out_dtype=jnp.float32))(x, wq, ws)

    def highest(x, w, s):
        from models.quantization import quantize_per_token
        xq, sx = quantize_per_token(x)
        y = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)
        return y * sx[:, None] * s
    high = jax.jit(highest)(x, wq, ws)
    bf16 = jnp.matmul(x, w.T.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    for name, y in (("fp8 GEMM, default precision", default), ("fp8 GEMM, Precision.HIGHEST", high),
                    ("bf16 GEMM of the float weights (the quantization error)", bf16)):
        mx, mean = rel(y)
        print(f"accuracy M=256 gate_proj, {name} vs dequantized f32 reference: max {mx:.2e}, mean {mean:.2e} "
              "(of max |y|)")


def make_weights(variant: str, layers: int, shared: bool):
    key = jax.random.key(0)
    out = []

    @jax.jit
    def one(k):
        ws = {}
        for i, (name, (o, n)) in enumerate(SHAPES.items()):
            w = jax.random.normal(jax.random.fold_in(k, i), (o, n), jnp.float32) / n ** 0.5
            ws[name] = quantize_weight(w) if variant.startswith("fp8") else w.T.astype(jnp.bfloat16)  # bf16: [in, out]
        return ws
    for i in range(layers):
        out.append(out[0] if shared and i else one(jax.random.fold_in(key, i)))
    return out


def fp8_linear_bf16_out(x, w, s):
    """The fp8 Linear with the GEMM writing bf16 (scales applied after, in f32): half the output bytes of the f32
    product, one more rounding."""
    from models.quantization import quantize_per_token
    xq, sx = quantize_per_token(x)
    y = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return (y.astype(jnp.float32) * sx[:, None] * s).astype(x.dtype)


def stack(weights, x, variant: str):
    def lin(x, w):
        if variant == "fp8":
            return fp8_linear(x, *w)
        if variant == "fp8-bf16out":
            return fp8_linear_bf16_out(x, *w)
        return x @ w
    for lw in weights:
        q, k, v = lin(x, lw["q"]), lin(x, lw["k"]), lin(x, lw["v"])
        g, u = lin(x, lw["gate"]), lin(x, lw["up"])
        h = lin(q + jnp.tile(k + v, Q // KV), lw["o"])
        x = x + h + lin(jax.nn.silu(g) * u, lw["down"])
    return x


def time_stacks(a) -> None:
    rows = [int(r) for r in a.rows.split(",")]
    variants = [v.strip() for v in a.variants.split(",")]
    per_layer = sum(o * n for o, n in SHAPES.values())
    results = {}
    for variant in variants:
        weights = make_weights(variant, a.layers, a.shared_weights)
        nbytes = a.layers * per_layer * (1 if variant.startswith("fp8") else 2)
        print(f"{variant}: {a.layers} layers, {nbytes / 1e9:.2f} GB of weights, read bound "
              f"{nbytes / a.bandwidth_tb_s / 1e9:.3f} ms at {a.bandwidth_tb_s} TB/s", flush=True)
        fn = jax.jit(lambda w, x: stack(w, x, variant))
        for r in rows:
            x = jax.random.normal(jax.random.key(r), (r, HIDDEN), jnp.float32).astype(jnp.bfloat16) * 0.5
            jax.block_until_ready(fn(weights, x))
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(a.repeats):
                    y = fn(weights, x)
                jax.block_until_ready(y)
                best = min(best, (time.perf_counter() - t0) / a.repeats * 1e3)
            results[(variant, r)] = best
            print(f"  {variant} rows {r:5d}: {best:8.3f} ms per stack, "
                  f"{2 * per_layer * a.layers * r / best / 1e9:8.1f} TFLOP/s", flush=True)
            if r in a.kernel_rows:
                outs = []
                print_kernels(lambda: outs.append(fn(weights, x)), lambda: jax.block_until_ready(outs), 5,
                              a.top_kernels, f"{variant}, {r} rows")
        del weights, fn
    if "bf16" in variants:
        others = [v for v in variants if v != "bf16"]
        print(f"{'rows':>6} {'bf16 ms':>9} " + " ".join(f"{v + ' ms':>15} {'speed-up':>8}" for v in others))
        for r in rows:
            print(f"{r:>6} {results[('bf16', r)]:>9.3f} " + " ".join(
                f"{results[(v, r)]:>15.3f} {results[('bf16', r)] / results[(v, r)]:>8.2f}" for v in others))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hlo-dir", default=None, help="write the optimized HLO texts here")
    p.add_argument("--skip-hlo", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--rows", default="1,16,64,256,1024,4096,8192")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shared-weights", action="store_true", help="every layer uses layer 0's weights")
    p.add_argument("--variants", default="bf16,fp8", help="comma list of bf16, fp8 (the model's fp8_linear: f32 "
                   "GEMM output), fp8-bf16out (the GEMM writes bf16)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bandwidth-tb-s", type=float, default=3.35)
    p.add_argument("--kernel-rows", default="16,1024", help="row counts whose kernels to list (CUPTI through torch)")
    p.add_argument("--top-kernels", type=int, default=10)
    a = p.parse_args()
    a.kernel_rows = {int(r) for r in a.kernel_rows.split(",") if r}
    print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; fp8 dtype {jnp.dtype(FP8_DTYPE)}")
    ok = True
    if not a.skip_hlo:
        ok = check_hlo(pathlib.Path(a.hlo_dir) if a.hlo_dir else None)
        check_accuracy()
    if not a.skip_timing:
        time_stacks(a)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
