"""scripts/bench_restart.py's pure parts: reading the processes' up-lines, and the testbed's spread."""

from __future__ import annotations

from support.helpers import load_script

bench = load_script("bench_restart")

LINES = (
    "start 0 0 100 10.0\n"
    "up 0 0 100 12.5\n"
    "up 0 1 101 12.0\n"
    "up 1 1 201 20.0\n"
    "up 1 1 202 21.0\n"  # the same rank twice in one attempt: the first line counts
    "up 1 0 200 19.5"  # a line still being written (no newline): not yet
)


def test_each_attempt_is_up_when_every_rank_wrote_its_line() -> None:
    seen = bench.parse_lines(LINES)
    assert bench.all_in(seen, "up", 0, 2) == (12.0, 12.5)
    assert seen[("up", 1)] == {1: (201, 20.0)}
    assert bench.all_in(seen, "up", 1, 2) is None
    assert bench.all_in(bench.parse_lines(LINES + "\n"), "up", 1, 2) == (19.5, 20.0)
    assert bench.all_in(seen, "start", 0, 2) is None


def test_malformed_lines_are_skipped() -> None:
    assert bench.parse_lines("pslaunch: hello\nup 0 0\n\n") == {}


def test_processes_spread_evenly_over_at_most_four_hosts() -> None:
    assert [bench.spread(n) for n in (1, 2, 8, 32, 6, 7)] == [(1, 1), (2, 1), (4, 2), (4, 8), (3, 2), (1, 7)]
