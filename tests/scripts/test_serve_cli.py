"""scripts/serve.py and scripts/bench_serving.py refuse bad options with one line, before loading anything."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).parents[2] / "scripts"


@pytest.mark.parametrize("script,args,message", [
    ("serve.py", ["--model", "no-such-model"], "error: model='no-such-model' is neither"),
    ("serve.py", ["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization=1.5 must be in (0, 1]"),
    ("bench_serving.py", ["--request-rate", "0.5x,inf"], "a relative rate needs an 'inf' run before it"),
    ("bench_serving.py", ["--request-rate", "0"], "--request-rate=0 must be > 0"),
])
def test_bad_options_fail_fast_with_one_line(script, args, message):
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
