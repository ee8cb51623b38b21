"""The command line, as a user types it."""

import json
import subprocess
import sys
from unittest import mock

import pytest
import torch

from autopar import cli
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


def test_a_plan_says_whether_the_fitted_profile_measured_layouts_like_it(capsys):
    argv = ["plan", "--model", "tiny-llama", "--seq", "64", "--global-batch-tokens", "1K",
            "--cluster", "h100-efa", "--nodes", "2", "--quiet", "--layout"]
    # "auto" recompute that resolved to a plain mode is compared as that mode
    assert main([*argv, "dp=16,zero=1,microbatch=1,grad_accum=1,recompute=auto"]) == 0
    text = capsys.readouterr().out
    assert "fitted on measured runs of playbook-1b, playbook-8b with zero=1, recompute='none'" \
        in text
    assert "this layout lies inside them; tiny-llama was not among their models" in text
    assert "extrapolates" not in text
    assert main([*argv, "dp=16,zero=3,microbatch=1,grad_accum=1"]) == 0
    text = capsys.readouterr().out
    assert "none with zero=3" in text and "lies inside" not in text


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


@pytest.mark.slow  # a benchmark's smoke run: benchmarks live apart from the default run
def test_runtime_bench_quick_runs_and_compares_with_hand_written(tmp_path, monkeypatch):
    from bench.runtime import format_runtime_bench, run_runtime_bench

    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "cal.json"))
    result = run_runtime_bench(quick=True, world=2, progress=lambda _line: None)
    labels = [r["layout"] for r in result["rows"]]
    assert labels == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + full recompute", "TP+SP",
                      "PP2 1F1B", "solver"]
    assert all(r["measured_s"] > 0 and r["hand_written_s"] > 0 and r["predicted_s"] > 0 for r in result["rows"])
    assert "Spearman" in format_runtime_bench(result)
    json.dumps(result)


# --- a user's mistakes: one paragraph naming the problem and the fix, no traceback, ---------
# --- answered from the arguments and configs before any model is built or captured ---------

GPT2_8 = ["plan", "--model", "gpt2", "--quiet"]  # one node of 8 H100s, the default cluster


def _fails(capsys, argv, *needles, early=True, fix=True):
    """Run the CLI on argv: exit 2, one `autopar: error:` paragraph with a fix, no traceback.

    early=True: the answer came before any torch module was constructed (no model built, so
    none captured). fix=False: a failure inside a rank, whose fix is whatever its exception says."""
    built = []
    module_init = torch.nn.Module.__init__

    def recording_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        module_init(self, *args, **kwargs)

    with mock.patch.object(torch.nn.Module, "__init__", recording_init):
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("autopar: error:")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0].rstrip()), err
    message = errors[0]
    assert "fix:" in message or not fix, message
    for needle in needles:
        assert needle in message, (needle, message)
    if early:
        assert built == [], f"a model was built before the argument check: {built[:3]}"
    return message


def test_seq_zero(capsys):
    _fails(capsys, ["plan", "--model", "gpt2", "--seq", "0"], "--seq 0", "1 to 1024",
           "pass --seq between 1 and 1024")
    _fails(capsys, ["inspect", "--model", "gpt2", "--seq", "0"], "--seq 0")


def test_layout_value_that_is_not_a_number(capsys):
    _fails(capsys, [*GPT2_8, "--layout", "dp=eight"], "dp=eight", "whole number", "dp=2")


def test_layout_degrees_that_do_not_match_the_cluster(capsys):
    _fails(capsys, [*GPT2_8, "--layout", "dp=3"], "3 ranks", "cluster has 8",
           "multiply to 8")
    _fails(capsys, [*GPT2_8, "--nodes", "2", "--layout", "dp=8"], "cluster has 16 (2 nodes x 8")


