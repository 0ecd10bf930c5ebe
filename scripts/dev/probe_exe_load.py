"""Where a serialized step executable's 0.49 s load goes (session 21, H200): for the first ``--limit`` files of an
executable-cache folder (``jaxkv/worker/executable_cache.py``), the PJRT executable's bytes are taken out of the
pickle and loaded by ``backend.deserialize_executable`` without compile options (what
``jax.experimental.serialize_executable`` does), then with compile options rebuilt as JAX's compiler builds them
for one device (what JAX's persistent cache passes), each twice.

    python scripts/dev/probe_exe_load.py ~/.cache/jaxkv/jax-compilation-cache/jaxkv-executables --limit 6
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import time

import jax
import numpy as np
from jax._src import compiler
from jax._src.lib import xla_client as xc


class _Bytes(pickle.Unpickler):
    """Unpickles jax.experimental.serialize_executable's payload, keeping the executable's bytes."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.executables = []

    def persistent_load(self, pid):
        if pid[0] == "exec":
            self.executables.append(pid[1])
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--limit", type=int, default=6)
    a = p.parse_args()
    device = jax.devices()[0]
    backend = device.client
    devices = xc.DeviceList((device,))
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                           device_assignment=np.array([[device]]), backend=backend)
    print(f"device {device.device_kind}, jax {jax.__version__}")
    for path in sorted(pathlib.Path(a.folder).glob("*.exe"))[:a.limit]:
        serialized, _, _ = pickle.loads(path.read_bytes())
        u = _Bytes(serialized)
        try:
            u.load()
        except Exception:  # the payload's other objects (shardings) need the real unpickler's devices
            pass
        if not u.executables:
            print(f"{path.name}: no executable found")
            continue
        raw = u.executables[0]
        times = {}
        for label, kwargs in (("no options", {}), ("no options again", {}), ("with options", {"compile_options": options}),
                              ("with options again", {"compile_options": options})):
            t0 = time.perf_counter()
            try:
                backend.deserialize_executable(raw, devices, **kwargs)
                times[label] = f"{time.perf_counter() - t0:.3f} s"
            except Exception as e:
                times[label] = f"{type(e).__name__}: {str(e)[:80]}"
        print(f"{path.name[:12]} {len(raw) / 2**20:7.2f} MiB: {times}", flush=True)


if __name__ == "__main__":
    main()
