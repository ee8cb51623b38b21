"""`bench published`: the published-runs reader (rows, skips, clear errors) and the
leave-one-source-out bench on a small file of tiny shapes."""

import math

import numpy as np
import pytest

from autopar.calibrate.runs import RunsError
from bench.published import (
    LOSO,
    ORACLE,
    TARGETS,
    PublishedPricer,
    format_published_bench,
    quick_subset,
    run_published_bench,
    scores,
    textbook_price,
)
from bench.published_runs import COLUMNS, MEGATRON_CORE, read_published, short_source
from cost.params import CostParams


def _row(**kw):
    row = dict.fromkeys(COLUMNS, "")
    row.update(source="Src A (2024)", model_name="tiny", layers="2", hidden="64",
               ffn_hidden="256", heads="4", kv_heads="4", vocab="128", seq_len="64",
               gpu="H100-80GB", num_gpus="8", gpus_per_node="8", dp="8", tp="1", pp="1", cp="1",
               ep="1", zero_or_fsdp="fsdp (FULL_SHARD)", sp="0", microbatch="2",
               global_batch_sequences="32", recompute="none", precision="bf16",
               measured_metric="tokens_per_s_per_gpu", measured_value="1000")
    row.update({k: str(v) for k, v in kw.items()})
    return row


def _write(tmp_path, rows, name="runs.csv"):
    import csv

    path = tmp_path / name
    with path.open("w", newline="") as f:
        extra = sorted({k for r in rows for k in r} - set(COLUMNS) - {"notes"})  # head_dim
        w = csv.DictWriter(f, fieldnames=list(COLUMNS) + ["notes"] + extra)
        w.writeheader()
        for r in rows:
            w.writerow({"notes": "", **r})
    return path


def _file(tmp_path):
    """Three sources, each a group of 4 runs of one tiny shape whose throughput falls with the
    GPU count, plus rows the reader must skip."""
    rows = []
    for src, shape, gpu in (("Src A (2024)", {}, "H100-80GB"),
                            ("Src B, Table 1", {"ffn_hidden": 176, "kv_heads": 2}, "A100-80GB"),
                            ("Src C 2021", {"hidden": 128, "ffn_hidden": 512}, "A100-40GB")):
        for k, gpus in enumerate((8, 16, 32, 64)):
            rows.append(_row(source=src, gpu=gpu, num_gpus=gpus, dp=gpus,
                             global_batch_sequences=gpus * 4,
                             measured_value=2000 * (0.9 ** k), **shape))
    rows.append(_row(source="Src A (2024)", ffn_hidden="768 per expert", ep=8))  # MoE: skipped
    rows.append(_row(source="Src C 2021", vocab=""))  # vocabulary not stated: skipped
    rows.append(_row(source="Src C 2021", tp="", pp=""))  # split not stated: skipped
    return _write(tmp_path, rows)


def test_reader_turns_rows_into_layouts_and_skips_what_it_cannot_price(tmp_path):
    runs = read_published(_file(tmp_path))
    priced = [r for r in runs if not r.skip]
    assert len(priced) == 12 and len(runs) == 15
    a = priced[0]
    assert a.profile == "h100" and a.layout.zero == 3 and a.layout.grad_accum == 2
    assert a.config.family == "gpt2" and a.config.tied  # 4h non-gated MLP, MHA
    b = next(r for r in priced if r.source.startswith("Src B"))
    assert b.config.family == "llama" and b.config.n_kv_heads == 2 and b.profile == "a100-80gb"
    assert {r.profile for r in priced if r.source.startswith("Src C")} == {"a100-40gb"}
    whys = [r.skip for r in runs if r.skip]
    assert any("mixture of experts" in w for w in whys)
    assert any("vocabulary not stated" in w for w in whys)
    assert any("not all stated" in w for w in whys)
    assert short_source("Narayanan et al. 2021 'Efficient'") == "Narayanan et al."
    assert short_source("MosaicML llm-foundry scripts/train") == "MosaicML llm-foundry"