def test_default_seq_is_the_models_own_limit(capsys):
    # gpt2 takes 1024 tokens: the default is 1024 and the note says so (then the layout fails,
    # quickly, on the cluster size rather than on the sequence length)
    message = _fails(capsys, [*GPT2_8, "--layout", "dp=3"], "cluster has 8")
    assert "seq" not in message
    assert main(["plan", "--model", "gpt2", "--layout", "dp=3"]) == 2
    assert "gpt2 takes at most 1024 tokens per sequence, so --seq defaults to 1024" in \
        capsys.readouterr().err
    assert cli.DEFAULT_SEQ == 4096
    assert cli._seq(None, cli._model_config("llama3-8b")) == 4096
    assert capsys.readouterr().err == ""  # no note where the default is the model's own


def test_unknown_model(capsys):
    _fails(capsys, ["inspect", "--model", "unknown"], "unknown model 'unknown'", "gpt2, gpt2-xl",
           "--model gpt2")


def test_nodes_zero(capsys):
    _fails(capsys, ["plan", "--model", "gpt2", "--nodes", "0"], "--nodes 0", "--nodes 1 or more")


def test_unknown_cluster(capsys):
    _fails(capsys, ["plan", "--model", "gpt2", "--cluster", "nosuch"], "'nosuch'",
           "h100, h100-efa", "local")


def test_global_batch_tokens_not_a_multiple_of_seq(capsys):
    _fails(capsys, ["plan", "--model", "gpt2", "--seq", "1000"], "1,048,576", "sequences of 1000",
           "multiple of 1000")
    _fails(capsys, ["plan", "--model", "gpt2", "--global-batch-tokens", "lots"], "token count",
           "1M")


def test_layout_fields_with_bad_values(capsys):
    _fails(capsys, [*GPT2_8, "--layout", "dp=8,zero=5"], "zero=5", "0, 1, 2 or 3")
    _fails(capsys, [*GPT2_8, "--layout", "dp=8,schedule=foo"], "schedule=foo", "1f1b")
    _fails(capsys, [*GPT2_8, "--layout", "dp=8,sp=maybe"], "sp=maybe", "sp=1 or sp=0")
    _fails(capsys, [*GPT2_8, "--layout", "dpp=8"], "'dpp'", "did you mean 'pp'")
    _fails(capsys, [*GPT2_8, "--layout", "dp"], "not key=value")


def test_tp_that_does_not_divide_the_heads(capsys):
    _fails(capsys, ["plan", "--model", "tiny-llama", "--seq", "64", "--global-batch-tokens", "1K",
                    "--gpus-per-node", "3", "--quiet", "--layout", "tp=3"],
           "tp=3", "8 attention heads", "1, 2, 4, 8")
    _fails(capsys, [*GPT2_8, "--gpus-per-node", "6", "--layout", "dp=2,tp=3", "--model", "gpt2-xl"],
           "25 attention heads", "1, 5, 25")


def test_dump_arguments_are_checked_before_any_rank_starts(capsys):
    dump = ["dump", "--model", "tiny-llama", "--world", "2"]
    _fails(capsys, [*dump, "--seq", "0"], "--seq 0", "1 to 64")
    _fails(capsys, [*dump, "--rank", "2"], "--rank 2", "between 0 and 1")
    _fails(capsys, [*dump, "--layout", "dp=3"], "3 ranks", "multiply to 2")
    _fails(capsys, [*dump, "--layout", "pp=2,zero=3"], "ZeRO-3 inside a pipeline",
           "autopar plan --layout")
    _fails(capsys, [*dump, "--model", "nosuch"], "unknown model")


def test_dump_failure_in_a_rank_is_one_paragraph(capsys, monkeypatch):
    # Let a layout the ranks refuse through the parent's checks: the ranks raise, and the
    # command prints the failing rank and the root cause, not the 40-line RankFailedError.
    monkeypatch.setattr(cli, "_check_executable", lambda layout: None)
    argv = ["dump", "--model", "tiny-llama", "--world", "2", "--layout", "dp=2,precision=bf16"]
    message = _fails(capsys, argv, "failed: UnsupportedLayoutError", "--verbose", early=False,
                    fix=False)
    assert message.startswith("autopar: error: rank ")


