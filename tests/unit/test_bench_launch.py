"""scripts/bench_launch.py's pure parts: the paired first-batch ratios."""

from __future__ import annotations

import pytest
from support.helpers import load_script

bench = load_script("bench_launch")


def test_paired_ratios_compare_each_round_with_itself() -> None:
    # round 2 was slow for both: paired, it is a tie, not a loss
    mid, lo, hi, ahead = bench.paired_ratios([4.0, 6.0, 4.0, 4.0], [4.4, 6.0, 3.6, 4.8])
    assert (round(mid, 3), round(lo, 3), round(hi, 3), ahead) == (1.05, 0.975, 1.125, 3)


def test_one_round_is_its_own_quartiles() -> None:
    assert bench.paired_ratios([2.0], [1.0]) == (0.5, 0.5, 0.5, 0)


def test_unpaired_times_are_refused() -> None:
    with pytest.raises(ValueError, match="one time per round"):
        bench.paired_ratios([1.0, 2.0], [1.0])
