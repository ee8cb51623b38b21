"""The scaling oracle: the measurements, runs equal but for their GPU count priced
non-increasing with it."""

import itertools

import numpy as np
import pytest

from autopar.calibrate.runs import Run
from bench.playbook import spearman
from bench.scaling_oracle import chains, equal_work, non_increasing, rising_chains, scaling_oracle
from vocab.layout import Layout


def _run(row, gpus, tps, mb=10, seq=2048):
    lay = Layout(dp=gpus, tp=1, zero=3, microbatch=mb, grad_accum=1, precision="bf16")
    return Run(row, "playbook-1b", max(gpus // 8, 1), lay, seq, tps, None)


def test_pooling_keeps_a_falling_sequence_and_averages_a_rise():
    assert non_increasing([5.0, 4.0, 1.0]) == [5.0, 4.0, 1.0]
    assert non_increasing([3.0, 5.0, 4.0, 1.0]) == [4.0, 4.0, 4.0, 1.0]
    assert non_increasing([1.0, 2.0, 3.0]) == [2.0, 2.0, 2.0]
    assert non_increasing([]) == []
    assert non_increasing([1.0, 4.0], [3.0, 1.0]) == [1.75, 1.75]


def test_chains_join_equal_work_only():
    runs = [_run(0, 32, 100.0), _run(1, 16, 110.0), _run(2, 16, 90.0, mb=8),
            _run(3, 64, 105.0), _run(4, 64, 80.0, seq=4096), _run(5, 128, None)]
    assert equal_work(runs[0]) == equal_work(runs[3]) != equal_work(runs[2])
    # the failed run is left out; a chain runs in GPU-count order
    assert chains(runs) == [[1, 0, 3]]
    assert rising_chains(runs) == [[1, 0, 3]]
    tps = scaling_oracle(runs)
    assert tps.tolist() == pytest.approx([102.5, 110.0, 90.0, 102.5, 80.0, 0.0])
    # a repeat at one GPU count is priced with its twin, whatever the order
    again = runs + [_run(6, 64, 95.0)]
    assert scaling_oracle(again)[[3, 6]].tolist() == pytest.approx([100.0, 100.0])


def test_a_rise_no_monotone_model_can_price_caps_the_groups_rank_correlation():
    # llm-foundry's MPT-1b on A100-40GB: 16 GPUs at micro-batch 8, and a chain at
    # micro-batch 10 whose 32-GPU run measured 18 % below its 64- and 128-GPU runs
    runs = [_run(0, 16, 19085.0, mb=8), _run(1, 32, 15555.0), _run(2, 64, 19001.0),
            _run(3, 128, 18647.0)]
    measured = np.array([r.tok_s_gpu for r in runs])
    oracle = spearman(scaling_oracle(runs), measured)
    # every ranking (ties allowed) that keeps the chain non-increasing in GPU count
    best = max(spearman(np.array(levels, float), measured)
               for levels in itertools.product(range(4), repeat=4)
               if levels[1] >= levels[2] >= levels[3] and len(set(levels)) > 1)
    assert oracle == pytest.approx(best) == pytest.approx(np.sqrt(0.6))
    assert best < 0.8
