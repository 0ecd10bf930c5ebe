"""fp8/bf16 ring configurations of the Mosaic decode kernel (H100 exploration; never committed)."""
import functools, statistics, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from scripts.bench_attention import _timer, _make_inputs, HEAD_SIZE
import pallas_kernels.paged_attention_mgpu as M

time_calls, how = _timer()
orig_convert = M._convert_tile

def run(kw, inputs, noconv=False):
    jax.clear_caches()
    M._convert_tile = (lambda s, d: None) if noconv else orig_convert
    fn = jax.jit(functools.partial(M.paged_attention_mgpu, scale=HEAD_SIZE ** -0.5, **kw))
    try:
        fn(*inputs[0]).block_until_ready()
        return statistics.median(time_calls(fn, inputs, 20))
    except Exception as e:
        print(f"    {kw}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
    finally:
        M._convert_tile = orig_convert

F8 = dict(k_scale=1.0, v_scale=1.0)
VARIANTS = {
    "bf16 st2q2": (False, dict(num_stages=2, num_q_buffers=2), False),
    "bf16 st3q1": (False, dict(num_stages=3, num_q_buffers=1), False),
    "in st3q1": (True, dict(F8, convert_ahead=False, num_stages=3, num_q_buffers=1), False),
    "in st3q2": (True, dict(F8, convert_ahead=False, num_stages=3, num_q_buffers=2), False),
    "in st4q1": (True, dict(F8, convert_ahead=False, num_stages=4, num_q_buffers=1), False),
    "ah st3q1": (True, dict(F8, convert_ahead=True, num_stages=3, num_q_buffers=1), False),
    "ah st3q2": (True, dict(F8, convert_ahead=True, num_stages=3, num_q_buffers=2), False),
    "ah st4q1": (True, dict(F8, convert_ahead=True, num_stages=4, num_q_buffers=1), False),
    "ah st3q2 noconv": (True, dict(F8, convert_ahead=True, num_stages=3, num_q_buffers=2), True),
}
shapes = [tuple(int(x) for x in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else "64x1024,64x4096,256x1024,256x4096").split(",")]
rng = np.random.default_rng(0)
print("device", jax.devices()[0].device_kind, how, flush=True)
for b, c in shapes:
    inputs = _make_inputs(rng, b, c, 3)
    fp8 = [(q, kv.astype(jnp.float8_e4m3fn), t, l) for q, kv, t, l in inputs]
    res = {k: run(kw, fp8 if f8 else inputs, nc) for k, (f8, kw, nc) in VARIANTS.items()}
    bf = res["bf16 st2q2"]
    print(f"{b}x{c}: " + " | ".join(f"{k} {v*1e6:.1f}us ({bf/v:.2f}x)" if v else f"{k} -" for k, v in res.items()), flush=True)
