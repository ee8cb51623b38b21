"""parallelize never edits the solver's plan: what the passes find as they run (the values the
recompute pass rebuilds, the ops run replicated) is an `ExecutionReport` that ``pm.plan`` (a
copy of the plan carrying it) and ``pm.execution_report`` show, and that survives JSON."""

from __future__ import annotations

import copy
import json

import torch
from parity_checks import close
from torch import nn

from runtime.launch import spawn


class CumBlock(nn.Module):
    """A pre-norm block around an op without a DTensor sharding strategy (logcumsumexp)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.logcumsumexp(self.fc1(self.norm(x)), dim=-1))


class CumBlocks(nn.Module):
    """Plain PyTorch: two `CumBlock` and a linear head; returns its output (loss_fn: Huber)."""

    def __init__(self, hidden: int = 16, out: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CumBlock(hidden) for _ in range(2))
        self.head = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _huber(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.huber_loss(out, target, delta=0.5)


def _cases(world: int):
    """(name, model, batch, loss_fn, layout): the zoo's llama (its own loss) under DP with full
    recompute; a model of our own (a Huber loss through loss_fn) under TP with selective."""
    import autopar

    llama = autopar.models.build("tiny-llama", seed=3)
    llama_batch = autopar.models.example_inputs("tiny-llama", batch=4, seq=16)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    cum_batch = (torch.randn(4, 8, 16, generator=gen), torch.randn(4, 8, 8, generator=gen))
    return [("tiny-llama", llama, llama_batch, None, autopar.Layout(dp=world, recompute="full")),
            ("cum-blocks", CumBlocks(), cum_batch, _huber, autopar.Layout(tp=world, recompute="selective"))]


def _worker(rank: int, world: int) -> list[dict]:
    import autopar

    seen = []
    cluster = autopar.Cluster.local(ranks=world, threads_per_rank=1)
    for name, model, batch, loss_fn, layout in _cases(world):
        plan = autopar.plan(model, batch, cluster=cluster, loss_fn=loss_fn, layout=layout)
        before = plan.to_json()
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, world, example_inputs=batch, loss_fn=loss_fn, plan=plan)
        report = pm.execution_report
        again = autopar.Plan.from_json(pm.plan.to_json())
        loss = pm(*batch)
        ref_loss = ref(*batch) if loss_fn is None else loss_fn(ref(batch[0]), batch[1])
        seen.append({
            "name": name,
            "plan unchanged": plan.to_json() == before and plan.execution is None,
            "decisions shared": pm.plan.decisions.to_dict() == plan.decisions.to_dict(),
            "planned recompute": list(plan.recompute),
            "ran recompute": list(pm.plan.recompute),
            "report recompute": {block: len(values) for block, values in (report.recompute or {}).items()},
            "recomputed nodes": sum("recomputes" in n.meta for n in pm._rank_graph.gm.graph.nodes),
            "fallbacks": [f.op for f in pm.plan.fallbacks],
            "report fallbacks": [f.op for f in report.fallbacks],
            "summary": pm.plan.summary(),
            "round trip": (again.execution == report and again.recompute == pm.plan.recompute
                           and again.fallbacks == pm.plan.fallbacks),
            "loss": close(loss.detach(), ref_loss.detach()),
        })
    return seen


def test_parallelize_leaves_the_plan_and_reports_what_ran():
    results = spawn(_worker, 2, timeout_s=400)
    for seen in results:
        for case in seen:
            name = case["name"]
            assert case["plan unchanged"] and case["decisions shared"], name
            assert case["loss"], name
            # the solver describes what each block recomputes; the report lists what ran
            ran = case["ran recompute"]
            assert ran and ran != case["planned recompute"], (name, ran)
            assert all(line.startswith("block ") and " values (" in line for line in ran), ran
            assert len(ran) == len(case["report recompute"]) and all(case["report recompute"].values())
            assert case["recomputed nodes"] > 0, name
            assert case["fallbacks"] == case["report fallbacks"], name
            assert "recompute (as run): block" in case["summary"], name
            assert "fallbacks (as run): " in case["summary"], name
            assert case["round trip"], name
    llama, cum = results[0]
    assert llama["fallbacks"] == []
    assert "aten.logcumsumexp.default" in cum["fallbacks"]
    assert "logcumsumexp" in cum["summary"].split("fallbacks (as run): ")[1]


def test_report_round_trips_and_a_plan_without_one_is_unchanged():
    import autopar
    from vocab.plan_types import ExecutionReport, Fallback

    for report in (ExecutionReport(),
                   ExecutionReport({0: ("mul", "gelu_1"), 2: ()}, (Fallback("aten.x.default", "why"),))):
        assert ExecutionReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    model = CumBlocks()
    batch = (torch.randn(4, 8, 16), torch.randn(4, 8, 8))
    plan = autopar.plan(model, batch, cluster=autopar.Cluster.local(ranks=2, threads_per_rank=1),
                        loss_fn=_huber, layout=autopar.Layout(tp=2, recompute="full"))
    text = plan.to_json()
    assert "execution" not in json.loads(text)  # the digest parallelize's ranks compare stays
    ran = plan.with_execution(ExecutionReport({0: ("mul", "mul_1")}, (Fallback("aten.x.default", "why"),)))
    assert plan.to_json() == text and plan.execution is None and ran.decisions is plan.decisions
    assert ran.recompute == ["block 0: 2 values (mul)"] and plan.recompute != ran.recompute
    assert [f.op for f in ran.fallbacks] == ["aten.x.default"]
    assert "recompute (as run): block" in ran.summary() and "recompute (as run)" not in plan.summary()
    assert autopar.Plan.from_json(ran.to_json()).execution == ran.execution
    # a report without recompute leaves the plan's own description
    assert plan.with_execution(ExecutionReport()).recompute == plan.recompute