def test_reader_converts_metrics_and_marks_assumptions(tmp_path):
    hw = _row(measured_metric="hardware_tflops_per_gpu", measured_value="100", microbatch="",
              recompute="full")
    step = _row(measured_metric="step_time_s", measured_value="2.0", zero_or_fsdp="", sp="",
                recompute="")
    fp8 = _row(precision="fp8 (current scaling)",
               zero_or_fsdp="1 (recipe default distributed optimizer; table FSDP=0)")
    r_hw, r_step, r_fp8 = read_published(_write(tmp_path, [hw, step, fp8]))
    L, h, s, V = 2, 64, 64, 128  # Narayanan's eq. 3: F per token = 96 l h^2 (1 + s/6h + V/16lh)
    assert r_hw.tok_s_gpu == pytest.approx(100e12 / (96 * L * h * h * (1 + s / (6 * h)
                                                                   + V / (16 * L * h))))
    assert r_hw.assumed == ("microbatch",) and r_hw.layout.microbatch == 1
    assert r_hw.layout.recompute == "full"
    assert r_step.tok_s_gpu == pytest.approx(32 * 64 / 2.0 / 8)
    assert set(r_step.assumed) == {"zero", "recompute", "sp"} and r_step.layout.zero == 1
    assert r_fp8.layout.fp8 == "all" and r_fp8.layout.zero == 1 and not r_fp8.assumed


def test_head_widths_are_read_and_mixtures_of_experts_skipped_with_their_shape(tmp_path):
    """A head width comes from the column or the notes; a mixture of experts is named with its
    experts and skipped (the zoo's MoE is not the recipes': bench/published_runs.py)."""
    shape = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=64, num_gpus=8,
                 dp=8, microbatch=1, global_batch_sequences=16, zero_or_fsdp="1")
    rows = [_row(ffn_hidden="176", notes="shape from a provider (head_dim 32)", **shape),
            _row(ffn_hidden="176", head_dim="8", **shape),
            _row(ffn_hidden="176", **shape),
            _row(ffn_hidden="256", head_dim="8", **{**shape, "kv_heads": 4}),
            _row(ffn_hidden="96 per expert (8 experts, top-2)", ep=4, **shape),
            _row(ffn_hidden="176", ep=2, **shape)]
    noted, column, plain, gpt_wide, moe, ep_only = read_published(_write(tmp_path, rows))
    assert noted.config.head_dim == 32 and noted.config.attn_dim == 128
    assert column.config.head_dim == 8 and plain.config.head_dim == 16  # hidden / heads
    assert noted.model != plain.model  # captured apart
    assert "head width other than hidden / heads" in gpt_wide.skip
    assert "mixture of experts (8 experts, top-2)" in moe.skip
    assert "mixture of experts" in ep_only.skip
    tps = PublishedPricer(CostParams()).price([noted, plain]).tps
    assert tps[0] < tps[1]  # twice the attention width: more FLOPs per token


def test_nvidia_recipes_are_priced_with_megatron_cores_overlaps(tmp_path):
    """Runs whose source names NeMo or Megatron-Bridge are Megatron-Core's performance recipes:
    priced with its TP, pipeline, weight-gather and ring overlaps; other sources are not."""
    shape = dict(layers=4, hidden=128, ffn_hidden=352, heads=8, kv_heads=2, vocab=256,
                 seq_len=256, num_gpus=16, dp=2, tp=4, pp=2, virtual_pp=2, sp=1, microbatch=1,
                 global_batch_sequences=16, zero_or_fsdp="1", precision="bf16")
    rows = [_row(source=src, **shape) for src in
            ("NeMo performance summary, NeMo 24.07", "Megatron-Bridge performance summary",
             "Narayanan et al. 2021 'Efficient'")]
    nemo, bridge, other = read_published(_write(tmp_path, rows))
    assert nemo.framework == bridge.framework == MEGATRON_CORE and other.framework == ""
    pricer = PublishedPricer(CostParams())
    flags = ("tp_overlap_all", "p2p_hidden", "param_gather_hidden", "cp_kv_heads")
    assert all(getattr(pricer.facts(nemo), f) for f in flags)
    assert not any(getattr(pricer.facts(other), f) for f in flags)
    fast, slow = pricer.price([bridge, other]).tps
    assert fast > slow  # the same layout of the same model, its communication hidden


