"""What-if timing of the fp8 Mosaic decode kernel (results WRONG on purpose for the ablations):
which part of the compute warpgroup's chain bounds fp8. Not a test; never committed."""
import functools, statistics, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from scripts.bench_attention import _timer, _make_inputs, NUM_KV_HEADS, HEAD_SIZE
import pallas_kernels.paged_attention_mgpu as M

time_calls, how = _timer()
orig_convert = M._convert_tile
orig_wgmma = M.plgpu.wgmma
calls = {"n": 0}

def conv_skip(which):
    def f(src, dst):
        calls["n"] += 1
        kind = "k" if calls["n"] % 2 == 1 else "v"
        if which == "both" or which == kind:
            return
        orig_convert(src, dst)
    return f

def run(name, kw, inputs, patch=None, bytes_=None):
    jax.clear_caches()
    calls["n"] = 0
    M._convert_tile = patch or orig_convert
    fn = jax.jit(functools.partial(M.paged_attention_mgpu, scale=HEAD_SIZE ** -0.5, **kw))
    try:
        fn(*inputs[0]).block_until_ready()
        t = statistics.median(time_calls(fn, inputs, 20))
    except Exception as e:
        print(f"    {name}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        t = None
    finally:
        M._convert_tile = orig_convert
    return t

shapes = [tuple(int(x) for x in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else "64x1024,64x4096,256x1024,256x4096").split(",")]
rng = np.random.default_rng(0)
print("device", jax.devices()[0].device_kind, how, flush=True)
for b, c in shapes:
    inputs = _make_inputs(rng, b, c, 3)
    fp8 = [(q, kv.astype(jnp.float8_e4m3fn), t, l) for q, kv, t, l in inputs]
    f8kw = dict(k_scale=1.0, v_scale=1.0)
    res = {}
    res["bf16"] = run("bf16", {}, inputs)
    res["fp8 inorder"] = run("fp8 inorder", dict(f8kw, convert_ahead=False), fp8)
    res["fp8 ahead"] = run("fp8 ahead", dict(f8kw, convert_ahead=True), fp8)
    res["fp8 noconv(both)"] = run("noconv", dict(f8kw, convert_ahead=False), fp8, conv_skip("both"))
    res["fp8 noconv-K"] = run("noconvk", dict(f8kw, convert_ahead=False), fp8, conv_skip("k"))
    res["fp8 noconv-V"] = run("noconvv", dict(f8kw, convert_ahead=False), fp8, conv_skip("v"))
    res["fp8 ahead noconv"] = run("ahead noconv", dict(f8kw, convert_ahead=True), fp8, conv_skip("both"))
    bf = res["bf16"]
    print(f"{b}x{c}: " + " | ".join(f"{k} {v*1e6:.1f}us ({bf/v:.2f}x)" if v else f"{k} -" for k, v in res.items()), flush=True)
