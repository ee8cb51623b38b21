"""The expert-parallel load imbalance (cost/routing.py) against a simulated balanced router."""

import numpy as np
import pytest

from cost.routing import expected_max_normal, imbalance


def test_expected_max_of_normals():
    assert expected_max_normal(1) == pytest.approx(0.0, abs=1e-9)
    assert expected_max_normal(2) == pytest.approx(1 / np.sqrt(np.pi), rel=1e-6)  # exact
    draws = np.random.default_rng(0).standard_normal((200_000, 8)).max(axis=1).mean()
    assert expected_max_normal(8) == pytest.approx(draws, rel=0.01)


@pytest.mark.parametrize("ep, rows", [(2, 256), (8, 1024), (8, 16384), (32, 4096)])
def test_imbalance_matches_a_balanced_router(ep, rows):
    """ep ranks' rows routed uniformly at random (each of ep x rows rows to one of ep ranks):
    the busiest rank's load over the mean, averaged over draws, is what `imbalance` says."""
    loads = np.random.default_rng(1).multinomial(ep * rows, [1 / ep] * ep, size=4000)
    measured = (loads.max(axis=1) / rows).mean()
    assert imbalance(rows, ep) - 1 == pytest.approx(measured - 1, rel=0.05)


def test_no_imbalance_without_ep_or_rows():
    assert imbalance(1024, 1) == imbalance(0, 8) == 1.0
