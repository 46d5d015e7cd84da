"""A pytest plugin: the CPU time of each test, and where a run's CPU minutes go.

On a shared machine a test's wall time says more about the other jobs than
about the test; its CPU time (user + system, of the pytest process and of the
subprocesses it waited for, e.g. the 8-device sharding session) does not.

    PYTHONPATH=ci python -m pytest -q -p cpu_durations                # summary
    PYTHONPATH=ci CPU_DURATIONS=cpu.tsv python -m pytest -q -p cpu_durations

prints the CPU seconds per directory and the 25 costliest tests at the end
(and with ``CPU_DURATIONS``, writes every test's ``cpu_s wall_s outcome
nodeid`` to that file, costliest first, and to ``CPU_DURATIONS.partial``
as each test ends).  Setup of a module- or
session-scoped fixture is counted in the first test that uses it;
collection is a line of its own.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict

import pytest

_rows: list[tuple[float, float, str, str]] = []
_collect = [0.0]


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``CPU_SAMPLE=n``: only the first ``n`` cases of each test function run
    (a quick estimate of a grid's cost: its cases times their mean)."""
    n = int(os.environ.get("CPU_SAMPLE", "0"))
    if not n:
        return
    seen: dict[str, int] = defaultdict(int)
    keep, drop = [], []
    for item in items:
        key = item.nodeid.split("[")[0]
        seen[key] += 1
        (keep if seen[key] <= n else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    path = os.environ.get("CPU_DURATIONS")
    if path:
        with open(path + ".counts", "w") as out:
            for key, count in seen.items():
                out.write(f"{count}\t{key}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    start = _cpu()
    yield
    _collect[0] = _cpu() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.monotonic()
    outcome = {"value": "passed"}
    item._cpu_outcome = outcome
    yield
    row = (_cpu() - cpu, time.monotonic() - wall, outcome["value"], item.nodeid)
    _rows.append(row)
    path = os.environ.get("CPU_DURATIONS")
    if path:  # as it goes, so that a stopped run keeps what it measured
        with open(path + ".partial", "a") as out:
            out.write("{:.3f}\t{:.3f}\t{}\t{}\n".format(*row))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.outcome != "passed" or report.when == "call":
        if getattr(item, "_cpu_outcome", {}).get("value") == "passed":
            item._cpu_outcome["value"] = report.outcome


def _directory(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return os.path.dirname(path) or path


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    write = terminalreporter.write_line
    total = sum(r[0] for r in _rows)
    by_dir: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for cpu, wall, _, nodeid in _rows:
        for table, key in ((by_dir, _directory(nodeid)), (by_file, nodeid.split("::")[0])):
            table[key][0] += cpu
            table[key][1] += wall
            table[key][2] += 1
    terminalreporter.section("CPU time")
    write(f"collection: {_collect[0]:.1f} s CPU; tests: {total:.1f} s CPU, {len(_rows)} tests")
    for title, table, top in (("directory", by_dir, None), ("file", by_file, 40)):
        write(f"{'cpu_s':>8} {'wall_s':>8} {'tests':>6}  {title}")
        rows = sorted(table.items(), key=lambda kv: -kv[1][0])
        for key, (cpu, wall, n) in rows[:top]:
            write(f"{cpu:8.1f} {wall:8.1f} {n:6d}  {key}")
    write(f"{'cpu_s':>8} {'wall_s':>8}  test (the 25 costliest)")
    for cpu, wall, _, nodeid in sorted(_rows, reverse=True)[:25]:
        write(f"{cpu:8.1f} {wall:8.1f}  {nodeid}")
    path = os.environ.get("CPU_DURATIONS")
    if path:
        with open(path, "w") as out:
            for cpu, wall, outcome, nodeid in sorted(_rows, reverse=True):
                out.write(f"{cpu:.3f}\t{wall:.3f}\t{outcome}\t{nodeid}\n")
