"""Compiled step programs on disk, found without tracing: the warm start's executable cache.

JAX's persistent compilation cache skips XLA's compile, but its key is the lowered program, so a warm start
still traces and lowers every bucket before it can look one up: ~0.27 s a program, 10 of a SmolLM2 server's
23.8 s warm start with its 38 programs (docs/perf-notes.md, session 20). This cache keys each program by what
determines it without tracing it, and stores the executable (``jax.experimental.serialize_executable``, the
same serialized form the persistent cache stores):

* the **environment**: the versions of JAX, jaxlib, its CUDA plugin, Flax, NumPy and Triton, the backend's
  platform version (CUDA, driver), the devices' kinds and ids, ``XLA_FLAGS``, every ``JAXKV_*`` variable and
  JAX's configuration values;
* the **code**: a digest of every ``.py`` file of the packages that build the step (``jaxkv``, ``models``,
  ``pallas_kernels``), so any source change misses;
* the **caller's description**: whatever else the traced function closes over (the engine arguments and
  the model config: :func:`models.entrypoints.engine_args.build_engine` passes them);
* per program, its **name, static arguments and every argument's shape, dtype and sharding**.

A miss (or a file that fails to load: it is deleted) falls back to tracing, lowering and compiling, and
stores the result. :meth:`ExecutableCache.read` is cheap and runs in the warm-up's pass over the buckets;
:meth:`ExecutableCache.load_payload` puts an executable on the device (0.3-0.7 s for a 1-2 MiB GPU executable
on an H200) and runs on the warm-up's compile threads, as JAX's own cache reads do. A SmolLM2 server with its
36 programs was ready 12.5-12.7 s after a warm start with this cache, 23.9-24.4 s without (session 21).
Files are never evicted: a source or version change leaves the old ones (1-2 MiB a program for SmolLM2)
until the folder is deleted, as JAX's persistent cache does by default. vLLM keeps a comparable cache of
``torch.compile`` artifacts keyed by a hash of its configs and source (``~/.cache/vllm/torch_compile_cache``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile
import threading

import jax

log = logging.getLogger(__name__)

_PACKAGES = ("jaxkv", "models", "pallas_kernels")


def _source_digest() -> str:
    """sha256 over the paths and bytes of every ``.py`` file of :data:`_PACKAGES` (those importable)."""
    import importlib.util

    h = hashlib.sha256()
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = pathlib.Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


# installed distributions whose version can change a traced or compiled step (absent ones are skipped)
_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                  "jax-cuda13-plugin", "jax-cuda13-pjrt", "triton", "jax-triton")


def _versions() -> str:
    from importlib import metadata

    out = []
    for name in _DISTRIBUTIONS:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ",".join(out)


def environment_fingerprint() -> str:
    """What besides the code and the arguments decides a compiled program (see the module docstring)."""
    import jaxlib

    backend = jax.devices()[0].client
    config = sorted((k, v) for k, v in jax.config.values.items()
                    if isinstance(v, (bool, int, float, str, type(None))) and "cache" not in k and "log" not in k)
    parts = [jax.__version__, jaxlib.__version__, _versions(), backend.platform, backend.platform_version,
             repr([(d.id, d.device_kind) for d in jax.devices()]), os.environ.get("XLA_FLAGS", ""),
             repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("JAXKV_"))), repr(config),
             _source_digest()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def program_devices(x: jax.Array) -> list:
    """The devices a program taking ``x`` runs on, in its device assignment's order: the mesh's devices for
    a ``NamedSharding``, else ``x``'s devices by id."""
    mesh = getattr(x.sharding, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        return list(mesh.devices.flat)
    return sorted(x.sharding.device_set, key=lambda d: d.id)


def _describe(x) -> str:
    if x is None:
        return "None"
    return f"{tuple(x.shape)}:{x.dtype}:{getattr(x, 'sharding', None)}"


class ExecutableCache:
    """Serialized executables under ``directory``, one file per program.

    Args:
        directory: where the files go (created on first store).
        description: the caller's part of the key (e.g. ``repr`` of the engine arguments and model config).

    The key of a program is :meth:`key`'s digest; :meth:`read` returns ``None`` on a miss and
    :meth:`load_payload` puts what it read on the devices. Loading an executable runs what its file holds: point ``directory`` only at files this process's user wrote (the
    same trust as JAX's persistent cache directory).
    """

    def __init__(self, directory: str | os.PathLike, description: str = ""):
        self.directory = pathlib.Path(directory)
        self.fingerprint = hashlib.sha256(f"{environment_fingerprint()}\0{description}".encode()).hexdigest()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def key(self, name: str, args, static: dict) -> str:
        """The digest of program ``name`` called with ``args`` (a pytree of arrays) and ``static``."""
        leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=lambda x: x is None)
        text = "\0".join([self.fingerprint, name, repr(sorted(static.items())), str(treedef),
                          *map(_describe, leaves)])
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.exe"

    def read(self, key: str) -> tuple | None:
        """The file stored under ``key`` (``(serialized executable, in_tree, out_tree)``), or ``None`` (a miss,
        or a file that does not unpickle: it is deleted). Cheap: nothing is loaded onto a device yet."""
        path = self._path(key)
        if not path.exists():
            self.misses += 1
            return None
        try:
            payload = pickle.loads(path.read_bytes())
            if not (isinstance(payload, tuple) and len(payload) == 3):
                raise TypeError(f"a {type(payload).__name__}, not (executable, in_tree, out_tree)")
        except Exception as e:
            log.warning("executable cache: %s does not read (%s: %s); compiling instead", path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        return payload

    def load_payload(self, key: str, payload: tuple, devices) -> jax.stages.Compiled | None:
        """:meth:`read`'s ``payload`` loaded onto ``devices`` (those the program runs on, in its device
        assignment's order: :func:`program_devices`; thread-safe, the device load releases the GIL), or
        ``None`` when it does not load (the file is deleted). Without ``devices`` JAX would load a one-device
        program onto every visible device, and its first call would fail ("Expected args to
        execute_sharded_on_local_devices to have 2 shards")."""
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            compiled = deserialize_and_load(*payload, execution_devices=list(devices))
        except Exception as e:  # a stale file: drop it and compile again
            log.warning("executable cache: %s does not load (%s: %s); compiling instead", self._path(key),
                        type(e).__name__, e)
            self._path(key).unlink(missing_ok=True)
            with self._lock:
                self.misses += 1
            return None
        with self._lock:
            self.hits += 1
        return compiled

    @contextlib.contextmanager
    def fresh_compiles(self):
        """On CPU, JAX's persistent compilation cache off inside (and on again after, when it was on): the
        programs to be stored compile from scratch. An executable that JAX loaded from its persistent cache
        does not survive a second serialization on XLA:CPU (measured: the loaded copy then misses its fusion
        functions, "Function convert_add_fusion not found"), so there only executables compiled in this
        process are stored. GPU executables keep their binaries when loaded: a GPU warm start stores what
        the persistent cache gave it (checked end to end on an H200, docs/benchmarks.md, session 21)."""
        from jax._src import compilation_cache

        was = jax.config.jax_enable_compilation_cache and jax.default_backend() == "cpu"
        if was:
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
        try:
            yield
        finally:
            if was:
                jax.config.update("jax_enable_compilation_cache", True)
                compilation_cache.reset_cache()

    def store(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Write ``compiled`` under ``key`` (atomically; a program that cannot be serialized is skipped: one with
        a host callback, such as the steps computing structured-output masks inside them, quietly)."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload = pickle.dumps(serialize(compiled))
        except Exception as e:
            callback = "python_callback" in str(e)
            (log.debug if callback else log.warning)("executable cache: program not stored (%s: %s)",
                                                     type(e).__name__, e)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, self._path(key))
