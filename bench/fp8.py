"""`autopar bench fp8`: the per-matmul FP8 choice against all-FP8 and no FP8, predicted.

For each setting the step time is predicted three ways on the same layout: no FP8 matmul
(``fp8="none"``), every weight matmul in FP8 (``"all"``), and the cost model's choice per
block-tied weight (``"auto"``: `autopar.search.choices.choose_fp8`, FP8 where the matmul's
predicted time at its local shape, casts included, beats high precision). Where local shapes
are small (llama3-8b at tp=8, one sequence of 2048 tokens per micro-batch) the casts cost more
than FP8 saves on some matmuls and the choice should beat both; on large shapes it should
equal all-FP8.

Reference (data/fp8.json): torchtitan's published Float8 runs of Llama-3 8B on 8xH100 (FSDP,
torch.compile), bf16 against tensorwise FP8: the "fsdp8" row predicts that setting and prints
the published ratio beside the predicted one. torchao's filter (tensorwise layers with
K <= 4096 and N <= 1024 stay in bf16) is compared with the choice, weight by weight.

These are predictions of the cost model, not measurements: the FP8 GEMM curve is the H200
fit of cost/compute.py (GEMM_HALF_EFFICIENCY_FLOPS, in-sample on 12 GEMMs), the cast traffic
`FP8_CAST_BYTES_PER_INPUT_BYTE` (the pass's ops, fused).
"""

from __future__ import annotations

from dataclasses import dataclass

import autopar
from autopar import models
from autopar.report import fmt_time, table
from bench.reference import reference_table
from cost import Cluster, Layout


@dataclass(frozen=True)
class Setting:
    """One row: a model, a sequence, a batch, a cluster and the degrees of the layout."""

    label: str
    model: str
    seq: int
    batch: int
    nodes: int
    degrees: dict


SETTINGS = (
    Setting("tp8 small shapes", "llama3-8b", 2048, 8, 1, {"tp": 8, "sp": True, "microbatch": 1}),
    Setting("tp8 seq 1024", "llama3-8b", 1024, 8, 1, {"tp": 8, "sp": True, "microbatch": 1}),
    Setting("fsdp8 (torchtitan's run)", "llama3-8b", 8192, 8, 1, {"dp": 8, "zero": 3, "microbatch": 1}),
    Setting("70b tp8 x 8 nodes", "llama3-70b", 4096, 64, 8, {"dp": 8, "tp": 8, "sp": True, "zero": 1,
                                                             "microbatch": 1}),
)


def run_fp8_bench(quick: bool = False) -> dict:
    """Predict every setting three ways; the rows, the reference and the checks (JSON-ready)."""
    rows = []
    for s in SETTINGS[:2] if quick else SETTINGS:
        model = models.build(s.model, device="meta")
        inputs = models.example_inputs(s.model, batch=s.batch, seq=s.seq, device="meta")
        cluster = Cluster("h100", nodes=s.nodes, gpus_per_node=8)
        times, chosen = {}, []
        for fp8 in ("none", "all", "auto"):
            plan = autopar.plan(model, inputs, cluster=cluster, layout=Layout(**s.degrees, fp8=fp8))
            times[fp8] = plan.predicted.step_time_s
            if fp8 == "auto":
                chosen = sorted({_short(w) for w in plan.fp8})
                candidates = sorted({_short(w) for w in plan.decisions.params if w.endswith(".weight")})
        rows.append({"setting": s.label, "model": s.model, "seq": s.seq, "layout": plan.layout.short(),
                     "none_s": times["none"], "all_s": times["all"], "auto_s": times["auto"],
                     "auto_over_none": times["auto"] / times["none"],
                     "auto_over_all": times["auto"] / times["all"],
                     "fp8_matmuls": chosen, "high_precision": [c for c in candidates if c not in chosen
                                                               and "norm" not in c and "embed" not in c]})
    ref = reference_table("fp8", "torchtitan_llama3_8b")
    checks = {
        "auto never slower than all or none": all(
            r["auto_s"] <= min(r["all_s"], r["none_s"]) * (1 + 1e-9) for r in rows),
        "auto strictly faster than both somewhere": any(
            r["auto_s"] < min(r["all_s"], r["none_s"]) * (1 - 1e-3) for r in rows),
    }
    return {"rows": rows, "reference": ref, "checks": checks}


def format_fp8_bench(result: dict) -> str:
    """The table, the published reference beside the prediction, and the checks."""
    lines = ["FP8 per matmul, predicted step time (h100)"]
    lines.append(table(
        ["setting", "layout", "no fp8", "all fp8", "auto", "auto/none", "auto/all", "kept high"],
        [[r["setting"], r["layout"], fmt_time(r["none_s"]), fmt_time(r["all_s"]), fmt_time(r["auto_s"]),
          f"{r['auto_over_none']:.3f}", f"{r['auto_over_all']:.3f}", ", ".join(r["high_precision"]) or "-"]
         for r in result["rows"]]))
    ref = result["reference"]
    fsdp = next((r for r in result["rows"] if r["setting"].startswith("fsdp8")), None)
    if fsdp is not None:
        published = ref["bf16_tok_s"] / ref["tensorwise_tok_s"]
        lines.append(f"torchtitan Llama-3 8B, 8xH100 FSDP: fp8/bf16 step time published {published:.3f} "
                     f"(tensorwise; rowwise {ref['bf16_tok_s'] / ref['rowwise_tok_s']:.3f}), "
                     f"predicted all-fp8 {fsdp['all_s'] / fsdp['none_s']:.3f}")
    lines += [f"check: {name}: {'ok' if ok else 'FAILED'}" for name, ok in result["checks"].items()]
    return "\n".join(lines)


def _short(weight: str) -> str:
    """``layers.3.mlp.up_proj.weight`` -> ``mlp.up_proj`` (blocks decide alike)."""
    parts = weight.split(".")
    if parts[0] == "layers" and len(parts) > 2:
        parts = parts[2:]
    return ".".join(p for p in parts if p != "weight")
