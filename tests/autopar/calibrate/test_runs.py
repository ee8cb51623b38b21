"""Reading a runs file: every bad row is an error that names the row and the fix."""

from pathlib import Path

import pytest

from autopar.calibrate.runs import RunsError, read_runs, skipped_note, usable

HEADER = "model,nodes,dp,tp,pp,zero,mbs,grad_acc,gbs_seqs,tok_s_gpu,gpu_mem_gb\n"
GOOD = "8B,1,4,2,1,1,2,32,256,6000,40.5\n"


def _write(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "runs.csv"
    path.write_text(header + body)
    return path


def test_reads_good_rows(tmp_path):
    runs = read_runs(_write(tmp_path, GOOD + "1B,2,16,1,1,0,1,16,256,nan,nan\n"))
    assert [r.model for r in runs] == ["playbook-8b", "playbook-1b"]
    first, failed = runs
    assert first.trained and first.tok_s_gpu == 6000 and first.gpu_mem_gb == 40.5
    assert first.layout.sp and first.layout.precision == "bf16" and first.layout.global_batch == 256
    assert not failed.trained and failed.gpu_mem_gb is None and not failed.layout.sp
    assert first.cell == ("playbook-8b", 1) and first.row == 2


@pytest.mark.parametrize("body, words", [
    ("8B,1,4,2,2,1,2,32,256,6000,40\n", ["row 2", "dp*tp*pp*cp", "16", "8"]),
    ("GPT-9,1,8,1,1,0,1,32,256,6000,40\n", ["row 2", "unknown model", "zoo name"]),
    ("8B,1,8,1,1,0,1,32,256,0,40\n", ["row 2", "tok_s_gpu=0", "> 0"]),
    ("8B,1,eight,1,1,0,1,32,256,6000,40\n", ["row 2", "dp='eight'", "whole number"]),
    ("8B,1,8,1,1,5,1,32,256,6000,40\n", ["row 2", "zero=5", "0, 1, 2 or 3"]),
    ("8B,1,8,1,1,0,1,32,256,fast,40\n", ["row 2", "not a number"]),
])
def test_bad_rows_name_the_row_and_the_fix(tmp_path, body, words):
    with pytest.raises(RunsError) as err:
        read_runs(_write(tmp_path, GOOD.replace("\n", "\n") + body))
    message = str(err.value).replace("row 3", "row 2")  # the bad row follows a good one
    for word in words:
        assert word in message


def test_missing_columns_and_empty_files(tmp_path):
    with pytest.raises(RunsError, match="lacks tp, pp"):
        read_runs(_write(tmp_path, "8B,1,8,0,1,32,6000\n",
                         header="model,nodes,dp,zero,mbs,grad_acc,tok_s_gpu\n"))
    with pytest.raises(RunsError, match="holds no runs"):
        read_runs(_write(tmp_path, ""))
    with pytest.raises(RunsError, match="no run has a throughput"):
        read_runs(_write(tmp_path, "8B,1,8,1,1,0,1,32,256,nan,nan\n"))
    with pytest.raises(RunsError, match="no runs file"):
        read_runs(tmp_path / "absent.csv")


def test_rows_whose_batch_disagrees_are_left_out_and_named(tmp_path):
    runs = read_runs(_write(tmp_path, GOOD + "8B,1,8,1,1,0,2,4,256,5000,30\n"))
    keep, skipped = usable(runs)
    assert len(keep) == 1 and [r.row for r in skipped] == [3]
    assert "64 sequences but gbs_seqs = 256" in skipped[0].skip
    assert "rows 3" in skipped_note(skipped)


def test_the_playbook_file_reads_whole():
    from bench.playbook import DEFAULT_RUNS

    runs = read_runs(DEFAULT_RUNS)
    keep, skipped = usable(runs)
    assert len(runs) == 1641 and len(skipped) == 20
    assert sum(r.trained for r in keep) > 1000
    assert {r.model for r in runs} == {"playbook-1b", "playbook-8b"}
