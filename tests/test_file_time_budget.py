"""The per-file time guard (tests/file_time_budget.py) in a pytest run of its own, with and without xdist."""

from __future__ import annotations

import pathlib
import re

import pytest

pytest_plugins = ["pytester"]
ROOT = pathlib.Path(__file__).parents[1]

BURN = """
import time

def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_a():
    _burn(0.3)

def test_b():
    _burn(0.3)
"""


@pytest.fixture
def run(pytester, monkeypatch):
    monkeypatch.delenv("JAXKV_FILE_TIME_OUTER_PID", raising=False)  # this run is nested in ours
    monkeypatch.delenv("JAXKV_SLOW", raising=False)
    monkeypatch.delenv("JAXKV_MGPU_FUZZ", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest("""
from tests.file_time_budget import FileTimeBudget

def pytest_configure(config):
    config.pluginmanager.register(FileTimeBudget(config), "jaxkv-file-time-budget")
""")
    pytester.makepyfile(test_slow=BURN, test_fast="def test_c():\n    pass\n")

    def go(limit, *args):
        monkeypatch.setenv("JAXKV_FILE_TIME_LIMIT_S", str(limit))
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    return go


@pytest.mark.parametrize("xdist", [[], ["-n", "2", "--dist", "loadfile"]], ids=["plain", "xdist"])
def test_a_file_over_the_limit_fails_the_run_naming_it(run, xdist):
    """Each test of test_slow.py burns 0.3 CPU s: only their sum (0.6 s, one file) passes the 0.45 s limit;
    under xdist the workers' reports reach the controller, which sums them per file."""
    result = run(0.45, *xdist)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert "3 passed" in out
    line = next(l for l in out.splitlines() if l.startswith("FAILED file time budget"))
    assert re.search(r"test_slow\.py took 0\.[6-9] cpu-s", line) and "limit of 0.45 cpu-s" in line
    assert "test_fast.py took" not in out


def test_under_the_limit_or_off_passes(run):
    assert run(5).ret == pytest.ExitCode.OK
    result = run(0)  # 0: the check is off, the summary still lists the files
    assert result.ret == pytest.ExitCode.OK and "per-file limit off" in result.stdout.str()


def test_machine_factor_is_the_median_slowdown_at_least_one():
    """The default limit's scale: the median of measured over recorded CPU seconds of the files recorded at >= 10 s
    (a file that grew alone does not move it), never below 1, and 1 for a run of too few files."""
    from tests.file_time_budget import machine_factor
    recorded = {f"f{i}": 20.0 + i for i in range(12)} | {"tiny": 1.0}
    slow = {f: 1.75 * s for f, s in recorded.items()} | {"f0": 400.0, "tiny": 50.0}
    assert abs(machine_factor(slow, recorded) - 1.75) < 1e-9
    assert machine_factor({f: 0.5 * s for f, s in recorded.items()}, recorded) == 1.0   # a faster machine
    assert machine_factor({"f1": 100.0}, recorded) == 1.0                                 # a partial run
