"""Bar chart of a decode benchmark: percent of copy bandwidth per shape and kernel.

    python scripts/dev/plot_bench.py docs/logs/bench-decode-h200.json docs/bench-decode-h200.png

Reads the JSON written by ``scripts/bench_attention.py --mode decode --json``; plots, per (batch, ctx),
our kernel with its tuned defaults ("ours auto"), JAX's ``paged_attention`` with its defaults and the
best of its sweep, and prints the geometric mean of ours / JAX's best. Needs matplotlib (``pip install
-e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def summarize(data: dict) -> tuple[list[str], dict[str, list[float]], float]:
    """Per-shape percent of copy bandwidth for ours / JAX default / JAX best, and the geomean ratio."""
    copy = data["copy_gbs"]
    labels, series = [], {"ours (auto)": [], "JAX default": [], "JAX best of sweep": []}
    log_ratio = 0.0
    for row in data["rows"]:
        gbs = row["gbs"]
        jax_best = max(v for k, v in gbs.items() if k.startswith("jax") and v)
        labels.append(f"b{row['batch']}\nctx {row['ctx']}")
        series["ours (auto)"].append(100 * gbs["ours auto"] / copy)
        series["JAX default"].append(100 * (gbs.get("jax default") or 0) / copy)
        series["JAX best of sweep"].append(100 * jax_best / copy)
        log_ratio += math.log(gbs["ours auto"] / jax_best)
    return labels, series, math.exp(log_ratio / len(data["rows"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json_path")
    p.add_argument("png_path")
    args = p.parse_args(argv)
    with open(args.json_path) as f:
        data = json.load(f)
    labels, series, geomean = summarize(data)
    print(f"geometric mean, ours auto / JAX best: {geomean:.2f}x over {len(labels)} shapes")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.27
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - 1) * width for j in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.axhline(100, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("% of copy bandwidth (read+write)")
    ax.set_title(f"Paged decode attention, {data['device']}: 32q/8kv heads, D 128, bf16, block 16 "
                 f"(copy {data['copy_gbs']:.0f} GB/s; ours/JAX-best geomean {geomean:.2f}x)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.png_path, dpi=110)
    print(f"wrote {args.png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
