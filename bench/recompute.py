"""`autopar bench recompute`: recomputation chosen per matmul output, against none, selective
and full, predicted at scale and measured on this machine.

1. The solver: for each setting the search runs four times, each time allowed one recompute
   mode (none, selective, full, or "auto": per layout the fastest choice that fits,
   `cost.terms.recompute`), and reports the best layout of each. "auto" can only match or beat
   the others; it beats them where the fastest layout needs some recomputation but not all.
2. A layout that fits only with recomputation: the four modes on one layout.
3. Measured on this CPU: a 4-block llama (hidden 512, sequence 512, batch 4, fp32) run node by
   node after the recompute pass (`runtime.memory.peak_live_bytes`: the peak of live tensor
   bytes above the inputs, and the process's peak resident set growth, VmHWM after a reset),
   against the cost model's activations + transients for the same choice on one local rank.
   "auto" runs on a device squeezed between what selective and full need.

Sections 1-2 are predictions of the cost model (the h100 profile, and for the first and last
settings again the h100-efa profile fitted to the playbook's measured H100 runs), not
measurements.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass

import autopar
from autopar import models
from autopar.report import fmt_bytes, fmt_time, table
from cost import Cluster, Layout

MODES = ("none", "selective", "full", "auto")


@dataclass(frozen=True)
class Setting:
    """A model at a sequence length and global batch on ``nodes`` nodes of 8 H100s, priced
    with the ``cluster`` profile."""

    label: str
    model: str
    seq: int
    batch: int
    nodes: int
    cluster: str = "h100"


SETTINGS = (
    Setting("llama3-70b, 8 nodes, seq 4096", "llama3-70b", 4096, 256, 8),
    Setting("llama3-70b, 4 nodes, seq 4096", "llama3-70b", 4096, 256, 4),
    Setting("llama3-8b, 1 node, seq 16k", "llama3-8b", 16384, 64, 1),
    # the named settings again on the profile fitted to measured H100 runs: its allocator
    # overhead and reserve (fitted, `cost.params`) leave less room than the datasheet's
    Setting("llama3-70b, 8 nodes, seq 4096, h100-efa", "llama3-70b", 4096, 256, 8, "h100-efa"),
    Setting("llama3-8b, 1 node, seq 16k, h100-efa", "llama3-8b", 16384, 64, 1, "h100-efa"),
)
# the layout of section 2: FSDP over one node at 16k tokens fits only with recomputation
TIGHT = (Setting("llama3-8b fsdp8, seq 16k", "llama3-8b", 16384, 64, 1), {"dp": 8, "zero": 3, "microbatch": 1})


def _model(s: Setting):
    cfg = models.config(s.model)
    if s.seq > cfg.max_seq:  # Llama 3.1 runs 128k; the zoo's config says Llama 3's 8k
        cfg = dataclasses.replace(cfg, max_seq=s.seq)
    return (models.build(cfg, device="meta"),
            models.example_inputs(cfg, batch=s.batch, seq=s.seq, device="meta"))


def _row(plan) -> dict:
    p = plan.predicted
    return {"layout": plan.layout.short(), "step_s": p.step_time_s, "fits": p.fits,
            "memory_bytes": p.memory_per_device_bytes, "recompute_s": p.time_breakdown["recompute_s"],
            "choice": plan.decisions.recompute_choice.describe()}


def solver_rows(settings=SETTINGS, progress=print) -> list[dict]:
    """Section 1: the best layout per recompute mode, per setting."""
    out = []
    for s in settings:
        model, inputs = _model(s)
        cluster = Cluster(s.cluster, nodes=s.nodes)
        for mode in MODES:
            t0 = time.perf_counter()
            plan = autopar.plan(model, inputs, cluster=cluster, recompute=(mode,), compare_manual=False)
            out.append({"setting": s.label, "mode": mode, **_row(plan), "plan_s": time.perf_counter() - t0})
            progress(f"  {s.label}: {mode} -> {out[-1]['layout']} {fmt_time(out[-1]['step_s'])}")
    return out


def tight_rows(progress=print) -> list[dict]:
    """Section 2: the four modes on one layout that needs recomputation to fit."""
    s, degrees = TIGHT
    model, inputs = _model(s)
    cluster = Cluster(s.cluster, nodes=s.nodes)
    rows = []
    for mode in MODES:
        plan = autopar.plan(model, inputs, cluster=cluster, layout=Layout(**degrees, recompute=mode))
        rows.append({"setting": s.label, "mode": mode, **_row(plan)})
    progress(f"  {s.label}: " + ", ".join(f"{r['mode']} {fmt_time(r['step_s'])}" for r in rows))
    return rows


def _vm(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(float(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _four_blocks():
    """The 4-block model's captured step and what running it needs: (graph, layers, groups,
    primals, seeds, config)."""
    import torch

    from autopar.analysis.graph import analyze
    from autopar.capture.joint import capture
    from autopar.search.facts import _fp8_roles
    from passes.recompute import heavy_groups

    cfg = dataclasses.replace(models.config("tiny-llama"), name="llama-4x512", n_layers=4, hidden=512,
                              n_heads=8, n_kv_heads=8, ffn=1408, vocab=256, max_seq=512)
    model = models.build(cfg, seed=0)
    batch = models.example_inputs(cfg, batch=4, seq=512)
    graph = capture(model, batch)
    analysis = analyze(graph)
    layers = {n: i.layer for n, i in analysis.nodes.items()}
    weight_of = {n: w for n, (w, role) in _fp8_roles(graph)[0].items() if role == "forward"}
    groups = heavy_groups(graph.gm, layers, {n: i.module for n, i in analysis.nodes.items()}, weight_of)
    params = dict(model.named_parameters())
    primals = [params[i.name] if i.kind == "param" else batch[int(i.name[len("input"):])]
               for i in graph.inputs if i.kind in ("param", "input")]
    seeds = [torch.ones(()) for i in graph.inputs if i.kind == "tangent"]
    return graph, analysis, layers, groups, primals, seeds, cfg


def _rewritten(graph, layers, groups, choice):
    from autopar.execution.parallelize import _recompute

    gm = copy.deepcopy(graph.gm)
    if choice.mode != "none":
        _recompute(gm, layers, groups, [choice], {}, retraced=False)
    return gm


def _rss_growth(mode: str, outputs: tuple[str, ...]) -> float:
    """In a fresh process: the resident set's peak growth (VmHWM after a reset, over VmRSS
    before) while the 4-block step runs under the choice, after one warm-up run (torch's
    one-time allocations). The parent sets MALLOC_MMAP_THRESHOLD_ so that every tensor is its
    own mapping, returned when freed: the resident set then follows the live tensors instead
    of the allocator's retained heap (without it, one process's runs reuse each other's heap)."""
    import torch

    from vocab.plan_types import RecomputeChoice

    graph, _, layers, groups, primals, seeds, _ = _four_blocks()
    gm = _rewritten(graph, layers, groups, RecomputeChoice(mode, outputs))
    with torch.no_grad():  # the joint graph is the backward: autograd would hold every value
        gm(*primals, *seeds)
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
            f.write("5")
        before = _vm("VmRSS")
        gm(*primals, *seeds)
    return _vm("VmHWM") - before


