"""`pm.profile_step`: one training step under torch.profiler, on 2 gloo ranks (one spawn).

tiny-llama under tp=2 and a plain-PyTorch model with two losses under dp=2: each rank writes a
Chrome trace whose events carry their track (compute / communication), the summary's parts add
up (compute + communication = total, communication > 0: the step ran collectives) and the
gradients the profiled step leaves are those of an ordinary ``pm(*batch).backward()``. Rank 0
then writes the plan's report against its measured trace, and the page renders in headless
Chromium with the predicted-against-measured chart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "autopar" / "planning"))
from test_report_html import check_rendered, render_dom  # noqa: E402


class TwoLossNet(nn.Module):
    """Linear -> ReLU -> two heads; cross-entropy of one plus MSE of the other."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.cls, self.reg = nn.Linear(32, 4), nn.Linear(32, 1)

    def forward(self, x, label, target):
        h = self.body(x)
        return (nn.functional.cross_entropy(self.cls(h), label)
                + nn.functional.mse_loss(self.reg(h).squeeze(-1), target))


def _grads(pm) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
            for n, p in pm.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, out: str) -> list:
    import autopar
    from autopar import models
    from autopar.errors import InputError

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    cases = [("tiny-llama", models.build("tiny-llama", seed=3),
              models.example_inputs("tiny-llama", batch=4, seq=16), autopar.Layout(tp=2)),
             ("two-loss", TwoLossNet(), (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g),
                                         torch.randn(8, generator=g)), autopar.Layout(dp=2))]
    results = []
    for name, model, batch, layout in cases:
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout)
        path = Path(out) / f"{name}-rank{rank}.json"
        summary = pm.profile_step(*batch, path=str(path))
        profiled = _grads(pm)
        pm.zero_grad(set_to_none=True)
        pm(*batch).backward()
        plain = _grads(pm)
        same = profiled.keys() == plain.keys() and all(
            torch.allclose(profiled[k], plain[k], rtol=1e-5, atol=1e-7) for k in plain)
        trace = json.loads(path.read_text())
        tracks = {e.get("args", {}).get("autopar_track") for e in trace["traceEvents"] if e.get("ph") == "X"}
        report = None
        if rank == 0:
            report = str(pm.plan.report(Path(out) / f"{name}.html", measured=path))
        pm.eval()
        try:
            pm.profile_step(*batch, path=str(path))
            refused = False
        except InputError:
            refused = True
        results.append((name, summary, same, sorted(t for t in tracks if t), report, refused))
    return results


def test_profile_step_writes_trace_and_summary_on_two_ranks(tmp_path):
    per_rank = spawn(_worker, 2, args=(str(tmp_path),), timeout_s=900)
    for rank, results in enumerate(per_rank):
        for name, summary, same, tracks, report, refused in results:
            label = f"{name} rank {rank}"
            assert same, f"{label}: the profiled step's gradients differ from a plain step's"
            assert summary["total_s"] > 0 and summary["communication_s"] > 0, (label, summary)
            assert summary["compute_s"] + summary["communication_s"] == pytest.approx(summary["total_s"])
            assert "compute" in tracks and "communication" in tracks, (label, tracks)
            assert refused, f"{label}: profile_step in eval mode was not refused"
            if rank == 0:
                text = Path(report).read_text()
                assert "Predicted against measured" in text
                check_rendered(render_dom(Path(report), tmp_path), charts=5)
