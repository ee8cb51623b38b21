"""The overlap probe's arithmetic on given times (no timing in the test): the hidden share is 1
where the shorter of comm and compute hides wholly behind the other, 0 where they take turns,
negative where running both at once costs more than apart; the table shows it per size."""

import pytest

from bench.overlap_probe import format_overlap_probe, hidden_share


def test_hidden_share():
    assert hidden_share(4.0, 3.0, 4.0) == 1.0  # the compute hid wholly behind the all-reduce
    assert hidden_share(4.0, 3.0, 7.0) == 0.0  # one after the other
    assert hidden_share(2.0, 6.0, 7.0) == pytest.approx(0.5)  # half the all-reduce hidden
    assert hidden_share(4.0, 3.0, 8.0) < 0  # contention: both at once slower than apart


def test_the_table_shows_each_size():
    rows = [{"message_mb": mb, "matmuls": 3, "comm_s": 0.004, "compute_s": 0.003, "both_s": both,
             "hidden_share": hidden_share(0.004, 0.003, both)} for mb, both in ((1, 0.004), (4, 0.007))]
    text = format_overlap_probe({"world": 2, "threads_per_rank": 1, "repeats": 5, "rows": rows,
                                 "hidden_share_median": 0.5})
    lines = text.splitlines()
    assert lines[2].split()[:2] == ["1", "MB"] and lines[2].split()[-1] == "1.00"
    assert lines[3].split()[:2] == ["4", "MB"] and lines[3].split()[-1] == "0.00"
    assert "median over sizes: 0.50" in text
