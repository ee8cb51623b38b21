"""The solver's search space: each recompute mode it is allowed spans every layout the other
degrees give (a loop variable once shadowed the modes and cut the space to one micro-batch)."""

import autopar
from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.search.solver import candidate_layouts
from autopar.search.step import CapturedStep


def test_every_recompute_mode_spans_the_same_layouts():
    model, batch = models.build("tiny-llama"), models.example_inputs("tiny-llama", batch=8, seq=16)
    graph = capture(model, batch)
    facts = CapturedStep(graph, analyze(graph), models.config("tiny-llama")).facts()
    cluster = autopar.Cluster("h100", nodes=1, gpus_per_node=4)
    spaces = {}
    for modes in (("auto",), ("none", "full")):
        layouts = list(candidate_layouts(facts, cluster, [1, 2, 4], recompute=modes))
        # a layout keeping TP+SP's gathers (regather=False) follows its regathering twin, and
        # only where something is recomputed
        kept = [lay for lay in layouts if not lay.regather]
        assert kept and all(lay.sp and lay.recompute != "none" for lay in kept)
        assert all(layouts[layouts.index(lay) - 1] == lay.replace(regather=True) for lay in kept)
        layouts = [lay for lay in layouts if lay.regather]
        spaces[modes] = {lay.replace(recompute="none") for lay in layouts}
        assert len(layouts) == len(spaces[modes]) * len(modes)
        assert {lay.microbatch for lay in layouts} == {1, 2, 4, 8}
    assert spaces[("auto",)] == spaces[("none", "full")]
