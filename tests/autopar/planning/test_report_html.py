"""`plan.report`: one self-contained HTML page that a browser renders without script errors.

The page is opened in headless Chromium (Debian's ``chromium`` package; the test FAILS, naming
the install command, where it is missing): the DOM it dumps after the scripts ran carries no
script error (a ``window`` error listener writes any into the DOM) and holds every chart drawn
as SVG by plotly. The page loads nothing from the network (no http(s) src/href). With a
measured trace, the predicted-against-measured chart is there too. Plans: a 2-stage pipeline of
a llama3-8b shape (meta device) and a plain-PyTorch model with two losses.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.errors import InputError
from autopar.planning.report_html import write_plan_outputs

INSTALL = "apt-get install -y chromium"


def chromium() -> str:
    """The headless browser's path; fails (not skips) with the install command if absent."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"no chromium on PATH: the report render test needs it; install with `{INSTALL}`")


def render_dom(path, tmp_path) -> str:
    """The DOM of the page after its scripts ran, as headless Chromium dumps it."""
    cmd = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000",
           "--dump-dom", path.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def check_rendered(dom: str, charts: int) -> None:
    """No script error, and ``charts`` plotly charts each drawn as SVG."""
    err = re.search(r'data-script-error="([^"]*)"', dom)
    assert err is None, f"script error in the report: {err.group(1)}"
    divs = re.findall(r'class="plotly-graph-div[^"]*"', dom)
    svgs = dom.count('class="main-svg"')
    assert len(divs) == charts, f"{len(divs)} plotly charts, expected {charts}"
    assert svgs >= charts, f"only {svgs} rendered SVGs for {charts} charts"
    assert dom.count('class="bars"') + dom.count("class=\"trace bars\"") >= charts  # bars drawn


def offline(html_text: str) -> None:
    """Nothing fetched at view time: no external script, stylesheet or image."""
    ext = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?:[^"]+)"', html_text)
    assert not ext, f"the report loads {ext[:3]} from the network"


@pytest.fixture(scope="module")
def pipeline_plan():
    cfg = dataclasses.replace(models.config("llama3-8b"), n_layers=4)
    model = models.build(cfg, device="meta")
    inputs = models.example_inputs(cfg, batch=16, seq=512, device="meta")
    cluster = autopar.Cluster("h100", nodes=1, gpus_per_node=8)
    return autopar.plan(model, inputs, cluster=cluster,
                        layout=autopar.Layout(dp=2, pp=2, tp=2, sp=True, microbatch=1, grad_accum=8))


def test_report_renders_in_chromium_with_every_chart(pipeline_plan, tmp_path):
    trace, report = write_plan_outputs(pipeline_plan, trace=tmp_path / "t.json", report=tmp_path / "r.html")
    assert json.loads(trace.read_text())["traceEvents"]
    text = report.read_text()
    offline(text)
    assert "stage 1" in text and "layers.*.attn" in text  # the timeline's stages, the placements
    check_rendered(render_dom(report, tmp_path), charts=4)


def test_report_with_a_measured_trace(pipeline_plan, tmp_path):
    measured = tmp_path / "step.json"
    # a torch.profiler-shaped trace: compute and a gloo all-reduce on one thread
    measured.write_text(json.dumps({"traceEvents": [
        {"name": "aten::mm", "ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 700.0},
        {"name": "gloo:all_reduce", "ph": "X", "pid": 1, "tid": 1, "ts": 700.0, "dur": 300.0}]}))
    report = pipeline_plan.report(tmp_path / "r.html", measured=measured)
    assert "Predicted against measured" in report.read_text()
    check_rendered(render_dom(report, tmp_path), charts=5)
    with pytest.raises(InputError, match="profile_step"):
        pipeline_plan.report(tmp_path / "x.html", measured=tmp_path / "missing.json")


class TwoLossNet(nn.Module):
    """Linear -> ReLU -> Linear with a classification and a regression loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.cls, self.reg = nn.Linear(64, 4), nn.Linear(64, 1)

    def forward(self, x, label, target):
        h = self.body(x)
        return nn.functional.cross_entropy(self.cls(h), label) + nn.functional.mse_loss(self.reg(h).squeeze(-1), target)


def test_own_model_report_renders(tmp_path):
    inputs = (torch.randn(8, 32), torch.randint(0, 4, (8,)), torch.randn(8))
    plan = autopar.plan(TwoLossNet(), inputs, cluster=autopar.Cluster("cpu", nodes=1, gpus_per_node=2),
                        layout=autopar.Layout(dp=2, microbatch=2, grad_accum=2))
    report = plan.report(tmp_path / "r.html")
    check_rendered(render_dom(report, tmp_path), charts=4)
