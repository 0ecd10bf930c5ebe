"""Session 14 A/B 2 (H100): the new item structure (seq_len carried, early query move) vs session 13's with the
edge-only mask (.scratch/pam_edge.py = 15dbcae + edge mask); bf16 and fp8 at batch >= 64."""
import functools, statistics, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from scripts.bench_attention import _timer, _make_inputs, HEAD_SIZE
from pallas_kernels.paged_attention import paged_attention_reference
import pallas_kernels.paged_attention_mgpu as M
sys.path.insert(0, '.scratch')
import pam_edge as OLD
time_calls, how = _timer()

def run(kw, inputs, ref=None, patch=None, mod=M):
    jax.clear_caches()
    saved = {n: getattr(M, n) for n in (patch or {})}
    for n, v in (patch or {}).items():
        setattr(M, n, v)
    fn = jax.jit(functools.partial(mod.paged_attention_mgpu, scale=HEAD_SIZE ** -0.5, **kw))
    try:
        out = fn(*inputs[0]).block_until_ready()
        if ref is not None:
            err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
            if not err < 2e-2:
                print(f"    {kw} {patch}: WRONG {err}", flush=True); return None
        return statistics.median(time_calls(fn, inputs, 20))
    except Exception as e:
        print(f"    {kw} {patch}: failed {type(e).__name__}: {str(e)[:400]}", flush=True)
    finally:
        for n, v in saved.items():
            setattr(M, n, v)

F8 = dict(k_scale=1.0, v_scale=1.0)
VARIANTS = {
    "bf16": (False, {}, None, M),
    "bf16 s13+edge": (False, {}, None, OLD),
    "fp8": (True, F8, None, M),
    "fp8 s13+edge": (True, F8, None, OLD),
    "fp8 moveq@2": (True, F8, dict(MOVE_Q_STEP=2), M),
}
only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
shapes = [tuple(int(x) for x in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else "64x1024,64x4096,256x1024,256x4096").split(",")]
rng = np.random.default_rng(0)
print("device", jax.devices()[0].device_kind, how, flush=True)
for b, c in shapes:
    inputs = _make_inputs(rng, b, c, 3)
    fp8 = [(q, kv.astype(jnp.float8_e4m3fn), t, l) for q, kv, t, l in inputs]
    ref8 = ref16 = None
    if b * c <= 2 ** 18:
        q, kv8, t, l = fp8[0]
        ref8 = paged_attention_reference(q.astype(jnp.float32), kv8.astype(jnp.float32), t, l, scale=HEAD_SIZE ** -0.5)
        q, kv, t, l = inputs[0]
        ref16 = paged_attention_reference(q.astype(jnp.float32), kv.astype(jnp.float32), t, l, scale=HEAD_SIZE ** -0.5)
    res = {k: run(kw, fp8 if f8 else inputs, ref8 if f8 else ref16, patch, mod)
           for k, (f8, kw, patch, mod) in VARIANTS.items() if k in only}
    bf = res.get("bf16")
    print(f"{b}x{c}: " + " | ".join(f"{k} {v*1e6:.1f}us ({bf/v:.3f}x)" if v and bf else f"{k} -" for k, v in res.items()), flush=True)
