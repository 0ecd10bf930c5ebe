"""scripts/dev/profile_mgpu_decode.py: its summary of a Mosaic GPU profiler trace.

The trace is written by Mosaic GPU's own ``ProfilerSpec.dump`` (the code that writes the kernel's traces on
the GPU) from a hand-built profile buffer with known cycle counts, so the test checks the script's reading
of the real format. ``dump`` subtracts an estimated profiling overhead of at most 11 cycles per event, and
the scopes start 20 cycles late; they last thousands of cycles, so the expected values hold to 1 %.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import load_script

profiler = pytest.importorskip("jax.experimental.mosaic.gpu.profiler")

# Per warpgroup role: (name, begin, end) in SM cycles from the warpgroup's first event.
COMPUTE = [("wait_q", 0, 10_000), ("qk", 10_000, 20_000), ("softmax", 20_000, 50_000),
           ("pv", 50_000, 60_000), ("qk", 70_000, 80_000), ("pv", 80_000, 90_000),
           ("store", 90_000, 100_000)]
MEMORY = [("issue", 0, 30_000), ("wait_slot", 30_000, 40_000), ("issue", 40_000, 80_000)]
CONVERTER = [("convert", 0, 20_000), ("wait_fp8", 20_000, 25_000), ("convert", 25_000, 60_000)]
GAP = 20


def _buffer(spec, ctas, start_ns):
    """The profile buffer the kernel fills: per warpgroup a header (start time, SM id, entries used), then
    (tag, cycle) pairs, ENTER and EXIT per scope."""
    n = spec.entries_per_warpgroup
    buf = np.zeros((ctas, 3, n), np.uint32)
    for cta in range(ctas):
        for wg, scopes in enumerate((COMPUTE, MEMORY, CONVERTER)):
            entries = []
            for name, begin, end in scopes:
                tag = spec.intern_name(name)
                entries += [tag | profiler.ProfilerSpec.ENTER, 5_000 + begin + GAP,   # events >= 12 cycles
                            tag | profiler.ProfilerSpec.EXIT, 5_000 + end]           # apart, as on the GPU
            buf[cta, wg, :3] = (start_ns[cta], cta, len(entries))
            buf[cta, wg, 3:3 + len(entries)] = entries
    return buf.reshape(-1)


def test_summary_of_a_dumped_trace(tmp_path):
    mod = load_script("profile_mgpu_decode")
    spec = profiler.ProfilerSpec(64)
    start_ns = [1_000_000, 1_000_300]
    path = tmp_path / "trace.json"
    with open(path, "w") as f:
        spec.dump(_buffer(spec, 2, start_ns), f, grid=(2,), block=(384, 1, 1))

    s = mod.summarize(str(path), warpgroups=3)

    approx = lambda x: pytest.approx(x, rel=0.01)   # noqa: E731
    assert s["compute"] == {"wait_q": approx(10_000), "qk": approx(20_000), "softmax": approx(30_000),
                            "pv": approx(20_000), "store": approx(10_000), "other": approx(10_000)}
    assert s["memory"]["issue"] == approx(70_000) and s["memory"]["wait_slot"] == approx(10_000)
    assert 0 <= s["memory"]["other"] < 500                         # only the gaps between scopes
    assert s["converter"]["convert"] == approx(55_000) and s["converter"]["wait_fp8"] == approx(5_000)
    assert s["span"]["compute"] == (approx(100_000), approx(100_000))
    assert s["startup"] == (approx(10_000), approx(10_000))       # to the first qk
    assert s["drain"] == (approx(10_000), approx(10_000))         # from the last pv's end
    assert s["start_skew_ns"] == approx(300)
