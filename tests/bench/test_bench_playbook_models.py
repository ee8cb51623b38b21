"""`bench playbook` leave-one-model-out: each model ranked by a fit on the others only, each
cell's regret beside the twin-blind oracle's, and the acceptance lines of issue 27."""

import math

import pytest

from bench.playbook import (
    LOMO,
    MODEL_TARGETS,
    ORACLE,
    format_playbook_bench,
    oracle_ratio_worst,
    run_playbook_bench,
)


def _runs_file(tmp_path):
    """tiny-llama and tiny-gpt2 runs on 1 node (ZeRO-0/1 twins included) whose throughput
    falls with tp and rises with the micro-batch."""
    lines = ["model,nodes,dp,tp,pp,zero,mbs,grad_acc,tok_s_gpu,gpu_mem_gb,seq"]
    for model, scale in (("tiny-llama", 1000.0), ("tiny-gpt2", 1500.0)):
        for tp in (1, 2, 4):
            for mb in (1, 2):
                dp = 8 // tp
                ga = 64 // (dp * mb)
                for zero, noise in ((0, 1.0), (1, 0.97)):
                    lines.append(f"{model},1,{dp},{tp},1,{zero},{mb},{ga},"
                                 f"{scale * noise * mb / tp},,64")
    path = tmp_path / "runs.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_oracle_ratio_is_the_worst_cell():
    scores = {"a": {"regret": 0.9}, "b": {"regret": 0.5}, "c": {"regret": 0.7}}
    oracle = {"a": {"regret": 1.0}, "b": {"regret": 0.5}, "c": {"regret": 0.0}}
    assert oracle_ratio_worst(scores, oracle) == pytest.approx(0.9)  # c: no oracle regret
    assert math.isnan(oracle_ratio_worst(scores, {}))


def test_leave_one_model_out_rows_and_checks(tmp_path):
    result = run_playbook_bench(_runs_file(tmp_path), fold_evals=8, max_evals=16, progress=None)
    assert result["cells"] == 2 and LOMO in result["rows"]
    assert set(result["rows"][LOMO]) == {"tiny-gpt2 x1", "tiny-llama x1"}
    # each model's fit saw only the other model's runs, and says so with its bounds
    assert {k: v["fitted_on"] for k, v in result["model_fits"].items()} == {
        "tiny-gpt2": ["tiny-llama"], "tiny-llama": ["tiny-gpt2"]}
    for rep in result["model_fits"].values():
        assert all(p["lower"] <= p["value"] <= p["upper"] for p in rep["parameters"].values())
    assert set(result["model_checks"]) == set(MODEL_TARGETS)
    lomo = result["summary"][LOMO]
    for k, c in result["model_checks"].items():
        assert c["value"] == lomo[k] and c["ok"] == (c["value"] >= c["target"])
    ratio = lomo["oracle_ratio_worst"]
    cells = result["rows"][LOMO]
    assert ratio == pytest.approx(min(c["regret"] / result["rows"][ORACLE][k]["regret"]
                                      for k, c in cells.items()))
    text = format_playbook_bench(result)
    assert "leave one model out, per cell" in text and "fitted without tiny-llama" in text
    assert "acceptance of issue 27" in text and ("met" in text or "NOT MET" in text)
    assert "oracle_ratio_worst" in text
