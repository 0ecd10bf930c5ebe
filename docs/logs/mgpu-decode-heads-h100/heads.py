"""Session 14: Mosaic vs Triton decode at the shipped models' head shapes (H100), bf16.
SmolLM2-135M: 9 q / 3 kv heads, head 64; Gemma 3 270M: 4 q / 1 kv head, head 256 (global and sliding layers)."""
import functools, statistics, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from scripts.bench_attention import _timer
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu
time_calls, how = _timer()
BS = 16

def inputs(rng, b, c, h, kv, d, n=3):
    pages = c // BS
    nb = b * pages
    out = []
    for _ in range(n):
        key = jax.random.key(int(rng.integers(2**31)))
        cache = jax.random.normal(key, (2, nb, kv, BS, d), jnp.bfloat16)
        q = jax.random.normal(jax.random.fold_in(key, 1), (b, h, d), jnp.bfloat16)
        t = jnp.asarray(rng.permutation(nb).reshape(b, pages).astype(np.int32))
        out.append((q, cache, t, jnp.full((b,), c, jnp.int32)))
    return out

def timed(fn, ins, ref):
    try:
        out = fn(*ins[0]).block_until_ready()
        if ref is not None:
            err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
            if not err < 2e-2:
                return f"WRONG {err:.3g}"
        return statistics.median(time_calls(fn, ins, 20)) * 1e6
    except Exception as e:
        return f"failed {type(e).__name__}: {str(e)[:200]}"

rng = np.random.default_rng(0)
print("device", jax.devices()[0].device_kind, how, flush=True)
for name, h, kv, d, window in (("smollm2", 9, 3, 64, None), ("gemma3-global", 4, 1, 256, None),
                               ("gemma3-sliding", 4, 1, 256, 512)):
    for b in (1, 64, 256):
        for c in (256, 1024, 4096):
            ins = inputs(rng, b, c, h, kv, d)
            q, cache, t, l = ins[0]
            ref = None
            if b * c <= 2 ** 16:
                ref = paged_attention_reference(q.astype(jnp.float32), cache.astype(jnp.float32), t, l,
                                                scale=d ** -0.5, sliding_window=window)
            kw = dict(scale=d ** -0.5, sliding_window=window)
            tri = timed(jax.jit(functools.partial(paged_attention, **kw)), ins, ref)
            mos = timed(jax.jit(functools.partial(paged_attention_mgpu, **kw)), ins, ref)
            ratio = f"{tri / mos:.2f}x" if isinstance(tri, float) and isinstance(mos, float) else "-"
            fmt = lambda x: f"{x:8.1f}us" if isinstance(x, float) else x
            print(f"{name:15s} b{b:<4d} ctx{c:<5d} triton {fmt(tri)} mosaic {fmt(mos)}  mosaic speed-up {ratio}", flush=True)
