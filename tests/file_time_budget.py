"""A pytest plugin that fails the run when one test file takes more than its share of the suite's budget.

CI runs the whole suite on a 2-core CPU machine with ``-n 2 --dist loadfile`` against a budget of 600 s of
pytest time (issue 31). With ``--dist loadfile`` a file is the unit of work (all its tests run on one worker,
in order), so the longest file bounds a worker's wall time, and a file that grows past its share shows up
here, in the run that made it grow, naming the file.

A file's time is summed over its tests' setup, call and teardown phases (module fixtures are in the setup
of its first test and the teardown of its last): the CPU seconds they used (user + system, of the test
process and of the subprocesses it waited for: servers, CLIs, the 4-device mesh run) and their wall seconds.
The limit applies to the CPU seconds by default: they are what the file costs whatever else runs on the
machine (on the shared 2-core development machine the same file's wall seconds varied 2-3x with the
load, its CPU seconds by a few percent). The reports reach the xdist controller from the workers, so the
totals are the same with and without xdist. The check runs once, in the outermost pytest process (the
controller, or the only process), at the end of the session, over every file that ran; a pytest run
started by a test (test_mesh.py's 4-device run) does not check again.

Settings (environment, read once at configure time):

* ``JAXKV_FILE_TIME_LIMIT_S``: the limit in seconds (default :data:`DEFAULT_LIMIT_S`, 20 % of 600 s);
  ``0`` turns the check off. The default limit is for a machine as fast as the one ``tests/file_seconds.json``
  was measured on: on a slower one it is scaled by :func:`machine_factor` (the median of the run's file CPU
  seconds over the recorded ones; session 27's CPU machine ran every file, touched or not, ~1.75x slower than
  session 26's), so a file is flagged when it grew against the others, not when the hardware is slow. A limit
  set in the environment is taken as it is. The long variants (``JAXKV_SLOW=1``, ``JAXKV_MGPU_FUZZ=N``) turn it off too,
  unless the limit is set explicitly: they are meant to be long.
* ``JAXKV_FILE_TIME_MEASURE``: ``cpu`` (default) or ``wall``: which seconds the limit applies to (``wall``
  on a machine that runs nothing else).
* ``JAXKV_FILE_TIMES_JSON``: a path to write ``{file: {"s": seconds, "cpu_s": CPU seconds}}`` of the run to
  (for measuring).

Balance: with ``--dist loadfile`` pytest-xdist hands out files in collection order, after sorting them by
their number of tests (``--loadscope-reorder``, its default), which put 10-test files of 100 s last, where
one worker ran them while the other had finished. The plugin turns that sort off and orders the files
longest first (largest processing time first, the classic rule for balancing jobs over machines) by the
measured CPU seconds in ``tests/file_seconds.json`` (regenerate with ``JAXKV_FILE_TIMES_JSON``; a file not
listed counts :data:`UNLISTED_FILE_S`); the tests inside a file keep their order.

The terminal summary lists the longest files in any case, with the CPU seconds their tests used (user +
system, of the test process and of the subprocesses it waited for): on a machine shared with other work the
wall seconds move with the load, the CPU seconds much less.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib

import pytest

SUITE_BUDGET_S = 600.0
# 20 % of the budget: the longest files measured 59-70 CPU s on the 2-core development machine (serial and
# -n 2 runs, 2026-11-26: the two Mosaic GPU interpreter files, the server end-to-end file), so 120 leaves
# room for a CI machine up to ~1.7x slower and still fails a file that alone takes a fifth of the budget.
DEFAULT_LIMIT_S = 0.20 * SUITE_BUDGET_S
SHOW_LONGEST = 8
MIN_FACTOR_FILES = 10    # files needed to tell the machine's speed (a partial run keeps the nominal limit)
MIN_RECORDED_S = 10.0    # files recorded at fewer CPU seconds do not count (start-up noise)
FILE_SECONDS = pathlib.Path(__file__).with_name("file_seconds.json")
UNLISTED_FILE_S = 20.0
_OUTER = "JAXKV_FILE_TIME_OUTER_PID"  # set by the outermost run, inherited by pytest runs its tests start


def _limit_from_env() -> float | None:
    """The per-file limit in seconds, or None when the check is off."""
    raw = os.environ.get("JAXKV_FILE_TIME_LIMIT_S")
    if raw is not None:
        try:
            limit = float(raw)
        except ValueError:
            raise pytest.UsageError(f"JAXKV_FILE_TIME_LIMIT_S={raw!r} is not a number of seconds") from None
        if limit < 0:
            raise pytest.UsageError(f"JAXKV_FILE_TIME_LIMIT_S={raw!r} must be >= 0 (0 turns the check off)")
        return limit or None
    if os.environ.get("JAXKV_SLOW") or os.environ.get("JAXKV_MGPU_FUZZ"):
        return None
    return DEFAULT_LIMIT_S


def machine_factor(measured: dict[str, float], recorded: dict[str, float]) -> float:
    """How much slower this machine ran the files than the machine ``recorded`` (``tests/file_seconds.json``'s CPU
    seconds) was measured on: the median of ``measured / recorded`` over the files recorded at
    :data:`MIN_RECORDED_S` or more, at least 1 (a faster machine keeps the nominal limit); 1 with fewer than
    :data:`MIN_FACTOR_FILES` such files."""
    ratios = sorted(measured[f] / r for f, r in recorded.items() if r >= MIN_RECORDED_S and f in measured)
    if len(ratios) < MIN_FACTOR_FILES:
        return 1.0
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])
    return max(1.0, median)


def _recorded_cpu_seconds() -> dict[str, float]:
    try:
        return {path: float(entry["cpu_s"]) for path, entry in json.loads(FILE_SECONDS.read_text()).items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


class FileTimeBudget:
    """Per-file totals of test durations; fails the session when a file is over the limit."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.limit_s = _limit_from_env()
        self.scaled = "JAXKV_FILE_TIME_LIMIT_S" not in os.environ  # the default limit follows the machine's speed
        self.factor = 1.0
        self.measure = os.environ.get("JAXKV_FILE_TIME_MEASURE", "cpu")
        if self.measure not in ("cpu", "wall"):
            raise pytest.UsageError(f"JAXKV_FILE_TIME_MEASURE={self.measure!r} must be cpu or wall")
        self.json_path = os.environ.get("JAXKV_FILE_TIMES_JSON")
        self.nested = _OUTER in os.environ and not hasattr(config, "workerinput")
        if self.nested:  # a run started by a test: the outer run counts this file's time
            self.limit_s = self.json_path = None
        else:
            os.environ.setdefault(_OUTER, str(os.getpid()))
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.cpu_seconds: dict[str, float] = collections.defaultdict(float)
        self.over: list[tuple[str, float]] = []
        # xdist workers forward their reports to the controller, which does the counting
        self.is_worker = hasattr(config, "workerinput")
        self._cpu_mark = 0.0

    @staticmethod
    def _cpu_now() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        """Files longest first (measured CPU seconds), each file's tests in their order."""
        seconds = _recorded_cpu_seconds()
        if not seconds:
            return
        first_seen: dict[str, int] = {}
        for item in items:
            first_seen.setdefault(item.nodeid.split("::", 1)[0], len(first_seen))

        def key(item):
            path = item.nodeid.split("::", 1)[0]
            return -seconds.get(path, UNLISTED_FILE_S), first_seen[path]
        items.sort(key=key)  # stable: a file's tests keep their order

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self._cpu_mark = self._cpu_now()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        now = self._cpu_now()  # the CPU seconds of this phase ride to the controller with the report
        report.user_properties.append(("cpu_s", now - self._cpu_mark))
        self._cpu_mark = now
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.is_worker:
            return
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] += float(report.duration)
        self.cpu_seconds[path] += sum(v for k, v in report.user_properties if k == "cpu_s")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        if self.is_worker:
            return
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump({path: {"s": round(s, 2), "cpu_s": round(self.cpu_seconds[path], 2)}
                           for path, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}, f, indent=1)
        if self.limit_s is None:
            return
        measured = self.cpu_seconds if self.measure == "cpu" else self.seconds
        if self.scaled and self.measure == "cpu":
            self.factor = machine_factor(measured, _recorded_cpu_seconds())
        limit = self.limit_s * self.factor
        self.over = sorted(((f, s) for f, s in measured.items() if s > limit), key=lambda kv: -kv[1])
        if self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_unconfigure(self, config) -> None:
        if os.environ.get(_OUTER) == str(os.getpid()) and not self.is_worker:
            del os.environ[_OUTER]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.is_worker or self.nested or not self.seconds:
            return
        tr = terminalreporter
        measured = self.cpu_seconds if self.measure == "cpu" else self.seconds
        longest = sorted(self.seconds, key=lambda path: -measured[path])[:SHOW_LONGEST]
        limit = "off" if self.limit_s is None else f"{self.limit_s:g} {self.measure}-s"
        if self.limit_s is not None and self.factor > 1:
            limit += (f" x {self.factor:.2f}, this machine's slowness against tests/file_seconds.json's = "
                      f"{self.limit_s * self.factor:.0f} {self.measure}-s")
        tr.write_sep("-", f"longest test files (wall and CPU seconds of their tests; per-file limit {limit})")
        for path in longest:
            tr.write_line(f"{self.seconds[path]:8.1f} s {self.cpu_seconds[path]:8.1f} cpu-s  {path}")
        tr.write_line(f"{sum(self.seconds.values()):8.1f} s {sum(self.cpu_seconds.values()):8.1f} cpu-s  "
                      f"all {len(self.seconds)} files")
        for path, s in self.over:
            tr.write_line(
                f"FAILED file time budget: {path} took {s:.1f} {self.measure}-s, over the per-file limit of "
                f"{self.limit_s * self.factor:g} {self.measure}-s ({self.limit_s / SUITE_BUDGET_S:.0%} of the suite's "
                f"{SUITE_BUDGET_S:.0f} s; "
                "split the file, share its compiles, or move long variants behind JAXKV_SLOW; "
                "JAXKV_FILE_TIME_LIMIT_S overrides the limit)", red=True, bold=True)
