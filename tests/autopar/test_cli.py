"""The command line, as a user types it."""

import json

from autopar.cli import main


def test_inspect_prints_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["inspect", "--model", "tiny-llama", "--seq", "32", "--batch", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in ("parameters", "FLOPs / token", "activations saved", "2 x layers.* (identical)", "capture time"):
        assert needle in text
    data = json.loads(out.read_text())
    assert data["blocks"] == 2 and data["params"] > 0


def test_plan_prints_the_plan_and_the_manual_comparison(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny-llama", "--seq", "64", "--global-batch-tokens", "1K",
            "--cluster", "h100", "--nodes", "1", "--gpus-per-node", "4", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "predicted step" in text and "best manual layouts" in text
    assert json.loads(out.read_text())["layout"]["dp"] >= 1


def test_plan_of_a_manual_layout(capsys):
    argv = ["plan", "--model", "tiny-llama", "--seq", "64", "--global-batch-tokens", "1K", "--nodes", "1",
            "--gpus-per-node", "4", "--quiet", "--layout", "dp=2,tp=2,sp=1,zero=1,microbatch=4,grad_accum=2"]
    assert main(argv) == 0
    assert "dp2 tp2 zero1 sp mb4 ga2" in capsys.readouterr().out


def test_bad_input_exits_2_with_a_message(capsys):
    assert main(["inspect", "--model", "llama3-7b"]) == 2
    assert "Did you mean" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-llama", "--seq", "64", "--global-batch-tokens", "1000"]) == 2
    assert "multiple of 64" in capsys.readouterr().err
    argv = ["plan", "--model", "tiny-llama", "--seq", "64", "--global-batch-tokens", "1K", "--nodes", "1",
            "--gpus-per-node", "4", "--quiet", "--layout", "dp=8,microbatch=2,grad_accum=1"]
    assert main(argv) == 2
    assert "cluster has 4" in capsys.readouterr().err


def test_dump_shows_the_collectives_of_the_plan(capsys):
    argv = ["dump", "--model", "tiny-llama", "--world", "2", "--layout", "dp=2,zero=3,microbatch=2,precision=fp32"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # gloo: the gradients are all-reduced and each rank keeps its rows (faster than its reduce-scatter)
    assert "all_gather_into_tensor" in text and "then keep this rank's rows" in text
    assert "# ZeRO-3: gather block layers.0's weights for the forward" in text


def test_runtime_bench_quick_runs_and_compares_with_hand_written(tmp_path, monkeypatch):
    from autopar.bench.runtime import format_runtime_bench, run_runtime_bench

    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "cal.json"))
    result = run_runtime_bench(quick=True, world=2, progress=lambda _line: None)
    labels = [r["layout"] for r in result["rows"]]
    assert labels == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP+SP", "solver"]
    assert all(r["measured_s"] > 0 and r["hand_written_s"] > 0 and r["predicted_s"] > 0 for r in result["rows"])
    assert "Spearman" in format_runtime_bench(result)
    json.dumps(result)
