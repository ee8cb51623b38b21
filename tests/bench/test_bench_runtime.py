"""`bench runtime`'s report on given figures (no timing): the exposed communication of each
layout without a pipeline, measured against predicted, with the share the prediction hides."""

from bench.runtime import format_runtime_bench


def _row(layout, measured, predicted, **extra):
    return {"layout": layout, "degrees": layout.lower(), "measured_s": measured, "predicted_s": predicted,
            "hand_written_s": None, "autopar_over_hand": None, "samples_s": [measured], **extra}


def test_the_report_sets_exposed_communication_against_its_prediction():
    result = {"world": 4, "batch": 8, "seq": 64, "distinct_layouts": 3, "spearman_predicted_vs_measured": 1.0,
              "rows": [_row("DP", 0.2, 0.15, comm_waits_s=0.040, comm_exposed_predicted_s=0.030,
                            comm_total_predicted_s=0.030),
                       _row("TP+SP", 0.3, 0.25, comm_waits_s=0.100, comm_exposed_predicted_s=0.050,
                            comm_total_predicted_s=0.200),
                       _row("PP x DP", 0.2, 0.2, idle_measured_s=0.1, idle_predicted_s=0.05)]}
    text = format_runtime_bench(result)
    section = text.split("exposed communication per step")[1].splitlines()[3:]
    lines = {line.split()[0]: line.split() for line in section if line.strip() and ":" not in line}
    assert set(lines) == {"DP", "TP+SP"}  # a pipeline's reduction is not a functional collective
    assert lines["DP"][-2:] == ["0.75", "0.00"]  # 30 / 40 ms; CPU ranks hide nothing
    assert lines["TP+SP"][-2:] == ["0.50", "0.75"]  # 50 / 100 ms; 150 of 200 ms hidden
