"""The cost-model bench against the playbook's published numbers (quick mode, 1B/3B models).

Reference values are repeated here from shared/reference/playbook-facts.md on purpose: the
checks do not trust the bench's own copy or its own "within" flags.
"""

from __future__ import annotations

import json
import math

import pytest

from autopar import models
from autopar.bench.cost_model import (
    TITLES,
    activation_row,
    busbw_section,
    capture_model,
    format_cost_model_bench,
    run_cost_model_bench,
)

BUSBW_GBPS = {  # nodes 1, 2, 4, 8, 16, 32, 64
    "all_reduce": (436, 362, 160, 99.6, 84.7, 64.9, 32.9),
    "all_gather": (250, 185, 119, 69.0, 55.0, 28.0, 11.0),
    "reduce_scatter": (250, 182, 116, 68.6, 54.5, 27.9, 11.1),
}
NODES = (1, 2, 4, 8, 16, 32, 64)
DP_TOK_S_GPU = {8: 40150, 16: 37610, 32: 35368, 64: 31112, 128: 26446, 256: 15700}


@pytest.fixture(scope="module")
def quick():
    return run_cost_model_bench(quick=True, progress=None)


def test_busbw_within_15_percent():
    sec = busbw_section()
    seen = set()
    for row in sec["rows"]:
        measured = BUSBW_GBPS[row["kind"]][NODES.index(row["nodes"])] * 1e9
        assert abs(row["predicted_Bps"] / measured - 1) < 0.15, row
        seen.add((row["kind"], row["nodes"]))
    assert seen == {(k, n) for k in BUSBW_GBPS for n in NODES}
    # leave-one-out really drops the point: interior predictions move off the measured value
    interior = [r for r in sec["rows"] if not r["loo_extrapolated"]]
    assert len(interior) == 15
    moved = [abs(r["loo_predicted_Bps"] / r["measured_Bps"] - 1) for r in interior]
    assert max(moved) > 0.02
    assert sum(moved) / len(moved) < 0.30


def test_zero_memory_matches_playbook_formulas(quick):
    sec = next(s for s in quick["zero_memory"] if s["model"] == "playbook-1b")
    psi = sum(p.numel() for p in models.build("playbook-1b", device="meta").parameters())
    assert sec["num_params"] == psi
    n_d = 8
    expected = {  # bytes per parameter of bf16 + fp32 grad accumulation, sharded by ZeRO stage
        0: {"params": 2, "grads": 6, "optimizer": 12},
        1: {"params": 2, "grads": 6, "optimizer": 12 / n_d},
        2: {"params": 2, "grads": 6 / n_d, "optimizer": 12 / n_d},
        3: {"params": 2 / n_d, "grads": 6 / n_d, "optimizer": 12 / n_d},
    }
    checked = 0
    for row in sec["rows"]:
        if row["part"] == "total":
            continue
        ref = expected[row["zero"]][row["part"]] * psi
        assert abs(row["predicted_bytes"] / ref - 1) < 0.01, row
        checked += 1
    assert checked == 12


def test_dp_throughput_within_25_percent_and_falling(quick):
    rows = quick["dp_scaling"]["rows"]
    assert [r["dp"] for r in rows] == list(DP_TOK_S_GPU)
    predicted = [r["predicted_tok_s_gpu"] for r in rows]
    for r in rows:
        assert abs(r["predicted_tok_s_gpu"] / DP_TOK_S_GPU[r["dp"]] - 1) < 0.25, r
        # memory flat at 36.7 GB measured
        assert abs(r["predicted_memory_bytes"] / 36.7e9 - 1) < 0.25, r
    assert all(a > b for a, b in zip(predicted, predicted[1:])), predicted


def test_tp_scaling_trend_and_cliff(quick):
    sec = quick["tp_scaling"]
    assert len(sec["rows"]) == 10
    for sp in (False, True):
        rows = sorted((r for r in sec["rows"] if r["sp"] == sp), key=lambda r: r["tp"])
        pred = {r["tp"]: r["predicted_tok_s_gpu"] for r in rows}
        meas = {r["tp"]: r["measured_tok_s_gpu"] for r in rows}
        assert all(pred[a] > pred[b] for a, b in zip(sorted(pred), sorted(pred)[1:]))
        # the NVLink -> network cliff between TP 8 and TP 16, within 25 % of the measured one
        cliff_pred, cliff_meas = pred[16] / pred[8], meas[16] / meas[8]
        assert cliff_pred < 0.75
        assert abs(cliff_pred / cliff_meas - 1) < 0.25
    # up to TP 8 every point lies within 25 % of the measurement
    for r in sec["rows"]:
        if r["tp"] <= 8:
            assert abs(r["ratio"] - 1) < 0.25, r


def test_activation_rows_full_recompute_and_logits():
    cap = capture_model("playbook-1b", 256)
    cfg = cap.config
    sbh = 4096 * cfg.hidden
    full = activation_row(cap, 1, False, "full", None)
    # full recompute keeps each block's input: 2 bytes x s x h per layer
    assert full["predicted_blocks_bytes"] == pytest.approx(2 * sbh * cfg.n_layers, rel=0.01)
    # outside the blocks: the fp32 logits of the loss, 4 s v, dominate
    assert full["predicted_outside_bytes"] == pytest.approx(4 * 4096 * cfg.vocab, rel=0.05)
    none = activation_row(cap, 1, False, "none", None)
    assert none["predicted_blocks_bytes"] < none["formula_bytes"]  # flash attention: no scores
    # TP + SP shards every block activation: half of the unsharded block at t = 2
    sp2 = activation_row(cap, 2, True, "none", None)
    assert sp2["predicted_sbh_per_layer"] == pytest.approx(none["predicted_sbh_per_layer"] / 2,
                                                           rel=0.02)
    assert "sbh/layer" in sp2["explanation"]


def test_result_is_json_and_formats(quick):
    text = json.dumps(quick)
    back = json.loads(text)
    assert back["summary"] == quick["summary"]
    assert quick["summary"]["busbw"]["within"] == quick["summary"]["busbw"]["total"] == 21
    assert math.isfinite(quick["time_s"])
    out = format_cost_model_bench(quick)
    for key in ("zero_memory", "busbw", "dp_scaling", "tp_scaling", "summary"):
        assert TITLES[key] in out
    assert TITLES["activations"] not in out  # quick mode skips the 8B/70B sections
    assert "40,150" in out and "15,700" in out
