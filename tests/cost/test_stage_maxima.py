"""The per-stage maxima the memory terms take, computed without a loop per stage, are the
same floats as the plain rules: `group_max` is ``np.maximum.at`` on zeros, and each stage's
rebuilt peak (`_rebuilt_peaks_apart`) is the peak of its rows alone, the others zeroed."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.search.recompute_choice import _rebuilt_peaks_apart
from cost.terms.recompute import group_max, rebuilt_peaks, rebuilt_sweep


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e9, 1e9), st.integers(0, 4)), max_size=40),
       st.integers(5, 7), st.booleans())
def test_group_max_is_maximum_at_on_zeros(rows, groups, sort):
    if sort:
        rows = sorted(rows, key=lambda r: r[1])
    values = np.array([v for v, _ in rows], dtype=float)
    group = np.array([g for _, g in rows], dtype=int)
    expected = np.zeros(groups)
    np.maximum.at(expected, group, values)
    assert np.array_equal(group_max(values, group, groups), expected)


def test_one_group_is_the_largest_value_or_zero():
    assert group_max(np.array([-3.0, -1.0]), np.zeros(2, dtype=int), 1).tolist() == [0.0]
    assert group_max(np.array([2.0, 5.0, 1.0]), np.zeros(3, dtype=int), 1).tolist() == [5.0]
    assert group_max(np.array([]), np.zeros(0, dtype=int), 3).tolist() == [0.0, 0.0, 0.0]


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 40), st.integers(1, 6), st.integers(1, 4), st.booleans())
def test_each_stage_peak_is_its_rows_alone(data, n, blocks, stages, by_block):
    ints = st.integers(-1, 9)
    layer = np.sort(np.array(data.draw(st.lists(st.integers(0, blocks - 1), min_size=n, max_size=n))))
    made = np.array(data.draw(st.lists(ints, min_size=n, max_size=n)))
    spans = np.stack([made, made + np.array(data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))], 1)
    spans[made < 0] = -1
    local = np.array(data.draw(st.lists(st.floats(0.0, 1e6), min_size=n, max_size=n)))
    if by_block:  # a pipeline: each block on one stage, in order
        stage_of_block = np.sort(np.array(data.draw(st.lists(st.integers(0, stages - 1), min_size=blocks,
                                                             max_size=blocks))))
        group = stage_of_block[layer]
    else:
        group = np.array(data.draw(st.lists(st.integers(0, stages - 1), min_size=n, max_size=n)))
    sweep = rebuilt_sweep(spans, layer)
    got = _rebuilt_peaks_apart(local, group, stages, sweep)
    for s in range(stages):
        alone = rebuilt_peaks(local * (group == s), spans, layer, np.zeros(n, dtype=int), 1, sweep)[0]
        assert got[s] == alone
