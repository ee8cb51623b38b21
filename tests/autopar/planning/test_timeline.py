"""The predicted step as a timeline: `plan.trace` writes valid Chrome trace-event JSON whose span
is the predicted step time, for layouts with and without a pipeline, under every schedule.

Plans of a 4-block llama3-8b shape (meta device) and of a plain-PyTorch MLP stack with two
losses, on one 8-GPU H100 node; the trace is checked by a validator of the trace-event format
(required keys and types, non-negative durations, events sorted and never overlapping on one
track, every track and process named by metadata events).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import autopar
from autopar import models
from autopar.planning.timeline import TRACKS, predicted_spans, span_of


def validate_trace(trace: dict) -> list[dict]:
    """Assert ``trace`` is Chrome trace-event JSON as Perfetto reads it; return its X events."""
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list)
    named_procs, named_threads, xs = set(), set(), []
    for ev in trace["traceEvents"]:
        assert isinstance(ev.get("name"), str) and ev.get("ph") in ("X", "M"), ev
        assert isinstance(ev.get("pid"), int) and isinstance(ev.get("tid"), int), ev
        if ev["ph"] == "M":
            assert isinstance(ev.get("args"), dict), ev
            if ev["name"] == "process_name":
                named_procs.add(ev["pid"])
            if ev["name"] == "thread_name":
                named_threads.add((ev["pid"], ev["tid"]))
            continue
        assert isinstance(ev.get("ts"), (int, float)) and isinstance(ev.get("dur"), (int, float)), ev
        assert ev["ts"] >= 0 and ev["dur"] >= 0, ev
        xs.append(ev)
    per_track: dict[tuple[int, int], list[dict]] = {}
    for ev in xs:  # in file order: sorted per track
        per_track.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for key, evs in per_track.items():
        assert key[0] in named_procs and key in named_threads, f"track {key} has no name"
        for a, b in zip(evs, evs[1:]):
            assert a["ts"] <= b["ts"], f"track {key} not sorted: {a['name']} then {b['name']}"
            overlap = a["ts"] + a["dur"] - b["ts"]
            assert overlap <= 1e-6 * max(1.0, b["ts"]), f"{a['name']} overlaps {b['name']} on {key}"
    return xs


def _trace_span_us(xs: list[dict]) -> float:
    return max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)


@pytest.fixture(scope="module")
def llama():
    cfg = dataclasses.replace(models.config("llama3-8b"), n_layers=4)
    return (models.build(cfg, device="meta"),
            models.example_inputs(cfg, batch=16, seq=512, device="meta"))


CLUSTER = autopar.Cluster("h100", nodes=1, gpus_per_node=8)
LAYOUTS = [
    dict(dp=8, zero=1, microbatch=2, grad_accum=1),
    dict(dp=8, zero=3, microbatch=1, grad_accum=2),
    dict(dp=2, tp=4, sp=True, microbatch=2, grad_accum=4),
    dict(dp=4, pp=2, microbatch=1, grad_accum=4),
    dict(dp=2, pp=4, microbatch=1, grad_accum=8, schedule="afab"),
    dict(dp=2, pp=2, tp=2, microbatch=1, grad_accum=8, schedule="interleaved-1f1b", virtual_stages=2),
    dict(dp=2, pp=4, microbatch=2, grad_accum=4, schedule="zero-bubble"),
    dict(dp=1, pp=4, tp=2, microbatch=4, grad_accum=4),
]


@settings(derandomize=True, max_examples=12, deadline=None)
@given(st.sampled_from(LAYOUTS))
def test_trace_span_is_the_predicted_step_and_the_format_is_valid(llama, tmp_path_factory, kw):
    model, inputs = llama
    plan = autopar.plan(model, inputs, cluster=CLUSTER, layout=autopar.Layout(**kw))
    path = plan.trace(tmp_path_factory.mktemp("t") / "plan.json")
    trace = json.loads(path.read_text())
    xs = validate_trace(trace)
    step_us = plan.predicted.step_time_s * 1e6
    assert _trace_span_us(xs) == pytest.approx(step_us, rel=1e-9)
    assert span_of(predicted_spans(plan)) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    pids = {e["pid"] for e in xs}
    assert pids == set(range(plan.layout.pp)), "one process per pipeline stage"
    m = plan.layout.grad_accum
    for s in pids:  # every micro-batch's forward and backward on every stage
        names = {e["name"] for e in xs if e["pid"] == s and e["tid"] == TRACKS.index("compute")}
        assert {f"forward mb{i}" for i in range(m)} <= names
        assert {f"backward mb{i}" for i in range(m)} <= names
        assert "optimizer step" in names


def test_pipeline_bubble_and_exposed_communication_are_visible(llama):
    model, inputs = llama
    plan = autopar.plan(model, inputs, cluster=CLUSTER,
                        layout=autopar.Layout(dp=1, pp=4, tp=2, microbatch=4, grad_accum=4))
    spans = predicted_spans(plan)
    compute = [s for s in spans if s.track == "compute" and s.name.startswith(("forward", "backward"))]
    first = {st_: min(s.start_s for s in compute if s.stage == st_) for st_ in range(4)}
    assert first[0] == 0 and first[0] < first[1] < first[2] < first[3]  # the fill: bubbles
    busy = {st_: sum(s.dur_s for s in compute if s.stage == st_) for st_ in range(4)}
    end = max(s.end_s for s in compute)
    idle = sum(end - busy[st_] for st_ in range(4)) / 4
    assert idle > 0.5 * plan.predicted.time_breakdown["pp_bubble_s"]
    exposed_tp = sum(s.dur_s for s in spans if s.track == "TP collectives" and s.stage == 0)
    assert exposed_tp == pytest.approx(plan.predicted.time_breakdown["tp_comm_s"], rel=1e-9)
    assert all(s.exposed for s in spans if s.track == "TP collectives")
    # a plan read back from JSON (no captured step) draws the same timeline
    assert predicted_spans(autopar.Plan.from_json(plan.to_json())) == spans


class TwoHeadMLP(nn.Module):
    """A stack of Linear+GELU blocks with two heads; loss = MSE of one + L1 of the other."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.a, self.b = nn.Linear(width, 8), nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return nn.functional.mse_loss(self.a(x), y) + nn.functional.l1_loss(self.b(x), y)