def measured_rows(progress=print) -> list[dict]:
    """Section 3: measured against predicted memory of the 4-block model, per choice."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from autopar.search.choices import choose
    from autopar.search.step import CapturedStep
    from cost.step import predict_memory, recompute_choice
    from runtime.memory import peak_live_bytes
    from vocab.plan_types import RecomputeChoice

    graph, analysis, layers, groups, primals, seeds, cfg = _four_blocks()
    facts = CapturedStep(graph, analysis, cfg, fused=False).facts()  # the pass runs unfused
    cluster = Cluster.local(ranks=1)
    fp32 = dict(precision="fp32")
    total = {m: predict_memory(facts, cluster, Layout(**fp32, recompute=m)).total for m in ("selective", "full")}
    squeezed = Cluster.local(ranks=1)
    squeezed.gpu = dataclasses.replace(squeezed.gpu, memory_bytes=(total["selective"] + total["full"]) / 2)
    choices = {m: (cluster, RecomputeChoice(m)) for m in ("none", "selective", "full")}
    choices["auto (squeezed device)"] = (squeezed, recompute_choice(
        facts, squeezed, choose(facts, squeezed, Layout(**fp32, recompute="auto"))))
    rows = []
    env = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by the spawned child's glibc
    try:
        rss = {}
        for label, (_, choice) in choices.items():
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                rss[label] = pool.submit(_rss_growth, choice.mode, choice.outputs).result()
    finally:
        if env is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = env
    for label, (where, choice) in choices.items():
        torch.manual_seed(0)
        prof = peak_live_bytes(_rewritten(graph, layers, groups, choice), *primals, *seeds)
        rss_growth = rss[label]
        mem = predict_memory(facts, where, Layout(**fp32, recompute=choice.outputs or choice.mode))
        predicted = mem.activations + mem.buffers  # one local rank: buffers are the transients
        rows.append({"choice": label, "resolved": choice.describe(), "measured_live_bytes": prof.extra_bytes,
                     "measured_rss_growth_bytes": rss_growth, "predicted_bytes": predicted,
                     "predicted_over_measured": predicted / prof.extra_bytes})
        progress(f"  {label}: measured {fmt_bytes(prof.extra_bytes)} live, {fmt_bytes(rss_growth)} resident, "
                 f"predicted {fmt_bytes(predicted)}")
    none = rows[0]["measured_live_bytes"]
    for r in rows:
        r["of_none"] = r["measured_live_bytes"] / none
    return rows


def run_recompute_bench(quick: bool = False, progress=print) -> dict:
    """All three sections (quick: the 8B setting only); JSON-ready."""
    t0 = time.perf_counter()
    settings = SETTINGS[2:3] if quick else SETTINGS
    progress("bench recompute: the solver per recompute mode ...")
    solver = solver_rows(settings, progress)
    progress("bench recompute: one layout that needs recomputation ...")
    tight = tight_rows(progress)
    progress("bench recompute: measured memory of a 4-block model ...")
    measured = measured_rows(progress)
    checks = {}
    for s in settings:
        rows = {r["mode"]: r for r in solver if r["setting"] == s.label}
        best_manual = min(rows[m]["step_s"] for m in MODES[:3] if rows[m]["fits"])
        checks[s.label] = {"auto_over_best_manual": rows["auto"]["step_s"] / best_manual}
    return {"solver": solver, "tight": tight, "measured": measured, "checks": checks,
            "time_s": time.perf_counter() - t0}


def format_recompute_bench(result: dict) -> str:
    """Three tables and the ratios."""
    head = ["setting", "recompute", "best layout", "step", "memory", "recompute", "what is recomputed"]
    rows = [[r["setting"], r["mode"], r["layout"], fmt_time(r["step_s"]), fmt_bytes(r["memory_bytes"]),
             fmt_time(r["recompute_s"]), r["choice"]] for r in result["solver"]]
    out = ["1. the solver, one recompute mode allowed at a time (predicted; h100 unless named)",
           table(head, rows, "lllrrrl")]
    out += [f"   {label}: auto / best of none, selective, full = {c['auto_over_best_manual']:.4f}"
            for label, c in result["checks"].items()]
    head = ["setting", "recompute", "layout", "step", "memory", "fits", "what is recomputed"]
    rows = [[r["setting"], r["mode"], r["layout"], fmt_time(r["step_s"]), fmt_bytes(r["memory_bytes"]),
             "yes" if r["fits"] else "NO", r["choice"]] for r in result["tight"]]
    out += ["", "2. one layout, four modes (predicted, h100)", table(head, rows, "lllrrll")]
    head = ["choice", "resolved", "measured live", "of none", "RSS growth", "predicted", "pred / meas"]
    rows = [[r["choice"], r["resolved"], fmt_bytes(r["measured_live_bytes"]), f"{r['of_none']:.3f}",
             fmt_bytes(r["measured_rss_growth_bytes"]), fmt_bytes(r["predicted_bytes"]),
             f"{r['predicted_over_measured']:.2f}"] for r in result["measured"]]
    out += ["", "3. measured on this CPU: 4-block llama, h512 s512 b4 fp32, extra memory of one step",
            table(head, rows, "llrrrrr")]
    return "\n".join(out)
