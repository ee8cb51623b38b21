"""The twin-blind oracle: measured throughput, ZeRO-0/1 twins priced alike."""

import numpy as np
import pytest

from autopar.calibrate.runs import Run
from bench.twin_oracle import expected_regret, twin_oracle
from vocab.layout import Layout


def _run(row, tps, zero=1, tp=1, nodes=1):
    lay = Layout(dp=8 // tp, tp=tp, zero=zero, sp=tp > 1, microbatch=1,
                 grad_accum=32 // (8 // tp), precision="bf16")
    return Run(row, "playbook-1b", nodes, lay, 4096, tps, None)


def test_twins_share_their_geometric_mean_and_the_pick_among_them_is_a_coin_flip():
    runs = [_run(0, 100.0, zero=0), _run(1, 25.0, zero=1), _run(2, 40.0, tp=2),
            _run(3, None, tp=4), _run(4, 80.0, zero=0, nodes=2)]
    tps, fits = twin_oracle(runs)
    # rows 0 and 1 are twins: both sqrt(100 * 25) = 50; another cell's run is not a twin
    assert tps[:3] == pytest.approx([50.0, 50.0, 40.0]) and tps[4] == 80.0
    assert tps[3] == 0.0 and fits.tolist() == [True, True, True, False, True]
    # the oracle ranks the twins first: half the time it picks the 100, half the 25
    assert expected_regret(runs[:4], tps[:4]) == pytest.approx((100 + 25) / 2 / 100)


def test_a_failed_twin_does_not_lower_the_one_that_trained():
    runs = [_run(0, 100.0, zero=0), _run(1, None, zero=1), _run(2, 60.0, tp=2)]
    tps, _ = twin_oracle(runs)
    assert tps.tolist() == [100.0, 0.0, 60.0]
    assert expected_regret(runs, tps) == 1.0
    # without twins the oracle is the measurement itself
    solo = [_run(0, 30.0), _run(1, 90.0, tp=2)]
    assert np.array_equal(twin_oracle(solo)[0], [30.0, 90.0])


def test_a_cell_where_nothing_trained_scores_no_pick():
    runs = [_run(0, None, zero=0), _run(1, None, zero=1)]
    tps, fits = twin_oracle(runs)
    assert tps.tolist() == [0.0, 0.0] and not fits.any()
    assert expected_regret(runs, tps) == 0.0