@pytest.mark.parametrize("kw", [dict(dp=2, microbatch=4, grad_accum=2), dict(dp=1, pp=2, microbatch=2, grad_accum=8)])
def test_own_model_two_losses_trace(tmp_path, kw):
    model = TwoHeadMLP()
    inputs = (torch.randn(16, 256), torch.randn(16, 8))
    cluster = autopar.Cluster("cpu", nodes=1, gpus_per_node=2)
    plan = autopar.plan(model, inputs, cluster=cluster, layout=autopar.Layout(**kw))
    xs = validate_trace(json.loads(plan.trace(tmp_path / "t.json").read_text()))
    assert _trace_span_us(xs) == pytest.approx(plan.predicted.step_time_s * 1e6, rel=1e-9)
    assert {e["pid"] for e in xs} == set(range(plan.layout.pp))


def test_validator_catches_overlaps_and_missing_keys():
    ok = {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "p"}},
                          {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "t"}},
                          {"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 2.0},
                          {"name": "b", "ph": "X", "pid": 0, "tid": 0, "ts": 2.0, "dur": 1.0}]}
    validate_trace(ok)
    bad = json.loads(json.dumps(ok))
    bad["traceEvents"][3]["ts"] = 1.0
    with pytest.raises(AssertionError, match="overlaps"):
        validate_trace(bad)
    bad = json.loads(json.dumps(ok))
    del bad["traceEvents"][2]["dur"]
    with pytest.raises(AssertionError):
        validate_trace(bad)
