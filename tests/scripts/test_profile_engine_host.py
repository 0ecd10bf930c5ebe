"""scripts/dev/profile_engine_host.py --workload: the decode census adds up to the engine's own step count."""

from __future__ import annotations

import json
import re

from tests.conftest import load_script


def _module():
    return load_script("profile_engine_host")


def test_decode_census_bins_rows_and_steps(capsys):
    mod = _module()
    mod.print_decode_census([(3, 8), (3, 2), (40, 8), (300, 1)], 8)
    out = capsys.readouterr().out
    # 4 loops of 8 iterations compute 32; 19 ran a row
    assert "(19 steps in 4 loops; the loops compute 32 iterations, 13 (40.6%) past every row's steps)" in out
    assert re.search(r"1-8\s+rows:\s+10 steps \(\s*52.6%\),\s+30 tokens", out), out
    assert re.search(r"33-64\s+rows:\s+8 steps .*\s320 tokens", out), out
    assert re.search(r"257-9999 rows:\s+1 steps .*\s300 tokens", out), out
    assert "9-32" not in out  # empty bins are left out


def test_workload_census_matches_the_engine_step_count(tmp_path, capsys):
    mod = _module()
    pairs = [[list(range(1, 4 + i)), 3 + 5 * i] for i in range(6)]
    path = tmp_path / "w.json"
    path.write_text(json.dumps(pairs))
    assert mod.main(["--workload", str(path), "--num-blocks", "64", "--max-num-seqs", "4"]) == 0
    out = capsys.readouterr().out
    decode_steps = int(re.search(r"\((\d+) in decode loops\)", out).group(1))
    census = int(re.search(r"\((\d+) steps in \d+ loops;", out).group(1))
    assert census == decode_steps > 0
    assert f"{sum(n for _, n in pairs)} output tokens" in out
