"""Does calling a jitted function block the Python thread until the device has run it?

    python scripts/dev/probe_host_sync.py [--size 4096] [--repeats 5]

JAX dispatch is asynchronous: a call returns once the program is enqueued, and only reading a result
waits. Control flow whose predicate lives on the device can break that on GPU: XLA's conditional thunk
(``lax.cond`` / ``lax.switch``) copies the predicate to the host and waits for it before it launches a
branch, unless the conditional is recorded into a CUDA graph with conditional nodes (command buffer type
``CONDITIONAL``). Then the call itself returns only after the work that computes the predicate is done.

For seven small programs (heavy work alone; then a ``lax.cond`` with trivial branches; a ``lax.scan``
whose body holds a ``lax.cond`` as the engine's decode loop did; the same with a select; a cond whose
branch sorts, as the sampler's top-k/top-p filter did; both in one scan; a scan drawing per-row random
tokens) this prints the time until the call returns ("dispatch") and until the result is ready ("total"), with
XLA's default command buffers and with ``CONDITIONAL``/``WHILE`` added through ``jax.jit``'s
``compiler_options``. A dispatch close to the total means the call blocked. Then, while a heavy program
is queued, how long a ``device_put``, a call with a NumPy argument and a call donating a busy buffer take
to return.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DEFAULT_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
WITH_CONTROL_FLOW = DEFAULT_TYPES + ",CONDITIONAL,WHILE"


def heavy(x, n=8):
    for _ in range(n):
        x = jnp.tanh(x @ x)
    return x


def programs():
    def plain(x):
        return heavy(x)[0, 0]

    def cond_after(x):
        y = heavy(x)
        return lax.cond(y.sum() > 0, lambda v: v[0, 0] + 1, lambda v: v[0, 0] - 1, y)

    def scan_cond(x, num_steps):
        def body(c, i):
            return lax.cond(i < num_steps, lambda v: heavy(v, 2), lambda v: v, c), None
        return lax.scan(body, x, jnp.arange(4))[0][0, 0]

    def scan_select(x, num_steps):
        def body(c, i):
            return jnp.where(i < num_steps, heavy(c, 2), c), None
        return lax.scan(body, x, jnp.arange(4))[0][0, 0]

    def cond_sort(x):  # a branch with a sort (the sampler's top-k/top-p filter)
        y = heavy(x)
        return lax.cond(y[0, 0] > 0, lambda v: -jnp.sort(-v, axis=-1), lambda v: v, y)[0, 0]

    def scan_cond_sort(x, num_steps):
        def body(c, i):
            c = lax.cond(i < num_steps, lambda v: heavy(v, 2), lambda v: v, c)
            return lax.cond(c[0, 0] > 0, lambda v: -jnp.sort(-v, axis=-1), lambda v: v, c), None
        return lax.scan(body, x, jnp.arange(4))[0][0, 0]

    def scan_rng(x, num_steps):  # the sampler's per-row keys and categorical draw
        def body(c, i):
            c = lax.cond(i < num_steps, lambda v: heavy(v, 2), lambda v: v, c)
            keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), i))(jnp.arange(c.shape[0], dtype=jnp.uint32))
            tok = jax.vmap(jax.random.categorical)(keys, c.astype(jnp.float32))
            return c + tok[:, None].astype(c.dtype) * 0, None
        return lax.scan(body, x, jnp.arange(4))[0][0, 0]

    return dict(plain=plain, cond_after=cond_after, scan_cond=scan_cond, scan_select=scan_select,
                cond_sort=cond_sort, scan_cond_sort=scan_cond_sort, scan_rng=scan_rng)


def measure(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    dispatch, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        total.append(t2 - t0)
    return statistics.median(dispatch), statistics.median(total)


def busy_device(x, repeats):
    """How long a call takes to return while a heavy program is enqueued and not finished."""
    print("while a heavy program runs (enqueued, not finished):")
    heavy_fn = jax.jit(lambda v: heavy(v, 16))
    step = jax.jit(lambda state, v: state + heavy(v, 16)[:8, :8].astype(state.dtype), donate_argnums=0)
    small = jax.jit(lambda a: a + 1)
    host = np.ones(8, np.float32)
    state = jnp.zeros((8, 8), jnp.float32)
    for _ in range(2):  # compile
        state = step(state, x)
        jax.block_until_ready((heavy_fn(x), state, small(host)))
    heavy_ms = 1e3 * measure(heavy_fn, (x,), 1)[1]
    for name in ("device_put(numpy)", "jit(small)(numpy arg)", "jit(step) donating a busy state"):
        times = []
        for _ in range(repeats):
            busy = heavy_fn(x)
            if name.startswith("device_put"):
                t0 = time.perf_counter()
                out = jax.device_put(host)
            elif name.startswith("jit(small)"):
                t0 = time.perf_counter()
                out = small(host)
            else:
                state = step(state, x)  # the device is still writing it
                t0 = time.perf_counter()
                state = out = step(state, x)
            times.append(time.perf_counter() - t0)
            jax.block_until_ready((busy, out))
        print(f"  {name:<34} returns after {1e3 * statistics.median(times):8.3f} ms "
              f"(the heavy program: {heavy_ms:.1f} ms)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.bfloat16) / args.size ** 0.5
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    print(f"{'program':<12} {'command buffers':<40} {'dispatch ms':>11} {'total ms':>9}")
    for types in (None, WITH_CONTROL_FLOW):
        opts = None if types is None else {"xla_gpu_enable_command_buffer": types}
        for name, fn in programs().items():
            call_args = (x,) if name in ("plain", "cond_after", "cond_sort") else (x, jnp.int32(3))
            try:
                jitted = jax.jit(fn, compiler_options=opts)
                d, t = measure(jitted, call_args, args.repeats)
                print(f"{name:<12} {types or 'default':<40} {1e3 * d:>11.3f} {1e3 * t:>9.3f}", flush=True)
            except Exception as e:  # an option this XLA does not know, or no GPU
                print(f"{name:<12} {types or 'default':<40} failed: {type(e).__name__}: {str(e)[:200]}")
    busy_device(x, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
