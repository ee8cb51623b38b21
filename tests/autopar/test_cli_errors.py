"""`autopar plan --layout`: a batch the layout cannot split is answered before torch loads, and
a layout that does not fit in memory is an error exit (2) with one line naming the memory short
and the knobs that help, never a report that says it runs."""

import subprocess
import sys

from autopar.cli import main

GPT2_8 = ["plan", "--model", "gpt2", "--seq", "1024", "--quiet"]  # one node of 8 H100s; 1M tokens = 1024 x 1024

BATCH_ERRORS = [
    [*GPT2_8, "--gpus-per-node", "3", "--layout", "dp=3"],  # 1024 sequences over 3 ranks
    [*GPT2_8, "--layout", "dp=8,microbatch=3"],  # 128 per rank, not a multiple of 3
    [*GPT2_8, "--layout", "dp=8,grad_accum=3"],
    [*GPT2_8, "--layout", "dp=8,microbatch=4,grad_accum=4"],  # 128 sequences, not 1024
]


def test_batch_mismatches_answer_before_torch_is_imported():
    code = ("import sys; from autopar.cli import main\n"
            f"for argv in {BATCH_ERRORS!r}:\n"
            "    assert main(argv) == 2, argv\n"
            "    assert 'torch' not in sys.modules, argv\n"
            "print('no torch')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no torch"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == len(BATCH_ERRORS), lines
    assert all(line.startswith("autopar: error: --layout") and "fix:" in line for line in lines), lines
    assert "not 1024" in lines[-1] and "does not divide the batch of 1024" in lines[0]
    assert "one of 1, 2, 4, 8, 16, 32, 64, 128" in lines[1]


def test_layout_that_does_not_fit_is_an_error_with_the_fix(capsys):
    # 128 sequences of 1024 tokens per rank, no recompute: the activations alone exceed 80 GB
    assert main([*GPT2_8, "--layout", "dp=8"]) == 2
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "runs     with autopar.parallelize" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("autopar: error: --layout dp8 mb128 ga1 does not fit:")
    assert "short (largest: activations" in lines[0] and "fix: recompute=full" in lines[0]
    assert "microbatch=64,grad_accum=2" in lines[0]


def test_layout_that_fits_still_exits_0(capsys):
    assert main([*GPT2_8, "--layout", "dp=8,microbatch=1,grad_accum=128,recompute=full"]) == 0
    out = capsys.readouterr().out
    assert "(fits)" in out and "runs     with autopar.parallelize" in out
