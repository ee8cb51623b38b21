"""`bench playbook`: per-cell scores of a ranking, the textbook baseline, and the whole bench
(leave-one-cell-out included) on a small runs file."""

import math

import numpy as np
import pytest

from autopar.calibrate.runs import Run
from bench.playbook import (
    ORACLE,
    cell_scores,
    format_playbook_bench,
    run_playbook_bench,
    spearman,
    summarize,
)
from bench.textbook import textbook
from vocab.layout import Layout


def _run(i, tps, tp=1, mb=1):
    lay = Layout(dp=8 // tp, tp=tp, zero=1, sp=tp > 1, microbatch=mb, grad_accum=32 // (8 // tp) // mb,
                 precision="bf16")
    return Run(i, "playbook-1b", 1, lay, 4096, tps, None)


def test_cell_scores_rank_among_runs_predicted_to_fit():
    runs = [_run(0, 100.0), _run(1, 90.0, tp=2), _run(2, None, tp=4), _run(3, 50.0, tp=8)]
    # the fastest prediction did not train; the next one predicted to fit is run 1
    tps = np.array([80.0, 95.0, 200.0, 10.0])
    fits = np.array([True, True, True, False])
    s = cell_scores(runs, tps, fits)
    assert s["regret"] == pytest.approx(0.9) and s["pick_failed"]
    assert s["best_ratio"] == pytest.approx(0.8)
    assert s["fit_recall"] == pytest.approx(2 / 3) and s["oom_recall"] == 0.0
    assert s["spearman"] == pytest.approx(0.5)
    perfect = cell_scores(runs, np.array([100.0, 90, 1, 50]), np.array([True, True, False, True]))
    assert perfect["regret"] == 1.0 and perfect["oom_recall"] == 1.0 and not perfect["pick_failed"]
    both = summarize({"a": s, "b": perfect})
    assert both["regret_worst"] == pytest.approx(0.9) and both["picks_failed"] == 1
    assert both["fit_recall"] == pytest.approx((2 / 3 * 3 + 3) / 6)
    assert math.isnan(spearman([1, 2], [2, 1]))


def test_textbook_follows_its_formulas():
    one = textbook("playbook-1b", 1, Layout(dp=8, microbatch=1, grad_accum=32, precision="bf16"))
    two = textbook("playbook-1b", 2, Layout(dp=16, microbatch=1, grad_accum=16, precision="bf16"))
    tp = textbook("playbook-1b", 1, Layout(dp=4, tp=2, sp=True, microbatch=1, grad_accum=64,
                                           precision="bf16"))
    pp = textbook("playbook-1b", 1, Layout(dp=4, pp=2, microbatch=1, grad_accum=1,
                                           precision="bf16"))
    # (6N + 12Lhs) = 9.66 GFLOP per token at 55 % of 989.5 TFLOP/s: 56k tok/s/GPU, less the
    # exposed 30 % of the DP all-reduce
    assert 54e3 < one[0] < 56.4e3 and two[0] < one[0]
    assert tp[0] < one[0] and tp[1] < one[1]  # TP traffic costs time, saves memory
    assert pp[0] < 0.6 * one[0]  # one micro-batch through two stages: half the time idle


def _runs_file(tmp_path):
    """tiny-llama runs on 1 and 2 nodes whose throughput falls with tp and rises with mb."""
    lines = ["model,nodes,dp,tp,pp,zero,mbs,grad_acc,tok_s_gpu,gpu_mem_gb,seq"]
    for nodes in (1, 2):
        world = 8 * nodes
        for tp in (1, 2, 4):
            for mb in (1, 2):
                dp = world // tp
                ga = 64 // (dp * mb)
                tps = 1000.0 * mb / tp / nodes ** 0.5
                lines.append(f"tiny-llama,{nodes},{dp},{tp},1,1,{mb},{ga},{tps},,64")
        lines.append(f"tiny-llama,{nodes},{world},1,1,0,8,{64 // (8 * world) or 1},nan,,64")
    path = tmp_path / "runs.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_bench_runs_every_row_and_scores_against_the_textbook(tmp_path):
    result = run_playbook_bench(_runs_file(tmp_path), fold_evals=14, max_evals=28, progress=None)
    assert result["cells"] == 2 and len(result["fold_params"]) == 2
    assert set(result["summary"]) == {"textbook", "autopar (unfitted defaults)",
                                      "autopar (fit on all cells)", "autopar (leave one cell out)",
                                      ORACLE}
    # no ZeRO twins in this file: the oracle is the measurements, every target within reach
    oracle = result["summary"][ORACLE]
    assert oracle["regret_worst"] == 1.0 and oracle["spearman_median"] == pytest.approx(1.0)
    assert all(c["oracle_ok"] for c in result["checks"].values())
    for name, s in result["summary"].items():
        assert 0.0 <= s["regret_worst"] <= s["regret_median"] <= 1.0, name
    assert set(result["checks"]) == {"regret_median", "regret_worst", "spearman_median",
                                     "fit_recall", "best_ratio_median_abs_error"}
    text = format_playbook_bench(result)
    assert "the data allows" in text and "leave one cell out" in text and "textbook" in text and "fitted parameters" in text
