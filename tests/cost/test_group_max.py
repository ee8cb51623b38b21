"""`group_max`, the per-stage maximum the memory terms take, is ``np.maximum.at`` on zeros:
the same floats, whether the groups come sorted (rows by block) or not."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cost.terms.recompute import group_max


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
