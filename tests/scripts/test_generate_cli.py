"""scripts/generate.py as a user runs it: bad input gives one clear line; a real run prints a summary."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "generate.py"


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--prompt", "hi", "--block-size", "12"], "error: --block-size=12 not supported"),
    (["--prompt", "hi", "--temperature", "-1"], "error: temperature=-1.0 must be >= 0"),
    (["--prompt", "hi", "--top-p", "0"], "error: top_p=0.0 must be in (0, 1]"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "error: max_tokens=0 must be >= 1"),
    (["--prompt", "hi", "--tokenizer", "/nonexistent"], "error: tokenizer='/nonexistent' is not a directory holding"),
])
def test_bad_arguments_fail_fast_with_one_line(args, message):
    proc = run(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_end_to_end_cpu_run_and_errors_on_real_weights(gguf_path):
    proc = run("--prompt", "The capital of France is", "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    summary = [line for line in proc.stdout.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1 and "generated_tokens=" in summary[0] and "attention=reference" in summary[0]
    assert "using the XLA reference attention" in proc.stderr  # the CPU fallback says so
    empty = run("--prompt", "")
    assert empty.returncode != 0 and "error: prompts[0] is empty" in empty.stderr