def test_dump_verbose_shows_the_rank_traceback(capsys, monkeypatch):
    from runtime import launch

    text = 'Traceback (most recent call last):\n  File "w.py", line 3, in f\n    g()\nKeyError: 7\n'

    def failing_spawn(*args, **kwargs):
        raise launch.RankFailedError(1, text)

    monkeypatch.setattr(launch, "spawn", failing_spawn)
    dump = ["dump", "--model", "tiny-llama", "--world", "2"]
    _fails(capsys, dump, "rank 1 failed: KeyError: 7", "--verbose", fix=False)
    assert main([*dump, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert 'File "w.py", line 3' in err and err.rstrip().splitlines()[-1].startswith("autopar: error:")


def test_command_line_from_a_shell_is_one_paragraph():
    # `python -m autopar`, as a user types it (the timeout only guards against a hang)
    proc = subprocess.run([sys.executable, "-m", "autopar", "plan", "--model", "gpt2", "--seq", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("autopar: error: --seq 0") and "fix:" in proc.stderr


def test_calibrate_runs_errors_and_profile_flag(tmp_path, capsys):
    bad = tmp_path / "runs.csv"
    bad.write_text("model,nodes,dp,tp,pp,zero,mbs,grad_acc,tok_s_gpu\n8B,1,4,4,1,0,1,64,5000\n")
    assert main(["calibrate", "--runs", str(bad), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "row 2" in err and "dp*tp*pp*cp" in err and "Traceback" not in err
    assert main(["plan", "--model", "tiny-llama", "--profile", str(tmp_path / "none.json")]) == 2
    assert "autopar calibrate" in capsys.readouterr().err


# one of every kind of argument check above, replayed in a fresh interpreter
EARLY_ERRORS = [
    ["plan", "--model", "gpt2", "--seq", "0"], ["inspect", "--model", "unknown"],
    [*GPT2_8, "--layout", "dp=eight"], [*GPT2_8, "--layout", "dp=3"], ["plan", "--model", "gtp2"],
    ["plan", "--model", "gpt2", "--nodes", "0"], ["plan", "--model", "gpt2", "--cluster", "nosuch"],
    ["plan", "--model", "gpt2", "--seq", "1000"], [*GPT2_8, "--layout", "dp=8,zero=5"],
    [*GPT2_8, "--layout", "dpp=8"],
    ["plan", "--model", "gpt2-xl", "--gpus-per-node", "6", "--layout", "dp=2,tp=3"],
    ["dump", "--model", "tiny-llama", "--world", "2", "--rank", "2"],
    ["dump", "--model", "tiny-llama", "--layout", "pp=2,zero=3"],
]


def test_argument_errors_answer_before_torch_is_imported():
    """A bad argument is answered from the configs alone: torch, the slow part of starting a
    command, is never loaded (so neither is any model)."""
    code = ("import sys; from autopar.cli import main\n"
            f"for argv in {EARLY_ERRORS!r}:\n"
            "    assert main(argv) == 2, argv\n"
            "    assert 'torch' not in sys.modules, argv\n"
            "print('no torch')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no torch"
    n = len(EARLY_ERRORS)
    assert out.stderr.count("autopar: error:") == n and out.stderr.count("fix:") == n, out.stderr


def test_bench_names_the_fix_where_the_benchmarks_are_not_installed(capsys, monkeypatch):
    # a clone finds bench/ beside autopar/; an installed wheel has no such folder
    assert "runtime" in cli._benches()
    monkeypatch.setattr(cli, "_benches", lambda: None)
    assert main(["bench", "runtime"]) == 2
    err = capsys.readouterr().err
    assert "bench/ folder" in err and "fix: clone the repository" in err


def test_bench_refuses_an_option_the_benchmark_would_ignore(capsys, tmp_path):
    assert main(["bench", "runtime", "--runs", str(tmp_path / "runs.csv")]) == 2
    err = capsys.readouterr().err
    assert "bench runtime takes no --runs" in err and "bench playbook and published" in err
    assert main(["bench", "solver", "--calibration", "x.json"]) == 2
    assert "fix: drop it" in capsys.readouterr().err


def test_bench_published_reads_the_runs_file_it_is_given(capsys, tmp_path):
    # a file that does not exist is named, not replaced by the shipped one
    assert main(["bench", "published", "--runs", str(tmp_path / "other.csv")]) == 2
    assert "other.csv" in capsys.readouterr().err
