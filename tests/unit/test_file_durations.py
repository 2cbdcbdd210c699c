"""The seconds-per-file table .ci/run prints (rlhf_megatron/testing/file_durations.py)."""

import pytest

from rlhf_megatron.testing.file_durations import FileTime, add_report, format_table


def test_a_file_spans_its_first_setup_to_its_last_teardown_and_counts_calls():
    table: dict[str, FileTime] = {}
    for when, start, stop in [("setup", 10.0, 14.0), ("call", 14.0, 15.0), ("teardown", 15.0, 15.1),
                              ("setup", 15.1, 15.2), ("call", 15.2, 19.0),
                              ("teardown", 19.0, 22.0)]:
        add_report(table, "tests/a.py", when, start, stop)
    add_report(table, "tests/b.py", "call", 3.0, 4.0)
    assert table["tests/a.py"].span == pytest.approx(12.0)
    assert table["tests/a.py"].tests == 2
    lines = format_table(table, 5)
    assert [line.split()[-1] for line in lines] == ["tests/a.py", "tests/b.py"]
    assert lines[0].split()[:2] == ["12.0s", "2"]
    assert len(format_table(table, 1)) == 1


def test_the_option_prints_the_table_in_a_real_run(pytester: pytest.Pytester):
    pytester.makepyfile(test_slow="import time\ndef test_a():\n    time.sleep(0.3)\n",
                        test_quick="def test_b():\n    pass\n")
    result = pytester.runpytest("-p", "rlhf_megatron.testing.file_durations",
                                "--durations-by-file=5")
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "slowest 5 files" in out
    rows = [line.split() for line in out.splitlines() if line.rstrip().endswith(".py")]
    assert [r[-1] for r in rows] == ["test_slow.py", "test_quick.py"]
    assert float(rows[0][0].rstrip("s")) >= 0.3
    assert "slowest" not in pytester.runpytest("-p", "rlhf_megatron.testing.file_durations"
                                               ).stdout.str()
