"""Converter warpgroup (producer_converts) vs compute-side conversion (H100 exploration)."""
import functools, statistics, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from scripts.bench_attention import _timer, _make_inputs, HEAD_SIZE
from pallas_kernels.paged_attention import paged_attention_reference
import pallas_kernels.paged_attention_mgpu as M
time_calls, how = _timer()

def run(kw, inputs, ref=None):
    jax.clear_caches()
    fn = jax.jit(functools.partial(M.paged_attention_mgpu, scale=HEAD_SIZE ** -0.5, **kw))
    try:
        out = fn(*inputs[0]).block_until_ready()
        if ref is not None:
            err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
            if not err < 2e-2:
                print(f"    {kw}: WRONG {err}", flush=True); return None
        return statistics.median(time_calls(fn, inputs, 20))
    except Exception as e:
        print(f"    {kw}: failed {type(e).__name__}: {str(e)[:400]}", flush=True)

F8 = dict(k_scale=1.0, v_scale=1.0)
VARIANTS = {
    "bf16": (False, {}),
    "ahead q2": (True, dict(F8)),
    "conv-wg": (True, dict(F8, producer_converts=True)),
    "conv-wg q1": (True, dict(F8, producer_converts=True, num_stages=4)),
    "conv-wg bkv64": (True, dict(F8, producer_converts=True, block_kv=64)),
    "conv-wg st2": (True, dict(F8, producer_converts=True, num_stages=2)),
}
shapes = [tuple(int(x) for x in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else "64x1024,64x4096,256x1024,256x4096").split(",")]
rng = np.random.default_rng(0)
print("device", jax.devices()[0].device_kind, how, flush=True)
for b, c in shapes:
    inputs = _make_inputs(rng, b, c, 3)
    fp8 = [(q, kv.astype(jnp.float8_e4m3fn), t, l) for q, kv, t, l in inputs]
    ref8 = None
    if b * c <= 2 ** 18:
        q, kv8, t, l = fp8[0]
        ref8 = paged_attention_reference(q.astype(jnp.float32), kv8.astype(jnp.float32), t, l, scale=HEAD_SIZE ** -0.5)
    res = {k: run(kw, fp8 if f8 else inputs, ref8 if f8 else None) for k, (f8, kw) in VARIANTS.items()}
    bf = res["bf16"]
    print(f"{b}x{c}: " + " | ".join(f"{k} {v*1e6:.1f}us ({bf/v:.2f}x)" if v else f"{k} -" for k, v in res.items()), flush=True)