@pytest.mark.parametrize("change, match", [
    ({"gpu": "V100"}, "names no GPU kind with a shipped profile"),
    ({"hidden": "abc"}, "row 2: hidden='abc' is not a number"),
    ({"measured_metric": "mfu"}, "measured_metric='mfu' is unknown"),
    ({"measured_value": "-3"}, "must be > 0"),
    ({"zero_or_fsdp": "maybe"}, "zero_or_fsdp='maybe' is not understood"),
    ({"seq_len": ""}, "seq_len is empty"),
    ({"ffn_hidden": "176", "kv_heads": "3"}, "model shape is inconsistent .*kv heads must divide"),
])
def test_bad_rows_are_named(tmp_path, change, match):
    with pytest.raises(RunsError, match=match):
        read_published(_write(tmp_path, [_row(**change)]))
    with pytest.raises(RunsError, match="no published-runs file"):
        read_published(tmp_path / "absent.csv")


def test_scores_and_textbook():
    runs = [r for r in read_published(_file_cached()) if not r.skip][:4]
    measured = np.array([r.tok_s_gpu for r in runs])
    s = scores(runs, measured * np.array([1.1, 0.7, 1.0, 1.3]), np.array([1, 1, 0, 1], bool))
    assert s["median_error"] == pytest.approx(0.2) and s["within_25"] == 0.5
    assert s["fit_recall"] == 0.75 and s["spearman_worst_group"] == pytest.approx(0.2)
    pricer = PublishedPricer(CostParams())
    tps, mem = textbook_price(runs[0], pricer.run_cluster(runs[0]))
    assert tps > 0 and 1.5e9 < mem < 2e9


_CACHE = {}


def _file_cached():
    import tempfile
    from pathlib import Path

    if "path" not in _CACHE:
        _CACHE["path"] = _file(Path(tempfile.mkdtemp()))
    return _CACHE["path"]


def test_leave_one_source_out_bench(tmp_path):
    result = run_published_bench(_file(tmp_path), max_evals=6, progress=None)
    assert result["runs"] == 12 and len(result["skipped"]) == 3
    assert set(result["folds"]) == {"Src A", "Src B", "Src C"}
    for src, fold in result["folds"].items():
        assert src not in fold["fitted_on"] and len(fold["fitted_on"]) == 2
        assert all(p["lower"] <= p["value"] <= p["upper"] for p in fold["parameters"].values())
    assert set(result["table"]) == {"textbook", "autopar (shipped profiles)",
                                    "autopar (playbook fit)", LOSO, "autopar (fit on all sources)",
                                    ORACLE}
    # each source's four runs are one chain whose throughput falls with the GPU count: the
    # oracle is the measurements themselves
    assert result["chains"] == {"count": 3, "rising": []}
    oracle = result["table"][ORACLE]["all"]
    assert oracle["median_error"] == 0.0 and oracle["spearman_worst_group"] == pytest.approx(1.0)
    assert result["checks"]["spearman_worst_group"]["oracle_ok"]
    held = result["table"][LOSO]
    assert set(held) == {"Src A", "Src B", "Src C", "all"} and held["all"]["runs"] == 12
    assert len(held["all"]["groups"]) == 3
    assert set(result["checks"]) == set(TARGETS)
    for c in result["checks"].values():
        assert isinstance(c["ok"], bool) and not math.isnan(c["value"])
    assert result["regimes"]["stated in full"]["runs"] == 12
    text = format_published_bench(result)
    for needle in ("(held out)", "(in-sample)", "skipped rows", "fitted without Src A",
                   "acceptance of issue 27", "by regime", "3 chains", "[+1.00]"):
        assert needle in text


def test_quick_keeps_every_source_with_its_smallest_shapes():
    runs = [r for r in read_published(_file_cached()) if not r.skip]
    quick = quick_subset(runs, shapes=1)
    assert {r.source for r in quick} == {r.source for r in runs}
    assert len({(r.model, r.seq) for r in quick}) == 3
