"""scripts/dev/plot_bench.py: the per-shape percentages and the geomean it reports (no matplotlib needed)."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))
import plot_bench  # noqa: E402


def test_summarize_percentages_and_geomean():
    data = {"copy_gbs": 2000.0, "device": "test", "rows": [
        {"batch": 1, "ctx": 4096, "gbs": {"ours auto": 1000.0, "jax default": 400.0, "jax k=1": 500.0,
                                           "jax k=4": None, "ours v1": 10.0}},
        {"batch": 8, "ctx": 1024, "gbs": {"ours auto": 900.0, "jax default": 1800.0, "jax k=1": 300.0}},
    ]}
    labels, series, geomean = plot_bench.summarize(data)
    assert labels == ["b1\nctx 4096", "b8\nctx 1024"]
    assert series["ours (auto)"] == [50.0, 45.0]
    assert series["JAX default"] == [20.0, 90.0]
    assert series["JAX best of sweep"] == [25.0, 90.0]
    assert math.isclose(geomean, math.sqrt((1000 / 500) * (900 / 1800)))
