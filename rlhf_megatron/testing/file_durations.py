"""A pytest plugin that prints seconds per test file at the end of a run (issue 24 item 6: the
per-file table in docs/BENCHMARKS.md comes from it). `--durations-by-file=N` prints the N longest
files; .ci/run passes it. Under pytest-xdist the controller sees every worker's reports, so one
table covers the whole run.

A file's span is from its first test's setup to its last test's teardown (module fixtures
included: they are set up in the first test's setup and torn down in the last's teardown); with
`--dist loadfile` one worker runs a whole file, so the span is what the file cost that worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass
class FileTime:
    start: float
    stop: float
    tests: int = 0

    @property
    def span(self) -> float:
        return self.stop - self.start


def add_report(table: dict[str, FileTime], path: str, when: str, start: float,
               stop: float) -> None:
    """Widen `path`'s span by one setup/call/teardown phase; a test counts once (its call)."""
    entry = table.setdefault(path, FileTime(start, stop))
    entry.start, entry.stop = min(entry.start, start), max(entry.stop, stop)
    if when == "call":
        entry.tests += 1


def format_table(table: dict[str, FileTime], limit: int) -> list[str]:
    """The `limit` longest files, longest first, as `seconds  tests  path` lines."""
    rows = sorted(table.items(), key=lambda kv: -kv[1].span)[:limit]
    return [f"{t.span:8.1f}s {t.tests:5d}  {path}" for path, t in rows]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-by-file", type=int, default=0, metavar="N",
                     help="print the N test files with the longest span (first setup to last "
                          "teardown); 0, the default, prints none")


class _Collector:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.table: dict[str, FileTime] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.start and report.stop:  # 0 for reports that never ran (e.g. collection)
            add_report(self.table, report.nodeid.split("::")[0], report.when, report.start,
                       report.stop)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.table:
            return
        terminalreporter.write_sep("=", f"slowest {self.limit} files (span, tests, file)")
        for line in format_table(self.table, self.limit):
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    limit = config.getoption("--durations-by-file")
    if limit > 0:
        config.pluginmanager.register(_Collector(limit), "rlhf_megatron_file_durations")
